"""Interleaved A/B of forward.c builds inside whole forwards (what forward_mm_ab.py does for matmul.c): the same
process, model and caches; each build's specdec_layers is handed to the model in turn, forward by forward, so the
host's drift hits every build alike. Medians of --n forwards: a chain of T new tokens after CTX cached, and B
sequences of one new token each (a batched decode step):

    python docs/results/forward_c_ab.py CTX NAME=FILE.c[:DEFINE,...] ... [--model GGUF] [--chains 1] [--batch 8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec import kernels
from specdec.loader import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ctx", type=int)
    ap.add_argument("builds", nargs="+", help="NAME=FILE.c[:DEFINE,...]")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--chains", default="1", help="chain lengths T")
    ap.add_argument("--batch", default="8", help="batch sizes B ('' for none)")
    ap.add_argument("--n", type=int, default=30, help="forwards per build and case (default 30)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ref = kernels.forward_lib()
    libs = {}
    for arg in a.builds:
        name, spec = arg.split("=", 1)
        src, _, defs = spec.partition(":")
        out = tmp / f"{name}.so"
        subprocess.run(["cc", *kernels.FLAGS, *(f"-D{d}" for d in defs.split(",") if d), "-o", str(out), src],
                       check=True)
        dll = ctypes.CDLL(str(out))
        dll.specdec_layers.restype = ref.specdec_layers.restype
        dll.specdec_layers.argtypes = ref.specdec_layers.argtypes
        dll.specdec_rms_norm.restype = None
        dll.specdec_rms_norm.argtypes = ref.specdec_rms_norm.argtypes
        dll.fns = ref.fns
        libs[name] = dll
    torch.manual_seed(0)
    model = load(a.model, ctx=2048).model
    ctx = a.ctx
    tokens = torch.randint(0, 40000, (8, ctx + 64))
    pool = model.new_pool(8, ctx + 80)
    seqs = [pool.acquire() for _ in range(8)]
    for b, c in enumerate(seqs):
        model.prefill(tokens[b, :ctx].tolist(), c)
    cases = [("chain", int(T)) for T in a.chains.split(",") if T] + [("batch", int(B)) for B in a.batch.split(",") if B]
    with torch.inference_mode():
        for kind, n in cases:
            times: dict[str, list[float]] = {k: [] for k in libs}
            for _ in range(a.n):
                for name, lib in libs.items():
                    kernels.forward_lib = lambda lib=lib: lib
                    t = time.perf_counter()
                    if kind == "chain":
                        model(tokens[:1, ctx:ctx + n], torch.arange(ctx, ctx + n), seqs[0], exact=True)
                    else:
                        model.forward_batch([(c, [int(tokens[b, ctx])], [ctx], None) for b, c in enumerate(seqs[:n])])
                    times[name].append(time.perf_counter() - t)
                    for c in seqs:
                        c.rollback(ctx)
            med = {k: statistics.median(v) for k, v in times.items()}
            base = next(iter(med.values()))
            print(f"ctx {ctx} {kind} {n}: " + "  ".join(f"{k} {m * 1e3:.2f} ms ({base / m:.3f}x)"
                                                       for k, m in med.items()), flush=True)


if __name__ == "__main__":
    main()
