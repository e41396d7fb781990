"""`specdec export-heads`: a heads file (weights/heads.py) as a checkpoint directory vLLM or SGLang loads, and
`read_exported`, which reads any of these directories back under specdec's native names.

Layouts, each checked against the loader that reads it:

- ``speculators`` (EAGLE-3 heads): the `speculators` package's format, which vLLM reads (config:
  speculators/models/eagle3/config.py, speculators/config.py; vLLM: transformers_utils/configs/speculators/base.py
  and algos.py, which default ``norm_before_residual`` to True when absent, so it is written). Tensors as vLLM's
  llama_eagle3.py and speculators' Eagle3DraftModel name them: ``fc``, ``layers.0.*``, ``norm``, ``lm_head`` (the
  target's output rows of the draft vocabulary, [V_draft, dim]); with a reduced vocabulary ``d2t`` (EAGLE-3's
  offsets, target id = i + d2t[i]) and ``t2d`` (bool [V_target]). No ``embed_tokens``: both share the target's.
- ``eagle3``: the EAGLE-3 reference layout (SafeAILab/EAGLE eagle/model/cnets.py, as in
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``midlayer.*`` for ``layers.0.*``, a LlamaConfig with architectures
  ``LlamaForCausalLMEagle3`` and ``draft_vocab_size``. vLLM (llama_eagle3.py renames ``midlayer.``) and SGLang
  (llama_eagle3.py, which only knows ``midlayer.``) load it. Aux layers: vLLM reads the top-level
  ``eagle_aux_hidden_state_layer_ids`` as "inputs of layer i" (specdec's convention); SGLang reads
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` as "outputs of layer i" and adds 1, so that copy is written
  shifted down by one.
- ``medusa`` (parallel heads): vLLM's Medusa (model_executor/models/medusa.py, transformers_utils/configs/medusa.py):
  ``blocks.{k}.layers.0.{weight,bias}`` (``medusa_fc_bias``: ours have biases), ``lm_heads.{k}.weight``; a reduced
  vocabulary is vLLM's ``token_map`` (any ids) with ``truncated_vocab_size``.
- ``deepseek-mtp`` (sequential modules): DeepSeek-V3's MTP layout as vLLM's deepseek_mtp.py loads it:
  ``model.layers.{L+i}.*`` with each module's own ``embed_tokens`` and ``shared_head.head`` (full vocabulary: the
  layout has no vocabulary map), ``num_nextn_predict_layers`` in the config.

The safetensors metadata keeps the heads file's header under "specdec" (ignored by the loaders).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelError
from .heads import check_base, read_header

#: --format -> the heads kind it exports
FORMATS = {"speculators": "eagle3", "eagle3": "eagle3", "medusa": "parallel", "deepseek-mtp": "sequential"}
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config classes the speculators layout was checked with
HF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "mimo": "MiMoForCausalLM"}


def check_format(path: str | Path, fmt: str) -> dict:
    """The heads file's header, if `fmt` exports its kind (before the model is loaded)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'")
    header = read_header(path)
    if FORMATS[fmt] != header["kind"]:
        fits = ", ".join(f for f, k in FORMATS.items() if k == header["kind"])
        raise ModelError(f"{path} holds {header['kind']} heads; --format {fmt} exports {FORMATS[fmt]} heads "
                         f"(use --format {fits})")
    return header


def _rows(linear, ids: torch.Tensor, device) -> torch.Tensor:
    """Rows `ids` of a model's embedding table / output head (dequantized) as bf16, a few thousand at a time."""
    return torch.cat([linear.rows(ids[i:i + 4096].to(device)).to("cpu", torch.bfloat16)
                      for i in range(0, len(ids), 4096)])


def _llama_config(a, ffn_dim: int, layers: int) -> dict:
    """The Hugging Face LlamaConfig fields of a draft layer on a model with args `a`."""
    if a.rope_scaling and a.rope_scaling.get("rope_type") == "freq_factors":
        raise ModelError("this GGUF stores its RoPE scaling as llama.cpp frequency factors, which a Hugging Face "
                         "config cannot express: export with -m the model's Hugging Face folder")
    rope = {"rope_type": "default", **(a.rope_scaling or {}), "rope_theta": a.rope_theta}
    cfg = {"model_type": "llama", "hidden_size": a.dim, "intermediate_size": ffn_dim,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
           "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "rope_parameters": rope,
           "vocab_size": a.vocab_size, "max_position_embeddings": a.max_seq_len, "num_hidden_layers": layers,
           "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",  # specdec's heads are SwiGLU (train/)
           "tie_word_embeddings": False}
    if a.rope_scaling:
        cfg["rope_scaling"] = dict(a.rope_scaling)
    return cfg


def _verifier_arch(target) -> list[str]:
    cfg = Path(target.path) / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("architectures") or []
    return [HF_ARCH[target.model.args.arch]] if target.model.args.arch in HF_ARCH else []


def export_heads(path: str | Path, target, fmt: str, out: str | Path, verifier: str | None = None,
                 speculative_tokens: int = 3) -> Path:
    """Write heads file `path` (trained for `target`) to directory `out` in layout `fmt` (FORMATS); -> `out`.
    verifier: the target's Hugging Face id or path, recorded in the speculators config (else null)."""
    from safetensors.torch import load_file, save_file

    header = check_format(path, fmt)
    check_base(header, target, path)
    a = target.model.args
    native = load_file(str(path))
    ids = native.pop("d2t", None)
    ids = torch.arange(a.vocab_size) if ids is None else ids.to(torch.int64).sort().values
    reduced = len(ids) < a.vocab_size
    trunk = target.model
    tensors: dict[str, torch.Tensor] = {}
    if fmt in ("speculators", "eagle3"):
        aux = list(header["aux_layers"])
        prefix = "layers.0." if fmt == "speculators" else "midlayer."
        tensors = {(prefix + n[len("layers.0."):] if n.startswith("layers.0.") else n): t for n, t in native.items()}
        tensors["lm_head.weight"] = _rows(trunk.output, ids, trunk.device)
        if reduced:
            tensors["d2t"] = ids - torch.arange(len(ids))
            tensors["t2d"] = torch.zeros(a.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        from ..models.eagle3 import draft_args

        layer = _llama_config(draft_args(a), header["ffn_dim"], 1)  # the draft layer's own shape (MLA / MoE trunks)
        if fmt == "speculators":
            config = {
                "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
                "draft_vocab_size": len(ids), "norm_before_residual": False, "norm_before_fc": False,
                "fc_norm": False, "norm_output": False, "embed_requires_grad": False, "target_hidden_size": None,
                "eagle_aux_hidden_state_layer_ids": aux,
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                          "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                    "verifier": {"name_or_path": verifier, "architectures": _verifier_arch(target)}}}
        else:
            config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(ids),
                      "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": aux}
            if min(aux) >= 1:  # SGLang's convention: the output of layer i (it captures the input of i + 1)
                config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                          "use_aux_hidden_state": True}
    elif fmt == "medusa":
        head = _rows(trunk.output, ids, trunk.device)
        for k in range(header["depth"]):
            for p in ("weight", "bias"):
                tensors[f"blocks.{k}.layers.0.{p}"] = native[f"medusa_head.{k}.0.linear.{p}"]
            tensors[f"lm_heads.{k}.weight"] = head
        if reduced:
            tensors["token_map"] = ids
        # no other key may contain "num" and "heads" / "layers": vLLM's MedusaConfig renames such keys
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": a.dim,
                  "vocab_size": a.vocab_size, "num_heads": header["depth"], "num_hidden_layers": 1,
                  "medusa_fc_bias": True, "truncated_vocab_size": len(ids)}
    else:
        L = header["num_hidden_layers"]
        full = torch.arange(a.vocab_size)
        embed, head = _rows(trunk.embed, full, trunk.device), _rows(trunk.output, full, trunk.device)
        tensors = dict(native)
        for i in range(header["depth"]):
            tensors[f"model.layers.{L + i}.embed_tokens.weight"] = embed
            tensors[f"model.layers.{L + i}.shared_head.head.weight"] = head
        config = {**_llama_config(a, header["ffn_dim"], L), "model_type": "deepseek_v3",
                  "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": header["depth"],
                  "first_k_dense_replace": L + header["depth"], "n_routed_experts": 0}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # shared rows (medusa's lm_heads, deepseek's embed / head) are written as separate copies, as the loaders expect
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous().clone() for n, t in
               tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "specdec": json.dumps(header)})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _layout(config: dict) -> str:
    arch = (config.get("architectures") or [""])[0]
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if arch.endswith("Eagle3") or arch.startswith("Eagle3"):
        return "eagle3"
    if config.get("model_type") == "medusa" or arch == "MedusaModel":
        return "medusa"
    if config.get("num_nextn_predict_layers"):
        return "deepseek-mtp"
    raise ModelError(f"not an exported heads directory (architectures {config.get('architectures')}): expected a "
                     f"speculators EAGLE-3, EAGLE-3, Medusa or DeepSeek-MTP checkpoint")


def read_exported(folder: str | Path) -> dict:
    """Any of the four layouts back under specdec's native names: {"format", "kind", "tensors" (native names, plus
    "d2t" = the draft vocabulary as target ids), "extra" (what specdec takes from the target instead:
    lm_head, t2d, embed_tokens, shared_head.head), "config", "header" (the specdec header, if written by specdec)}."""
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    fmt = _layout(config)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta = meta or (fh.metadata() or {})
            tensors.update({n: fh.get_tensor(n) for n in fh.keys()})
    if not tensors:
        raise ModelError(f"{folder} has no .safetensors weights")
    vocab = (config.get("transformer_layer_config") or config)["vocab_size"]
    native: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    ids = torch.arange(vocab)
    if fmt in ("speculators", "eagle3"):
        kind = "eagle3"
        for n, t in tensors.items():
            if n == "d2t":
                ids = torch.arange(len(t)) + t.to(torch.int64)
            elif n in ("lm_head.weight", "t2d") or "embed_tokens" in n:
                extra[n] = t
            else:
                native["layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n] = t
    elif fmt == "medusa":
        kind = "parallel"
        if config.get("num_hidden_layers", 1) != 1:
            raise ModelError(f"{folder}: Medusa heads with {config['num_hidden_layers']} residual blocks each; "
                             "specdec's parallel heads have one")
        for n, t in tensors.items():
            part = n.removeprefix("medusa_heads.").split(".")
            if part[0] == "blocks":
                native[f"medusa_head.{part[1]}.0.linear.{part[-1]}"] = t
            elif n == "token_map":
                ids = t.to(torch.int64)
            else:
                extra[n] = t
    else:
        kind = "sequential"
        for n, t in tensors.items():
            if ".embed_tokens." in n or ".shared_head.head." in n:
                extra[n] = t
            else:
                native[n] = t
    native["d2t"] = ids
    return {"format": fmt, "kind": kind, "tensors": native, "extra": extra, "config": config,
            "header": json.loads(meta["specdec"]) if "specdec" in meta else None}
