"""Interleaved A/B of attention.c builds inside whole SmolLM2 forwards: the same process, the same model and cache;
forward.c is handed each build's specdec_attend / specdec_rope_store in turn, call by call, so the host's drift
(~1.5x within minutes here) hits every build alike. Medians of 40 forwards over T new tokens after CTX cached, exact
(verification) plan, and with --batch B, of a batched decode step: B sequences of CTX cached tokens, one row each:

    python docs/results/forward_attn_ab.py CTX NAME=FILE.c[:-DFLAG ...] [NAME=FILE.c ...] [--chains 1,2,4,8,9]
        [--batch 8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from attention_bench import build  # docs/results/, the folder of this script

from specdec import kernels
from specdec.loader import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ctx", type=int)
    ap.add_argument("builds", nargs="+", help="NAME=FILE.c[:-DFLAG ...]")
    ap.add_argument("--chains", default="1,2,4,8,9", help="chain lengths T")
    ap.add_argument("--batch", default="", help="batch sizes B (default: none)")
    a = ap.parse_args()
    ctx = a.ctx
    tmp = Path(tempfile.mkdtemp())
    builds = {}
    for arg in a.builds:
        name, _, src = arg.partition("=")
        if not name or not Path(src.partition(":")[0]).is_file():
            ap.error(f"{arg!r}: expected NAME=FILE.c[:-DFLAG ...] with an existing FILE.c")
        lib = build(src, tmp / f"{name}.so")
        builds[name] = [ctypes.cast(f, ctypes.c_void_p).value for f in (lib.specdec_rope_store, lib.specdec_attend)]
        builds[name].append(lib)  # keep it loaded
    fwd = kernels.forward_lib()
    torch.manual_seed(0)
    model = load(None, ctx=2048).model
    batches = [int(b) for b in a.batch.split(",") if b]
    n_seq = max([1, *batches])
    pool = model.new_pool(n_seq, ctx + 32)
    seqs = [pool.acquire() for _ in range(n_seq)]
    tokens = torch.randint(0, 40000, (n_seq, ctx + 16))
    for b, c in enumerate(seqs):
        model.prefill(tokens[b, :ctx].tolist(), c)
    cache = seqs[0]
    cases = [("T", int(t)) for t in a.chains.split(",") if t] + [("B", b) for b in batches]
    with torch.inference_mode():
        for kind, n in cases:
            times: dict[str, list[float]] = {k: [] for k in builds}
            for _ in range(40):
                for name, (rope, attend, _) in builds.items():
                    fwd.fns[1], fwd.fns[2] = rope, attend
                    t = time.perf_counter()
                    if kind == "T":
                        model(tokens[:1, ctx:ctx + n], torch.arange(ctx, ctx + n), cache, exact=True)
                    else:
                        model.forward_batch([(c, [int(tokens[b, ctx])], [ctx], None) for b, c in enumerate(seqs[:n])])
                    times[name].append(time.perf_counter() - t)
                    for c in seqs:
                        c.rollback(ctx)
            med = {k: statistics.median(v) for k, v in times.items()}
            base = next(iter(med.values()))
            print(f"ctx {ctx} {kind}={n}: " + "  ".join(f"{k} {m * 1e3:.2f} ms ({base / m:.2f}x)"
                                                       for k, m in med.items()), flush=True)


if __name__ == "__main__":
    main()
