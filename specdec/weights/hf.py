"""Hugging Face folders: config.json + model.safetensors, or shards listed in model.safetensors.index.json.

Multi-token-prediction modules come in two layouts, both exposed as ``mtp.{i}.*`` (see specdec/models/mtp.py):
- DeepSeek-V3 / GLM-4.5: ``num_nextn_predict_layers`` = n, module i is ``model.layers.{L+i}`` (L =
  ``num_hidden_layers``, which does not count them) with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
  ``shared_head.head``, optionally ``embed_tokens``, and the usual block tensors;
- MiMo: ``model.mtp_layers.{i}`` with ``token_layernorm`` (-> enorm), ``hidden_layernorm`` (-> hnorm), ``input_proj``
  (-> eh_proj), ``final_layernorm`` (-> shared_head_norm) and the block tensors. MiMo concatenates [hidden; embedding]
  where DeepSeek concatenates [embedding; hidden]: the two column halves of ``input_proj`` are swapped on load, so
  the canonical ``eh_proj`` always takes [embedding; hidden] (llama.cpp's order).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ..config import FAMILIES, SUPPORTED, ModelArgs, ModelError, yarn_mscale
from . import LazyWeights, LoadedModel, Rows, rope_layout
from .gguf import brief, check_model

# HF per-layer names -> canonical (GGUF-style) names; Gemma's post_attention_layernorm differs, see _layer_map
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # mixture of experts (Qwen3-MoE, DeepSeek, GLM-4.5): router, its correction bias, shared experts
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction_bias": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # multi-head latent attention (DeepSeek-V2 / V3)
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")  # routed expert e -> exp.{e}.ffn_*
# routed experts stacked, as transformers 5 holds them in memory (and state dicts saved without its conversion):
# gate_up_proj [E, 2 I, D] (each expert's gate rows, then its up rows), down_proj [E, D, I]
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|e_score_correction_bias)$")
_MIMO_MTP_RE = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)\.(weight|bias)$")
# MTP-specific tensors of a module (DeepSeek-V3 and MiMo names) -> canonical short names
_MTP = {
    "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "embed_tokens": "embed_tokens",
    "shared_head.norm": "shared_head_norm", "shared_head.head": "shared_head_head",
    "token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
    "final_layernorm": "shared_head_norm",
}


def _layer_short(part: str) -> str | None:
    """Canonical short name of a layer tensor (``mlp.experts.3.up_proj`` -> ``exp.3.ffn_up``), None if unknown."""
    m = _EXPERT_RE.match(part)
    if m:
        return f"exp.{m[1]}.ffn_{m[2]}"
    return _LAYER.get(part)


def _rope_params(cfg: dict) -> tuple[float, dict | None, float | None]:
    """(theta, scaling, local theta) from either the classic `rope_theta`/`rope_scaling` keys or transformers 5's
    `rope_parameters` (which Gemma 3 splits per attention type)."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in params:  # per layer type
        local = params.get("sliding_attention", {}).get("rope_theta")
        params = params["full_attention"]
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        elif kind not in ("llama3", "linear", "yarn"):
            raise ModelError(f"rope scaling '{kind}' is not supported (linear, llama3 and yarn are)")
        else:
            scaling = dict(scaling, rope_type=kind)
            if kind == "yarn":  # as transformers: the trained context defaults to max_position_embeddings
                scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            need = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
            for key in need[kind]:
                try:
                    float(scaling[key])
                except (KeyError, TypeError, ValueError):
                    raise ModelError(f"config.json: rope_scaling of type {kind} needs a number '{key}'") from None
    local = local if local is not None else cfg.get("rope_local_base_freq")
    return theta, scaling, (float(local) if local is not None else None)


def args_from_config(cfg: dict, n_tensors: int | None = None) -> ModelArgs:
    """ModelArgs from a Hugging Face config.json dict (unknown keys are ignored). n_tensors: how many tensors the
    weights hold, when known: a layer count above it is refused (before per-layer lists are made)."""
    if "text_config" in cfg:  # multimodal wrapper (e.g. Gemma 3 4B+): the text model is what we run
        cfg = dict(cfg["text_config"], tie_word_embeddings=cfg.get("tie_word_embeddings", True))
    arch = cfg.get("model_type", "?")
    if arch not in FAMILIES:
        raise ModelError(f"unknown architecture '{arch}' in config.json: specdec supports {SUPPORTED}")
    family = FAMILIES[arch]
    qwen2 = arch in ("qwen2", "mimo")  # MiMo's trunk is a qwen2
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    if n_tensors is not None and n_layers > n_tensors:
        raise ModelError(f"config.json: num_hidden_layers = {n_layers} for {n_tensors} tensors: the folder is "
                         "corrupt, download it again")
    theta, scaling, local_theta = _rope_params(cfg)
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if qwen2 and not cfg.get("use_sliding_window", False):
        window = None
    if family == "gemma3" and not layer_types:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    sliding = [t == "sliding_attention" for t in layer_types] if layer_types and window else []
    gemma = family == "gemma3"
    return ModelArgs(**{**dict(
        vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=int(cfg.get("head_dim") or dim // n_heads),
        ffn_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=qwen2 or bool(cfg.get("attention_bias", False)) and family != "deepseek",
        qk_norm=arch in ("qwen3", "qwen3_moe") or gemma or bool(cfg.get("use_qk_norm")),
        sliding_window=int(window) if window else None, sliding_layers=sliding,
        rope_local_theta=(local_theta or 10000.0) if gemma else None,
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        embed_scale=dim**0.5 if gemma else 1.0, activation="gelu_tanh" if gemma else "silu", sandwich_norms=gemma,
        final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        n_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
    ), **_moe_args(cfg, arch, n_layers, n_heads, scaling)})


def _moe_args(cfg: dict, arch: str, n_layers: int, n_heads: int, scaling: dict | None) -> dict:
    """The mixture-of-experts and MLA fields of ModelArgs (and arch) from a config.json."""
    out: dict = {"arch": arch}
    if arch == "qwen3_moe":
        sparse = [i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0
                  for i in range(n_layers)]
        out.update(n_experts=int(cfg["num_experts"]), moe_ffn_dim=int(cfg["moe_intermediate_size"]),
                   moe_layers=sparse if int(cfg["num_experts"]) else [False] * n_layers,
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    elif arch in ("glm4_moe", "deepseek_v2", "deepseek_v3"):
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        v2 = arch == "deepseek_v2"
        groups = int(cfg.get("n_group") or 1)
        if v2 and cfg.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ModelError(f"config.json: DeepSeek-V2 topk_method '{cfg['topk_method']}' is not supported "
                             "(greedy and group_limited_greedy are)")
        if v2 and cfg.get("topk_method", "greedy") == "greedy":
            groups = 1
        out.update(n_experts=int(cfg["n_routed_experts"]), moe_ffn_dim=int(cfg["moe_intermediate_size"]),
                   n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                   moe_layers=[i >= first_dense for i in range(n_layers)],
                   router="softmax" if v2 else "sigmoid", router_groups=groups,
                   router_topk_groups=int(cfg.get("topk_group") or groups), router_group_score="max" if v2 else "top2",
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0))
    else:
        return out
    out["n_experts_used"] = int(cfg["num_experts_per_tok"])
    if arch == "glm4_moe":
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads)
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        out["rotary_dim"] = int(head_dim * float(factor))
    if arch.startswith("deepseek"):
        n, dr = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        out.update(attention="mla", q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                   kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_dim=n, qk_rope_dim=dr,
                   v_head_dim=int(cfg["v_head_dim"]), head_dim=n + dr)
        scale = (n + dr) ** -0.5
        if scaling and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        out["query_scale"] = scale
    if scaling and scaling.get("rope_type") == "yarn":
        out["rope_attention_factor"] = yarn_attention_factor(scaling)
    return out


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's factor on cos / sin, as transformers computes it: attention_factor when given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def canonical_name(hf_name: str, gemma: bool, n_layers: int | None = None) -> str | None:
    """Canonical name of an HF tensor, or None for tensors we don't use (vision towers, rotary buffers).

    n_layers: the trunk's layer count; layers from n_layers on are DeepSeek-style MTP modules (``mtp.{i}.*``)."""
    hf_name = hf_name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
    if _FUSED_RE.match(hf_name):  # stacked experts: read per expert by _fused_experts
        return None
    for prefix, name in _TOP.items():
        if hf_name in (f"{prefix}.weight", f"{prefix}.bias"):
            return name + (".bias" if hf_name.endswith(".bias") else "")
    m = _LAYER_RE.match(hf_name) or _MIMO_MTP_RE.match(hf_name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if kind == "e_score_correction_bias":  # a buffer of the router, named without .weight
        part, kind = f"{part}.{kind}", "weight"
    suffix = ".bias" if kind == "bias" else ""
    if hf_name.startswith("model.mtp_layers.") or (n_layers is not None and int(layer) >= n_layers):
        i = int(layer) - (0 if hf_name.startswith("model.mtp_layers.") else n_layers)
        short = _MTP.get(part) or _layer_short(part) or f"hf.{part}"
        return f"mtp.{i}.{short}{suffix}"
    if gemma and part == "post_attention_layernorm":
        short = "post_attention_norm"
    elif _layer_short(part):
        short = _layer_short(part)
    else:
        return f"blk.{layer}.hf.{part}{suffix}"  # kept, unused by the trunk
    return f"blk.{layer}.{short}{suffix}"


def _fused_experts(hf_name: str, shape: tuple[int, ...], args: ModelArgs, shard: str, expert_loader):
    """The per-expert canonical tensors (name, shape, loader) of a stacked expert tensor (_FUSED_RE), [] for any
    other tensor. A stack of the wrong shape is a ModelError."""
    m = _FUSED_RE.match(hf_name)
    if not m:
        return []
    layer, kind = int(m[1]), m[2]
    prefix = f"blk.{layer}." if layer < args.n_layers else f"mtp.{layer - args.n_layers}."
    E, D, inner = args.n_experts, args.dim, args.moe_ffn_dim
    want = (E, 2 * inner, D) if kind == "gate_up_proj" else (E, D, inner)
    if shape != want:
        raise ModelError(f"{hf_name} has shape {list(shape)}, not {list(want)} (experts, rows, columns) as "
                         "transformers stacks them: the folder is not this config's model")
    if kind == "down_proj":
        return [(f"{prefix}exp.{e}.ffn_down", (D, inner), expert_loader(hf_name, shard, e, slice(None)))
                for e in range(E)]
    halves = (("ffn_gate", slice(0, inner)), ("ffn_up", slice(inner, 2 * inner)))
    return [(f"{prefix}exp.{e}.{short}", (inner, D), expert_loader(hf_name, shard, e, part))
            for e in range(E) for short, part in halves]


def _open_shard(path: Path):
    """safe_open(path), with a bad file (header length past the end, bad JSON, an unknown dtype, offsets that do
    not match the shapes) as a ModelError."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{path} is truncated or corrupt ({brief(e)}): download it again") from e


def read_hf(folder: Path) -> LoadedModel:
    """Read config.json and index the safetensors shards; tensors load (as float32) on access."""
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelError(f"{folder} has no config.json: give a GGUF file or a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ModelError(f"{cfg_path} is not valid JSON ({brief(e)}): download it again") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_path} is not a JSON object: download it again")
    arch = (cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg).get("model_type", "?")
    if arch not in FAMILIES:  # said first: no point asking for the weights of a model we cannot run
        raise ModelError(f"unknown architecture '{arch}' in config.json: specdec supports {SUPPORTED}")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{index} is corrupt ({brief(e)}): download it again") from e
    elif (folder / "model.safetensors").exists():
        with _open_shard(folder / "model.safetensors") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    else:
        raise ModelError(f"{folder} has no model.safetensors (or index): convert the weights to safetensors")
    missing = sorted({s for s in weight_map.values() if not (folder / s).exists()})
    if missing:
        raise ModelError(f"{folder} lacks shard(s) {', '.join(missing)}: download them")
    try:
        args = args_from_config(cfg, n_tensors=len(weight_map))
    except KeyError as e:
        raise ModelError(f"config.json lacks {e}: the model folder is incomplete") from e
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:  # a value of the wrong type, a zero ...
        raise ModelError(f"{cfg_path} has a bad value ({brief(e)}): download it again") from e
    gemma = args.family == "gemma3"
    handles: dict[str, object] = {}

    def loader(hf_name: str, shard: str, name: str):
        def load() -> torch.Tensor:
            if shard not in handles:
                handles[shard] = safe_open(folder / shard, framework="pt")
            t = handles[shard].get_tensor(hf_name).float()
            if gemma and name.endswith("norm"):  # Gemma's RMSNorm multiplies by (1 + w)
                t = t + 1.0
            if hf_name.endswith("input_proj.weight"):  # MiMo: [hidden; embedding] -> canonical [embedding; hidden]
                t = torch.cat(t.chunk(2, dim=1)[::-1], dim=1)
            return rope_layout(args, name, t)

        return load

    def expert_loader(hf_name: str, shard: str, e: int, part: slice):
        def load() -> torch.Tensor:  # only expert e's bytes are read (a slice of the stacked tensor)
            if shard not in handles:
                handles[shard] = safe_open(folder / shard, framework="pt")
            return handles[shard].get_slice(hf_name)[e][part].float()

        return load

    def row_loader(hf_name: str, shard: str, shape: tuple[int, int]) -> Rows:
        def read(a: int, b: int) -> torch.Tensor:  # only rows [a, b) are read and widened to f32
            if shard not in handles:
                handles[shard] = safe_open(folder / shard, framework="pt")
            return handles[shard].get_slice(hf_name)[a:b].float()

        return Rows(shape, read)

    loaders, nbytes, numel, dtypes, rows = {}, {}, {}, set(), {}
    for hf_name, shard in weight_map.items():
        name = canonical_name(hf_name, gemma, args.n_layers)
        if name is not None:
            loaders[name] = loader(hf_name, shard, name)
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in set(weight_map.values()):
        with _open_shard(folder / shard) as f:
            for k in f.keys():  # noqa: SIM118
                sl = f.get_slice(k)
                dtypes.add(sl.get_dtype())
                size = {"F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 4)
                for name, shape, load in _fused_experts(k, tuple(sl.get_shape()), args, shard, expert_loader):
                    loaders[name], shapes[name], numel[name] = load, shape, math.prod(shape)
                    nbytes[name] = numel[name] * size
                name = canonical_name(k, gemma, args.n_layers)
                if name in ("token_embd", "output") and len(sl.get_shape()) == 2:  # never permuted
                    rows[name] = row_loader(k, shard, tuple(sl.get_shape()))
                if name is not None:
                    shapes[name] = tuple(sl.get_shape())
                    numel[name] = math.prod(sl.get_shape())
                    nbytes[name] = numel[name] * size
    if "output" not in loaders:
        args.tie_embeddings = True
    check_model(args, shapes, str(folder))
    # the modules the file really holds (some uploads keep num_nextn_predict_layers but drop the tensors)
    args.n_mtp_layers = sum(f"mtp.{i}.eh_proj" in loaders for i in range(max(args.n_mtp_layers, 0)))
    mimo = any(k.startswith("model.mtp_layers.") for k in weight_map)
    args.mtp_layout = ("mimo" if mimo else "deepseek") if args.n_mtp_layers else None
    kinds = "/".join(sorted(dtypes))
    return LoadedModel(args, LazyWeights(loaders, nbytes, numel, rows=rows), folder, f"safetensors {kinds}",
                       extra={"config": cfg})
