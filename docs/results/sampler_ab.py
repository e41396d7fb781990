"""Two or more builds of specdec/kernels/sample.c side by side: the same draws must come out of each (token and kept
candidates with their probabilities, on rows with ties, NaN, -inf, bf16-rounded values and signed zeros), then the
median time of one draw on a 49152-token row of random logits per sampler setting, the builds interleaved call by
call (this host's speed drifts within minutes):

    git show REV:specdec/kernels/sample.c > /tmp/sample_old.c
    python docs/results/sampler_ab.py old=/tmp/sample_old.c new=specdec/kernels/sample.c
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_bench import build  # noqa: E402

SETTINGS = {  # (top-k, temperature, top-p, min-p)
    "CLI defaults (top-k 40, 0.8, top-p 0.95, min-p 0.05)": (40, 0.8, 0.95, 0.05),
    "top-k 40, 0.8": (40, 0.8, 1.0, 0.0),
    "temperature 0.8 only": (0, 0.8, 1.0, 0.0),
    "min-p 0.05, 1.0": (0, 1.0, 1.0, 0.05),
    "top-k 5, 0.1, top-p 0.5": (5, 0.1, 0.5, 0.0),
    "temperature 1.5, top-p 0.95": (0, 1.5, 0.95, 0.0),
    "temperature 2, min-p 0.01": (0, 2.0, 1.0, 0.01),
}


def draw(lib: ctypes.CDLL, x: torch.Tensor, setting: tuple, u: float, ids, probs) -> tuple:
    n = ctypes.c_int(0)
    k, t, p, mp = setting
    tok = lib.specdec_sample(x.data_ptr(), x.shape[0], k, t, p, mp, u, ids.data_ptr() if ids is not None else None,
                             probs.data_ptr() if probs is not None else None, x.shape[0], ctypes.byref(n))
    return tok, n.value


def rows(g: torch.Generator):
    """Random rows of several kinds and lengths (a fifth at the default model's vocabulary)."""
    for i in range(300):
        V = 49152 if i % 5 == 0 else int(torch.randint(1, 3000, (1,), generator=g))
        x = torch.randn(V, generator=g) * 3
        kind = i % 6
        if kind == 1:
            x = torch.round(x * 2) / 2  # runs of ties
        elif kind == 2:
            x[torch.rand(V, generator=g) < 0.1] = float("nan")
        elif kind == 3:
            x[torch.rand(V, generator=g) < 0.5] = float("-inf")
        elif kind == 4:
            x = x.bfloat16().float()
        elif kind == 5:  # all equal (signed zeros); short rows: before e74c092+1 a row of 49152 took 10 s a draw
            x = torch.where(torch.rand(min(V, 3000), generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
        yield x


def main() -> None:
    specs = dict(a.split("=", 1) for a in sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        inc = f"-I{Path(__file__).resolve().parents[2] / 'specdec' / 'kernels'}"  # vexp.h
        libs = {name: build(f"{src}{'' if ':' in src else ':'} {inc}", Path(tmp) / f"{name}.so")
                for name, src in specs.items()}
        for lib in libs.values():
            lib.specdec_sample.restype = ctypes.c_long
            lib.specdec_sample.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        g = torch.Generator().manual_seed(0)
        cases = 0
        for x in rows(g):
            for setting in SETTINGS.values():
                u = float(torch.rand(1, generator=g)) if cases % 7 else (0.0, 1 - 1e-12)[cases % 2]  # and the ends
                seen = []
                for lib in libs.values():
                    ids, probs = torch.empty(x.shape[0], dtype=torch.long), torch.empty(x.shape[0], dtype=torch.float64)
                    tok, n = draw(lib, x, setting, u, ids, probs)
                    seen.append((tok, ids[:n].tolist(), probs[:n].tolist()))
                assert all(s == seen[0] for s in seen), (setting, [s[0] for s in seen])
                cases += 1
        print(f"same token and candidates from every build on {cases} draws")
        x = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 3
        print("| setting | " + " | ".join(f"{n} us" for n in libs) + " |")
        print("|---|" + "---|" * len(libs))
        for label, setting in SETTINGS.items():
            times = {n: [] for n in libs}
            for r in range(300):
                for n, lib in libs.items():
                    t = time.perf_counter()
                    draw(lib, x, setting, (r % 97) / 97, None, None)
                    times[n].append(time.perf_counter() - t)
            print(f"| {label} | " + " | ".join(f"{statistics.median(v) * 1e6:.1f}" for v in times.values()) + " |")


if __name__ == "__main__":
    main()
