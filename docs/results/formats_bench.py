"""One 4096 x 14336 matrix (Llama-3.1-8B's ffn_down) in each weight format matmul.c takes for K-quant files,
random codes, timed alternately at T = 1, 2, 4, 8, 9 rows (medians of 25): Q6_K kept as it is (q6k), requantized
to int8, Q4_K with its own scales (q4k), Q5_K (q5k) and Q5_0 (q5) kept as they are; GB/s = the format's bytes over
the time. `CC=<a gcc wrapper adding -march=znver2> python docs/results/formats_bench.py` times the AVX2 path.

    python docs/results/formats_bench.py
"""

from __future__ import annotations

import statistics
import time

import gguf
import numpy as np
import torch

from specdec.quant import Int4Linear, Int6Linear, Int8Linear
from specdec.weights.gguf import int4_codes, q5_codes, q6_codes, q501_codes


def main() -> None:
    n, k = 4096, 14336
    g = np.random.default_rng(0)
    d6 = g.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    d6[..., 208:210] = (np.abs(g.standard_normal((n, k // 256, 1))) * 0.001).astype(np.float16).view(np.uint8)
    d4 = g.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    d4[..., 0:4] = (np.abs(g.standard_normal((n, k // 256, 2))) * 0.002).astype(np.float16).view(np.uint8)
    d5 = g.integers(0, 256, (n, k // 256, 176), dtype=np.uint8)
    d5[..., 0:4] = (np.abs(g.standard_normal((n, k // 256, 2))) * 0.002).astype(np.float16).view(np.uint8)
    d50 = g.integers(0, 256, (n, k // 32, 22), dtype=np.uint8)
    d50[..., 0:2] = (np.abs(g.standard_normal((n, k // 32, 1))) * 0.002).astype(np.float16).view(np.uint8)
    layers = {"q6k": Int6Linear(q6_codes(d6.reshape(n, -1)), None), "int8": Int8Linear(torch.randn(n, k) * 0.02, None),
              "q4k": Int4Linear.from_codes(int4_codes(d4.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K), None),
              "q5k": Int6Linear(q5_codes(d5.reshape(n, -1)), None),
              "q5": Int6Linear(q501_codes(d50.reshape(n, -1), gguf.GGMLQuantizationType.Q5_0), None)}
    nbytes = {name: sum(t.numel() * t.element_size() for t in lin.tensors()) for name, lin in layers.items()}
    for T in (1, 2, 4, 8, 9):
        x = torch.randn(T, k).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(25):
            for name, lin in layers.items():
                t = time.perf_counter()
                lin(x)
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"T {T}: " + "  ".join(f"{name} {m * 1e3:.2f} ms ({nbytes[name] / m / 1e9:.1f} GB/s)"
                                     for name, m in med.items()), flush=True)


if __name__ == "__main__":
    main()
