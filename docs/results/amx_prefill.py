"""Prefill of 512 random tokens (one chunk), the matmul kernel's AMX path off and on alternately, median of 5 after
a warm-up: `python docs/results/amx_prefill.py [MODEL.gguf]` (docs/results/amx-matmul.txt)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdec import kernels
from specdec.loader import default_model_path, load


def main() -> None:
    torch.set_num_threads(2)
    model = load(sys.argv[1] if len(sys.argv) > 1 else default_model_path(), ctx=2048).model
    tokens = torch.randint(100, 20000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(6):
        for on in (False, True):
            kernels.set_amx(on)
            cache = model.new_cache()
            t = time.perf_counter()
            model.prefill(tokens, cache, 512)
            seconds[on].append(time.perf_counter() - t)
    for on in (False, True):
        print("amx" if on else "vnni", f"prefill 512 tokens: median {1e3 * statistics.median(seconds[on][1:]):.1f} ms")
    kernels.set_amx(True)


if __name__ == "__main__":
    main()
