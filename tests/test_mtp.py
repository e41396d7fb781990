"""MTP drafting: greedy identity for chain and tree drafts (shipped heads, random heads, parallel heads), the
trainable modules equal the inference modules they export to, heads refuse a different base model, and training
runs, resumes and is deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_PROMPTS, chat
from tiny_models import write_gguf

from specdec.config import ModelError
from specdec.generate import generate
from specdec.loader import load
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig, build_proposer, resolve_mtp
from specdec.spec.autok import FixedDraftLength
from specdec.train.mtp import TrainConfig, TrainParallel, TrainSequential, train_mtp
from specdec.weights.heads import base_fingerprint, check_base, find_heads, load_heads, read_header, save_heads

GREEDY = SamplingParams(temperature=0.0)
N = 40


def random_heads(target, tmp_path, kind: str, depth: int, vocab: int = 4096) -> str:
    """A heads file with random (untrained) weights for the default model: correctness may not depend on quality."""
    torch.manual_seed(0)
    args = target.model.args
    if kind == "sequential":
        tensors = {}
        for d in range(depth):
            mod = TrainSequential(args, 256)
            with torch.no_grad():
                mod.eh_proj.normal_(0, 0.05)
            tensors.update(mod.export(args.n_layers + d))
    else:
        net = TrainParallel(args.dim, depth)
        with torch.no_grad():
            net.w.normal_(0, 0.05)
        tensors = net.export()
    tensors["d2t"] = torch.randperm(args.vocab_size)[:vocab].sort().values
    path = tmp_path / f"random-{kind}.safetensors"
    save_heads(path, tensors, kind=kind, depth=depth, base=base_fingerprint(target), args=args, ffn_dim=256,
               train={})
    return str(path)


@pytest.fixture(scope="module")
def target(smollm2_default):
    return smollm2_default


@pytest.fixture(scope="module")
def plain(plain_greedy):
    return {p: plain_greedy(p, N) for p in CHAT_PROMPTS[:2]}


def heads_for(target, tmp_path, which):
    if which == "shipped":
        mtp = resolve_mtp(target)
        assert mtp is not None and mtp[3].startswith("shipped"), "the default model ships heads"
        return mtp
    kind, depth = which.split("-")
    return resolve_mtp(target, random_heads(target, tmp_path, kind, int(depth)))


@pytest.mark.parametrize("which", ["shipped", "sequential-1", "sequential-2", "parallel-3"])
@pytest.mark.parametrize("tree,k", [(None, 1), (None, 3), (None, 5), ([2, 2], 6), ([3, 1, 1], 8)])
def test_greedy_identity_chain_and_tree(target, plain, tmp_path, which, tree, k):
    mtp = heads_for(target, tmp_path, which)
    for p, ref in plain.items():
        spec = SpecConfig(kind="mtp", tree=tuple(tree) if tree else None)
        proposer = build_proposer(spec, target, GREEDY, mtp=mtp)
        r = generate(target.model, target.tokenizer, chat(target.tokenizer, p), GREEDY, max_tokens=N,
                     ignore_eos=True, proposer=proposer, draft_length=FixedDraftLength(k))
        assert r.tokens == ref, f"{which} tree={tree} k={k} differs on {p!r}"
        assert r.stats.drafted > 0


def test_shipped_heads_are_default_and_accept(target):
    """Without flags, `specdec generate` drafts with the shipped heads, and they do get accepted."""
    mtp = resolve_mtp(target)
    assert mtp is not None
    proposer = build_proposer(SpecConfig(kind="mtp"), target, GREEDY, mtp=mtp)
    r = generate(target.model, target.tokenizer, chat(target.tokenizer, CHAT_PROMPTS[0]), GREEDY, max_tokens=64,
                 proposer=proposer, draft_length=FixedDraftLength(3))
    assert r.stats.acceptance_rate > 0.05  # random heads: ~0
    header = read_header(find_heads(target))
    assert header["base"]["file"] == target.path.name and header["train"]["log"]


def test_sampled_mtp_is_reproducible_and_runs(target, tmp_path):
    mtp = heads_for(target, tmp_path, "sequential-1")
    params = SamplingParams(temperature=0.8, top_k=40, seed=3)
    outs = []
    for _ in range(2):
        proposer = build_proposer(SpecConfig(kind="mtp"), target, params, mtp=mtp)
        outs.append(generate(target.model, target.tokenizer, chat(target.tokenizer, CHAT_PROMPTS[1]), params,
                             max_tokens=30, proposer=proposer, draft_length=FixedDraftLength(3)).tokens)
    assert outs[0] == outs[1]
    tree = build_proposer(SpecConfig(kind="mtp", tree=(2, 2)), target, params, mtp=mtp)
    r = generate(target.model, target.tokenizer, chat(target.tokenizer, CHAT_PROMPTS[1]), params, max_tokens=30,
                 proposer=tree, draft_length=FixedDraftLength(6))
    assert len(r.tokens) == 30


def test_trainable_module_equals_inference_module(tmp_path):
    """TrainSequential (what train-mtp optimizes) and MTPModule (what drafting runs) compute the same function."""
    path = write_gguf("llama", tmp_path / "t.gguf", seed=2)
    t = load(path, dtype="f32", quant="none", ctx=64)
    args = t.model.args
    torch.manual_seed(1)
    mods = [TrainSequential(args, 48) for _ in range(2)]
    with torch.no_grad():
        for m in mods:
            for prm in m.parameters():
                prm.add_(torch.randn_like(prm) * 0.05)
    tensors = {k: v for d, m in enumerate(mods) for k, v in m.export(args.n_layers + d).items()}
    tensors["d2t"] = torch.arange(args.vocab_size)
    f = tmp_path / "h.safetensors"
    save_heads(f, tensors, kind="sequential", depth=2, base=base_fingerprint(t), args=args, ffn_dim=48, train={})
    kind, modules, vmap = load_heads(f, t)
    assert kind == "sequential" and len(modules) == 2
    T = 9
    h = torch.randn(T, args.dim)
    tokens = torch.randint(0, args.vocab_size, (2, T))
    from specdec.models.transformer import Rope, rope_inv_freq

    rope = Rope(rope_inv_freq(args.head_dim, args.rope_theta, None), T, torch.float32, "cpu")
    E = t.model.embed.rows(torch.arange(t.model.args.vocab_size))
    prev_t, prev_i = h, h[None]
    for d in range(2):
        # saved in bf16, so compare the trainable module with the bf16-rounded weights it exported
        with torch.no_grad():
            for prm in mods[d].parameters():
                prm.copy_(prm.to(torch.bfloat16).float())
            want = mods[d](prev_t, E[tokens[d]], rope.cos, rope.sin)
        logits, got = modules[d](prev_i, tokens[d][None], torch.arange(T), modules[d].new_cache(), exact=False)
        torch.testing.assert_close(got[0], want, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(logits[0], want @ E.T, atol=2e-3, rtol=1e-4)
        prev_t, prev_i = want, got


def test_heads_refuse_another_base_model(target, tmp_path):
    path = random_heads(target, tmp_path, "parallel", 1)
    tiny = load(write_gguf("llama", tmp_path / "t.gguf", seed=3), ctx=64)
    with pytest.raises(ModelError, match="trained for"):
        load_heads(path, tiny)
    header = read_header(path)
    header["base"]["sha256"] = "0" * 64  # same architecture and shapes, other weights
    with pytest.raises(ModelError, match="sha256"):
        check_base(header, target, path)


def test_training_runs_resumes_and_is_deterministic(tmp_path, monkeypatch):
    path = write_gguf("llama", tmp_path / "t.gguf", seed=4)
    t = load(path, ctx=256)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say something about {w}."}) for w in
                                 ("cats", "rain", "bread")))
    cfg = TrainConfig(kind="sequential", depth=2, samples=2, max_new=12, epochs=2, vocab=512, ffn_dim=32,
                      prompts=str(prompts))
    a = train_mtp(t, tmp_path / "a.safetensors", cfg)
    train_mtp(t, tmp_path / "b.safetensors", cfg)  # a fresh run with the same seed
    from safetensors.torch import load_file

    ta, tb = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert a["sequences"] == 6 and len(a["log"]) == 2 and a["draft_vocab"] == 512
    # resuming: every stage is cached, so nothing is generated again and training is not repeated

    def boom(*args, **kwargs):
        raise AssertionError("regenerated")

    monkeypatch.setattr("specdec.generate.generate", boom)
    again = train_mtp(t, tmp_path / "a.safetensors", cfg)
    assert again["log"] == a["log"]
    kind, modules, vmap = load_heads(tmp_path / "a.safetensors", t)
    assert kind == "sequential" and len(modules) == 2 and len(vmap) == 512


@pytest.mark.parametrize("which", ["shipped", "sequential-2"])
def test_catch_up_runs_the_last_positions_only(target, plain, tmp_path, monkeypatch, which):
    """After the prompt, the modules run over its last CATCH_UP positions only (not every position: a thousand-token
    prompt cost each first draft ~50 ms), and the output is still plain greedy's."""
    from specdec.spec import mtp as mtp_spec

    monkeypatch.setattr(mtp_spec, "CATCH_UP", 8)
    mtp = heads_for(target, tmp_path, which)
    rows: list[int] = []  # the positions each module call runs over
    cls = type(build_proposer(SpecConfig(kind="mtp"), target, GREEDY, mtp=mtp).modules[0])
    call = cls.__call__

    def counted(self, h, tokens, *a, **k):
        rows.append(tokens.shape[1])
        return call(self, h, tokens, *a, **k)

    monkeypatch.setattr(cls, "__call__", counted)
    for p, ref in plain.items():
        proposer = build_proposer(SpecConfig(kind="mtp"), target, GREEDY, mtp=mtp)
        ids = chat(target.tokenizer, p)
        assert len(ids) > 8
        r = generate(target.model, target.tokenizer, ids, GREEDY, max_tokens=N, ignore_eos=True, proposer=proposer,
                     draft_length=FixedDraftLength(3))
        assert r.tokens == ref
        assert r.stats.drafted > 0
    assert rows and max(rows) <= 8
