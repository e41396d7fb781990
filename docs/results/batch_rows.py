"""The cost of a batched forward against its number of rows: 8 sequences with CTX cached tokens each, one pending
row apiece plus 0..24 draft rows spread over them (engine.Engine's step shape), against one sequence's chain of T
rows; medians of 15 forwards per shape, interleaved. What engine.attribute's marginal cost rests on.

    python docs/results/batch_rows.py [GGUF] [--ctx 200]   (docs/results/batch-rows-1204.txt)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.loader import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--ctx", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(2)
    m = load(a.model).model
    pool = m.new_pool(8, a.ctx + 64)
    caches = [pool.acquire() for _ in range(8)]
    with torch.inference_mode():
        for i, c in enumerate(caches):
            m.prefill(list(range(100 + i, 100 + i + a.ctx)), c)

        def batch(extra: int) -> float:
            items = []
            for i, c in enumerate(caches):
                k = extra // 8 + (1 if i < extra % 8 else 0)
                items.append((c, [5] * (1 + k), list(range(c.length, c.length + 1 + k)), None))
            t = time.perf_counter()
            m.forward_batch(items)
            dt = time.perf_counter() - t
            for c in caches:
                c.rollback(a.ctx)
            return dt

        def chain(t_rows: int) -> float:
            c = caches[0]
            t = time.perf_counter()
            m(torch.tensor([[5] * t_rows]), torch.arange(c.length, c.length + t_rows), c, exact=True)
            dt = time.perf_counter() - t
            c.rollback(a.ctx)
            return dt

        shapes = [("batch", e) for e in (0, 1, 2, 4, 8, 16, 24)] + [("chain", t) for t in (1, 2, 4, 8)]
        times: dict = {s: [] for s in shapes}
        for _ in range(15):
            for kind, v in shapes:
                times[(kind, v)].append(batch(v) if kind == "batch" else chain(v))
    for kind, v in shapes:
        label = f"8 sequences, {8 + v} rows" if kind == "batch" else f"1 sequence, chain of {v}"
        print(f"{label}: {statistics.median(times[(kind, v)]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
