"""kernels' attention alone at SmolLM2's shapes (9 query heads, 3 KV heads, D = 64, bf16 storage), several builds of
attention.c interleaved call by call in one process (the host drifts ~1.5x within minutes: only same-run ratios
count): one chain of T rows after S cached slots, or B sequences of one row each; medians of 300 calls per build.
With --layers N, each call runs N layers' caches in turn (a forward's pattern: each layer's cache cold, as after the
matmuls stream the weights) and the time is per layer; the builds' outputs are compared bitwise (same=True/False).

    python docs/results/attention_bench.py NAME=FILE.c[:-DFLAG ...] [NAME=FILE.c ...]
    python docs/results/attention_bench.py old=/tmp/old/specdec/kernels/attention.c new=specdec/kernels/attention.c
    python docs/results/attention_bench.py --layers 30 --cases 1500:1:1,1500:8:1,700:1:8 old=... new=...
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec import kernels

H, HKV, D = 9, 3, 64
CASES = ((64, 1, 1), (700, 1, 1), (64, 8, 1), (256, 8, 1), (700, 4, 1), (700, 8, 1), (64, 1, 8), (700, 1, 8))


def build(spec: str, out: Path) -> ctypes.CDLL:
    src, _, flags = spec.partition(":")
    subprocess.run(["gcc", "-w", *kernels.FLAGS, *flags.split(), "-o", str(out), src], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(out))


def case(S: int, T: int, B: int) -> tuple[tuple, list[torch.Tensor]]:
    """specdec_attend's arguments for one case, and the tensors they point into."""
    slots = -(-(B * (S + T) + 64) // 32) * 32
    kv = torch.randn(1, HKV, slots, D).to(torch.bfloat16)  # values head by head, as KVPool.values
    kt = torch.randn(HKV, slots // 32, D, 32).to(torch.bfloat16)
    if B == 1:
        rows = [(0, S, list(range(S, S + t + 1))) for t in range(T)]
    else:
        rows = [(b * (S + T), S, [b * (S + T) + S]) for b in range(B)]
    spans, tails = kernels.row_spans(rows, None)
    n = len(rows)
    qkv = torch.randn(1, n, H + 2 * HKV, D).to(torch.bfloat16)
    out = torch.empty(1, n, H * D, dtype=torch.bfloat16)
    p, vp = spans.data_ptr(), ctypes.c_void_p
    args = (vp(qkv.data_ptr()), ctypes.c_long(qkv.shape[2] * D), vp(kv.data_ptr()), vp(kt.data_ptr()),
            ctypes.c_long(kt.shape[1]), H, HKV, D, n, vp(p), vp(p + 8 * n), vp(tails.data_ptr()), vp(p + 16 * n),
            ctypes.c_float(D ** -0.5), vp(out.data_ptr()), 1)
    return args, [qkv, kv, kt, spans, tails, out]


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """--cases "S:T:B,..." -> [(S, T, B), ...] (an argparse type: a bad value is a one-line usage error)."""
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S:T:B,... with integers, not {text!r}") from None
    if any(len(c) != 3 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"expected S:T:B,... with S, T, B >= 1, not {text!r}")
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=FILE.c[:-DFLAG ...]")
    ap.add_argument("--layers", type=int, default=1, help="caches of this many layers called in turn")
    ap.add_argument("--cases", default=None, type=parse_cases, help="S:T:B,... (default: the shapes above)")
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    cases = a.cases or CASES
    tmp = Path(tempfile.mkdtemp())
    libs = {}
    for arg in a.builds:
        name, spec = arg.split("=", 1)
        libs[name] = build(spec, tmp / f"{name}.so")
    for S, T, B in cases:
        layers = [case(S, T, B) for _ in range(a.layers)]
        outs = {n: torch.empty_like(layers[0][1][-1]) for n in libs}
        times: dict[str, list[float]] = {n: [] for n in libs}
        same = True
        for _ in range(a.calls // a.layers or 1):
            for name, lib in libs.items():
                t = time.perf_counter()
                for args, _keep in layers:
                    lib.specdec_attend(*args)
                times[name].append((time.perf_counter() - t) / a.layers)
                outs[name].copy_(layers[-1][1][-1])
            first = next(iter(outs.values()))
            same = same and all(torch.equal(o, first) for o in outs.values())
        med = {n: statistics.median(v) for n, v in times.items()}
        base = next(iter(med.values()))
        flop = 4 * H * D * (B * S + (T * (T + 1) // 2 if B == 1 else B) + (S * (T - 1) if B == 1 else 0))
        print(f"S {S} T {T} B {B}{f' same={same}' if len(libs) > 1 else ''}: " + "  ".join(
            f"{n} {m * 1e6:.1f} us ({base / m:.2f}x, {flop / m / 1e9:.0f} GFLOP/s)" for n, m in med.items()),
            flush=True)


if __name__ == "__main__":
    main()
