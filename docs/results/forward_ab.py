"""Time one target forward over T new tokens after `context` cached tokens, exactly as verification runs it
(exact=True), medians of 40, for T = 1, 2, 3, 4, 8, 9. Run it alternately on two checkouts to compare them in one
session (the machine's speed drifts between sessions):

    python docs/results/forward_ab.py 700                       # this checkout
    PYTHONPATH=/tmp/old python docs/results/forward_ab.py 700   # another one (git worktree add /tmp/old COMMIT)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec.loader import load


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 700
    torch.manual_seed(0)
    model = load(None, ctx=1024).model
    cache = model.new_cache()
    tokens = torch.randint(0, 40000, (1, ctx))
    model.prefill(tokens[0].tolist(), cache)
    ts = (1, 2, 3, 4, 8, 9)
    times: dict[int, list[float]] = {t: [] for t in ts}
    with torch.inference_mode():
        for _ in range(40):
            for t in ts:
                start = time.perf_counter()
                model(tokens[:, :t], torch.arange(ctx, ctx + t), cache, exact=True)
                times[t].append(time.perf_counter() - start)
                cache.rollback(ctx)
    base = statistics.median(times[1])
    print(" ".join(f"T={t} {statistics.median(times[t]) * 1e3:.2f}ms x{statistics.median(times[t]) / base:.2f}"
                   for t in ts))


if __name__ == "__main__":
    main()
