"""A forward over T = 1 and T = 8 rows (the exact verification plan) against the number of cached tokens, one
process, the contexts interleaved, medians of 25: how much of a verification's cost at Spec-Bench rag / summarization
contexts (~800-1500 tokens) is attention.

    python docs/results/ctx_curve.py [GGUF]   (docs/results/attention-ctx-1204.txt)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec.loader import load

CTXS, TS = (64, 400, 800, 1500), (1, 8)


def main() -> None:
    torch.set_num_threads(2)
    m = load(sys.argv[1] if len(sys.argv) > 1 else None).model
    pool = m.new_pool(len(CTXS), max(CTXS) + 64)
    caches = {}
    times: dict[tuple[int, int], list[float]] = {(n, t): [] for n in CTXS for t in TS}
    with torch.inference_mode():
        for n in CTXS:
            caches[n] = c = pool.acquire()
            m.prefill(list(range(100, 100 + n)), c)
        for _ in range(25):
            for n in CTXS:
                for t_rows in TS:
                    c = caches[n]
                    t = time.perf_counter()
                    m(torch.tensor([[5] * t_rows]), torch.arange(n, n + t_rows), c, exact=True)
                    times[(n, t_rows)].append(time.perf_counter() - t)
                    c.rollback(n)
    for n in CTXS:
        cells = "  ".join(f"T={t} {statistics.median(times[(n, t)]) * 1e3:.2f} ms" for t in TS)
        print(f"ctx {n}: {cells}")


if __name__ == "__main__":
    main()
