"""A batched decode step with the KV pool in 4 KB pages (cache.lazy_zeros) against the same pool in 2 MB
(transparent huge) pages (its mapping advised MADV_HUGEPAGE here), alternated step by step in one process, both
pools prefilled with the same tokens; medians, and whether the logits are bitwise the same:

    python docs/results/kv_thp_ab.py CTX BATCH [N]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import specdec.cache as cache  # noqa: E402
from specdec.loader import load  # noqa: E402


def main() -> None:
    ctx, batch = int(sys.argv[1]), int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    torch.manual_seed(0)
    model = load(None, ctx=2048).model
    tokens = torch.randint(0, 40000, (batch, ctx + 1))
    pools = {}
    real = cache.anonymous_memory
    for name, huge in (("4 KB", False), ("2 MB", True)):
        cache.anonymous_memory = lambda size, huge=huge, **_: real(size, huge)
        pool = model.new_pool(batch, ctx + 80)
        seqs = [pool.acquire() for _ in range(batch)]
        for b, c in enumerate(seqs):
            model.prefill(tokens[b, :ctx].tolist(), c)
        pools[name] = seqs
    cache.anonymous_memory = real
    times: dict[str, list[float]] = {k: [] for k in pools}
    logits = {}
    with torch.inference_mode():
        for _ in range(n):
            for name, seqs in pools.items():
                t = time.perf_counter()
                logits[name], _ = model.forward_batch([(c, [int(tokens[b, ctx])], [ctx], None)
                                                       for b, c in enumerate(seqs)])
                times[name].append(time.perf_counter() - t)
                for c in seqs:
                    c.rollback(ctx)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ctx {ctx} batch {batch}: " + "  ".join(f"{k} pages {v * 1e3:.2f} ms" for k, v in med.items())
          + f"   2 MB / 4 KB speedup {med['4 KB'] / med['2 MB']:.3f}x, logits bitwise the same: "
          + str(torch.equal(*logits.values())))


if __name__ == "__main__":
    main()
