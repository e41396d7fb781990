"""The quantized matmul kernel's AVX2 path (matmul.c on CPUs without AVX-512) against PyTorch's weight-only kernels
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`: what specdec used on such CPUs before), same process: median
microseconds of one call per T (rows), bf16 activations, 2 threads, cache-resident weights where they fit. With
--rows, the AVX2 path is also compiled with other register blockings (AVX2_ROWS4 / AVX2_ROWS8: activation rows per
pass over a block's weights). `python docs/results/avx2_matmul.py [--rows]` (docs/results/avx2-matmul.txt)."""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from amx_matmul import per_call_us as amx_per_call_us

from specdec import kernels
from specdec.quant import Int4Linear, Int8Linear

SHAPES = [(Int4Linear, 3072, 576), (Int4Linear, 576, 1536), (Int8Linear, 3072, 576), (Int8Linear, 49152, 576),
          (Int4Linear, 4096, 4096), (Int4Linear, 28672, 4096)]
TS = (1, 2, 4, 8, 16, 64, 512)


def per_call_us(f, budget: float = 0.3) -> float:
    """amx_matmul.per_call_us with as many calls per timing as fit `budget` seconds over its 15 timings (an 8B-sized
    call at T = 64 takes ~0.1 s, a small one ~50 us)."""
    t = time.perf_counter()
    f()
    return amx_per_call_us(f, max(1, min(50, int(budget / 15 / max(time.perf_counter() - t, 1e-6)))))


def variant(rows4: int, rows8: int, tmp: Path) -> ctypes.CDLL:
    """matmul.c compiled with another AVX2 register blocking, argument types as kernels.matmul_lib() sets them."""
    out = tmp / f"matmul-{rows4}-{rows8}.so"
    subprocess.run(["cc", *kernels.FLAGS, f"-DAVX2_ROWS4={rows4}", f"-DAVX2_ROWS8={rows8}", "-o", str(out),
                    str(kernels.SOURCE.with_name("matmul.c"))], check=True)
    dll = ctypes.CDLL(str(out))
    ptr, i = ctypes.c_void_p, ctypes.c_int
    dll.specdec_matmul.restype = i
    dll.specdec_matmul.argtypes = [ptr, i, i, i, i, ptr, ptr, ptr, ptr, i, ptr, ctypes.c_float, i, ptr]
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", action="store_true", help="also time other AVX2 register blockings")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lib = kernels.matmul_lib()
    if lib is None or lib.specdec_matmul_supported() != 1:
        raise SystemExit("this build of matmul.c is not the AVX2 path (an AVX-512 CPU, or no compiler)")
    supports = kernels.matmul_supports
    with tempfile.TemporaryDirectory() as tmp:
        variants = {}
        if args.rows:
            variants = {(r4, r8): variant(r4, r8, Path(tmp)) for r4, r8 in ((4, 2), (5, 3), (6, 4), (8, 3))}
        print("cells: PyTorch weight-only kernel / specdec AVX2 kernel, us per call"
              + (" ; then AVX2 with (ROWS4, ROWS8) = " + ", ".join(map(str, variants)) if variants else ""))
        for cls, n, k in SHAPES:
            w = torch.randn(n, k) * 0.05
            native = cls(w, None)
            kernels.matmul_supports = lambda *a: False
            try:
                torch_lin = cls(w, None)
            finally:
                kernels.matmul_supports = supports
            row = []
            for T in TS:
                if n * k > 1e8 and T > 64:
                    continue
                x = torch.randn(T, k).bfloat16()
                a = per_call_us(lambda x=x, f=torch_lin: f(x))
                b = per_call_us(lambda x=x, f=native: f(x))
                cell = f"T={T}: {a:.0f}/{b:.0f}"
                for dll in variants.values():
                    kernels.matmul_lib = lambda dll=dll: dll
                    try:
                        cell += f"/{per_call_us(lambda x=x, f=native: f(x)):.0f}"
                    finally:
                        kernels.matmul_lib = lambda: lib
                row.append(cell)
            print(f"{cls.__name__} {n}x{k}", " ".join(row), flush=True)


if __name__ == "__main__":
    main()
