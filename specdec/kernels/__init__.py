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
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import cache_dir

SOURCE = Path(__file__).with_name("attention.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
WIDEN = 2  # matmul.c's dtype code for bf16 inputs and float32 outputs rounded to bf16 (matmul(widen=True))


def _cpu_id() -> bytes:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine.encode()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()


BUILDS_KEPT_DAYS = 30  # a kernel's other builds unused this long are removed when a new one is compiled


def _mark_used(lib: Path) -> None:
    """Record that this process loads `lib` (its mtime; a read-only cache folder keeps its times)."""
    try:
        os.utime(lib)
    except OSError:
        pass


def _prune_builds(name: str, new: Path) -> None:
    """Remove the builds of kernel `name` other than `new` that no process has loaded for BUILDS_KEPT_DAYS. Every
    change to a kernel's source (an upgrade) or to the CPU under the cache compiles a build of its own, and nothing
    removed the old ones; a host that shares the folder and still loads its own build keeps it."""
    cutoff = time.time() - BUILDS_KEPT_DAYS * 86400
    for old in new.parent.glob(f"{name}-*.so"):
        try:
            if old != new and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass


def _build(name: str, fallback: str) -> ctypes.CDLL | None:
    """Compile (once per machine, cached) and load kernels/<name>.c, or None with one line on stderr saying what
    is used instead (`fallback`) when there is no working C compiler. SPECDEC_NO_KERNELS=1 turns every kernel off,
    SPECDEC_NO_KERNELS=matmul (or attention, comma-separated) only those named."""
    off = os.environ.get("SPECDEC_NO_KERNELS", "")
    if off == "1" or name in off.split(","):
        return None
    source = SOURCE.with_name(f"{name}.c")
    cc = os.environ.get("CC", "cc")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([cc, *FLAGS]).encode() + _cpu_id()).hexdigest()[:16]
    lib = cache_dir() / f"{name}-{key}.so"
    if lib.exists():
        _mark_used(lib)
    else:
        print(f"specdec: compiling the {name} kernel (once per machine, ~10 s)", file=sys.stderr, flush=True)
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run([cc, *FLAGS, "-o", str(out), str(source)], check=True, capture_output=True, timeout=120)
                out.replace(lib)  # atomic: a concurrent process sees the whole file or none
            _prune_builds(name, lib)
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            why = err.decode(errors="replace").strip().splitlines()[-1:] or [str(e)]
            print(f"specdec: could not compile the {name} kernel with '{cc}' ({why[0]}); using {fallback}: "
                  "install gcc to get it", file=sys.stderr)
            return None
    return ctypes.CDLL(str(lib))


@functools.cache
def attention_lib() -> ctypes.CDLL | None:
    """The compiled attention kernel, or None (no compiler, or disabled): callers then use PyTorch's SDPA."""
    dll = _build("attention", "PyTorch SDPA, which makes verification slower")
    if dll is None:
        return None
    f = dll.specdec_attend
    f.restype = ctypes.c_int
    ptr, i = ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ptr, ctypes.c_long, ptr, ptr, ctypes.c_long, i, i, i, i, ptr, ptr, ptr, ptr, ctypes.c_float, ptr,
                  i]
    f = dll.specdec_attend_latent
    f.restype = ctypes.c_int
    f.argtypes = [ptr, ctypes.c_long, ptr, ptr, ctypes.c_long, i, i, i, i, ptr, ptr, ptr, ptr, ctypes.c_float, ptr,
                  i]
    g = dll.specdec_store_keys
    g.restype = None
    g.argtypes = [ptr, ptr, i, ctypes.c_long, ctypes.c_long, ctypes.c_long, i, i, ctypes.c_long, ctypes.c_long,
                  ctypes.c_long, i]
    r = dll.specdec_rope_store
    r.restype = None
    r.argtypes = [ptr, i, i, i, i, ptr, ptr, ptr, ptr, ctypes.c_long, ptr, i]
    dll.specdec_attend_pairs.restype = i
    return dll


def attention_weights_bf16() -> bool:
    """Whether the kernel weighs a bf16 cache's values by bf16-rounded softmax weights, two keys an instruction
    (AVX-512 BF16, as FlashAttention-2's P V; see values_pairs in attention.c)."""
    dll = attention_lib()
    return bool(dll is not None and dll.specdec_attend_pairs())


HEAD_DIMS = (16, 32, 64, 128, 256)  # head sizes attention.c is built for


def kernel_supports(dtype: torch.dtype, device: torch.device, head_dim: int, value_dim: int | None = None) -> bool:
    """Whether a model with these settings attends through the kernel (else PyTorch SDPA); value_dim: multi-head
    latent attention, whose slot vector is head_dim wide (keys) and whose values are its first value_dim elements
    (attend_latent)."""
    if value_dim is None:
        fits = head_dim in HEAD_DIMS
    else:
        fits = head_dim % 16 == 0 and head_dim <= 1024 and value_dim <= head_dim and (
            value_dim in (16, 32) or value_dim % 64 == 0)
    return device.type == "cpu" and dtype in DTYPES and fits and attention_lib() is not None


def row_spans(rows: list[tuple[int, int, Sequence[int]]], window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of T rows attends, as attend() takes it. rows[r] = (base, start, tail): the row's sequence owns pool
    slots from `base` on and has `start` tokens cached before this forward; the row attends those, then the slots
    `tail` (absolute: its own chain or tree path in this forward, itself last; a range for a chain), all but the last
    `window` of them dropped for a sliding-window layer. -> (spans [3 T + 1]: the rows' first slots, the ends of
    their consecutive runs (base + start), the T + 1 offsets of their tails in the second tensor; the tail slots,
    concatenated). A chain of T rows has T (T + 1) / 2 tail slots: built as lists and converted element by element,
    those of a 512-token prefill chunk took 17 ms and a 1000-token one 66 ms (docs/results/row-spans-1206g.txt);
    chains of more than 256 slots go to numpy whole (a decode step's few are cheaper one by one: 15 against 21 us)."""
    lo, hi, cut, offsets = [], [], [], [0]
    for base, start, tail in rows:
        first = max(0, start + len(tail) - window) if window else 0
        lo.append(base + min(first, start))
        hi.append(base + start)
        cut.append(tail[max(0, first - start):])
        offsets.append(offsets[-1] + len(cut[-1]))
    spans = torch.tensor(lo + hi + offsets, dtype=torch.int64)
    if offsets[-1] <= 256 or not all(isinstance(t, range) for t in cut):  # a decode step, a tree: a few slots
        return spans, torch.tensor([x for t in cut for x in t], dtype=torch.int64)
    # a chain's rows: each row's slots from its first on, one arange shifted per row
    at = np.asarray(offsets[:-1], dtype=np.int64) - np.asarray([t.start for t in cut], dtype=np.int64)
    return spans, torch.from_numpy(np.arange(offsets[-1], dtype=np.int64) - np.repeat(at, [len(t) for t in cut]))


TILE = 32  # slots per tile of transposed keys (BLOCK in attention.c)


def key_tiles(n_layers: int, n_kv: int, head_dim: int, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed storage for the keys, in tiles [layers, Hkv, tiles, D / P, 32, P]: P = 2 for bf16 (each slot's dims in
    pairs, the operand of AVX-512 BF16's dot product), else 1 (see tile_at in attention.c)."""
    from ..cache import lazy_zeros

    P = 2 if dtype == torch.bfloat16 else 1
    return lazy_zeros((n_layers, n_kv, -(-max_len // TILE), head_dim // P, TILE, P), dtype)


def store_keys(keys: torch.Tensor, kt: torch.Tensor, start: int) -> None:
    """Write keys [1, n, Hkv, D] of one layer (or [layers, 1, n, Hkv, D] of every layer; contiguous in their last two
    dims, e.g. a slice of a qkv projection or of a latent cache) into the tiles kt [Hkv, tiles, D / P, 32, P]
    ([layers, ...], contiguous; key_tiles) at slots [start, start + n)."""
    every = keys.dim() == 5
    n, Hkv, D = keys.shape[-3:]
    if keys.stride(-1) != 1 or keys.stride(-2) != D:
        keys = keys.contiguous()
    assert kt.is_contiguous() and keys.dtype == kt.dtype and kt.shape[-5] == Hkv and kt.shape[-3] * kt.shape[-1] == D
    attention_lib().specdec_store_keys(keys.data_ptr(), kt.data_ptr(), keys.shape[0] if every else 1,
                                       keys.stride(0) if every else 0, kt.stride(0) if every else 0, kt.shape[-4],
                                       Hkv, D, keys.stride(-3), start, start + n, keys.element_size())


def tile_keys(kt: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The keys of slots [a, b) out of tiles kt [..., Hkv, tiles, D / P, 32, P] -> [..., Hkv, b - a, D] (a copy)."""
    t0, t1 = a // TILE, -(-b // TILE)
    k = kt[..., t0:t1, :, :, :].transpose(-2, -3)  # [..., Hkv, t1 - t0, 32, D / P, P]
    return k.reshape(*k.shape[:-4], -1, k.shape[-2] * k.shape[-1])[..., a - t0 * TILE:b - t0 * TILE, :]


def tile_slots(kt: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """keys [..., D] shaped as they go into slots of tiles kt [..., D / P, 32, P] (kt[..., tile, :, lane] = this)."""
    return keys.unflatten(-1, (-1, kt.shape[-1]))


def rope_store(qkv: torch.Tensor, kv: torch.Tensor, kt: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, n_heads: int, n_kv: int) -> None:
    """RoPE on qkv's query and key heads in place (qkv [1, T, H + 2 Hkv, D], contiguous; cos, sin f32 [T, D]: the
    Rope tables' rows at the T positions), then row t's value stored at slot slots[t] (int64 [T]) of one layer's
    values kv [1, Hkv, S, D] (head by head, S = 32 x tiles) and its key in the key tiles kt (key_tiles)."""
    _, T, _, D = qkv.shape
    assert qkv.is_contiguous() and kv.is_contiguous() and kt.is_contiguous() and qkv.dtype == kv.dtype == kt.dtype
    assert kv.shape == (1, n_kv, kt.shape[1] * TILE, D)
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert slots.dtype == torch.int64 and slots.numel() == T and slots.is_contiguous()
    attention_lib().specdec_rope_store(qkv.data_ptr(), T, n_heads, n_kv, D, cos.data_ptr(), sin.data_ptr(),
                                       kv.data_ptr(), kt.data_ptr(), kt.shape[1], slots.data_ptr(), qkv.element_size())


def attend(qkv: torch.Tensor, kv: torch.Tensor, kt: torch.Tensor, n_heads: int, n_kv: int, spans: torch.Tensor,
           tails: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of qkv's query heads (qkv [1, T, H + 2 Hkv, D], contiguous, queries first) over one layer's values
    kv [1, Hkv, S, D] (head by head, S = 32 x tiles) and key tiles kt (key_tiles), each row over its own slots
    (row_spans) -> [1, T, H * D]."""
    _, T, _, D = qkv.shape
    assert qkv.is_contiguous() and kv.is_contiguous() and kt.is_contiguous() and qkv.dtype == kv.dtype == kt.dtype
    assert kv.shape == (1, n_kv, kt.shape[1] * TILE, D)
    assert spans.numel() == 3 * T + 1 and spans.dtype == tails.dtype == torch.int64
    out = torch.empty(1, T, n_heads * D, dtype=qkv.dtype)
    p = spans.data_ptr()
    rc = attention_lib().specdec_attend(qkv.data_ptr(), qkv.shape[2] * D, kv.data_ptr(), kt.data_ptr(),
                                        kt.shape[1], n_heads, n_kv, D, T, p, p + 8 * T, tails.data_ptr(),
                                        p + 16 * T, scale, out.data_ptr(), DTYPES[qkv.dtype])
    if rc != 0:
        raise MemoryError("the attention kernel ran out of memory") if rc == -1 else ValueError(f"head size {D}")
    return out


def attend_latent(query: torch.Tensor, kv: torch.Tensor, kt: torch.Tensor, value_dim: int, spans: torch.Tensor,
                  tails: torch.Tensor, scale: float) -> torch.Tensor:
    """Multi-head latent attention (models/mla.py, absorbed): query [1, T, H, D] (contiguous; each head's query in
    latent space) over one layer's latent cache kv [1, S, 1, D] (one vector a slot: the key, whose first value_dim
    elements are the value) and its tiles kt (key_tiles), each row over its own slots (row_spans)
    -> [1, T, H, value_dim]. Batch-invariant as attend() is."""
    _, T, H, D = query.shape
    assert query.is_contiguous() and kv.is_contiguous() and kt.is_contiguous()
    assert query.dtype == kv.dtype == kt.dtype and spans.numel() == 3 * T + 1
    out = torch.empty(1, T, H, value_dim, dtype=query.dtype)
    p = spans.data_ptr()
    rc = attention_lib().specdec_attend_latent(query.data_ptr(), H * D, kv.data_ptr(), kt.data_ptr(), kt.shape[1],
                                               H, D, value_dim, T, p, p + 8 * T, tails.data_ptr(), p + 16 * T, scale,
                                               out.data_ptr(), DTYPES[query.dtype])
    if rc != 0:
        why = "the attention kernel ran out of memory" if rc == -1 else f"latent sizes {D}, {value_dim}"
        raise MemoryError(why) if rc == -1 else ValueError(why)
    return out



@functools.cache
def matmul_lib() -> ctypes.CDLL | None:
    """The compiled quantized matmul kernel when this CPU runs it (AVX-512 VNNI, or AVX2: matmul_isa()), else None:
    the quantized linear layers then use PyTorch's weight-only kernels."""
    dll = _build("matmul", "PyTorch's weight-only int4/int8 kernels, which make decoding slower")
    if dll is None or not dll.specdec_matmul_supported():
        return None
    return declare_matmul(dll)


def declare_matmul(dll: ctypes.CDLL) -> ctypes.CDLL:
    """A loaded build of matmul.c with its functions' argument types set, and AMX on where there is AMX (also for
    other builds of it: docs/results' A/B scripts)."""
    ptr, i = ctypes.c_void_p, ctypes.c_int
    dll.specdec_matmul.restype = i
    dll.specdec_matmul.argtypes = [ptr, i, i, i, i, ptr, ptr, ptr, ptr, i, ptr, ctypes.c_float, i, ptr]
    dll.specdec_matmul_heads.restype = i
    dll.specdec_matmul_heads.argtypes = [ptr, i, i, i, i, i, ptr, ptr, ptr, ptr, i]
    dll.specdec_experts.restype = i
    dll.specdec_experts.argtypes = [ptr, i, i, i, ptr, i, i, i, i, ptr, ptr, ptr, i]
    dll.specdec_matmul_amx.restype = i
    dll.specdec_matmul_amx.argtypes = [i]
    dll.specdec_rows_int8.restype = i
    dll.specdec_rows_int8.argtypes = [ptr, ptr, i, i, ptr, i, ptr, i, ctypes.c_float]
    dll.specdec_peak.restype = ctypes.c_double
    dll.specdec_peak.argtypes = [i, ctypes.c_long]
    dll.specdec_matmul_amx(int(os.environ.get("SPECDEC_AMX", "1") != "0"))  # SPECDEC_AMX=0: VNNI only
    return dll


def matmul_isa() -> str | None:
    """The instruction set the matmul kernel was built for on this CPU: "AVX-512 VNNI", "AVX2", or None (not built).
    Both compute the same integer dot products and float operations (matmul.c)."""
    dll = matmul_lib()
    return {2: "AVX-512 VNNI", 1: "AVX2"}.get(dll.specdec_matmul_supported()) if dll is not None else None


PEAK_INSTRUCTIONS = {"AVX-512 VNNI": ("VPDPBUSD zmm", "VFMADD zmm"), "AVX2": ("VPMADDUBSW ymm", "VFMADD ymm")}


def instruction_peaks(seconds: float = 0.05, repeats: int = 3) -> dict | None:
    """The peak rates (multiply-adds per second, every thread at once) of the instruction the quantized matmul
    kernel's integer dot products run on and of f32 FMAs at the same width (matmul.c's specdec_peak: 12 independent
    chains a thread), the best of `repeats` runs of about `seconds` each; None where the kernel is not built. The
    yardstick for the kernels' own rates: a rate near it leaves nothing to gain but fewer multiply-adds."""
    dll, isa = matmul_lib(), matmul_isa()
    if dll is None or isa is None:
        return None
    out = {"isa": isa}
    for which, key in ((0, "int"), (1, "fma")):
        t = time.perf_counter()
        if dll.specdec_peak(which, 20_000) <= 0:  # a first run, timed to size the measured ones
            return None
        iters = max(1, int(20_000 * seconds / max(time.perf_counter() - t, 1e-6)))
        out[f"{key}_macs_s"] = max(dll.specdec_peak(which, iters) for _ in range(repeats))
        out[f"{key}_instruction"] = PEAK_INSTRUCTIONS[isa][which]
    return out


def set_amx(on: bool) -> bool:
    """Use Intel AMX tiles for the quantized matmuls' multi-row passes (on where the CPU, the compiler and the OS
    allow it, unless SPECDEC_AMX=0); returns whether AMX is now used. Rows are bitwise the same either way."""
    dll = matmul_lib()
    return dll is not None and bool(dll.specdec_matmul_amx(int(on)))


@functools.cache
def forward_lib() -> ctypes.CDLL | None:
    """forward.c: a forward's decoder layers in one call (Llama / Gemma 3 dense layers on the kernel plan), or None
    (no compiler, or the matmul / attention kernels missing): the layers are then called one kernel at a time."""
    if matmul_lib() is None or attention_lib() is None:
        return None
    dll = _build("forward", "one call per kernel from Python")
    if dll is None:
        return None
    ptr, i, c_long, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    dll.specdec_layers.restype = i
    dll.specdec_layers.argtypes = [ptr, i, i, ptr, ptr, c_long, i, i, i, i, i, i, f, f, i, ptr, ptr, ptr, ptr, ptr,
                                   ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i, ptr, ptr, ptr,
                                   c_long, ptr, f, ptr]
    dll.specdec_rms_norm.restype = None
    dll.specdec_rms_norm.argtypes = [ptr, i, i, ptr, f, ptr, i]
    dll.fns = [ctypes.cast(fn, ctypes.c_void_p).value for fn in
               (matmul_lib().specdec_matmul, attention_lib().specdec_rope_store, attention_lib().specdec_attend)]
    return dll


LANES, GROUP = 16, 32  # output rows per block, inputs per quantization group (matmul.c)
Q4K, KGROUPS = 20, 8  # matmul.c's format code for int4 codes with Q4_K's scales; groups per Q4_K super-block
Q6K, Q5K, Q5 = 22, 21, 23  # matmul.c's format codes for Q6_K's, Q5_K's and Q5_0's / Q5_1's codes and scales
STACK = 30  # matmul.c's format code for a weight whose blocks of rows are parts in different formats


def matmul_supports(n: int, k: int, device: torch.device) -> bool:
    """Whether an [n, k] weight can run in matmul.c (CPU with the kernel, n a multiple of 16, k of 32)."""
    return device.type == "cpu" and n % LANES == 0 and k % GROUP == 0 and matmul_lib() is not None


PACK_ROWS = 4096  # rows packed at a time: the layout's temporaries stay a few MB (a 262k-row table's were GBs)


def pack_codes4(q: torch.Tensor) -> torch.Tensor:
    """matmul.c's int4 codes from q [N, K] (0..15) -> [N/16, K/32, 4, 64] uint8: instruction 2j in the low nibbles,
    2j + 1 in the high ones. Packed by PACK_ROWS rows into the output."""
    N, G = q.shape[0], q.shape[1] // GROUP
    packed = torch.empty(N // LANES, G, 4, 64, dtype=torch.uint8)
    for a in range(0, N, PACK_ROWS):
        rows = q[a:a + PACK_ROWS].to(torch.uint8)
        codes = rows.reshape(-1, LANES, G, 4, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(-1, G, 4, 2, 64)
        packed[a // LANES:(a + rows.shape[0]) // LANES] = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)
    return packed


def unpack_codes4(codes: torch.Tensor, blk: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Rows (block blk, lane) of pack_codes4's codes (the first 256 bytes of each group of `codes` [N/16, K/32, ...])
    -> [..., K/32, 32] uint8 (0..15)."""
    nb, G = codes.shape[:2]
    c = codes.reshape(nb, G, -1)[..., :256].reshape(nb, G, 4, LANES, 4)[blk, :, :, lane]  # [..., G, 4, 4]
    return torch.stack([c & 15, c >> 4], dim=-2).reshape(*blk.shape, G, GROUP)


def lanes_last(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N/16, ..., 16]: each block of 16 rows' values with the row (the kernel's lane) innermost."""
    return t.reshape(-1, LANES, *t.shape[1:]).movedim(1, -1)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """matmul.c's int4 layout from codes q [N, K] (0..15) and per-group scale, zero [N, K/32] (w = (q - 8) s + z)
    -> (codes (pack_codes4), scales and zeros [N/16, K/32, 16] bf16)."""
    per_block = lambda t: lanes_last(t).to(torch.bfloat16).contiguous()  # noqa: E731
    return pack_codes4(q), per_block(scale), per_block(zero)


def pack_q4k(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """matmul.c's Q4_K scales (format Q4K) from a Q4_K tensor's own: d, dmin [N, K/256] (f16 values), sc, mn
    [N, K/32] (6-bit codes) -> [N/16, K/256, 320] uint8: per block of 16 rows and super-block, f16 d [16] and
    -dmin [16], then sc [8, 16] and mn [8, 16] (group-major, one byte a row)."""
    N, S = d.shape
    nb = N // LANES
    f = torch.stack([d, -dmin], dim=-1).to(torch.float16)  # [N, S, 2], exact: the file's f16 values
    f = lanes_last(f).contiguous().view(torch.uint8).reshape(nb, S, 64)
    c = torch.stack([sc.reshape(N, S, KGROUPS), mn.reshape(N, S, KGROUPS)], dim=2).to(torch.uint8)  # [N, S, 2, 8]
    c = lanes_last(c).reshape(nb, S, 2 * KGROUPS * LANES)
    return torch.cat([f, c], dim=-1).contiguous()


def unpack_q4k(meta: torch.Tensor, blk: torch.Tensor, lane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (block blk, lane) of pack_q4k's scales -> per-group scale d sc and minimum factor -dmin mn [..., K/32]
    f32 (a row's w = q scale + minimum)."""
    nb, S = meta.shape[:2]
    f = meta[..., :64].contiguous().view(torch.float16).reshape(nb, S, 2, LANES)[blk, :, :, lane].float()
    c = meta[..., 64:].reshape(nb, S, 2, KGROUPS, LANES)[blk, :, :, :, lane].float()  # [..., S, 2, 8]
    both = f[..., None] * c
    return both[..., 0, :].flatten(-2), both[..., 1, :].flatten(-2)


def pack_q6k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matmul.c's Q6_K layout (format Q6K) from a Q6_K tensor's own codes q [N, K] (0..63), scales sc [N, K/16]
    (int8) and d [N, K/256] (f16 values) -> (codes [N/16, K/32, 384] uint8: the low nibbles as pack_codes4, then the
    high bit pairs, byte j of vector v holding instruction 4v + k's at bits 2k, 2k + 1; scales [N/16, K/256, 288]
    uint8: per block of 16 rows and super-block, f16 d [16], then sc [8 groups, 2 halves, 16] int8)."""
    N, K = q.shape
    nb, G, S = N // LANES, K // GROUP, d.shape[1]
    codes = torch.empty(nb, G, 384, dtype=torch.uint8)
    for a in range(0, N, PACK_ROWS):
        rows = q[a:a + PACK_ROWS].to(torch.uint8)
        b = rows.shape[0] // LANES
        hi = (rows >> 4).reshape(b, LANES, G, 2, 4, 4).permute(0, 2, 3, 4, 1, 5).reshape(b, G, 2, 4, 64)
        pairs = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
        codes[a // LANES:a // LANES + b] = torch.cat([pack_codes4(rows & 15).reshape(b, G, 256),
                                                      pairs.reshape(b, G, 128)], dim=-1)
    f = lanes_last(d.to(torch.float16)).contiguous().view(torch.uint8)  # [nb, S, 32]
    c = lanes_last(sc.to(torch.int8).reshape(N, S, 2 * KGROUPS)).contiguous().view(torch.uint8)
    return codes, torch.cat([f, c.reshape(nb, S, 2 * KGROUPS * LANES)], dim=-1).contiguous()


def pack_codes5(q: torch.Tensor) -> torch.Tensor:
    """matmul.c's 5-bit codes (formats Q5K, Q5) from q [N, K] (0..31) -> [N/16, K/32, 320] uint8: the low nibbles as
    pack_codes4, then 64 bytes whose byte j holds at bit i the fifth bit of byte j of instruction i."""
    N, K = q.shape
    G = K // GROUP
    codes = torch.empty(N // LANES, G, 320, dtype=torch.uint8)
    for a in range(0, N, PACK_ROWS):
        rows = q[a:a + PACK_ROWS].to(torch.uint8)
        b = rows.shape[0] // LANES
        hi = (rows >> 4).reshape(b, LANES, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(b, G, 8, 64)
        plane = sum(hi[:, :, i] << i for i in range(8))
        codes[a // LANES:a // LANES + b] = torch.cat([pack_codes4(rows & 15).reshape(b, G, 256), plane], dim=-1)
    return codes


def unpack_codes5(codes: torch.Tensor, blk: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Rows (block blk, lane) of pack_codes5's codes -> [..., K/32, 32] uint8 (0..31)."""
    nb, G = codes.shape[:2]
    h = codes[..., 256:].reshape(nb, G, LANES, 4)[blk, :, lane]  # [..., G, 4]
    hi = torch.stack([(h >> i) & 1 for i in range(8)], dim=-2).reshape(*blk.shape, G, GROUP)
    return unpack_codes4(codes, blk, lane) | (hi << 4)


def pack_q5k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """matmul.c's Q5_K layout (format Q5K) from a Q5_K tensor's own codes q [N, K] (0..31) and Q4_K-style scales ->
    (codes as pack_codes5, scales as pack_q4k)."""
    return pack_codes5(q), pack_q4k(d, dmin, sc, mn)


def unpack_q5k(codes: torch.Tensor, scales: torch.Tensor, blk: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Rows (block blk, lane) of pack_q5k's layout -> their weights d sc q - dmin mn [..., K] f32."""
    s, m = unpack_q4k(scales, blk, lane)
    return (unpack_codes5(codes, blk, lane).float() * s[..., None] + m[..., None]).flatten(-2)


def pack_q5(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """matmul.c's Q5_0 / Q5_1 layout (format Q5) from a tensor's own codes q [N, K] (0..31) and factors d, m
    [N, K/32] (f16 values; w = d q + m) -> (codes as pack_codes5, d and m [N/16, K/32, 16] f16; m None where it is
    -16 d throughout: Q5_0, whose kernel pass derives it)."""
    per_block = lambda t: lanes_last(t).to(torch.float16).contiguous()  # noqa: E731
    return pack_codes5(q), per_block(d), None if torch.equal(m, -16 * d) else per_block(m)


def unpack_q5(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, blk: torch.Tensor,
              lane: torch.Tensor) -> torch.Tensor:
    """Rows (block blk, lane) of pack_q5's layout -> their weights d q + m [..., K] f32."""
    d = scales[blk, :, lane].float()  # [..., G]
    m = zeros[blk, :, lane].float() if zeros is not None else -16 * d
    return (unpack_codes5(codes, blk, lane).float() * d[..., None] + m[..., None]).flatten(-2)


def unpack_q6k(codes: torch.Tensor, scales: torch.Tensor, blk: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Rows (block blk, lane) of pack_q6k's layout -> their weights d sc (q - 32) [..., K] f32."""
    nb, G = codes.shape[:2]
    lo = unpack_codes4(codes, blk, lane)
    h = codes[..., 256:].reshape(nb, G, 2, LANES, 4)[blk, :, :, lane]  # [..., G, 2, 4]
    hi = torch.stack([(h >> (2 * k)) & 3 for k in range(4)], dim=-2).reshape(*blk.shape, G, GROUP)
    S = scales.shape[1]
    dd = scales[..., :32].contiguous().view(torch.float16).reshape(nb, S, LANES)[blk, :, lane].float()  # [..., S]
    sc = scales[..., 32:].contiguous().view(torch.int8).reshape(nb, S, 2 * KGROUPS, LANES)[blk, :, :, lane].float()
    s = (dd[..., None] * sc).reshape(*blk.shape, G, 2, 1)  # d sc per half of each group
    q = (lo | (hi << 4)).float().reshape(*blk.shape, G, 2, 16) - 32.0
    return (s * q).reshape(*blk.shape, G * GROUP)


def stack_table(parts: list) -> torch.Tensor:
    """matmul.c's STACK table of quantized linear layers in the kernel's layout (quant._Native), their rows stacked:
    int64 {n, then per part: blocks of 16 rows, bits, codes, scales, zeros (0: none)}. The parts must outlive it."""
    rows = [[p.out_features // LANES, p.bits, p.weight.data_ptr(), p.scales.data_ptr(),
             p.zeros.data_ptr() if getattr(p, "zeros", None) is not None else 0] for p in parts]
    return torch.tensor([len(parts)] + [v for r in rows for v in r], dtype=torch.int64)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """matmul.c's int8 layout from codes q [N, K] (int8, -127..127): q + 128 as [N/16, K/32, 8, 64] uint8 (q + 128
    is q's byte with the top bit flipped). Packed by PACK_ROWS rows into the output."""
    N, K = q.shape
    out = torch.empty(N // LANES, K // GROUP, 8, LANES, 4, dtype=torch.uint8)
    for a in range(0, N, PACK_ROWS):
        rows = q[a:a + PACK_ROWS].contiguous().view(torch.uint8) ^ 0x80
        out[a // LANES:(a + rows.shape[0]) // LANES] = rows.reshape(-1, LANES, K // GROUP, 8, 4).permute(0, 2, 3, 1, 4)
    return out


def matmul(x: torch.Tensor, bits: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
           n: int, norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool | int = False,
           residual: torch.Tensor | None = None, widen: bool = False) -> torch.Tensor:
    """y = x W^T for x [..., K] (f32 or bf16) and a weight [n, K] packed by pack_int4 (bits 4), pack_codes4 with
    pack_q4k's scales (bits Q4K, zeros None) or pack_int8 (bits 8) -> [..., n] in
    x's dtype; fused (see matmul.c): norm (f32 [K]) RMS-normalizes x's rows first, swiglu (True or 1) returns
    silu(first half) * second half [..., n / 2] (2: GELU, tanh approximation, in place of silu), residual [..., n or
    n / 2] is added. widen: float32 out, bitwise what `.float()` of the x-dtype result gives, without that second
    pass (an output head's logits)."""
    k, dtype = x.shape[-1], x.dtype
    if dtype not in DTYPES:
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    n_out = n // 2 if swiglu else n
    wide = widen and x.dtype == torch.bfloat16
    y = torch.empty(*x.shape[:-1], n_out, dtype=torch.float32 if wide else x.dtype)
    if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()):
        residual = residual.to(x.dtype).contiguous()
    rc = matmul_lib().specdec_matmul(x.data_ptr(), x.numel() // k, k, n, bits, codes.data_ptr(), scales.data_ptr(),
                                     zeros.data_ptr() if zeros is not None else None, y.data_ptr(),
                                     WIDEN if wide else DTYPES[x.dtype],
                                     norm.data_ptr() if norm is not None else None, eps, swiglu,
                                     residual.data_ptr() if residual is not None else None)
    if rc != 0:
        raise MemoryError("the matmul kernel ran out of memory") if rc == -1 else ValueError(f"matmul shape {n}x{k}")
    if y.dtype != dtype and not wide:
        y = y.to(dtype)
    return y.float() if widen else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's rows [..., dim] (f32 or bf16) times weight (f32 [dim]), in forward.c: the final norm
    forward.c applies after the layers, for the forwards that run their layers one call at a time."""
    x = x.contiguous()
    out = torch.empty_like(x)
    forward_lib().specdec_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps,
                                   out.data_ptr(), DTYPES[x.dtype])
    return out


def rows_int8(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype,
              mul: float = 1.0) -> torch.Tensor:
    """Rows `ids` [...] of an int8 weight packed by pack_int8 (scales: bf16 [N]) as activations [..., K] in `dtype`
    (f32 or bf16): (q - 128) s, then times mul (an embedding scale), each rounded to dtype as the PyTorch ops
    quant.Int8Linear.rows(ids).to(dtype) * mul round them (matmul.c, specdec_rows_int8)."""
    ids = ids.to(torch.int64).contiguous()
    N, K = codes.shape[0] * LANES, codes.shape[1] * GROUP
    out = torch.empty(*ids.shape, K, dtype=dtype)
    if matmul_lib().specdec_rows_int8(codes.data_ptr(), scales.data_ptr(), N, K, ids.data_ptr(), ids.numel(),
                                      out.data_ptr(), DTYPES[dtype], mul):
        raise IndexError(f"a token id outside the vocabulary (0..{N - 1})")
    return out


def head_pointers(linears: list) -> torch.Tensor:
    """int64 [3, H]: the packed codes, scales and zeros (0: symmetric) of H quantized linear layers of one shape and
    format (quant.Int4Linear / Int8Linear in the kernel's layout), as matmul_heads() takes them (experts() takes
    the transpose, [H, 3]). The layers must outlive the pointers."""
    return torch.tensor([[lin.weight.data_ptr() for lin in linears], [lin.scales.data_ptr() for lin in linears],
                         [lin.zeros.data_ptr() if getattr(lin, "zeros", None) is not None else 0 for lin in linears]],
                        dtype=torch.int64)


def matmul_heads(x: torch.Tensor, bits: int, pointers: torch.Tensor, n: int) -> torch.Tensor:
    """H products at once, y[h] = x[h] W_h^T: x [H, T, K] (f32 or bf16), W_h [n, K] the layers of head_pointers()
    -> [H, T, n] in x's dtype; each head bitwise what matmul() gives for it (see matmul.c)."""
    H, T, k = x.shape
    x = x.contiguous()
    y = torch.empty(H, T, n, dtype=x.dtype)
    p = pointers.data_ptr()
    rc = matmul_lib().specdec_matmul_heads(x.data_ptr(), H, T, k, n, bits, p, p + 8 * H, p + 16 * H, y.data_ptr(),
                                           DTYPES[x.dtype])
    if rc != 0:
        raise MemoryError("the matmul kernel ran out of memory") if rc == -1 else ValueError(f"matmul shape {n}x{k}")
    return y


def experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bits13: int, bits2: int,
            inner: int) -> torch.Tensor:
    """A MoE layer's routed experts in one call (matmul.c's specdec_experts): x [R, D] (f32 or bf16, normed), ids
    [R, k] int64 the chosen experts; w13 / w2: head_pointers()-style int64 tables [E, 3] of every expert's packed
    gate-then-up [2 inner, D] and down [D, inner] layers -> [R, k, D], slot (r, j) the output of expert ids[r, j]
    on row r, bitwise what that expert's own two matmul() calls give for it."""
    R, D = x.shape
    k = ids.shape[1]
    x, ids = x.contiguous(), ids.contiguous()
    out = torch.empty(R, k, D, dtype=x.dtype)
    rc = matmul_lib().specdec_experts(x.data_ptr(), R, D, k, ids.data_ptr(), w13.shape[0], inner, bits13, bits2,
                                      w13.data_ptr(), w2.data_ptr(), out.data_ptr(), DTYPES[x.dtype])
    if rc != 0:
        raise MemoryError("the matmul kernel ran out of memory") if rc == -1 else ValueError("expert shapes or ids")
    return out


@functools.cache
def sample_lib() -> ctypes.CDLL | None:
    """The compiled sampling kernels (sample.c: top-n selection, the sampler of one row), or None: sampling then
    uses torch.topk and the numpy / torch path of sampling.py."""
    dll = _build("sample", "torch.topk and torch ops, which makes sampling slower")
    if dll is None:
        return None
    ptr, c_long = ctypes.c_void_p, ctypes.c_long
    dll.specdec_topk.restype = ctypes.c_int
    dll.specdec_topk.argtypes = [ptr, c_long, c_long, c_long, ctypes.c_int, ptr, ptr]
    dll.specdec_sample.restype = c_long
    dll.specdec_sample.argtypes = [ptr, c_long, ctypes.c_int, ctypes.c_float, ctypes.c_double, ctypes.c_double,
                                   ctypes.c_double, ptr, ptr, ctypes.c_int, ptr]
    return dll


def sample_row(x: torch.Tensor, k: int, temperature: float, top_p: float, min_p: float, u: float,
               want_candidates: bool = False) -> int | tuple[int, torch.Tensor, torch.Tensor] | None:
    """One token drawn by sample.c from the processed distribution of one row of logits x [V] (CPU float32,
    contiguous) with the uniform u: inverse CDF over the ranked survivors of top-k / top-p / min-p (see
    specdec_sample). None when the kernel is not built or the row needs sampling.py's general path (no finite
    value). want_candidates: (token, kept ids [m], their probabilities [m], float64) instead, for tests."""
    lib = sample_lib() if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() else None
    if lib is None:
        return None
    V = x.shape[-1]
    ids = probs = None
    n = ctypes.c_int(0)
    if want_candidates:
        ids, probs = torch.empty(V, dtype=torch.long), torch.empty(V, dtype=torch.float64)
    tok = lib.specdec_sample(x.data_ptr(), V, k, max(temperature, 1e-5), top_p, min_p, u,
                             ids.data_ptr() if ids is not None else None,
                             probs.data_ptr() if probs is not None else None, V, ctypes.byref(n))
    if tok == -2:
        raise MemoryError("the sampling kernel ran out of memory")
    if tok < 0:
        return None
    if want_candidates:
        return tok, ids[:n.value], probs[:n.value]
    return tok


def topk(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of each row of x [R, V] and their indices, sorted descending (like torch.topk; equal
    values in no particular order), in one pass of sample.c on CPU float32 (~25x faster than torch.topk for a
    49152-wide row here), else torch.topk."""
    lib = sample_lib() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if lib is None or not 1 <= n <= x.shape[1]:
        return torch.topk(x, n, dim=-1)
    if x.stride(1) != 1:
        x = x.contiguous()
    vals = torch.empty(x.shape[0], n)
    ids = torch.empty(x.shape[0], n, dtype=torch.long)
    if lib.specdec_topk(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), n, vals.data_ptr(), ids.data_ptr()):
        raise MemoryError("the top-k kernel ran out of memory")
    return vals, ids
