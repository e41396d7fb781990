"""Interleaved A/B of matmul.c builds inside whole forwards: the same process, model and caches; each build's
specdec_matmul is handed to forward.c (the layers) and to the Python side (the output head) in turn, call by call,
so the host's drift hits every build alike. Medians of 30 forwards: a chain of T new tokens after CTX cached (the
verification plan; v(T) = its time over T = 1's), and B sequences of one new token each (a batched decode step):

    python docs/results/forward_mm_ab.py CTX NAME=FILE.c[:DEFINE,...] ... [--model GGUF] [--chains 1,4,8] [--batch 8]
        [--n 30]

e.g. `old=/tmp/old.c new=specdec/kernels/matmul.c:VNNI_ROWS4=6` (a define: a compile-time setting of matmul.c).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from matmul_ab import build  # docs/results/, the folder of this script

from specdec import kernels
from specdec.loader import load


def ab_parser(doc: str, chains: str = "1,4,8", batch: str = "8", n: int = 30,
              builds: str = "NAME=FILE.c[:DEFINE,...]") -> argparse.ArgumentParser:
    """The command line of the forward A/B scripts (this one, forward_c_ab.py, forward_attn_ab.py): CTX, the builds,
    --model, --chains, --batch and --n, with each script's defaults."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("ctx", type=int)
    ap.add_argument("builds", nargs="+", help=builds)
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--chains", default=chains, help="chain lengths T")
    ap.add_argument("--batch", default=batch, help="batch sizes B ('' for none)")
    ap.add_argument("--n", type=int, default=n, help=f"forwards per build and case (default {n})")
    return ap


def main() -> None:
    a = ab_parser(__doc__).parse_args()
    ctx = a.ctx
    tmp = Path(tempfile.mkdtemp())
    builds = {}
    for arg in a.builds:
        name, spec = arg.split("=", 1)
        src, _, defs = spec.partition(":")
        builds[name] = build(Path(src), tmp / f"{name}.so", tuple(d for d in defs.split(",") if d))
    fwd = kernels.forward_lib()

    def use(lib: ctypes.CDLL) -> None:
        fwd.fns[0] = ctypes.cast(lib.specdec_matmul, ctypes.c_void_p).value
        kernels.matmul_lib = lambda: lib

    compare(a.model, ctx, a.chains, a.batch, {name: (lambda lib=lib: use(lib)) for name, lib in builds.items()}, a.n)


def compare(model_path: str | None, ctx: int, chains: str, batch: str, builds: dict, n: int = 30) -> None:
    """Time whole forwards of the model, each build put in place by its callable builds[NAME]() just before its
    forward, interleaved forward by forward; print the medians of n per case (chains "1,4", batch sizes "8")."""
    torch.manual_seed(0)
    model = load(model_path, ctx=2048).model
    tokens = torch.randint(0, 40000, (8, ctx + 64))
    pool = model.new_pool(8, ctx + 80)
    seqs = [pool.acquire() for _ in range(8)]
    for b, c in enumerate(seqs):
        model.prefill(tokens[b, :ctx].tolist(), c)
    cache = seqs[0]
    cases = [("chain", int(T)) for T in chains.split(",") if T] + [("batch", int(B)) for B in batch.split(",") if B]
    one: dict[str, float] = {}
    with torch.inference_mode():
        for kind, n_rows in cases:
            times: dict[str, list[float]] = {k: [] for k in builds}
            for _ in range(n):
                for name, put in builds.items():
                    put()
                    t = time.perf_counter()
                    if kind == "chain":
                        model(tokens[:1, ctx:ctx + n_rows], torch.arange(ctx, ctx + n_rows), cache, exact=True)
                    else:
                        model.forward_batch([(c, [int(tokens[b, ctx])], [ctx], None)
                                             for b, c in enumerate(seqs[:n_rows])])
                    times[name].append(time.perf_counter() - t)
                    for c in seqs:
                        c.rollback(ctx)
            med = {k: statistics.median(v) for k, v in times.items()}
            base = next(iter(med.values()))
            if kind == "chain" and n_rows == 1:
                one = med
            vt = "  ".join(f"v {m / one[k]:.2f}" for k, m in med.items()) if kind == "chain" and one else ""
            print(f"ctx {ctx} {kind} {n_rows}: " + "  ".join(f"{k} {m * 1e3:.2f} ms ({base / m:.2f}x)"
                                                            for k, m in med.items()) + (f"   {vt}" if vt else ""),
                  flush=True)

if __name__ == "__main__":
    main()
