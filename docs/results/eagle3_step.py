"""What EAGLE-3 heads add to a decode step on the default model, interleaved in one process (medians):
the target forward with and without the aux features the head reads (forward.c copies them out), and one step of
the draft layer with attention.c (its cache's keys in tiles) against PyTorch's SDPA.

    python docs/results/eagle3_step.py --json docs/results/eagle3-step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from specdec.cache import KVCache
    from specdec.loader import load
    from specdec.models.transformer import cache_shape
    from specdec.spec import resolve_mtp

    t = load(None)
    m = t.model
    (mod,) = resolve_mtp(t)[1]
    aux = m.aux_layers
    cache = m.new_cache(1024)
    m(torch.randint(0, 1000, (1, 100)), torch.arange(100), cache)
    tok, pos = torch.tensor([[7]]), torch.tensor([100])
    mcache = mod.new_cache(1024)
    mod(torch.randn(1, 100, mod.in_dim).to(mod.dtype), torch.randint(0, 1000, (1, 100)), torch.arange(100), mcache)
    scache = KVCache(1, *cache_shape(mod.args), 1024, mod.dtype, mod.device)  # no key tiles: the SDPA plans
    mod(torch.randn(1, 100, mod.in_dim).to(mod.dtype), torch.randint(0, 1000, (1, 100)), torch.arange(100), scache)
    g = torch.randn(1, 1, m.args.dim).to(mod.dtype)
    arms = {"forward, no features": lambda: setattr(m, "aux_layers", ()),
            "forward, EAGLE-3 features": lambda: setattr(m, "aux_layers", aux),
            "draft layer step, attention.c": lambda: None, "draft layer step, SDPA": lambda: None}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.reps * len(arms)):
        name = list(arms)[r % len(arms)]
        arms[name]()
        t0 = time.perf_counter()
        if name.startswith("forward"):
            m(tok, pos, cache, exact=True)
            cache.rollback(100)
        else:
            c = mcache if name.endswith("attention.c") else scache
            mod(g, tok, pos, c, last_only=True)
            c.rollback(100)
        times[name].append(time.perf_counter() - t0)
        if r and r % (a.reps // 4 * len(arms)) == 0:
            print(f"{r // len(arms)}/{a.reps}", file=sys.stderr)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k, v in med.items():
        print(f"| {k} | {v:.3f} ms |")
    print(f"\nfeatures cost {med['forward, EAGLE-3 features'] - med['forward, no features']:.3f} ms a forward; the "
          f"draft layer on attention.c saves {med['draft layer step, SDPA'] - med['draft layer step, attention.c']:.3f}"
          f" ms a step; draft module weights {mod.weight_bytes / 1e6:.1f} MB")
    if a.json:
        Path(a.json).write_text(json.dumps({"reps": a.reps, "median_ms": med, "module_bytes": mod.weight_bytes},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
