"""Time kernels.attend alone at SmolLM2's shapes (9 query heads, 3 KV heads, D = 64, bf16 storage): one chain of T
rows after S cached slots, or B sequences of one row each; median microseconds per layer of 200 calls, and the
attention FLOP rate (4 H D flops per key). Run it on two checkouts alternately to compare kernel builds:

    python docs/results/attention_bench.py
    cd /tmp/old && PYTHONPATH=/tmp/old python /tmp/old/docs/results/attention_bench.py
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec import kernels

H, HKV, D = 9, 3, 64


def bench(S: int, T: int, B: int, n: int = 200) -> tuple[float, float]:
    slots = B * (S + T) + 64
    kv = torch.randn(1, slots, HKV, D).to(torch.bfloat16)
    kt = torch.randn(HKV, -(-slots // 32), D, 32).to(torch.bfloat16)
    if B == 1:
        rows = [(0, S, list(range(S, S + t + 1))) for t in range(T)]
    else:
        rows = [(b * (S + T), S, [b * (S + T) + S]) for b in range(B)]
    spans, tails = kernels.row_spans(rows, None)
    qkv = torch.randn(1, len(rows), H + 2 * HKV, D).to(torch.bfloat16)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        kernels.attend(qkv, kv, kt, H, HKV, spans, tails, D ** -0.5)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    keys = sum(S + len(r[2]) for r in rows)
    return med, 4 * H * D * keys / med / 1e9


def main() -> None:
    for S in (64, 256, 700):
        for T, B in ((1, 1), (4, 1), (8, 1), (1, 8)):
            med, rate = bench(S, T, B)
            print(f"S {S} T {T} B {B}: {med * 1e6:.1f} us/layer, x30 layers {med * 30e3:.2f} ms, {rate:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
