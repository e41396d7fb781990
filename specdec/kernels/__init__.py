"""Native CPU kernels, compiled on first use with the machine's C compiler and cached on disk.

attention.c is batch-invariant attention for decode and verification steps (see its header). It is plain C called
through ctypes: no PyTorch headers, so it compiles in seconds (~7 s) with gcc or clang, and a machine without a
compiler still runs (attention then falls back to PyTorch's SDPA, one call per verified row; SPECDEC_NO_KERNELS=1
forces that fallback). The shared library is cached under $SPECDEC_CACHE (default ~/.cache/specdec), keyed by the
source, the compiler flags and the CPU (it is built with -march=native).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attention.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_id() -> bytes:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine.encode()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


@functools.cache
def attention_lib() -> ctypes.CDLL | None:
    """The compiled attention kernel, or None (no compiler, or disabled): callers then use PyTorch's SDPA."""
    if os.environ.get("SPECDEC_NO_KERNELS"):
        return None
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_id()).hexdigest()[:16]
    lib = cache_dir() / f"attention-{key}.so"
    if not lib.exists():
        print("specdec: compiling the attention kernel (once per machine, ~10 s)", file=sys.stderr, flush=True)
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE)], check=True, capture_output=True, timeout=120)
                out.replace(lib)  # atomic: a concurrent process sees the whole file or none
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            why = err.decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
            print(f"specdec: could not compile the attention kernel with '{cc}' ({why[0]}); using PyTorch SDPA, "
                  "which makes verification slower: install gcc to get it", file=sys.stderr)
            return None
    dll = ctypes.CDLL(str(lib))
    f = dll.specdec_attend
    f.restype = ctypes.c_int
    ptr, i = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ptr, ctypes.c_long, ptr, ptr, ctypes.c_long, i, i, i, i, ptr, ptr, ptr, ptr, ctypes.c_float, ptr,
                  i]
    g = dll.specdec_store_keys
    g.restype = None
    g.argtypes = [ptr, ptr, i, ctypes.c_long, ctypes.c_long, ctypes.c_long, i, i, ctypes.c_long, ctypes.c_long, i]
    return dll


HEAD_DIMS = (16, 32, 64, 128, 256)  # head sizes attention.c is built for


def kernel_supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a model with these settings attends through the kernel (else PyTorch SDPA)."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS and attention_lib() is not None


def row_spans(start: int, tails: list[torch.Tensor], window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of T rows attends, as attend() takes it: every slot before `start`, then the slots tails[r] (its
    own chain or tree path, itself last), all but the last `window` of them dropped for a sliding-window layer.
    -> (spans [3 T + 1]: the T rows' first slots, the T ends of their consecutive runs (all `start`), the T + 1
    offsets of their tails in the second tensor; the tail slots, concatenated)."""
    lo, hi, cut = [], [], []
    for tail in tails:
        first = max(0, start + len(tail) - window) if window else 0
        lo.append(min(first, start))
        hi.append(start)
        cut.append(tail[max(0, first - start):])
    offsets = [0]
    for c in cut:
        offsets.append(offsets[-1] + len(c))
    return torch.tensor(lo + hi + offsets, dtype=torch.int64), torch.cat(cut)


TILE = 32  # slots per tile of transposed keys (BLOCK in attention.c)


def key_tiles(n_layers: int, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed storage for the keys again, in tiles [layers, Hkv, tiles, D, 32] (see attention.c)."""
    return torch.zeros(n_layers, n_kv, -(-max_len // TILE), head_dim, TILE, dtype=dtype)


def store_keys(kv: torch.Tensor, kt: torch.Tensor, start: int, end: int) -> None:
    """Copy the keys of slots [start, end) from a cache kv [1, S, 2 Hkv, D] into its tiles kt [Hkv, tiles, D, 32]:
    one layer, or every layer of KVCache.kv [layers, 1, S, 2 Hkv, D] / KVCache.kt [layers, Hkv, tiles, D, 32]
    (both contiguous, as KVCache makes them)."""
    every = kv.dim() == 5
    Hkv, tiles, D, _ = kt.shape[-4:]
    attention_lib().specdec_store_keys(kv.data_ptr(), kt.data_ptr(), kv.shape[0] if every else 1,
                                       kv.stride(0) if every else 0,
                                       kt.stride(0) if every else 0, tiles, Hkv, D, start, end, kv.element_size())


def attend(qkv: torch.Tensor, kv: torch.Tensor, kt: torch.Tensor, n_heads: int, n_kv: int, spans: torch.Tensor,
           tails: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of qkv's query heads (qkv [1, T, H + 2 Hkv, D], contiguous, queries first) over one layer's cache
    kv [1, S, 2 Hkv, D] and its key tiles kt [Hkv, tiles, D, 32], each row over its own slots (row_spans)
    -> [1, T, H * D]."""
    _, T, _, D = qkv.shape
    assert qkv.is_contiguous() and kv.is_contiguous() and kt.is_contiguous() and qkv.dtype == kv.dtype == kt.dtype
    assert spans.numel() == 3 * T + 1 and spans.dtype == tails.dtype == torch.int64
    out = torch.empty(1, T, n_heads * D, dtype=qkv.dtype)
    p = spans.data_ptr()
    rc = attention_lib().specdec_attend(qkv.data_ptr(), qkv.shape[2] * D, kv.data_ptr(), kt.data_ptr(),
                                        kt.shape[1], n_heads, n_kv, D, T, p, p + 8 * T, tails.data_ptr(),
                                        p + 16 * T, scale, out.data_ptr(), DTYPES[qkv.dtype])
    if rc != 0:
        raise MemoryError("the attention kernel ran out of memory") if rc == -1 else ValueError(f"head size {D}")
    return out

