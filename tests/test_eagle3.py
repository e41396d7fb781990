"""EAGLE-3 heads: the trunk features they read, training-time test against step-by-step drafting, greedy identity."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHAT_PROMPTS, chat
from tiny_models import write_gguf, write_hf
from tiny_mtp import eagle3_file

from specdec.generate import generate
from specdec.loader import load
from specdec.models.eagle3 import default_aux_layers, draft_args
from specdec.models.transformer import Rope, rope_inv_freq
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig, build_proposer, resolve_mtp
from specdec.spec.autok import FixedDraftLength
from specdec.train.mtp import TrainConfig, train_mtp
from specdec.weights.heads import load_heads

GREEDY = SamplingParams(temperature=0.0)


def test_features_are_the_aux_layers_inputs(tmp_path):
    """With aux layers set, the trunk's hidden output is [inputs of layers 2, L/2, L-3; final normed hidden],
    compared with transformers' hidden_states (hidden_states[i] is the input of layer i)."""
    from transformers import AutoModelForCausalLM

    folder = write_hf("llama", tmp_path / "m", seed=3, num_hidden_layers=8)
    t = load(folder, dtype="f32", quant="none", ctx=64)
    L, dim = t.model.args.n_layers, t.model.args.dim
    aux = default_aux_layers(L)
    assert aux == (2, 4, 5)
    ids = torch.randint(0, t.model.args.vocab_size, (1, 11))
    t.model.aux_layers = aux
    _, hidden = t.model(ids, torch.arange(11), t.model.new_cache())
    t.model.aux_layers = ()
    _, plain = t.model(ids, torch.arange(11), t.model.new_cache())
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    assert hidden.shape == (1, 11, 4 * dim)
    for j, layer in enumerate(aux):
        torch.testing.assert_close(hidden[0, :, j * dim:(j + 1) * dim], hs[layer][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden[..., 3 * dim:], plain)  # then the usual (normed) hidden state
    with pytest.raises(AssertionError):  # the check can fail: a wrong layer is far off
        torch.testing.assert_close(hidden[0, :, :dim], hs[1][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_training_time_test_equals_step_by_step_drafting(tmp_path, arch):
    """TrainEagle3.unroll (what training optimizes: all indices, steps attending step 0 causally and their own chain
    on the diagonal) equals the inference module run as the drafter runs it: the real positions into its cache, then
    one drafted position at a time in temporary slots, fed its own output."""
    t = load(write_gguf(arch, tmp_path / "t.gguf", seed=2), dtype="f32", quant="none", ctx=64)
    args = draft_args(t.model.args)  # Gemma 3: the draft layer is still a plain Llama layer
    path, net = eagle3_file(t, tmp_path)
    kind, (mod,), vmap = load_heads(path, t)
    assert kind == "eagle3" and vmap is None
    T, steps, dim = 10, 3, args.dim
    torch.manual_seed(4)
    A = torch.randn(T, 3 * dim)
    tokens = torch.randint(0, args.vocab_size, (T,))
    E = t.model.embed.rows(torch.arange(args.vocab_size))
    rope = Rope(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), T + steps, torch.float32, "cpu")
    with torch.no_grad():
        outs = net.unroll(A, tokens, E, rope.cos, rope.sin, steps)
    assert [o.shape[0] for o in outs] == [T - 1, T - 2, T - 3]
    H = torch.cat([A, torch.randn(T, dim)], dim=-1)  # the trunk's hidden output: features, then h (unused)
    for p in (0, 3, T - 1 - steps):
        cache = mod.new_cache()
        logits, x = mod(H[None, :p + 1], tokens[None, 1:p + 2], torch.arange(p + 1), cache)  # the real positions
        torch.testing.assert_close(logits[0], outs[0][:p + 1] @ E.T, atol=2e-3, rtol=1e-4)
        g = x[:, -1:]
        for k in range(1, steps):  # drafted positions, one at a time, each attending the cache and its chain
            lg, g = mod(g, tokens[None, p + 1 + k:p + 2 + k], torch.tensor([p + k]), cache)
            torch.testing.assert_close(lg[0, 0], outs[k][p] @ E.T, atol=2e-3, rtol=1e-4)


def test_batched_training_equals_one_sequence_at_a_time(tmp_path):
    """A batch of right-padded sequences of different lengths (the online trainer's batches) gives each sequence's
    TTT outputs, losses and agreement counts as that sequence alone; padding tokens are never counted."""
    from specdec.train.eagle3 import eagle3_loss

    t = load(write_gguf("llama", tmp_path / "t.gguf", seed=2), dtype="f32", quant="none", ctx=64)
    args = draft_args(t.model.args)
    _, net = eagle3_file(t, tmp_path)
    dim, steps, lens = args.dim, 3, [9, 4, 12]
    torch.manual_seed(5)
    T = max(lens)
    A, h = torch.randn(3, T, 3 * dim), torch.randn(3, T, dim)
    tokens = torch.randint(0, args.vocab_size, (3, T))
    E = t.model.embed.rows(torch.arange(args.vocab_size))
    head = E[:200]
    rope = Rope(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), T + steps, torch.float32, "cpu")
    with torch.no_grad():
        outs = net.unroll(A, tokens, E, rope.cos, rope.sin, steps)
        lb, ab = eagle3_loss(net, A, h, tokens, E, head, rope, steps, 0.8, torch.tensor(lens))
        singles = [eagle3_loss(net, A[b, :n], h[b, :n], tokens[b, :n], E, head, rope, steps, 0.8)
                   for b, n in enumerate(lens)]
        for b, n in enumerate(lens):
            for k, o in enumerate(net.unroll(A[b, :n], tokens[b, :n], E, rope.cos, rope.sin, steps)):
                torch.testing.assert_close(outs[k][b, :n - 1 - k], o, atol=1e-5, rtol=1e-5)
    for k in range(steps):  # the batch's loss: every sequence's per-token KL, averaged over all valid tokens
        counts = [s[1][k][1] for s in singles]
        assert ab[k][1] == sum(counts) == sum(n - 1 - k for n in lens)
        assert ab[k][0] == sum(s[1][k][0] for s in singles)
        want = sum(s[0][k] * c for s, c in zip(singles, counts, strict=True)) / sum(counts)
        torch.testing.assert_close(lb[k], want, atol=1e-5, rtol=1e-4)
    full = eagle3_loss(net, A, h, tokens, E, head, rope, steps, 0.8)[1]
    assert full[0][1] == 3 * (T - 1) != ab[0][1]  # without lengths the padding counts: the mask is what drops it


@pytest.fixture(scope="module")
def target(smollm2_default):
    return smollm2_default


@pytest.mark.parametrize("tree,k", [(None, 4), ([2, 2], 6)])
def test_greedy_identity(target, plain_greedy, tmp_path, tree, k):
    path, _ = eagle3_file(target, tmp_path, ffn=256, vocab=4096)
    try:
        mtp = resolve_mtp(target, path)
        assert mtp[0] == "eagle3"
        for p in CHAT_PROMPTS[:1]:
            ref = plain_greedy(p, 40)
            proposer = build_proposer(SpecConfig(kind="mtp", tree=tuple(tree) if tree else None), target, GREEDY,
                                      mtp=mtp)
            r = generate(target.model, target.tokenizer, chat(target.tokenizer, p), GREEDY, max_tokens=40,
                         ignore_eos=True, proposer=proposer, draft_length=FixedDraftLength(k))
            assert r.tokens == ref and r.stats.drafted > 0
    finally:
        target.model.aux_layers = ()  # the session's shared model: plain hidden states again


def test_train_eagle3_runs_and_resumes(tmp_path):
    t = load(write_gguf("llama", tmp_path / "t.gguf", seed=4), ctx=256)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say something about {w}."}) for w in ("cats", "rain")))
    cfg = TrainConfig(kind="eagle3", depth=3, samples=2, max_new=12, epochs=2, vocab=512, ffn_dim=32,
                      prompts=str(prompts))
    a = train_mtp(t, tmp_path / "a.safetensors", cfg)
    assert a["sequences"] == 4 and len(a["log"]) == 2 and len(a["log"][0]["top1"]) == 3
    again = train_mtp(t, tmp_path / "a.safetensors", cfg)
    assert again["log"] == a["log"]
    kind, (mod,), vmap = load_heads(tmp_path / "a.safetensors", t)
    assert kind == "eagle3" and len(vmap) == 512 and t.model.aux_layers == default_aux_layers(t.model.args.n_layers)


def test_train_on_make_data_file_subset(tmp_path):
    """--data reads a make-data JSONL; --data-tokens takes a seeded subset drawn from the whole file."""
    from specdec.train.mtp import token_subset

    seqs = [[i] * (5 + i % 7) for i in range(200)]
    a, b = token_subset(seqs, 300, 0), token_subset(seqs, 300, 0)
    assert a == b and 300 <= sum(map(len, a)) < 312 and a != token_subset(seqs, 300, 1)
    assert max(s[0] for s in a) > 100  # not the first lines only
    assert token_subset(seqs, 0, 0) == seqs
    t = load(write_gguf("llama", tmp_path / "t.gguf", seed=4), ctx=256)
    V = t.model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [{"id": i, "prompt_tokens": torch.randint(0, V, (6,), generator=g).tolist(),
             "answers": [{"tokens": torch.randint(0, V, (10,), generator=g).tolist()} for _ in range(2)]}
            for i in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": 6, "prompt_tok')  # + a truncated line
    cfg = TrainConfig(kind="eagle3", depth=2, epochs=1, vocab=256, ffn_dim=32, data=str(data), data_tokens=64)
    s = train_mtp(t, tmp_path / "h.safetensors", cfg)
    assert s["sequences"] == 4 and s["tokens"] == 64  # 16-token sequences until >= 64 tokens


def test_other_heads_still_read_the_final_hidden_state(target, tmp_path):
    """With EAGLE-3 heads loaded, the trunk's hidden output carries the aux features first: Medusa heads and
    sequential modules must draft exactly what they draft without them (they read the last dim columns)."""
    prompt = chat(target.tokenizer, CHAT_PROMPTS[2])

    def drafts(kind: str) -> list:
        mtp = resolve_mtp(target, None, kind)
        assert mtp is not None and mtp[0] == kind
        r = generate(target.model, target.tokenizer, prompt, GREEDY, max_tokens=24, ignore_eos=True,
                     proposer=build_proposer(SpecConfig(kind="mtp"), target, GREEDY, mtp=mtp),
                     draft_length=FixedDraftLength(3))
        return [r.stats.drafted, r.stats.accepted]

    try:
        want = {k: drafts(k) for k in ("parallel", "sequential")}
        resolve_mtp(target, eagle3_file(target, tmp_path, ffn=64, vocab=1024)[0])  # sets the aux layers
        assert target.model.aux_layers
        assert {k: drafts(k) for k in ("parallel", "sequential")} == want
    finally:
        target.model.aux_layers = ()


@pytest.mark.parametrize("arch,kind", [("qwen3_moe", "eagle3"), ("glm4_moe", "eagle3"), ("deepseek_v2", "eagle3"),
                                       ("qwen3_moe", "parallel")])
def test_train_heads_on_moe_and_mla_trunks(tmp_path, arch, kind):
    """train-mtp makes EAGLE-3 (and parallel) heads for mixture-of-experts trunks (Qwen3-MoE, GLM-4.5: GQA,
    partial rotary) and MLA trunks (DeepSeek-V2: the draft layer has dim / n_heads per head and its own full RoPE);
    drafting with them is exact (greedy --spec mtp = plain greedy) and drafts."""
    from tiny_moe import write_moe_hf

    folder, _, _ = write_moe_hf(arch, tmp_path / arch, seed=7, tokenizer=True)
    t = load(folder, dtype="bf16", quant="int8", ctx=256)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say something about {w}."}) for w in ("cats", "rain")))
    cfg = TrainConfig(kind=kind, depth=2, samples=2, max_new=12, epochs=1, vocab=0, ffn_dim=32,
                      prompts=str(prompts))
    summary = train_mtp(t, tmp_path / "h.safetensors", cfg)
    assert summary["sequences"] == 4
    got, drafter, vmap = load_heads(tmp_path / "h.safetensors", t)
    assert got == kind and vmap is None
    if kind == "eagle3":
        (mod,) = drafter
        assert mod.args.attention == "gqa" and mod.args.n_experts == 0
    if arch == "deepseek_v2":
        assert mod.args.head_dim * mod.args.n_heads == t.model.args.dim
        from specdec.weights.export import export_heads  # speculators' config describes this layer, not the trunk's

        out = export_heads(tmp_path / "h.safetensors", t, "speculators", tmp_path / "s")
        layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
        assert layer["head_dim"] == mod.args.head_dim and layer["num_key_value_heads"] == mod.args.n_heads
    prompt = chat(t.tokenizer, "Repeat: the quick brown fox.")
    try:
        plain = generate(t.model, t.tokenizer, prompt, GREEDY, max_tokens=16, ignore_eos=True).tokens
        spec = SpecConfig(kind="mtp", heads=str(tmp_path / "h.safetensors"))
        r = generate(t.model, t.tokenizer, prompt, GREEDY, max_tokens=16, ignore_eos=True,
                     proposer=build_proposer(spec, t, GREEDY), draft_length=FixedDraftLength(3))
    finally:
        t.model.aux_layers = ()
    assert r.tokens == plain and r.stats.drafted > 0


def test_the_teacher_of_an_untied_model_is_its_output_head(tmp_path):
    """Training's teacher softmax(h W^T) uses the output matrix of an untied model (it used the embedding table,
    which is another matrix there)."""
    from tiny_moe import write_moe_hf

    from specdec.train.mtp import output_rows

    folder, cfg, _ = write_moe_hf("qwen3_moe", tmp_path / "m", seed=3, tokenizer=True)
    assert cfg["tie_word_embeddings"] is False
    t = load(folder, dtype="f32", quant="none", ctx=64)
    ids = torch.randint(0, t.model.args.vocab_size, (1, 9))
    logits, h = t.model(ids, torch.arange(9), t.model.new_cache())
    torch.testing.assert_close(h[0] @ output_rows(t).T, logits[0], atol=1e-4, rtol=1e-4)
    E = t.model.embed.rows(torch.arange(t.model.args.vocab_size))
    assert not torch.allclose(h[0] @ E.T, logits[0], atol=1e-2)
