"""Interleaved A/B of a GGUF file's int4 layers with Q4_K's own scales (format Q4K, layout version 4) and with
bf16 scale and zero per group (the layout before it, version 3): both models in one process, forwards alternated
call by call so the host's drift hits both alike. Medians of `--repeats` forwards of a chain of T new tokens after
CTX cached (T = 1: a decode step):

    python docs/results/layout_ab.py GGUF CTX [--chains 1,4,8] [--repeats 30]

The version-3 model comes from its cache entry when one exists (an older checkout's), else it is converted here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import weights
from specdec.loader import load
from specdec.weights import layout


def load_bf16_scales(path: str, ctx: int):
    """The model as version 3 laid it out: Q4_K codes with bf16 scale and zero (LazyWeights.codes without Q4_K's
    own scales), in version 3's cache entry."""
    codes, version = weights.LazyWeights.codes, layout.LAYOUT_VERSION
    weights.LazyWeights.codes = lambda self, *names: (lambda c: c[:3] if c else c)(codes(self, *names))
    layout.LAYOUT_VERSION = 3
    try:
        return load(path, ctx=ctx).model
    finally:
        weights.LazyWeights.codes, layout.LAYOUT_VERSION = codes, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("ctx", type=int)
    ap.add_argument("--chains", default="1,4,8", help="chain lengths T")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    models = {"bf16-scales": load_bf16_scales(a.gguf, a.ctx + 64), "q4k": load(a.gguf, ctx=a.ctx + 64).model}
    for name, m in models.items():
        lins = [lin for layer in m.layers for lin in layer.linears()] + [m.output]
        nbytes = sum(t.numel() * t.element_size() for lin in lins for t in lin.tensors())
        print(f"{name}: {nbytes / 1e9:.3f} GB in linear layers", flush=True)
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (1, a.ctx + 16))
    caches = {}
    with torch.inference_mode():
        for name, m in models.items():
            caches[name] = m.new_pool(1, a.ctx + 32).acquire()
            m.prefill(tokens[0, :a.ctx].tolist(), caches[name])
        for T in (int(t) for t in a.chains.split(",")):
            times: dict[str, list[float]] = {k: [] for k in models}
            for _ in range(a.repeats):
                for name, m in models.items():
                    t = time.perf_counter()
                    m(tokens[:, a.ctx:a.ctx + T], torch.arange(a.ctx, a.ctx + T), caches[name], exact=True)
                    times[name].append(time.perf_counter() - t)
                    caches[name].rollback(a.ctx)
            med = {k: statistics.median(v) for k, v in times.items()}
            base = med["bf16-scales"]
            print(f"ctx {a.ctx} T {T}: " + "  ".join(f"{k} {v * 1e3:.1f} ms ({base / v:.3f}x)" for k, v in med.items()),
                  flush=True)


if __name__ == "__main__":
    main()
