"""Mixture-of-experts and multi-head latent attention models (qwen3_moe, deepseek_v2, deepseek_v3, glm4_moe):
logits parity with Hugging Face transformers on tiny random HF folders (prefill, decode steps, exact verification),
the MLA cache holds only the latent, MoE compute is batch-invariant and reads only the chosen experts, and routing
edge cases (ties, one expert for every row, an expert nobody chose) behave as transformers' routers do.

Tolerance as in test_parity.py: f32 on both sides, max abs diff <= 1e-4 x the logit scale.
"""

from __future__ import annotations

import pytest
import torch
from tiny_moe import ARCHS, IDS, assert_close, moe_config, write_moe_hf

from specdec.models.moe import route
from specdec.models.transformer import Transformer
from specdec.weights import read_model
from specdec.weights.hf import args_from_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_moe_hf(arch, root / arch, seed=i + 1) for i, arch in enumerate(ARCHS)}


def build(folder, dtype=torch.float32, quant="none") -> Transformer:
    lm = read_model(folder)
    return Transformer(lm.args, lm.weights, dtype, quant, max_len=128)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_parity_prefill_decode_verify(folders, arch):
    from transformers import AutoModelForCausalLM

    folder, cfg, _ = folders[arch]
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS])).logits[0]
    m = build(folder)
    n = 6
    with torch.inference_mode():
        full, _ = m(torch.tensor([IDS]), torch.arange(len(IDS)), m.new_cache())
        cache = m.new_cache()
        first, _ = m(torch.tensor([IDS[:n]]), torch.arange(n), cache)
        steps = [m(torch.tensor([[t]]), torch.tensor([n + i]), cache)[0][0] for i, t in enumerate(IDS[n:])]
        verify_cache = m.new_cache()
        m(torch.tensor([IDS[:n]]), torch.arange(n), verify_cache)
        verify, _ = m(torch.tensor([IDS[n:]]), torch.arange(n, len(IDS)), verify_cache, exact=True)
    assert_close(full[0], theirs)
    assert_close(torch.cat([first[0], *steps]), theirs)
    assert_close(verify[0], theirs[n:])
    if arch.startswith("deepseek"):  # the cache holds [c_kv; k_rope] per token, not K and V
        assert cache.kv.shape[-2:] == (1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])


def test_yarn_matters(folders):
    """The tiny DeepSeek configs are YaRN-scaled: without the scaling the logits move (so it is really applied)."""
    folder, _, _ = folders["deepseek_v3"]
    lm = read_model(folder)
    m = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=128)
    lm.args.rope_scaling, lm.args.rope_attention_factor = None, 1.0
    plain = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=128)
    with torch.inference_mode():
        a, _ = m(torch.tensor([IDS]), torch.arange(len(IDS)), m.new_cache())
        b, _ = plain(torch.tensor([IDS]), torch.arange(len(IDS)), plain.new_cache())
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("arch,dtype,quant", [("qwen3_moe", torch.bfloat16, "int8"),
                                              ("deepseek_v3", torch.bfloat16, "int4"),
                                              ("glm4_moe", torch.bfloat16, "none")])
def test_rows_batch_invariant(folders, arch, dtype, quant):
    """A verification over T rows computes each row bitwise as its decode step does (exact=True): the MoE layers'
    grouped expert matmuls and the routing of a row do not depend on the other rows."""
    steps_equal_rows(build(folders[arch][0], dtype, quant))


def steps_equal_rows(m: Transformer, n: int = 5) -> torch.Tensor:
    """Decode IDS[n:] step by step after a prefill of IDS[:n], then verify them in one exact forward: every row
    bitwise its step. -> the steps' logits [len(IDS) - n, V]."""
    with torch.inference_mode():
        cache = m.new_cache()
        m(torch.tensor([IDS[:n]]), torch.arange(n), cache)
        steps = [m(torch.tensor([[t]]), torch.tensor([n + i]), cache)[0][0, 0] for i, t in enumerate(IDS[n:])]
        cache.rollback(n)
        rows, _ = m(torch.tensor([IDS[n:]]), torch.arange(n, len(IDS)), cache, exact=True)
    for i, step in enumerate(steps):
        assert torch.equal(rows[0, i], step), f"row {i}"
    return torch.stack(steps)


def moe_layer(m: Transformer):
    return next(layer.moe for layer in m.layers if layer.moe is not None)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_moe_layer_row_alone_equals_row_in_batch(folders, quant):
    moe = moe_layer(build(folders["qwen3_moe"][0], torch.bfloat16, quant))
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        batch = moe(x, exact=True)
        for i in range(9):
            assert torch.equal(moe(x[:, i:i + 1], exact=True)[0, 0], batch[0, i]), i
            assert torch.equal(moe(x[:, [i, (i + 3) % 9]], exact=True)[0, 0], batch[0, i]), i


def test_only_chosen_experts_are_read(folders, monkeypatch):
    """Each chosen expert runs once, over exactly the rows that chose it; the others are never touched."""
    moe = moe_layer(build(folders["deepseek_v3"][0]))
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        h = moe.norm(x).reshape(-1, 64)
        _, ids = route(moe.router_logits(h, True), moe.args, moe.bias)
        expect = {e: sorted(r for r in range(3) if e in ids[r].tolist()) for e in set(ids.flatten().tolist())}
        assert len(expect) < moe.args.n_experts  # 3 rows x 2 experts: some experts unused
        calls: dict[int, list[int]] = {}

        class Spy:
            def __init__(self, e, lin):
                self.e, self.lin = e, lin

            def apply(self, rows, **kw):
                calls.setdefault(self.e, []).append(rows.shape[0])
                return self.lin.apply(rows, **kw)

        ref = moe(x)
        monkeypatch.setattr(moe, "experts", [(Spy(e, w13), w2) for e, (w13, w2) in enumerate(moe.experts)])
        assert torch.equal(moe(x), ref)
    assert calls == {e: [len(rows)] for e, rows in expect.items()}


# ----------------------------------------------------------------------------------------------------------------
# routing edge cases, against transformers' own routers
# ----------------------------------------------------------------------------------------------------------------

def hf_router(arch: str, cfg: dict, bias: torch.Tensor | None):
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    keys = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cls, conf = {"qwen3_moe": (Qwen3MoeTopKRouter, Qwen3MoeConfig), "deepseek_v2": (DeepseekV2TopkRouter,
                 DeepseekV2Config), "deepseek_v3": (DeepseekV3TopkRouter, DeepseekV3Config)}[arch]
    router = cls(conf(**keys))
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))  # logits = the hidden state itself
        if bias is not None:
            router.e_score_correction_bias.copy_(bias)
    return router


def as_dict(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for w, i in zip(weights, ids, strict=True)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_routing_edge_cases_match_transformers(arch):
    cfg = moe_config(arch, hidden_size=8)
    args = args_from_config(cfg)
    bias = torch.tensor([0.0, 0.0, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0]) if arch == "deepseek_v3" else None
    ref = hf_router(arch, cfg, bias)
    logits = torch.tensor([
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # all tied
        [0.5, 2.0, 2.0, 0.5, 0.1, 0.1, 0.3, 0.3],  # a tie for the top two
        [0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0],  # a tie inside one group
        [5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    out = ref(logits)
    theirs = as_dict(out[1].float(), out[2])
    ours = as_dict(*route(logits, args, bias))
    assert [sorted(o) for o in ours] == [sorted(t) for t in theirs]  # the same experts chosen, ties included
    for o, t in zip(ours, theirs, strict=True):
        assert list(o.values()) == pytest.approx([t[k] for k in o], rel=1e-6)


def test_all_rows_one_expert_and_an_unchosen_expert(folders):
    """Rows that all choose the same experts go through each once, as one group; experts no row chose produce
    nothing, and the result equals a dense reference computed expert by expert."""
    moe = moe_layer(build(folders["qwen3_moe"][0]))
    with torch.no_grad():
        moe.router = torch.zeros_like(moe.router)
        moe.router[3, :] = 1.0  # every row's logits: expert 3 first, then the rest tied
        moe.router[5, :] = 0.5
    x = torch.rand(1, 4, 64, generator=torch.Generator().manual_seed(2)) + 0.5  # positive sums: 3 then 5
    with torch.inference_mode():
        h = moe.norm(x).reshape(-1, 64)
        w, ids = route(moe.router_logits(h, False), moe.args, None)
        assert ids.tolist() == [[3, 5]] * 4
        y = moe(x)
        ref = x.clone()
        for j, e in enumerate((3, 5)):
            w13, w2 = moe.experts[e]
            ref = ref + (w2(w13.apply(h, swiglu=True)) * w[:, j:j + 1]).view(1, 4, 64)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# GGUF under llama.cpp's names: the same logits as the HF folder of the same weights
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,qtype,split", [("qwen3_moe", "F32", True), ("glm4_moe", "F16", True),
                                              ("deepseek_v2", "F32", False), ("deepseek_v3", "F32", True),
                                              ("deepseek_v3", "Q8_0", True)])
def test_gguf_matches_hf_folder(folders, tmp_path, arch, qtype, split):
    from tiny_moe import write_moe_gguf

    folder, cfg, sd = folders[arch]
    path = write_moe_gguf(arch, tmp_path / f"{arch}.gguf", cfg, sd, qtype=qtype, split_kv_b=split)
    lm = read_model(path)
    assert lm.args.arch == arch and lm.args.moe_layers == read_model(folder).args.moe_layers
    with torch.inference_mode():
        theirs, _ = (m := build(folder))(torch.tensor([IDS]), torch.arange(len(IDS)), m.new_cache())
        ours, _ = (g := build(path))(torch.tensor([IDS]), torch.arange(len(IDS)), g.new_cache())
    if qtype == "F32":
        assert_close(ours[0], theirs[0])
    else:  # rounded weights (which may flip a near-tied expert choice, moving a row's logits): close on the whole
        err = (ours[0] - theirs[0]).abs()
        assert err.mean() < 0.02 * theirs.abs().max() and err.max() < 0.5 * theirs.abs().max()
        import gguf  # each expert's slice of a stacked Q8_0 tensor is exactly that expert's dequantized rows
        qt = gguf.GGMLQuantizationType[qtype]
        for e in (0, 5):
            w = sd[f"model.layers.2.mlp.experts.{e}.up_proj.weight"].numpy()
            expect = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt))
            assert torch.equal(lm.weights[f"blk.2.exp.{e}.ffn_up"], expect)


def test_gguf_mtp_layer_loads(folders, tmp_path):
    from tiny_moe import write_moe_gguf

    from specdec.models.mtp import load_mtp_modules

    folder, cfg, sd = write_moe_hf("glm4_moe", tmp_path / "hf", seed=9, n_mtp=1)
    path = write_moe_gguf("glm4_moe", tmp_path / "m.gguf", cfg, sd)
    out = []
    for src in (folder, path):
        lm = read_model(src)
        trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
        (module,) = load_mtp_modules(trunk, lm.weights, lm.args)
        with torch.inference_mode():
            _, h = trunk(torch.tensor([IDS]), torch.arange(len(IDS)), trunk.new_cache())
            out.append(module(h[:, :-1], torch.tensor([IDS[1:]]), torch.arange(len(IDS) - 1), module.new_cache())[0])
    assert_close(out[1][0], out[0][0])


def test_unknown_moe_variant_is_one_line_error(tmp_path):
    """A Mixtral-style GGUF (arch llama with experts) and an unsupported gating function: one-line ModelErrors."""
    import gguf
    import numpy as np

    from specdec.config import ModelError

    w = gguf.GGUFWriter(None, "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(128)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((8, 64), np.float32))
    path = tmp_path / "mixtral.gguf"
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="mixture-of-experts variant") as e:
        read_model(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_forward_batch_rows_equal_solo_rows(folders, arch):
    """Continuous batching (Engine's forward_batch) on a MoE trunk (and on MLA's latent cache, attended by the
    kernel): each sequence's rows are bitwise its solo exact forward, whatever experts the other sequence's rows
    chose."""
    m = build(folders[arch][0], torch.bfloat16, "int8")
    assert m.kernel
    pool = m.new_pool(2)
    a, b = pool.acquire(), pool.acquire()
    with torch.inference_mode():
        m.prefill(IDS[:5], a)
        m.prefill(IDS[3:9], b)
        batch, _ = m.forward_batch([(a, IDS[5:8], [5, 6, 7], None), (b, IDS[9:11], [6, 7], None)])
        a.rollback(5)
        b.rollback(6)
        solo_a, _ = m(torch.tensor([IDS[5:8]]), torch.tensor([5, 6, 7]), a, exact=True)
        solo_b, _ = m(torch.tensor([IDS[9:11]]), torch.tensor([6, 7]), b, exact=True)
    assert torch.equal(batch[:3], solo_a[0]) and torch.equal(batch[3:], solo_b[0])


def fuse_experts(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """The state dict with each layer's routed experts stacked as transformers 5 holds them: mlp.experts.gate_up_proj
    [E, 2 I, D] (gate rows, then up rows), mlp.experts.down_proj [E, D, I]."""
    import re

    out, stacks = {}, {}
    for k, v in sd.items():
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            stacks.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    n = cfg.get("num_experts") or cfg["n_routed_experts"]
    for prefix, parts in stacks.items():
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fused_expert_layout_reads_as_per_expert(tmp_path, arch):
    """A folder whose routed experts are stacked (transformers 5's in-memory layout, as a raw state dict saves them;
    the MTP layer's experts too) gives bitwise the per-expert folder's logits, reading one expert's slice at a
    time; a stack of the wrong shape is a one-line error."""
    import json

    from safetensors.torch import save_file

    from specdec.config import ModelError

    folder, _, sd = write_moe_hf(arch, tmp_path / "per-expert", seed=3, n_mtp=1 if arch == "deepseek_v3" else 0)
    cfg = json.loads((folder / "config.json").read_text())
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(json.dumps(cfg))
    stacked = fuse_experts(sd, cfg)
    assert any(k.endswith("gate_up_proj") for k in stacked) and not any(".experts.0." in k for k in stacked)
    save_file({k: v.contiguous() for k, v in stacked.items()}, str(fused / "model.safetensors"))
    lm_a, lm_b = read_model(folder), read_model(fused)
    assert lm_a.args.n_mtp_layers == lm_b.args.n_mtp_layers
    names = [n for n in lm_a.weights if ".exp." in n]
    assert names and sorted(names) == sorted(n for n in lm_b.weights if ".exp." in n)
    for n in names:
        assert torch.equal(lm_a.weights[n], lm_b.weights[n]), n
    a, b = (Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64) for lm in (lm_a, lm_b))
    with torch.inference_mode():
        la, _ = a(torch.tensor([IDS]), torch.arange(len(IDS)), a.new_cache())
        lb, _ = b(torch.tensor([IDS]), torch.arange(len(IDS)), b.new_cache())
    assert torch.equal(la, lb)
    bad = next(k for k in stacked if k.endswith("down_proj") and "experts" in k)
    stacked[bad] = stacked[bad].transpose(1, 2)
    save_file({k: v.contiguous() for k, v in stacked.items()}, str(fused / "model.safetensors"))
    with pytest.raises(ModelError, match="not this config's model") as e:
        read_model(fused)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_mla_absorbed_matrices_quantized_per_head(tmp_path, monkeypatch, quant):
    """With quantized weights, MLA's absorbed W_UK / W_UV run per head in the matmul kernel (one matmul_heads call
    each): fewer bytes than the bf16 tables, logits near those of the same model with the bf16 tables, and
    verification rows bitwise the decode steps (the kernel is batch-invariant). Nope head size 32 here, a multiple
    of the kernel's groups."""
    import types

    from specdec import kernels
    from specdec.models import mla as mla_module

    if kernels.matmul_lib() is None:
        pytest.skip("no matmul kernel on this CPU")
    folder, _, _ = write_moe_hf("deepseek_v2", tmp_path / "ds", seed=5, qk_nope_head_dim=32)
    m = build(folder, torch.bfloat16, quant)
    no_heads = types.SimpleNamespace(**{k: getattr(kernels, k) for k in dir(kernels) if not k.startswith("__")})
    no_heads.matmul_supports = lambda *a: False
    monkeypatch.setattr(mla_module, "kernels", no_heads)
    ref = build(folder, torch.bfloat16, quant)  # the same quantized model, its absorbed matrices bf16 tables
    monkeypatch.undo()
    mla = next(layer.mla for layer in m.layers)
    assert mla.uk is not None and len(mla.uk) == mla.H and ref.layers[0].mla.uk is None
    assert sum(t.nbytes for t in mla.tensors()) < sum(t.nbytes for t in ref.layers[0].mla.tensors())
    n = 5
    steps = steps_equal_rows(m, n)
    with torch.inference_mode():
        theirs, _ = ref(torch.tensor([IDS]), torch.arange(len(IDS)), ref.new_cache())
    err = (steps - theirs[0, n:]).abs().max() / theirs.abs().max()
    assert 0 < err < (0.06 if quant == "int8" else 0.2), err


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_in_one_call_equal_the_per_expert_path(folders, dtype, quant):
    """With packed experts the routed experts run in one kernels.experts call: bitwise the per-expert path (each
    chosen expert's own two matmuls over its rows), alone or in a batch; an expert no row chose is never read
    (its weight pointers set to NULL: reading one would crash the test), and a chosen one is (pointed at another
    expert's weights, the output changes)."""
    from specdec import kernels

    if kernels.matmul_lib() is None:
        pytest.skip("no matmul kernel on this CPU")
    moe = moe_layer(build(folders["qwen3_moe"][0], dtype, quant))
    assert moe.tables is not None
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        one_call = moe(x, exact=True)
        rows = torch.cat([moe(x[:, i:i + 1], exact=True) for i in range(9)], dim=1)
        tables = moe.tables
        moe.tables = None
        per_expert = moe(x, exact=True)
        moe.tables = tables
        assert torch.equal(one_call, per_expert) and torch.equal(one_call, rows)
        h = moe.norm(x[:, :2]).reshape(-1, 64)
        _, ids = route(moe.router_logits(h, True), moe.args, moe.bias)
        chosen = set(ids.flatten().tolist())
        assert len(chosen) < moe.args.n_experts
        w13, w2 = (t.clone() for t in tables[:2])
        for e in set(range(moe.args.n_experts)) - chosen:
            w13[e], w2[e] = 0, 0
        moe.tables = (w13, w2, *tables[2:])
        assert torch.equal(moe(x[:, :2], exact=True), one_call[:, :2])
        e = min(chosen)
        w13[e] = tables[0][(e + 1) % moe.args.n_experts]  # a chosen expert computed with another one's gate / up
        assert not torch.equal(moe(x[:, :2], exact=True), one_call[:, :2])
        moe.tables = tables
