"""The layout cache: a model's weights as specdec keeps them in memory, written once, memory-mapped afterwards.

Turning a GGUF file into the kernels' layout (dequantize or take the codes, requantize, pack, fuse q|k|v and
gate|up) takes seconds for a small model and minutes for an 8B one, and llama.cpp users expect a model to open
in about the time it takes to map it. So the first load records every tensor the model keeps (packed layers, norms,
the embedding table) into one safetensors file under ``$SPECDEC_CACHE/layouts`` as it converts them, layer by layer,
and later loads map that file (``mmap``, copy-on-write) and build the model around the mapped tensors without
reading the source file at all: no dequantization, no GGUF parsing, and the weights' pages are shared with the page
cache instead of copied. Small entries (READ_MAX) are instead read whole into anonymous memory in 2 MB pages, which
decodes faster.

An entry is named by the source path and the settings that shape the layout (layout version, dtype, quantization,
device, which kernels this machine runs, torch version); inside, its metadata records the source's identity (size,
mtime and a hash of its header and of sampled chunks of its bytes). An entry whose identity, settings or structure
does not check out (stale: the file changed; corrupt: truncated, garbled header, offsets past the end) is rebuilt,
never trusted. Entries are written to a temporary file and renamed into place, so a crash mid-write leaves no entry.

The entries together stay under a budget (SPECDEC_LAYOUT_CACHE_GB, default 20 GB): a load marks the entry it used
(its mtime), and writing a new entry removes the least recently used others while the total is above the budget,
as ccache bounds its cache. Entries of settings or hosts no longer used (another --quant, a VM moved to a CPU with
other kernels) would otherwise stay forever, each a whole model's size.

File format: standard safetensors (8-byte little-endian header length, JSON header, data), readable by the
`safetensors` package. The header is reserved up front and padded with spaces (the format allows it) so that data
can be streamed to disk while converting; tensors start on 64-byte boundaries (``__pad.N`` byte tensors fill the gaps,
since safetensors forbids holes).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..cache import anonymous_memory

# 2: Q4_0 keeps no zeros; 3: 5-bit formats become int8; 4: Q4_K scales; 5: Q6_K; 6: stacks; 7: Q5_K; 8: Q5_0 / Q5_1;
# 9: 5-bit formats on AVX2 too, the kernel's instruction set in the key; 10: Q6_K on AVX2 too
LAYOUT_VERSION = 10
ALIGN = 64
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
           torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
_TORCH = {v: k for k, v in _DTYPES.items()}
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


class StaleEntry(Exception):
    """A cache entry that does not match its source or settings, or is damaged: rebuild it."""


def source_identity(path: Path) -> dict:
    """What identifies a model file (or HF folder) for the cache: sizes and mtimes, plus a SHA-1 of its first MiB
    (a GGUF's whole header: metadata and tensor table) and of 64 KiB samples spread over the data. A changed file
    almost always changes size or mtime; the hash catches a same-size rewrite with a restored mtime."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors")) if path.is_dir() else [path]
    h = hashlib.sha1()
    stats = []
    for f in files:
        st = f.stat()
        stats.append([f.name, st.st_size, st.st_mtime_ns])
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if st.st_size > 1 << 21:
                for i in range(1, 33):
                    fh.seek((st.st_size - (1 << 16)) * i // 32)
                    h.update(fh.read(1 << 16))
    return {"path": str(path.resolve()), "files": stats, "sample_sha1": h.hexdigest()}


def cheap_identity(path: Path) -> list:
    """Sizes and mtimes only (a stat per file): compared first, so a changed file is noticed without reading it."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors")) if path.is_dir() else [path]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def entry_path(root: Path, source: Path, settings: dict) -> Path:
    """One entry per (source path, settings): a rewritten file replaces its own entry instead of adding one."""
    key = json.dumps({"path": str(source.resolve()), **settings}, sort_keys=True)
    return root / "layouts" / f"{source.name[:48]}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.safetensors"


class LayoutWriter:
    """Streams tensors into a safetensors file as they are made; finish() writes the header and renames it."""

    def __init__(self, path: Path, n_hint: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        self.tmp = Path(tmp)
        self.f = os.fdopen(fd, "wb")
        # ~160 bytes of JSON per tensor entry; a generous reserve, and a rewrite when even that is exceeded
        self.reserve = _round_up(8 + 65536 + 400 * n_hint, ALIGN) - 8
        self.f.seek(8 + self.reserve)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.pads = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"layout cache: tensor {name} recorded twice")
        t = t.detach().contiguous().cpu()
        gap = _round_up(self.offset, ALIGN) - self.offset
        if gap:
            self.entries[f"__pad.{self.pads}"] = {"dtype": "U8", "shape": [gap],
                                                  "data_offsets": [self.offset, self.offset + gap]}
            self.f.write(b"\0" * gap)
            self.pads += 1
            self.offset += gap
        n = t.numel() * t.element_size()
        self.entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + n]}
        if n:
            self.f.write(t.view(-1).view(torch.uint8).numpy().data)
        self.offset += n

    def finish(self, metadata: dict[str, str]) -> None:
        header = json.dumps({"__metadata__": metadata, **self.entries}, separators=(",", ":")).encode()
        if len(header) > self.reserve:  # rare: copy the data behind a bigger header
            self.f.close()
            self._rewrite(header)
        else:
            self.f.seek(0)
            self.f.write(struct.pack("<Q", self.reserve) + header + b" " * (self.reserve - len(header)))
            self.f.close()
        os.replace(self.tmp, self.path)

    def _rewrite(self, header: bytes) -> None:
        size = _round_up(8 + len(header), ALIGN) - 8
        fd, tmp2 = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as out, open(self.tmp, "rb") as src:
            out.write(struct.pack("<Q", size) + header + b" " * (size - len(header)))
            src.seek(8 + self.reserve)
            while chunk := src.read(1 << 24):
                out.write(chunk)
        os.unlink(self.tmp)
        self.tmp = Path(tmp2)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


# Cached layouts up to this size are read into memory by default (read_entry's in_memory, the loader's use_mmap):
# private anonymous memory in 2 MB pages decodes faster than the file's 4 KB mapped pages (fewer TLB misses). On the
# Zen 2 host, `generate --spec none`, alternated (docs/results/weights-in-memory-1206.txt): SmolLM2 1.07x, Gemma-3-270M
# 1.06x, a 1B-shaped Q4_0 file 1.15x, for 0.06-0.5 s more loading; an 8B-shaped Q4_K_M file 1.11x, for 3.4 s more,
# which ~200 tokens repay: big layouts stay mapped unless --no-mmap says otherwise.
READ_MAX = 1 << 30


def read_into_memory(entry: Path, use_mmap: bool | None) -> bool:
    """Whether a load reads the existing `entry` into memory (use_mmap False: `--no-mmap`, `specdec serve`'s
    default) or maps it (True: `--mmap`); None (the default): read one of at most READ_MAX bytes. An entry larger
    than the free memory is mapped (with a note when reading was asked for): mapped pages can be dropped and read
    again, anonymous ones cannot."""
    if use_mmap or not entry.exists():
        return False
    size = entry.stat().st_size
    if use_mmap is None and size > READ_MAX:
        return False
    try:
        import psutil

        free = psutil.virtual_memory().available
    except Exception:  # no psutil or no /proc
        free = size
    if size > free:
        if use_mmap is False:
            note(f"the weights ({size / 2**30:.1f} GiB) do not fit in the free memory ({free / 2**30:.1f} GiB): "
                 "mapping them instead of reading them into memory")
        return False
    return True


def _read_whole(f, size: int) -> mmap.mmap | None:
    """The whole open file f in anonymous_memory(), read by two threads (preadv releases the GIL; the page faults of
    both halves then run on both cores), or None where the platform has no preadv."""
    if not hasattr(os, "preadv"):
        return None
    from concurrent.futures import ThreadPoolExecutor

    buf = anonymous_memory(size)
    view, fd, chunk, half = memoryview(buf), f.fileno(), 8 << 20, size // 2 >> 21 << 21

    def read(lo: int, hi: int) -> None:
        for at in range(lo, hi, chunk):
            want = min(at + chunk, hi) - at
            if os.preadv(fd, [view[at:at + want]], at) != want:
                raise StaleEntry("shorter than when it was opened")

    try:
        with ThreadPoolExecutor(2) as pool:
            for job in [pool.submit(read, 0, half), pool.submit(read, half, size)]:
                job.result()
    finally:
        view.release()
    return buf


def _header(f) -> tuple[int, int, dict]:
    """An open entry's (file size, header length, header with its metadata checked present)."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise StaleEntry("shorter than a header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(size - 8, 1 << 28):
        raise StaleEntry("header length past the end")
    header = json.loads(f.read(n))
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise StaleEntry("no metadata")
    return size, n, header


def read_metadata(path: Path) -> dict[str, str]:
    """An entry's metadata alone (its header's), to check it before reading the data. Raises StaleEntry."""
    try:
        with open(path, "rb") as f:
            return _header(f)[2]["__metadata__"]
    except (OSError, ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise StaleEntry(f"unreadable ({type(e).__name__})") from e


def read_entry(path: Path, in_memory: bool = False) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """An entry -> (metadata, its tensors): backed by a copy-on-write mapping of the file, or with in_memory by the
    file read whole into anonymous_memory() (see READ_MAX). Raises StaleEntry when it is damaged."""
    try:
        with open(path, "rb") as f:
            size, n, header = _header(f)
            mm = None
            if size > 8 + n:
                mm = _read_whole(f, size) if in_memory else None
                mm = mm or mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise StaleEntry(f"unreadable ({type(e).__name__})") from e
    meta = header.pop("__metadata__")
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for name, e in header.items():
        try:
            dtype, shape, (lo, hi) = e["dtype"], [int(s) for s in e["shape"]], e["data_offsets"]
            count = 1
            for s in shape:
                count *= s
            ok = dtype in _TORCH and min(shape, default=0) >= 0 and 0 <= lo <= hi and hi - lo == count * _SIZES[dtype]
        except (KeyError, TypeError, ValueError) as err:
            raise StaleEntry(f"bad entry {name}") from err
        if not ok or 8 + n + hi > size:
            raise StaleEntry(f"bad or truncated entry {name}")
        end = max(end, hi)
        if name.startswith("__pad."):
            continue
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=_TORCH[dtype])
        else:
            tensors[name] = torch.frombuffer(mm, dtype=_TORCH[dtype], count=count, offset=8 + n + lo).view(shape)
    if 8 + n + end != size:
        raise StaleEntry("size does not match its header")
    return meta, tensors


def note(msg: str) -> None:
    print(f"specdec: {msg}", file=sys.stderr, flush=True)


def layout_settings(dtype: str, quant: str, device: torch.device) -> dict:
    """What shapes the in-memory layout besides the source (dtype and quant as asked, e.g. "auto": the file and
    these settings decide what they resolve to): a change in any of these needs another entry. The kernel's
    instruction set is one: the two builds have not always kept the same formats (Q6K was the AVX-512 build's alone
    before layout version 10), and a cache directory can outlive its host (a VM moved to another CPU) or be shared
    between machines."""
    from .. import kernels
    from ..quant import has_int4_kernel

    return {"version": LAYOUT_VERSION, "dtype": str(dtype), "quant": quant, "device": device.type,
            "matmul_kernel": device.type == "cpu" and kernels.matmul_lib() is not None,
            "matmul_isa": kernels.matmul_isa() if device.type == "cpu" else None,
            "int4_fallback": has_int4_kernel(), "torch": torch.__version__.split("+")[0]}


def cache_enabled() -> bool:
    return os.environ.get("SPECDEC_LAYOUT_CACHE", "1") != "0"


BUDGET_GB = 20.0  # default bound on all entries together: four 8B-sized Q4_K_M layouts


def cache_budget() -> float | None:
    """Bytes all entries may take together: $SPECDEC_LAYOUT_CACHE_GB (a number of GB, or "none" for no bound),
    default BUDGET_GB. A value that is neither is ignored with a note."""
    raw = os.environ.get("SPECDEC_LAYOUT_CACHE_GB", "").strip()
    if raw.lower() == "none":
        return None
    try:
        gb = float(raw) if raw else BUDGET_GB
        if not gb >= 0 or gb == float("inf"):
            raise ValueError
    except ValueError:
        note(f"ignoring SPECDEC_LAYOUT_CACHE_GB={raw!r} (give a number of GB, or none for no bound); keeping the "
             f"layout cache under {BUDGET_GB:g} GB")
        gb = BUDGET_GB
    return gb * 1e9


def mark_used(entry: Path) -> None:
    """Record that a load used `entry` (its mtime: the least recently used entries go first when the cache is over
    its budget). A read-only cache folder keeps its times."""
    try:
        os.utime(entry)
    except OSError:
        pass


def prune(root: Path, keep: Path | None = None) -> int:
    """Remove entries whose model file is gone (their headers name it) and entries of an older layout version (no
    later load can use them: an upgrade would otherwise leave a whole model's worth of layout per version), so the
    cache does not outgrow the models people still have; then, while all entries together take more than the budget
    (cache_budget), the least recently used ones other than `keep` (an entry larger than the budget alone stays).
    Returns how many were removed. Unreadable entries are removed too; a newer version's entries (another install
    sharing the folder) are kept unless the budget needs their room."""
    removed = 0
    kept: list[tuple[float, int, Path]] = []  # (last used, bytes, entry) of the entries that stay
    for entry in (root / "layouts").glob("*.safetensors"):
        if keep is not None and entry == keep:
            continue
        try:
            with open(entry, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                meta = json.loads(f.read(min(n, 1 << 28)))["__metadata__"]
            info = json.loads(meta["specdec_layout"])
            gone = not Path(info["identity"]["path"]).exists() or info.get("version", 0) < LAYOUT_VERSION
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            gone = True
        if gone:
            entry.unlink(missing_ok=True)
            removed += 1
            continue
        try:
            st = entry.stat()
            kept.append((st.st_mtime, st.st_size, entry))
        except OSError:
            pass
    removed += _evict(kept, keep)
    for tmp in (root / "layouts").glob("*.tmp"):  # left by a load that was killed mid-write, over an hour ago
        try:
            if tmp.stat().st_mtime < time.time() - 3600:
                tmp.unlink()
        except OSError:
            pass
    return removed


def _evict(entries: list[tuple[float, int, Path]], keep: Path | None) -> int:
    """Remove the least recently used of `entries` ((mtime, bytes, path); `keep` not among them) while they and
    `keep` take more than the cache budget; returns how many were removed."""
    budget = cache_budget()
    total = sum(size for _, size, _ in entries)
    if keep is not None and keep.exists():
        total += keep.stat().st_size
    removed = 0
    for used, size, entry in sorted(entries):
        if budget is None or total <= budget:
            break
        entry.unlink(missing_ok=True)
        total -= size
        removed += 1
        note(f"removed the cached layout {entry.name} ({size / 1e9:.1f} GB, last used "
             f"{time.strftime('%Y-%m-%d', time.localtime(used))}) to keep the layout cache under {budget / 1e9:g} GB "
             "(SPECDEC_LAYOUT_CACHE_GB)")
    return removed
