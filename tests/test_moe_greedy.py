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


@pytest.mark.parametrize("kind", ["none", "ngram", "mtp"])
def test_batched_greedy_equals_each_sequence_alone(model, kind, monkeypatch):
    """Continuous batching on MoE trunks (and MLA's latent cache, attended by the kernel): four prompts of different
    lengths decoded three at a time (one forward for all, joins and leaves) give each prompt's solo greedy output."""
    from specdec.api import LLM

    target, _, _ = model
    if kind == "mtp" and not target.mtp:
        pytest.skip("this architecture ships no MTP layers")
    prompts = [chat(target.tokenizer, p) for p in (PROMPT, "Count to ten.", "hi", "Name three colours, please.")]
    spec = SpecConfig(kind=kind, draft_max="3")
    lengths = [N, 9, 17, 12]

    def run(batch: int) -> list[list[int]]:
        llm = LLM.of(target, None, spec, max_batch=batch)
        outs = llm.generate(prompts, [GREEDY] * 4, max_tokens=lengths, ignore_eos=True, progress=False)
        return [o.tokens for o in outs]

    solo = run(1)
    sizes = []
    real = target.model.forward_batch
    monkeypatch.setattr(target.model, "forward_batch", lambda items: sizes.append(len(items)) or real(items))
    assert run(3) == solo
    assert max(sizes) == 3 and min(sizes) < 3  # really batched, with joins and leaves


@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_seeded_mtp_sampling_is_the_plain_sampled_text(model, tree):
    """Sampling (temperature 0.8, seeded) with the MoE trunk's own MTP layer drafting argmax chains or trees:
    coupled verification writes the plain seeded run's text, token for token, while drafts are accepted."""
    target, prompt, _ = model
    if not target.mtp:
        pytest.skip("this architecture ships no MTP layers")
    params = SamplingParams(temperature=0.8, seed=3)
    plain = generate(target.model, target.tokenizer, prompt, params, max_tokens=N, ignore_eos=True).tokens
    spec = SpecConfig(kind="mtp", tree=tree, draft_max="4" if tree else "3")
    argmax = SamplingParams(temperature=0.0)  # point-mass drafts, as auto and the CLI's mtp mode draft them
    proposer = build_proposer(spec, target, argmax, mtp=resolve_mtp(target))
    r = generate(target.model, target.tokenizer, prompt, params, max_tokens=N, ignore_eos=True, proposer=proposer,
                 draft_length=FixedDraftLength(4 if tree else 3))
    assert r.tokens == plain and r.stats.drafted > 0
