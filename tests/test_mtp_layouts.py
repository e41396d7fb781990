"""Native MTP modules in the layouts real models ship (llama.cpp nextn GGUF, DeepSeek-V3 / GLM-4.5 HF, MiMo HF),
against a plain reference written here from the raw HF-named tensors (no specdec code).

The reference encodes the layout facts (see specdec/models/mtp.py): DeepSeek concatenates [enorm(embedding);
hnorm(hidden)] and reads the trunk's hidden state after its final norm; MiMo concatenates [hidden_layernorm(hidden);
token_layernorm(embedding)] and reads it before the final norm; each depth's output after its final norm
(shared_head.norm / final_layernorm) feeds both the head and the next depth.

Tolerance as in test_parity.py: f32 on both sides, max abs diff <= 1e-4 x the logit scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import write_gguf, write_hf
from tiny_mtp import write_mtp_gguf, write_mtp_hf

from specdec.models.mtp import load_mtp_modules
from specdec.models.transformer import Transformer
from specdec.weights import read_model

IDS = [1, 504, 3458, 314, 253, 1789, 30, 2115, 9004, 17, 1380, 2]
REL_TOL = 1e-4


def assert_close(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err, scale = (a - b).abs().max().item(), scale or b.abs().max().item()
    assert err <= REL_TOL * scale, f"max abs diff {err:.3g} vs scale {scale:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# the reference: a plain Llama-family forward from HF-named tensors
# ---------------------------------------------------------------------------------------------------------------


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):  # x [T, H, D], rotate_half RoPE
    D = x.shape[-1]
    ang = pos[:, None].double() / theta ** (torch.arange(0, D, 2).double() / D)  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def block(x, sd, p, cfg, pos):  # x [T, dim], causal attention over the T positions given
    T, eps = x.shape[0], cfg["rms_norm_eps"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H

    def proj(name, a):
        y = a @ sd[p + f"self_attn.{name}.weight"].T
        return y + sd[p + f"self_attn.{name}.bias"] if p + f"self_attn.{name}.bias" in sd else y

    a = rmsnorm(x, sd[p + "input_layernorm.weight"], eps)
    q, k, v = proj("q_proj", a).view(T, H, D), proj("k_proj", a).view(T, Hkv, D), proj("v_proj", a).view(T, Hkv, D)
    if p + "self_attn.q_norm.weight" in sd:
        q, k = rmsnorm(q, sd[p + "self_attn.q_norm.weight"], eps), rmsnorm(k, sd[p + "self_attn.k_norm.weight"], eps)
    theta = cfg.get("rope_theta", 10000.0)
    q, k = rotate(q, pos, theta), rotate(k, pos, theta)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5
    scores = scores.masked_fill(~(pos[:, None] >= pos[None, :]), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, H * D)
    x = x + o @ sd[p + "self_attn.o_proj.weight"].T
    f = rmsnorm(x, sd[p + "post_attention_layernorm.weight"], eps)
    ffn = F.silu(f @ sd[p + "mlp.gate_proj.weight"].T) * (f @ sd[p + "mlp.up_proj.weight"].T)
    return x + ffn @ sd[p + "mlp.down_proj.weight"].T


def lm_head(sd):
    return sd.get("lm_head.weight", sd["model.embed_tokens.weight"])


def ref_trunk(sd, cfg, ids):
    """-> (logits [T, V], hidden before the final norm [T, dim], after it [T, dim])."""
    pos = torch.arange(len(ids))
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        x = block(x, sd, f"model.layers.{i}.", cfg, pos)
    post = rmsnorm(x, sd["model.norm.weight"], cfg["rms_norm_eps"])
    return post @ lm_head(sd).T, x, post


def ref_mtp(sd, cfg, layout, depth, h, tokens):
    """MTP module `depth` (0-based) at positions 0..T-1: h [T, dim], tokens [T] -> (logits [T, V], h_next)."""
    eps, pos = cfg["rms_norm_eps"], torch.arange(len(tokens))
    if layout == "mimo":
        p = f"model.mtp_layers.{depth}."
        e = sd["model.embed_tokens.weight"][tokens]
        x = torch.cat([rmsnorm(h, sd[p + "hidden_layernorm.weight"], eps),
                       rmsnorm(e, sd[p + "token_layernorm.weight"], eps)], -1) @ sd[p + "input_proj.weight"].T
        h_next = rmsnorm(block(x, sd, p, cfg, pos), sd[p + "final_layernorm.weight"], eps)
        return h_next @ lm_head(sd).T, h_next
    p = f"model.layers.{cfg['num_hidden_layers'] + depth}."
    e = sd.get(p + "embed_tokens.weight", sd["model.embed_tokens.weight"])[tokens]
    x = torch.cat([rmsnorm(e, sd[p + "enorm.weight"], eps), rmsnorm(h, sd[p + "hnorm.weight"], eps)], -1)
    x = block(x @ sd[p + "eh_proj.weight"].T, sd, p, cfg, pos)
    h_next = rmsnorm(x, sd[p + "shared_head.norm.weight"], eps)
    return h_next @ sd.get(p + "shared_head.head.weight", lm_head(sd)).T, h_next


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------

CASES = [  # (id, writer, kwargs, layout)
    ("gguf-llama-2", write_mtp_gguf, dict(trunk_arch="llama", n_mtp=2, seed=1), "deepseek"),
    ("gguf-qwen3-1-shared-head", write_mtp_gguf,
     dict(trunk_arch="qwen3", n_mtp=1, seed=2, own_head=False, own_embed=False), "deepseek"),
    ("hf-deepseek-llama-1", write_mtp_hf, dict(trunk_arch="llama", layout="deepseek", n_mtp=1, seed=3), "deepseek"),
    ("hf-deepseek-qwen2-2", write_mtp_hf,
     dict(trunk_arch="qwen2", layout="deepseek", n_mtp=2, seed=4, tied=False, own_head=False, own_embed=False),
     "deepseek"),
    ("hf-mimo-qwen2-1", write_mtp_hf, dict(trunk_arch="qwen2", layout="mimo", n_mtp=1, seed=5, tied=False), "mimo"),
    ("hf-mimo-qwen2-2", write_mtp_hf, dict(trunk_arch="qwen2", layout="mimo", n_mtp=2, seed=6), "mimo"),
]


def _write(tmp_path, writer, kwargs):
    kw = dict(kwargs)
    arch = kw.pop("trunk_arch")
    target = tmp_path / ("model.gguf" if writer is write_mtp_gguf else "model")
    return writer(arch, target, **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mtp_modules_match_reference(tmp_path, case):
    _, writer, kwargs, layout = case
    fx = _write(tmp_path, writer, kwargs)
    sd, cfg, n_mtp = fx.tensors, fx.cfg, kwargs["n_mtp"]
    lm = read_model(fx.path)
    assert (lm.args.n_layers, lm.args.n_mtp_layers, lm.args.mtp_layout) == (cfg["num_hidden_layers"], n_mtp, layout)
    assert not any(n.startswith(f"blk.{cfg['num_hidden_layers']}.") for n in lm.weights)

    trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    assert len(trunk.layers) == cfg["num_hidden_layers"]
    T = len(IDS)
    with torch.inference_mode():
        logits, h = trunk(torch.tensor([IDS]), torch.arange(T), trunk.new_cache())
    ref_logits, pre, post = ref_trunk(sd, cfg, IDS)
    assert_close(logits[0], ref_logits)
    h_ref = pre if layout == "mimo" else post  # what module 1 reads
    assert_close(h[0], h_ref)

    modules = load_mtp_modules(trunk, lm.weights, lm.args, torch.float32, "none")
    assert len(modules) == n_mtp
    ids = torch.tensor(IDS)
    for d, module in enumerate(modules):  # depth d + 1 at positions 0..n-1: h_p with the token at p + d + 1
        n = T - d - 1
        with torch.inference_mode():
            out, h_next = module(h[:, :n], ids[None, d + 1:], torch.arange(n), module.new_cache())
        ref_out, h_ref = ref_mtp(sd, cfg, layout, d, h_ref[:n], ids[d + 1:])
        assert out.dtype == torch.float32 and out.shape == (1, n, cfg["vocab_size"])
        assert_close(out[0], ref_out)
        assert_close(h_next[0], h_ref)
        h = h_next  # depth d + 2 consumes this depth's h_next


def test_mtp_decode_steps_match_prefill(tmp_path):
    """The module's KV cache: prefill then single-token steps (and exact mode) give the logits of one call."""
    fx = write_mtp_hf("qwen2", tmp_path / "m", layout="deepseek", n_mtp=1, seed=7)
    lm = read_model(fx.path)
    trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    (module,) = load_mtp_modules(trunk, lm.weights, lm.args)
    T = len(IDS)
    with torch.inference_mode():
        _, h = trunk(torch.tensor([IDS]), torch.arange(T), trunk.new_cache())
        h, toks, pos = h[:, :T - 1], torch.tensor([IDS[1:]]), torch.arange(T - 1)
        full, _ = module(h, toks, pos, module.new_cache())
        cache = module.new_cache()
        first, _ = module(h[:, :5], toks[:, :5], pos[:5], cache)
        steps = [module(h[:, i:i + 1], toks[:, i:i + 1], pos[i:i + 1], cache)[0] for i in range(5, T - 1)]
        exact, _ = module(h, toks, pos, module.new_cache(), exact=True)
    assert cache.length == T - 1
    assert_close(torch.cat([first, *steps], dim=1)[0], full[0])
    assert_close(exact[0], full[0])


@pytest.mark.parametrize("layout,arch", [("deepseek", "llama"), ("mimo", "qwen2")])
def test_hf_trunk_with_mtp_matches_transformers(tmp_path, layout, arch):
    """transformers ignores the MTP tensors; our trunk must too (n_layers excludes them)."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    fx = write_mtp_hf(arch, tmp_path / "m", layout=layout, n_mtp=1, seed=8, tied=layout != "mimo")
    lm = read_model(fx.path)
    trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    with torch.inference_mode():
        ours, _ = trunk(torch.tensor([IDS]), torch.arange(len(IDS)), trunk.new_cache())
    cls = Qwen2ForCausalLM if layout == "mimo" else AutoModelForCausalLM  # transformers has no "mimo" model type
    model = cls.from_pretrained(str(fx.path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    assert_close(ours[0], theirs)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_no_mtp_gives_no_modules(tmp_path, fmt):
    path = (write_gguf("qwen2", tmp_path / "m.gguf", seed=9, tokenizer=False) if fmt == "gguf"
            else write_hf("qwen2", tmp_path / "m", seed=9, tokenizer=False))
    lm = read_model(path)
    assert (lm.args.n_layers, lm.args.n_mtp_layers, lm.args.mtp_layout) == (2, 0, None)
    trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    assert load_mtp_modules(trunk, lm.weights, lm.args, torch.float32, "none") == []
