"""Greedy identity on the MoE / MLA architectures: speculative greedy output (n-gram drafts; the models' own MTP
layers, chains and trees) is token for token the plain greedy output. Loaded through specdec.loader.load (layout
cache included) in bf16 with int8 weights, whose matmuls are batch-invariant, so each verified row is bitwise its
decode step (models/moe.py, models/mla.py)."""

from __future__ import annotations

import pytest
from conftest import chat
from tiny_moe import ARCHS, write_moe_hf

from specdec.generate import generate
from specdec.loader import load
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig, build_proposer, resolve_mtp
from specdec.spec.autok import FixedDraftLength

GREEDY = SamplingParams(temperature=0.0)
N = 24
PROMPT = "Repeat exactly, twice: the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    arch = request.param
    n_mtp = 1 if arch in ("deepseek_v3", "glm4_moe") else 0
    folder, _, _ = write_moe_hf(arch, tmp_path_factory.mktemp(arch) / arch, seed=7, n_mtp=n_mtp, tokenizer=True)
    target = load(folder, dtype="bf16", quant="int8", ctx=256)
    assert bool(target.mtp) == bool(n_mtp)
    prompt = chat(target.tokenizer, PROMPT)
    plain = generate(target.model, target.tokenizer, prompt, GREEDY, max_tokens=N, ignore_eos=True).tokens
    return target, prompt, plain


@pytest.mark.parametrize("kind,tree,k", [("ngram", None, 4), ("auto", None, 4), ("mtp", None, 1), ("mtp", None, 3),
                                         ("mtp", (2, 2), 6)])
def test_speculative_greedy_equals_plain(model, kind, tree, k):
    target, prompt, plain = model
    if kind == "mtp" and not target.mtp:
        pytest.skip("this architecture ships no MTP layers")
    spec = SpecConfig(kind=kind, tree=tree, draft_max=str(k))
    proposer = build_proposer(spec, target, GREEDY, mtp=resolve_mtp(target) if kind == "mtp" else None)
    r = generate(target.model, target.tokenizer, prompt, GREEDY, max_tokens=N, ignore_eos=True, proposer=proposer,
                 draft_length=FixedDraftLength(k))
    assert r.tokens == plain
    if kind == "mtp":
        assert r.stats.drafted > 0
