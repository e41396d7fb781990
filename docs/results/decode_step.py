"""Time one decode step (an exact target forward over 1 token after 64 cached), median of N, for prefetch and kernel
comparisons at real sizes; run it with CC set to a wrapper that adds -D flags to compare kernel builds:

    python docs/results/decode_step.py FILE [N]
    CC=/tmp/cc-prefetch-1024.sh python docs/results/decode_step.py FILE 16   # exec gcc -DPREFETCH=1024 "$@"
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec.loader import load


def main() -> None:
    model = load(sys.argv[1], ctx=512).model
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    cache = model.new_cache()
    tokens = torch.randint(0, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    model.prefill(tokens[0].tolist(), cache)
    times = []
    with torch.inference_mode():
        for _ in range(n):
            start = time.perf_counter()
            model(tokens[:, :1], torch.tensor([64]), cache, exact=True)
            times.append(time.perf_counter() - start)
            cache.rollback(64)
    print(f"T=1 median ms {statistics.median(times) * 1e3:.2f}")


if __name__ == "__main__":
    main()
