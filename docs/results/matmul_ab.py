"""matmul.c of another commit against this checkout's, same process: median microseconds of one call per T (rows),
bf16 activations, 2 threads, the two builds alternated per cell, and a check that both give bitwise the same rows.

    python docs/results/matmul_ab.py c774cdf          # that commit's matmul.c / this one's
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
from specdec.quant import Int4Linear, Int8Linear

SHAPES = [(Int4Linear, 3072, 576), (Int4Linear, 16384, 2048), (Int8Linear, 2048, 2048), (Int8Linear, 49152, 576),
          (Int4Linear, 4096, 4096)]
TS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 32)


def build(source: Path, out: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """matmul.c compiled as kernels.matmul_lib() compiles it (plus -D `defines`), argument types as it sets them,
    AMX on as matmul_lib() turns it on."""
    subprocess.run(["cc", *kernels.FLAGS, *(f"-D{d}" for d in defines), "-I", str(kernels.SOURCE.parent), "-o",
                    str(out), str(source)], check=True)
    return kernels.declare_matmul(ctypes.CDLL(str(out)))


def per_call_us(f, budget: float = 0.02) -> float:
    t = time.perf_counter()
    f()
    n = max(1, int(budget / max(time.perf_counter() - t, 1e-6)))
    times = []
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("commit", help="the other matmul.c: git show COMMIT:specdec/kernels/matmul.c")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lib = kernels.matmul_lib()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old.c"
        shown = subprocess.run(["git", "show", f"{args.commit}:specdec/kernels/matmul.c"], capture_output=True,
                               text=True)
        if shown.returncode:
            ap.error(f"no specdec/kernels/matmul.c at {args.commit!r}: {shown.stderr.strip().splitlines()[-1]}")
        old.write_text(shown.stdout)
        dlls = [build(old, Path(tmp) / "old.so"), build(kernels.SOURCE.with_name("matmul.c"), Path(tmp) / "new.so")]
        print(f"cells: us per call, {args.commit} / this checkout ('!' where their rows differ)")
        try:
            for cls, n, k in SHAPES:
                lin = cls(torch.randn(n, k) * 0.05, None)
                cells = []
                for T in TS:
                    x = torch.randn(T, k).bfloat16()
                    outs, us = [], []
                    for dll in dlls:
                        kernels.matmul_lib = lambda dll=dll: dll
                        outs.append(lin(x))
                        us.append(per_call_us(lambda lin=lin, x=x: lin(x)))
                    same = torch.equal(outs[0], outs[1])
                    cells.append(f"T={T}: {us[0]:.0f}/{us[1]:.0f}" + ("" if same else "!"))
                print(f"{cls.__name__} {n}x{k}", " ".join(cells), flush=True)
        finally:
            kernels.matmul_lib = lambda: lib


if __name__ == "__main__":
    main()
