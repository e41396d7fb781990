"""Interleaved A/B of attention.c builds inside whole SmolLM2 forwards: the same process, the same model and cache;
forward.c is handed each build's specdec_attend / specdec_rope_store in turn, call by call, so the host's drift
(~1.5x within minutes here) hits every build alike. Medians of N forwards over T new tokens after CTX cached, exact
(verification) plan:

    python docs/results/forward_attn_ab.py CTX NAME=FILE.c [NAME=FILE.c ...]
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from attention_bench import build  # docs/results/, the folder of this script

from specdec import kernels
from specdec.loader import load


def main() -> None:
    ctx = int(sys.argv[1])
    tmp = Path(tempfile.mkdtemp())
    builds = {}
    for arg in sys.argv[2:]:
        name, src = arg.split("=", 1)
        lib = build(src, tmp / f"{name}.so")
        builds[name] = [ctypes.cast(f, ctypes.c_void_p).value for f in (lib.specdec_rope_store, lib.specdec_attend)]
        builds[name].append(lib)  # keep it loaded
    fwd = kernels.forward_lib()
    torch.manual_seed(0)
    model = load(None, ctx=2048).model
    cache = model.new_cache()
    tokens = torch.randint(0, 40000, (1, ctx + 16))
    model.prefill(tokens[0, :ctx].tolist(), cache)
    with torch.inference_mode():
        for T in (1, 2, 4, 8, 9):
            times: dict[str, list[float]] = {n: [] for n in builds}
            for _ in range(40):
                for name, (rope, attend, _) in builds.items():
                    fwd.fns[1], fwd.fns[2] = rope, attend
                    t = time.perf_counter()
                    model(tokens[:, ctx:ctx + T], torch.arange(ctx, ctx + T), cache, exact=True)
                    times[name].append(time.perf_counter() - t)
                    cache.rollback(ctx)
            med = {n: statistics.median(v) for n, v in times.items()}
            base = next(iter(med.values()))
            print(f"ctx {ctx} T={T}: " + "  ".join(f"{n} {m * 1e3:.2f} ms ({base / m:.2f}x)" for n, m in med.items()),
                  flush=True)


if __name__ == "__main__":
    main()
