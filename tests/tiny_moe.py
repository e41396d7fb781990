"""Writers of tiny random-weight mixture-of-experts / MLA models as Hugging Face folders, in the checkpoint names the
real models ship (Qwen3-30B-A3B, DeepSeek-V2-Lite / V3, GLM-4.5-Air): per-expert ``mlp.experts.{e}.{gate,up,down}_
proj``, ``mlp.gate`` (router), ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``, MLA's ``self_attn.
{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, and
DeepSeek-style MTP layers ``model.layers.{L+i}`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}``
and a full decoder layer, MoE here since L >= first_k_dense_replace). transformers loads these folders (converting
the per-expert tensors to its fused layout) and ignores the MTP layers.

Sizes: hidden 64, 3 layers (the first dense where the architecture has first_k_dense_replace), 8 experts, 2 per
token, the SmolLM2 vocabulary (so the folders also run through ``specdec.loader.load`` with a tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import SMOLLM2_VOCAB_SIZE, write_tokenizer

ARCHS = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe")

_COMMON = dict(vocab_size=SMOLLM2_VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
               hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               num_experts_per_tok=2, attention_dropout=0.0, initializer_range=0.02, torch_dtype="float32")

CONFIGS = {
    "qwen3_moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_key_value_heads=2,
                      head_dim=16, num_experts=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                      rope_theta=1000000.0, attention_bias=False, use_sliding_window=False, sliding_window=None),
    "deepseek_v2": dict(_COMMON, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, norm_topk_prob=False, rope_theta=10000.0,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek_v3": dict(_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                        first_k_dense_replace=1, topk_method="noaux_tc", n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=10000.0, rope_interleave=True,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "glm4_moe": dict(_COMMON, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", num_key_value_heads=2,
                     head_dim=32, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                     n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                     routed_scaling_factor=1.8, norm_topk_prob=True, rope_theta=1000000.0),
}


def moe_config(arch: str, **overrides) -> dict:
    return {**CONFIGS[arch], **overrides}


def _experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg["n_routed_experts"]


def is_moe_layer(cfg: dict, i: int) -> bool:
    if cfg["model_type"] == "qwen3_moe":
        return i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
    return i >= cfg.get("first_k_dense_replace", 0)


def layer_tensors(cfg: dict, p: str, i: int, gen: torch.Generator, std: float = 0.08) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (HF checkpoint names under prefix p), layer index i (dense or MoE)."""
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    mat = lambda r, c, s=std: torch.randn(r, c, generator=gen) * s  # noqa: E731
    norm = lambda n: 1.0 + 0.1 * torch.randn(n, generator=gen)  # noqa: E731
    sd = {p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D)}
    a = p + "self_attn."
    if cfg["model_type"].startswith("deepseek"):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        r = cfg["kv_lora_rank"]
        if cfg.get("q_lora_rank"):
            sd[a + "q_a_proj.weight"] = mat(cfg["q_lora_rank"], D, 2 * std)
            sd[a + "q_a_layernorm.weight"] = norm(cfg["q_lora_rank"])
            sd[a + "q_b_proj.weight"] = mat(H * qk, cfg["q_lora_rank"], 2 * std)
        else:
            sd[a + "q_proj.weight"] = mat(H * qk, D, 2 * std)
        sd[a + "kv_a_proj_with_mqa.weight"] = mat(r + cfg["qk_rope_head_dim"], D, 2 * std)
        sd[a + "kv_a_layernorm.weight"] = norm(r)
        sd[a + "kv_b_proj.weight"] = mat(H * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), r, 2 * std)
        sd[a + "o_proj.weight"] = mat(D, H * cfg["v_head_dim"])
    else:
        hd, Hkv = cfg["head_dim"], cfg["num_key_value_heads"]
        for name, rows in (("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd)):
            sd[a + f"{name}.weight"] = mat(rows, D, 2 * std)
            if cfg.get("attention_bias"):
                sd[a + f"{name}.bias"] = 0.1 * torch.randn(rows, generator=gen)
        sd[a + "o_proj.weight"] = mat(D, H * hd)
        if cfg["model_type"] == "qwen3_moe" or cfg.get("use_qk_norm"):
            sd[a + "q_norm.weight"], sd[a + "k_norm.weight"] = norm(hd), norm(hd)
    m = p + "mlp."
    if not is_moe_layer(cfg, i):
        F_ = cfg["intermediate_size"]
        sd.update({m + "gate_proj.weight": mat(F_, D), m + "up_proj.weight": mat(F_, D),
                   m + "down_proj.weight": mat(D, F_)})
        return sd
    E, Fm = _experts(cfg), cfg["moe_intermediate_size"]
    sd[m + "gate.weight"] = mat(E, D, 0.5)  # a decisive router: choices far from ties
    if cfg["model_type"] in ("deepseek_v3", "glm4_moe"):
        sd[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(E, generator=gen)
    for e in range(E):
        q = f"{m}experts.{e}."
        sd.update({q + "gate_proj.weight": mat(Fm, D), q + "up_proj.weight": mat(Fm, D),
                   q + "down_proj.weight": mat(D, Fm)})
    if cfg.get("n_shared_experts"):
        Fs = Fm * cfg["n_shared_experts"]
        q = m + "shared_experts."
        sd.update({q + "gate_proj.weight": mat(Fs, D), q + "up_proj.weight": mat(Fs, D),
                   q + "down_proj.weight": mat(D, Fs)})
    return sd


def moe_state_dict(cfg: dict, seed: int = 0, n_mtp: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the model (and n_mtp DeepSeek-style MTP layers after the trunk), float32."""
    gen = torch.Generator().manual_seed(seed)
    D, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    sd = {"model.embed_tokens.weight": torch.randn(V, D, generator=gen) * 0.08}
    for i in range(L):
        sd.update(layer_tensors(cfg, f"model.layers.{i}.", i, gen))
    sd["model.norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
    sd["lm_head.weight"] = torch.randn(V, D, generator=gen) * 0.08
    for j in range(n_mtp):
        p = f"model.layers.{L + j}."
        sd.update(layer_tensors(cfg, p, L + j, gen))
        sd[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
        sd[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
        sd[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=gen) * 0.08
        sd[p + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=gen)
        sd[p + "shared_head.head.weight"] = torch.randn(V, D, generator=gen) * 0.08
    return sd


def write_moe_hf(arch: str, folder: Path, *, seed: int = 0, n_mtp: int = 0, tokenizer: bool = False,
                 **overrides) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """A tiny `arch` HF folder -> (folder, config dict, state dict in HF names)."""
    from safetensors.torch import save_file

    cfg = moe_config(arch, **overrides)
    if n_mtp:
        cfg["num_nextn_predict_layers"] = n_mtp
    sd = moe_state_dict(cfg, seed, n_mtp)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        write_tokenizer(folder)
    return folder, cfg, sd


# ----------------------------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's convert_hf_to_gguf.py writes these models (Qwen3MoeModel, Glm4MoeModel, DeepseekV2Model)
# ----------------------------------------------------------------------------------------------------------------

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}

# HF layer tensor -> llama.cpp name (gguf.TENSOR_NAMES; ".bias" where the HF name is a bias)
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
    "self_attn.q_a_proj.weight": "attn_q_a", "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
    "self_attn.q_b_proj.weight": "attn_q_b", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm", "self_attn.kv_b_proj.weight": "attn_kv_b",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
    "mlp.gate.weight": "ffn_gate_inp", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
    "enorm.weight": "nextn.enorm", "hnorm.weight": "nextn.hnorm", "eh_proj.weight": "nextn.eh_proj",
    "shared_head.norm.weight": "nextn.shared_head_norm", "shared_head.head.weight": "nextn.shared_head_head",
}


def write_moe_gguf(arch: str, path: Path, cfg: dict, sd: dict[str, torch.Tensor], *, qtype: str = "F32",
                   split_kv_b: bool = True) -> Path:
    """The model (cfg, sd) of write_moe_hf as a GGUF with llama.cpp's names and metadata: experts stacked into
    ffn_{gate,up,down}_exps [E, N, K], MLA's kv_b split into attn_k_b [H, r, n] / attn_v_b [H, v, r] (split_kv_b, as
    the converter does for weight absorption; else one attn_kv_b), MTP layers as blk.{L+i}.nextn.*. Matrices in
    qtype (F32, F16 or Q8_0); norms, biases and the router stay F32, as llama.cpp keeps them."""
    import gguf
    import numpy as np

    g_arch = GGUF_ARCH[arch]
    L, n_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    w = gguf.GGUFWriter(None, g_arch)
    w.add_block_count(L + n_mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(_experts(cfg))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if arch != "qwen3_moe":
        w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
        w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
        w.add_expert_group_count(cfg.get("n_group", 1))
        w.add_expert_group_used_count(cfg.get("topk_group", 1))
        sigmoid = arch in ("deepseek_v3", "glm4_moe")
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if arch.startswith("deepseek"):
        r, dr, n = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
        w.add_head_count_kv(1)  # MLA converted to MQA over the latent
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_key_length_mla(n + dr)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_kv_lora_rank(r)
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_rope_dimension_count(dr)
        rs = cfg["rope_scaling"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        if arch == "glm4_moe":
            w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["partial_rotary_factor"]))
    w.add_tokenizer_model("none")

    def add(name: str, t: torch.Tensor) -> None:
        a = t.float().numpy()
        if a.ndim == 1 or name.endswith("ffn_gate_inp") or qtype == "F32":
            w.add_tensor(name + ("" if name.endswith(".bias") else ".weight"), np.ascontiguousarray(a))
        elif qtype == "F16" or a.shape[-1] % 32:  # rows too short for a 32-block: llama.cpp falls back too
            w.add_tensor(name + ".weight", a.astype(np.float16))
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name + ".weight", gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)

    add("token_embd", sd["model.embed_tokens.weight"])
    add("output_norm", sd["model.norm.weight"])
    add("output", sd["lm_head.weight"])
    H = cfg["num_attention_heads"]
    for i in range(L + n_mtp):
        p = f"model.layers.{i}."
        experts: dict[str, list[torch.Tensor]] = {}
        for hf, t in sd.items():
            if not hf.startswith(p):
                continue
            part = hf[len(p):]
            if part.startswith("mlp.experts."):
                experts.setdefault(part.split(".")[3], []).append(t)  # in expert order (dict order)
            elif part == "self_attn.kv_b_proj.weight" and split_kv_b:
                kv_b = t.view(H, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
                k_b, v_b = kv_b.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
                add(f"blk.{i}.attn_k_b", k_b.transpose(1, 2).contiguous())
                add(f"blk.{i}.attn_v_b", v_b.contiguous())
            else:
                add(f"blk.{i}.{_GGUF_LAYER[part]}", t)
        for kind, ts in experts.items():  # gate_proj -> ffn_gate_exps [E, N, K]
            add(f"blk.{i}.ffn_{kind.removesuffix('_proj')}_exps", torch.stack(ts))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


IDS = [1, 504, 3458, 314, 253, 1789, 30, 2115, 9004, 17, 1380, 2]  # token ids the parity tests run
REL_TOL = 1e-4  # as in test_parity.py: f32 on both sides, max abs diff <= 1e-4 x the logit scale


def assert_close(a, b) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= REL_TOL * scale, f"max abs diff {err:.3g} vs logit scale {scale:.3g}"
