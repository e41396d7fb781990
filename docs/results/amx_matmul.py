"""The quantized matmul kernel's AMX path against its VNNI path (matmul.c, specdec_matmul_amx), same process:
median microseconds of one call per T (rows), each cell "VNNI/AMX", bf16 activations, 2 threads, cache-resident
weights where they fit. `python docs/results/amx_matmul.py` (docs/results/amx-matmul.txt)."""

from __future__ import annotations

import statistics
import time

import torch

from specdec import kernels
from specdec.quant import Int4Linear, Int8Linear

SHAPES = [(Int4Linear, 3072, 576), (Int4Linear, 576, 1536), (Int8Linear, 3072, 576), (Int4Linear, 49152, 576),
          (Int4Linear, 4096, 4096)]


def per_call_us(f, n: int = 20) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    if not kernels.set_amx(True):
        raise SystemExit("no AMX here (CPU, compiler or OS)")
    for cls, n, k in SHAPES:
        lin = cls(torch.randn(n, k) * 0.05, None)
        row = []
        for T in (8, 15, 16, 17, 32, 64, 512):
            x = torch.randn(T, k).bfloat16()
            us = {}
            for on in (False, True):
                kernels.set_amx(on)
                us[on] = per_call_us(lambda x=x, lin=lin: lin(x))
            row.append(f"T={T}: {us[False]:.0f}/{us[True]:.0f}us")
        print(cls.__name__, n, k, " ".join(row), flush=True)
    kernels.set_amx(True)


if __name__ == "__main__":
    main()
