"""GGUF files as llama.cpp writes them, parsed and dequantized by the `gguf` package.

Metadata keys and tensor names are llama.cpp's (``{arch}.block_count``, ``blk.N.attn_q.weight`` ...). Two conversions
made by llama.cpp's convert_hf_to_gguf.py are undone here so the model sees Hugging Face's conventions: the q/k
rows of arch ``llama`` are permuted for interleaved RoPE (we restore rotate_half order), and the row/column order of
the GGUF shape (ne0 = columns) is the reverse of PyTorch's, which the reader already gives us.

Multi-token-prediction modules (llama.cpp's "nextn", from GLM-4.5 / DeepSeek-V3 conversions): metadata
``{arch}.nextn_predict_layers`` = n, and the MTP modules are the LAST n blocks (``block_count`` counts them). Their
tensors ``blk.{L+i}.nextn.{eh_proj, enorm, hnorm, embed_tokens, shared_head_head, shared_head_norm}`` and
``blk.{L+i}.{attn_q, ..., ffn_down}`` are exposed as ``mtp.{i}.*`` (L = the trunk's layer count), so the trunk
never sees them.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import torch

from ..config import FAMILIES, SUPPORTED, ModelArgs, ModelError
from . import LazyWeights, LoadedModel, unpermute_rotary

GGUF_MAGIC = b"GGUF"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _open(path: Path):
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (no GGUF magic): give a llama.cpp .gguf or a Hugging Face folder")
    try:
        reader = gguf.GGUFReader(path)
        # the reader maps tensor data lazily; touching the last tensor's bytes checks the file is complete
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as e:
        raise ModelError(f"{path} is truncated or corrupt ({type(e).__name__}): download the file again") from e
    size = path.stat().st_size
    if end > size:
        raise ModelError(f"{path} is truncated ({size} of {end} bytes): download the file again")
    return reader


def _meta(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays: the tokenizer reads them itself
        try:
            out[key] = field.contents()
        except Exception:  # a field type this gguf version can't decode; we don't need it
            continue
    return out


def read_gguf(path: Path) -> LoadedModel:
    """Read the config from GGUF metadata and return lazily dequantized tensors under canonical names."""
    from gguf import GGMLQuantizationType, dequantize

    reader = _open(path)
    meta = _meta(reader)
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise ModelError(f"unknown architecture '{arch}' in {path.name}: specdec supports {SUPPORTED}")
    tensors = {t.name.removesuffix(".weight"): t for t in reader.tensors}
    args = _args_from_meta(arch, meta, tensors)

    def canonical(name: str) -> str:
        m = _BLOCK_RE.match(name)
        if m and int(m[1]) >= args.n_layers:  # an MTP block: blk.{L+i}.nextn.eh_proj -> mtp.{i}.eh_proj
            return f"mtp.{int(m[1]) - args.n_layers}.{m[2].removeprefix('nextn.')}"
        return name

    def loader(t, name: str):
        def load() -> torch.Tensor:
            qtype = GGMLQuantizationType(t.tensor_type)
            arr = np.asarray(t.data) if qtype == GGMLQuantizationType.F32 else dequantize(t.data, qtype)
            shape = tuple(int(s) for s in reversed(t.shape))
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            w = torch.from_numpy(arr if arr.flags.writeable else arr.copy()).reshape(shape)
            if arch == "llama" and name.endswith(("attn_q", "attn_q.bias")):
                w = unpermute_rotary(w, args.n_heads)
            elif arch == "llama" and name.endswith(("attn_k", "attn_k.bias")):
                w = unpermute_rotary(w, args.n_kv_heads)
            return w

        return load

    loaders, nbytes, numel = {}, {}, {}
    for name, t in tensors.items():
        if name == "rope_freqs":
            continue  # folded into args.rope_scaling
        name = canonical(name)
        loaders[name] = loader(t, name)
        nbytes[name] = int(t.n_bytes)
        numel[name] = int(t.n_elements)
    # the modules the file really holds (a converter may keep the metadata but drop the MTP tensors)
    args.n_mtp_layers = sum(f"mtp.{i}.eh_proj" in loaders for i in range(args.n_mtp_layers))
    args.mtp_layout = args.mtp_layout if args.n_mtp_layers else None
    types = collections.Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) == 2)
    main_type = types.most_common(1)[0][0] if types else "F32"
    mixed = "" if len(types) <= 1 else " (mixed: " + ", ".join(f"{k} x{v}" for k, v in types.most_common()) + ")"
    return LoadedModel(args, LazyWeights(loaders, nbytes, numel), path, f"GGUF {main_type}{mixed}",
                       extra={"meta": meta})


def _args_from_meta(arch: str, meta: dict, tensors: dict) -> ModelArgs:
    def g(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key: str):
        v = g(key)
        if v is None:
            raise ModelError(f"GGUF metadata lacks '{arch}.{key}': the file is incomplete, convert it again")
        return v

    n_heads = int(need("attention.head_count"))
    kv = g("attention.head_count_kv", n_heads)
    if isinstance(kv, list | tuple):
        if len(set(kv)) != 1:
            raise ModelError("per-layer KV head counts are not supported")
        kv = kv[0]
    dim = int(need("embedding_length"))
    head_dim = int(g("attention.key_length", dim // n_heads))
    if "token_embd" not in tensors:
        raise ModelError("GGUF has no token_embd tensor: the file is incomplete, convert it again")
    vocab = int(tensors["token_embd"].shape[1])
    n_mtp = int(g("nextn_predict_layers", 0) or 0)
    n_layers = int(need("block_count")) - n_mtp  # llama.cpp counts the MTP blocks in block_count
    if n_layers < 1 or n_mtp < 0:
        raise ModelError(f"GGUF metadata: {arch}.nextn_predict_layers = {n_mtp} does not fit block_count")
    rope_scaling = None
    if "rope_freqs" in tensors:  # llama-3 rope scaling, precomputed by the converter as per-frequency divisors
        rope_scaling = {"rope_type": "freq_factors", "factors": np.asarray(tensors["rope_freqs"].data).tolist()}
    elif g("rope.scaling.type") not in (None, "none"):
        kind = g("rope.scaling.type")
        if kind != "linear":
            raise ModelError(f"rope scaling '{kind}' is not supported (linear and llama3 are)")
        rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
    args = dict(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=int(kv),
        head_dim=head_dim, ffn_dim=int(need("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, max_seq_len=int(g("context_length", 4096)), tie_embeddings="output" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm" in tensors,
        n_mtp_layers=n_mtp, mtp_layout="deepseek" if n_mtp else None,
    )
    if FAMILIES[arch] == "gemma3":
        window = g("attention.sliding_window")
        pattern = g("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list | tuple):
            sliding = [bool(x) for x in pattern][:n_layers]
        else:  # llama.cpp: every pattern-th layer is global, the others slide
            sliding = [(i % int(pattern)) < int(pattern) - 1 for i in range(n_layers)]
        args.update(
            sliding_window=int(window) if window else None, sliding_layers=sliding if window else [],
            rope_local_theta=float(g("rope.freq_base_swa", 10000.0)), embed_scale=dim**0.5,
            activation="gelu_tanh", sandwich_norms=True, qk_norm=True,
            final_logit_softcap=g("final_logit_softcapping"),
        )
    elif g("attention.sliding_window"):
        args["sliding_window"] = int(g("attention.sliding_window"))
    return ModelArgs(**args)
