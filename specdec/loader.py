"""Resolve model names, devices, dtypes and quantization; load a model and its tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelError, cache_dir
from .models.transformer import Transformer
from .paths import ALIASES, default_model_path, gemma3_270m_path, resolve_model_path  # noqa: F401
from .tokenizer import Tokenizer, load_tokenizer
from .weights import LoadedModel, read_model


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
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError("--device mps asked, but this torch build has no Apple GPU (MPS) support: use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ModelError(f"unknown device '{name}': use auto, cpu, cuda or mps")
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
    # how the weights came into memory: "mapped" (layout cache entry, weights/layout.py), "converted" (first load:
    # converted and cached), or "converted in memory" (cache off or not writable); seconds of each load stage
    load_kind: str = "converted in memory"
    load_split: dict = field(default_factory=dict)

    def load_summary(self) -> str:
        """e.g. "load 0.12 s (cached layout read into memory: tokenizer 0.08 s, read 0.04 s)"."""
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.load_split.items())
        return f"load {self.load_seconds:.2f} s ({self.load_kind}{': ' + parts if parts else ''})"


def _build(lm_args, weights, torch_dtype, q, ctx, dev, progress) -> tuple[Transformer, list]:
    from .models.mtp import load_mtp_modules

    net = Transformer(lm_args, weights, torch_dtype, q, max_len=ctx, device=dev, progress=progress)
    return net, load_mtp_modules(net, weights, lm_args, torch_dtype, q)


def load(model: str | Path | None = None, *, dtype: str = "auto", quant: str = "auto", device: str = "auto",
         ctx: int | None = None, progress=None, cache: bool | None = None, tokenizer: Tokenizer | None = None,
         use_mmap: bool | None = None) -> Loaded:
    """Load a model (GGUF file, HF folder, or an alias) with its tokenizer (`tokenizer`: already read from it).

    On CPU the converted weights are kept in the layout cache (weights/layout.py): the first load converts and
    writes them, later loads map them, or read them into memory (use_mmap False; None: layouts up to
    layout.READ_MAX). cache=False (or SPECDEC_LAYOUT_CACHE=0) converts in memory every time."""
    from .weights import layout

    t0 = time.perf_counter()
    path = resolve_model_path(model)
    if not path.exists():
        raise ModelError(f"model not found: {path}")
    dev = resolve_device(device)
    use_cache = (layout.cache_enabled() if cache is None else cache) and dev.type == "cpu"
    split: dict[str, float] = {}
    built = None
    tok = tokenizer
    before = getattr(tok, "load_s", 0.0)  # a light tokenizer, read before (light_tokenizer.py): its time counts too
    if before:
        split["tokenizer table"] = before
    if use_cache:
        entry = layout.entry_path(cache_dir(), path, layout.layout_settings(dtype, quant, dev))
        in_memory = layout.read_into_memory(entry, use_mmap)
        if in_memory and tok is None:  # its parsing's peak before the weights are resident
            t = time.perf_counter()
            tok = load_tokenizer(path)
            split["tokenizer"] = time.perf_counter() - t
        t = time.perf_counter()
        built = _map_entry(entry, path, ctx, dev, progress, in_memory)
        if built is not None:
            split["read" if in_memory else "map"] = time.perf_counter() - t
            kind = "cached layout read into memory" if in_memory else "cached layout mapped"
    if built is None:
        t = time.perf_counter()
        lm = read_model(path)
        torch_dtype, q = resolve_precision(dtype, quant, lm, dev)
        _check_memory(lm, path)
        if use_cache:
            built = _convert_to_entry(entry, lm, torch_dtype, q, ctx, dev, progress, use_mmap)
            kind = "first load: converted and cached"
        if built is None:
            net, mtp = _build(lm.args, lm.weights, torch_dtype, q, ctx, dev, progress)
            built = net, mtp, lm.file_type, sum(lm.weights.source_bytes.values())
            kind = "converted in memory"
        split["convert"] = time.perf_counter() - t
    net, mtp, file_type, source_bytes = built
    if ctx and ctx > net.args.max_seq_len:
        layout.note(f"-c {ctx} is more than the {net.args.max_seq_len} tokens this model was trained on: "
                    "output past that may degrade")
    if tok is None:
        t = time.perf_counter()
        tok = load_tokenizer(path)
        split["tokenizer"] = time.perf_counter() - t
    return Loaded(net, tok, path, file_type, time.perf_counter() - t0 + before, source_bytes, mtp or None, kind,
                  split)


def _map_entry(entry: Path, path: Path, ctx, dev, progress, in_memory: bool = False):
    """(model, mtp, file type, source bytes) built around a valid cache entry's tensors (mapped, or read into
    memory: layout.read_entry), or None when there is no valid entry (a stale or damaged one is removed, with a
    note)."""
    import json

    from .config import ModelArgs
    from .weights import CachedWeights, layout

    if not entry.exists():
        return None
    try:
        raw = layout.read_metadata(entry)["specdec_layout"]  # checked before any of the data is read
        info = json.loads(raw)
        if info.get("files") != layout.cheap_identity(path) or info.get("identity") != layout.source_identity(path):
            raise layout.StaleEntry("the model file changed")
        meta, tensors = layout.read_entry(entry, in_memory)
        if meta.get("specdec_layout") != raw:  # another process replaced the entry in between
            raise layout.StaleEntry("it changed while it was read")
        weights = CachedWeights(info, tensors)
        args = ModelArgs(**info["args"])
        dtype = getattr(torch, info["dtype"].removeprefix("torch."))
        net, mtp = _build(args, weights, dtype, info["quant"], ctx, dev, progress)
    except (layout.StaleEntry, KeyError, TypeError, ValueError, json.JSONDecodeError, ModelError) as e:
        layout.note(f"rebuilding the cached layout of {path.name} ({e})")
        entry.unlink(missing_ok=True)
        return None
    net.mapped = tensors  # keeps the mapping alive as long as the model (the tensors reference it too)
    layout.mark_used(entry)
    return net, mtp, info["file_type"], info["source_bytes_total"]


def _convert_to_entry(entry: Path, lm, torch_dtype, q, ctx, dev, progress, use_mmap: bool | None = None):
    """Convert the model, streaming every kept tensor into a new cache entry, then map it (or read it: use_mmap as
    load() takes it); None (with a note) when the entry cannot be written, so the caller converts in memory."""
    import dataclasses
    import json

    from .weights import layout

    try:
        writer = layout.LayoutWriter(entry, len(lm.weights))
    except OSError as e:
        layout.note(f"cannot write the layout cache in {entry.parent} ({e.strerror or e}); converting in memory "
                    "(set SPECDEC_CACHE to a writable folder to load faster next time)")
        return None
    weights = lm.weights
    weights.recorder = writer
    try:
        _build(lm.args, weights, torch_dtype, q, ctx, dev, progress)  # a scaffold: every weight went to the writer
        info = {"version": layout.LAYOUT_VERSION, "args": dataclasses.asdict(lm.args), "dtype": str(torch_dtype),
                "quant": q, "file_type": lm.file_type, "source_bytes": weights.source_bytes, "numel": weights._numel,
                "source_bytes_total": sum(weights.source_bytes.values()), "names": list(weights),
                "linears": weights.linears, "files": layout.cheap_identity(lm.path),
                "identity": layout.source_identity(lm.path)}
        writer.finish({"specdec_layout": json.dumps(info)})
        layout.prune(entry.parent.parent, keep=entry)
    except OSError as e:
        writer.abort()
        layout.note(f"cannot write the layout cache ({e.strerror or e}); converting in memory")
        return None
    except BaseException:
        writer.abort()
        raise
    finally:
        weights.recorder = None
    return _map_entry(entry, lm.path, ctx, dev, None, layout.read_into_memory(entry, use_mmap))


def _check_memory(lm, path: Path) -> None:
    """Refuse, before converting, a model whose weights cannot fit in this machine's memory."""
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # no psutil or no /proc: let the load try
        return
    need = sum(lm.weights.source_bytes.values())
    if need > avail:
        raise ModelError(f"{path.name} needs about {need / 2**30:.1f} GiB for its weights but only "
                         f"{avail / 2**30:.1f} GiB of memory is free: close other programs or use a smaller model")


def progress_bar(desc: str, unit: str = "layer"):
    """A tqdm progress bar on stderr (shown on a terminal only); returns (callback(i, n), close())."""
    import sys

    from tqdm import tqdm

    bar = None

    def update(i: int, n: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=n, desc=desc, unit=unit, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
        bar.n = i
        bar.refresh()

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def check_model_file(model: str | Path | None) -> Path:
    """A model's path, refused in one line when it is missing or, for a GGUF file, when its header is truncated or
    corrupt (weights/gguf.py's check, milliseconds): a draft model is checked so before the target loads and before
    its vocabulary is read (that read's own failure said only "unpack_from requires a buffer ...")."""
    path = resolve_model_path(model)
    if not path.exists():
        raise ModelError(f"model not found: {path}")
    if path.is_file():
        from .weights.gguf import check_gguf

        check_gguf(path)
    return path


def load_args(args, which: str = "model", target: Loaded | None = None, tokenizer: Tokenizer | None = None
              ) -> Loaded:
    """load() from the command line's common flags (-m / -md, --dtype, --quant, --device, -c), with a progress bar.
    target: the model a draft (-md) is for: the draft's vocabulary is checked against it from its tokenizer alone,
    before its weights are read (a mismatched draft used to be refused only after its whole load); tokenizer: the
    model's, read already (light_tokenizer.LightTokenizer)."""
    tok = tokenizer
    if target is not None:
        from .light_tokenizer import LightTokenizer
        from .spec.draft_model import check_vocab

        path = check_model_file(getattr(args, which))
        tok = LightTokenizer.cached(path) or load_tokenizer(path)  # a draft's tokenizer is only compared, not used
        check_vocab(target.tokenizer, tok)
    update, close = progress_bar(f"loading {which.replace('_', ' ')}")
    try:
        return load(getattr(args, which), dtype=args.dtype, quant=args.quant, device=args.device,
                    ctx=args.ctx_size, progress=update, tokenizer=tok, use_mmap=getattr(args, "use_mmap", None))
    finally:
        close()
