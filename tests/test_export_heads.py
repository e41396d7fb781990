"""`specdec export-heads`: every layout reads back to the native tensors, the speculators layout loads in the
`speculators` package and computes what specdec computes, refusals, and the command line."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import write_hf
from tiny_mtp import eagle3_file

from specdec.cli import main
from specdec.config import ModelError
from specdec.loader import load
from specdec.models.eagle3 import default_aux_layers
from specdec.models.transformer import Rope, rope_inv_freq
from specdec.train.mtp import TrainParallel, TrainSequential
from specdec.weights.export import FORMATS, export_heads, read_exported
from specdec.weights.heads import base_fingerprint, load_heads, save_heads

if importlib.util.find_spec("speculators") is not None:  # installed by the Makefile (--no-deps) on Python >= 3.11
    # installed but not importable (a dependency missing from the Makefile's list) is a failure, not a skip
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
else:
    Eagle3DraftModel = Eagle3SpeculatorConfig = None
needs_speculators = pytest.mark.skipif(Eagle3DraftModel is None, reason="the speculators package is not installed "
                                       "(make setup installs speculators==0.9.0 --no-deps on Python >= 3.11)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama as a Hugging Face folder (which speculators can read as the verifier), 8 layers: EAGLE-3's aux
    layers 2, 4, 5 are distinct. bf16 weights: the target's rows in the exported bf16 files are then exact."""
    return write_hf("llama", tmp_path_factory.mktemp("export") / "m", seed=3, num_hidden_layers=8,
                    dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def target(model_dir):
    return load(model_dir, dtype="f32", quant="none", ctx=64)


def heads_file(t, tmp_path, kind: str, vocab: int | None = None, depth: int = 2) -> str:
    """A random heads file of `kind` (parallel: Medusa heads, sequential: DeepSeek-V3-style modules)."""
    a = t.model.args
    torch.manual_seed(5)
    if kind == "parallel":
        net = TrainParallel(a.dim, depth)
        with torch.no_grad():
            for prm in net.parameters():
                prm.add_(torch.randn_like(prm) * 0.05)
        tensors = net.export()
    else:
        tensors = {}
        for d in range(depth):
            tensors.update(TrainSequential(a, 40).export(a.n_layers + d))
    tensors["d2t"] = torch.arange(a.vocab_size) if vocab is None else torch.randperm(a.vocab_size)[:vocab].sort().values
    path = tmp_path / f"{kind}.safetensors"
    save_heads(path, tensors, kind=kind, depth=depth, base=base_fingerprint(t), args=a,
               ffn_dim=0 if kind == "parallel" else 40, train={})
    return str(path)


def native_file(t, tmp_path, fmt: str, vocab: int | None) -> str:
    kind = FORMATS[fmt]
    return eagle3_file(t, tmp_path, vocab=vocab)[0] if kind == "eagle3" else heads_file(t, tmp_path, kind, vocab)


@pytest.mark.parametrize("vocab", [None, 512])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip(target, tmp_path, fmt, vocab):
    """Exported, read back: the native tensors (bf16 in both) and the draft vocabulary as target ids; the rows
    specdec takes from the target are the target's. DeepSeek's layout has no vocabulary map: its heads score the full
    vocabulary."""
    path = native_file(target, tmp_path, fmt, vocab)
    out = export_heads(path, target, fmt, tmp_path / fmt)
    back = read_exported(out)
    assert back["format"] == fmt and back["kind"] == FORMATS[fmt] and back["header"]["kind"] == FORMATS[fmt]
    native = load_file(path)
    V = target.model.args.vocab_size
    ids = torch.arange(V) if fmt == "deepseek-mtp" else native["d2t"]
    assert set(back["tensors"]) == set(native)
    torch.testing.assert_close(back["tensors"].pop("d2t"), ids, rtol=0, atol=0)
    for name, t in back["tensors"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, native[name]), name
    rows = lambda lin, i: lin.rows(i).to(torch.bfloat16)  # noqa: E731
    heads = [t for n, t in back["extra"].items() if "lm_head" in n or "shared_head.head" in n]
    assert heads and all(torch.equal(h, rows(target.model.output, ids)) for h in heads)
    cfg = json.loads((out / "config.json").read_text())
    if fmt in ("speculators", "eagle3"):
        assert set(back["extra"]) == ({"lm_head.weight"} | ({"t2d"} if vocab else set()))
        if vocab:
            assert torch.equal(back["extra"]["t2d"].nonzero()[:, 0], ids)
        assert cfg["draft_vocab_size"] == len(ids) and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    if fmt == "eagle3":  # SGLang reads its own copy, as outputs of layers (it adds 1)
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and not cfg["tie_word_embeddings"]
    if fmt == "medusa":  # vLLM's MedusaConfig.from_pretrained renames every key with "num" and "heads" / "layers"
        assert [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)] == ["num_heads", "num_hidden_layers"]
        assert cfg["num_heads"] == 2 and cfg["truncated_vocab_size"] == len(ids) and cfg["medusa_fc_bias"]
    if fmt == "deepseek-mtp":
        L = target.model.args.n_layers
        assert cfg["num_hidden_layers"] == L and cfg["num_nextn_predict_layers"] == 2
        assert all(n.startswith((f"model.layers.{L}.", f"model.layers.{L + 1}.")) for n in back["tensors"])
        assert torch.equal(back["extra"][f"model.layers.{L}.embed_tokens.weight"], rows(target.model.embed, ids))


@pytest.mark.parametrize("vocab", [None, 512])
def test_medusa_as_vllm_computes_it(target, tmp_path, vocab):
    """The medusa layout through vLLM's Medusa arithmetic (model_executor/models/medusa.py: ResidualBlock
    x + SiLU(W x + b) per head, lm_heads, and with a token_map the draft logits scattered into a -inf row over the
    full vocabulary) gives specdec's ParallelHeads' logits at the draft tokens; bf16 weights, float32 compute."""
    path = heads_file(target, tmp_path, "parallel", vocab)
    out = export_heads(path, target, "medusa", tmp_path / "m")
    w = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    V = cfg["vocab_size"]
    _, heads, vmap = load_heads(path, target)
    ids = torch.arange(V) if vmap is None else vmap
    torch.manual_seed(6)
    h = torch.randn(5, target.model.args.dim)
    ours = heads(h)
    for k in range(cfg["num_heads"]):
        x = h + torch.nn.functional.silu(h @ w[f"blocks.{k}.layers.0.weight"].float().T
                                         + w[f"blocks.{k}.layers.0.bias"].float())
        logits = x @ w[f"lm_heads.{k}.weight"].float().T
        if cfg["truncated_vocab_size"] < V:
            full = torch.full((5, V), float("-inf"))
            full[:, w["token_map"]] = logits
            logits = full
        torch.testing.assert_close(logits[:, ids], ours[k], atol=1e-4, rtol=1e-4)
        assert logits.argmax(-1).tolist() == ids[ours[k].argmax(-1)].tolist()


@needs_speculators
def test_speculators_config_validates(target, tmp_path):
    path, _ = eagle3_file(target, tmp_path, vocab=512)
    out = export_heads(path, target, "speculators", tmp_path / "s", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = json.loads((out / "config.json").read_text())
    c = Eagle3SpeculatorConfig.model_validate(cfg)
    a = target.model.args
    tl = c.transformer_layer_config
    assert type(tl).__name__ == "LlamaConfig" and tl.vocab_size == a.vocab_size and tl.intermediate_size == 48
    assert (tl.hidden_size, tl.head_dim, tl.num_key_value_heads, tl.num_hidden_layers) == (a.dim, a.head_dim, 2, 1)
    assert c.draft_vocab_size == 512 and c.norm_before_residual is False and c.eagle_aux_hidden_state_layer_ids
    s = c.speculators_config
    assert s.algorithm == "eagle3" and s.default_proposal_method == "greedy"
    assert s.proposal_methods[0].speculative_tokens == 3
    assert s.verifier.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct" and s.verifier.architectures == [
        "LlamaForCausalLM"]
    # what the speculators classes write back is what we wrote (speculators' own serialization, verbatim)
    dumped = json.loads(c.to_json_string())
    for key in ("speculators_model_type", "architectures", "draft_vocab_size", "norm_before_residual",
                "eagle_aux_hidden_state_layer_ids", "speculators_config"):
        assert dumped[key] == cfg[key], key


@needs_speculators
def test_speculators_model_computes_what_specdec_computes(target, tmp_path):
    """The speculators layout loaded as speculators' own Eagle3DraftModel, run with training-time test (3 steps) on
    random aux features, against specdec's TrainEagle3.unroll and, at step 0, the inference module.

    Alignment (speculators' Eagle3DraftModel.forward): its index i pairs the feature of trunk position i with
    input_ids[i], at position position_ids[i]; step k >= 1 feeds the layer's own pre-norm output at index i with
    input_ids shifted left by k (its teacher forcing: original_input_ids[:, k:] padded with zeros), positions + k, and
    attends step 0 causally plus its own earlier steps on the diagonal. specdec's index p pairs g_p with token
    t_{p+1} at position p, and step k reads t_{p+1+k} at position p + k. So input_ids = tokens[1:] (length S = T - 1),
    position_ids = 0..S-1, and speculators' step-k logits at index i equal ours at index i for i < S - k (the last k
    indices read padding). Both sides hold the same bf16 weights and compute in float32: agreement to ~1e-6
    (tolerance 1e-4 absolute and relative).

    The verifier is the target's folder: speculators 0.9.0's from_pretrained needs one (it reads the verifier's
    config, checking the aux layer ids against its depth) and takes its verifier_lm_head from it, the target's head
    restricted by t2d."""
    path, net = eagle3_file(target, tmp_path, vocab=512)
    out = export_heads(path, target, "speculators", tmp_path / "s", verifier=str(target.path))
    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is for GPUs
    model = Eagle3DraftModel.from_pretrained(str(out), config=config, dtype=torch.float32).eval()
    a = target.model.args
    assert model.target_layer_ids == [2, 4, 5] == list(default_aux_layers(a.n_layers))
    E = target.model.embed.rows(torch.arange(a.vocab_size))
    ids = load_file(path)["d2t"]
    with torch.no_grad():  # not exported (vLLM and speculators share the target's); speculators 0.9.0 copies the
        model.embed_tokens.weight.copy_(E)  # verifier's only over NaN, and transformers 5.24 initializes it to 0
    assert torch.equal(model.d2t + torch.arange(512), ids) and torch.equal(model.t2d.nonzero()[:, 0], ids)
    E_draft = E[ids].to(torch.bfloat16).float()
    assert torch.equal(model.lm_head.weight, E_draft)  # ours: the target's rows for d2t, in d2t's order ...
    assert torch.equal(model.verifier_lm_head.weight.to(torch.bfloat16).float(), E_draft)  # ... = speculators' t2d

    T, steps, dim = 12, 3, a.dim
    S = T - 1
    torch.manual_seed(4)
    A = torch.randn(T, 3 * dim)
    tokens = torch.randint(0, a.vocab_size, (T,))
    feats: list[torch.Tensor] = []  # per TTT step: what reaches lm_head (norm(x)), and the logits
    logits: list[torch.Tensor] = []

    def record(module, inputs, output) -> None:
        feats.append(inputs[0].clone())
        logits.append(output.clone())

    hook = model.lm_head.register_forward_hook(record)
    with torch.no_grad():
        model(A[None, :S], tokens[None, 1:], torch.zeros(1, S, dtype=torch.long),
              position_ids=torch.arange(S)[None], ttt_steps=steps)
    hook.remove()
    rope = Rope(rope_inv_freq(a.head_dim, a.rope_theta, None), T + steps, torch.float32, "cpu")
    with torch.no_grad():
        outs = net.unroll(A, tokens, E, rope.cos, rope.sin, steps)
    assert len(logits) == steps
    for k in range(steps):
        n = S - k
        torch.testing.assert_close(feats[k][0, :n], outs[k], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits[k][0, :n], outs[k] @ E_draft.T, atol=1e-4, rtol=1e-4)

    try:  # specdec's inference module, from the native file, at step 0
        _, (mod,), _ = load_heads(path, target)
        H = torch.cat([A, torch.zeros(T, dim)], dim=-1)  # the trunk's hidden output: features, then h (unused)
        with torch.no_grad():
            lg, _ = mod(H[None, :S], tokens[None, 1:], torch.arange(S), mod.new_cache())
        torch.testing.assert_close(lg[0], logits[0][0], atol=1e-4, rtol=1e-4)
    finally:
        target.model.aux_layers = ()


def test_refusals(target, tmp_path):
    e3, _ = eagle3_file(target, tmp_path, vocab=512)
    with pytest.raises(ModelError, match="holds eagle3 heads; --format medusa exports parallel heads"):
        export_heads(e3, target, "medusa", tmp_path / "x")
    with pytest.raises(ModelError, match="--format deepseek-mtp exports sequential heads"):
        export_heads(heads_file(target, tmp_path, "parallel"), target, "deepseek-mtp", tmp_path / "x")
    with pytest.raises(ValueError, match="--format must be one of"):
        export_heads(e3, target, "gguf", tmp_path / "x")
    other = load(write_hf("llama", tmp_path / "other", seed=4, num_hidden_layers=8), dtype="f32", quant="none", ctx=64)
    with pytest.raises(ModelError, match="was trained for m "):
        export_heads(e3, other, "eagle3", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_cli(model_dir, target, tmp_path, capsys):
    e3, _ = eagle3_file(target, tmp_path, vocab=512)
    out = tmp_path / "out"
    rc = main(["export-heads", e3, "--format", "eagle3", "-o", str(out), "-m", str(model_dir), "--dtype", "f32",
               "--quant", "none"])
    assert rc == 0 and read_exported(out)["format"] == "eagle3"
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and '"method": "eagle3"' in err
    rc = main(["export-heads", e3, "--format", "medusa", "-o", str(tmp_path / "m"), "-m", str(model_dir)])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: ") and "--format speculators, eagle3" in err
