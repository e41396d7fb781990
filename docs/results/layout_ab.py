"""Interleaved A/B of a GGUF file's layouts: its Q4_K tensors with bf16 scale and zero per group and its Q6_K ones as
int8 (layout version 3, "v3"), Q4_K with its own scales (format Q4K, version 4, "q4k"), Q6_K kept as it is too
(format Q6K, version 5, "q4k+q6k"), a fused layer of both formats stacked instead of int8 (version 6, "stacked"),
Q5_K kept as it is (format Q5K, version 7, "q5k"), and Q5_0 / Q5_1 kept as they are, stacked with parts that become
int8 (format Q5, version 8, "q5", the current one), or that with every Q6_K tensor int8 ("q5-noq6k", what the AVX2
kernel ran before it had Q6K): the models in one process, forwards alternated
call by call so the host's drift hits all alike. Medians of `--repeats` forwards of a chain of T new tokens after CTX
cached (T = 1: a decode step):

    python docs/results/layout_ab.py GGUF CTX [--chains 1,4,8] [--repeats 30] [--variants v3,...,q5,q5-noq6k]

The older layouts come from their cache entries when they exist (an older checkout's), else they are converted here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import weights
from specdec.loader import load
from specdec.weights import layout

VERSIONS = {"v3": 3, "q4k": 4, "q4k+q6k": 5, "stacked": 6, "q5k": 7, "q5": layout.LAYOUT_VERSION,  # q5: 8 to 10
            "q5-noq6k": layout.LAYOUT_VERSION}


def load_as(variant: str, path: str, ctx: int):
    """The model as layout `variant` laid it out (LazyWeights.codes without Q4_K's own scales for v3, without Q6_K's
    codes for v3 and q4k, no stacks before "stacked", no Q5_K codes before "q5k", no Q5_0 / Q5_1 codes and stacks
    only of parts that all have codes before "q5"), in that version's cache entry."""
    codes, runs, version = weights.LazyWeights.codes, weights.LazyWeights.code_runs, layout.LAYOUT_VERSION

    def older(self, *names):
        c = codes(self, *names)
        if c is None or isinstance(c, weights.Q501Codes) or (isinstance(c, weights.Q5Codes) and variant != "q5k") or (
                isinstance(c, weights.Q6Codes) and variant in ("v3", "q4k")):
            return None
        return c[:3] if variant == "v3" else c

    def older_runs(self, *names):  # (the codes of formats a version did not keep were not there)
        new = (weights.Q501Codes,) if variant == "q5k" else (weights.Q501Codes, weights.Q5Codes)
        if not all(n in self._codes and not isinstance(self._codes[n](), new) for n in names):
            return None
        return runs(self, *names)

    if variant == "q5-noq6k":  # converted in memory, not cached (its entry's key would be q5's)
        weights.LazyWeights.codes = lambda self, *names: None if isinstance(c := codes(self, *names),
                                                                            weights.Q6Codes) else c
        try:
            return load(path, ctx=ctx, cache=False).model
        finally:
            weights.LazyWeights.codes = codes
    if variant != "q5":
        weights.LazyWeights.codes, layout.LAYOUT_VERSION = older, VERSIONS[variant]
        weights.LazyWeights.code_runs = older_runs
    if variant in ("v3", "q4k", "q4k+q6k"):
        weights.LazyWeights.code_runs = lambda self, *names: None
    try:
        return load(path, ctx=ctx).model
    finally:
        weights.LazyWeights.codes, weights.LazyWeights.code_runs, layout.LAYOUT_VERSION = codes, runs, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("ctx", type=int)
    ap.add_argument("--chains", default="1,4,8", help="chain lengths T")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", default="v3,q4k,q4k+q6k,stacked,q5k,q5")
    a = ap.parse_args()
    models = {v: load_as(v, a.gguf, a.ctx + 64) for v in a.variants.split(",")}
    for name, m in models.items():
        lins = [lin for layer in m.layers for lin in layer.linears()] + [m.output]
        nbytes = sum(t.numel() * t.element_size() for lin in lins for t in lin.tensors())
        print(f"{name}: {nbytes / 1e9:.3f} GB in linear layers ({m.weight_format})", flush=True)
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
            base = next(iter(med.values()))
            print(f"ctx {a.ctx} T {T}: " + "  ".join(f"{k} {v * 1e3:.1f} ms ({base / v:.3f}x)" for k, v in med.items()),
                  flush=True)


if __name__ == "__main__":
    main()
