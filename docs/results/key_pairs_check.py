"""Key tiles in bf16 pairs (attention.c's tile_at): does a build without AVX-512 BF16 compute every output bitwise as
the [D, 32] tiles did, and how far do the VDPBF16PS scores move them? Two builds of attention.c (before / after),
each given the same keys through its own specdec_store_keys (so each lays its tiles out its own way), the same
queries, values and row spans; outputs compared bitwise, and both against float64 attention.

    python docs/results/key_pairs_check.py OLD.c NEW.c [-march=... or other flags for both builds]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch

from specdec import kernels

H, HKV, D = 9, 3, 64


def build(src: str, flags: list[str], out: Path) -> ctypes.CDLL:
    subprocess.run(["gcc", "-w", *kernels.FLAGS, *flags, "-o", str(out), src], check=True, capture_output=True)
    return ctypes.CDLL(str(out))


def run(lib: ctypes.CDLL, S: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output [T, H, D] as f32, float64 reference) for a chain of T rows after S cached slots."""
    g = torch.Generator().manual_seed(seed)
    slots = -(-(S + T) // 32) * 32
    keys = torch.randn(1, S + T, HKV, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, HKV, slots, D, generator=g).to(torch.bfloat16)
    q = torch.randn(1, T, H + 2 * HKV, D, generator=g).to(torch.bfloat16)
    kt = torch.zeros(HKV * slots * D, dtype=torch.bfloat16)
    vp = ctypes.c_void_p
    lib.specdec_store_keys(vp(keys.data_ptr()), vp(kt.data_ptr()), 1, ctypes.c_long(0), ctypes.c_long(0),
                           ctypes.c_long(slots // 32), HKV, D, ctypes.c_long(HKV * D), ctypes.c_long(0),
                           ctypes.c_long(S + T), 2)
    spans, tails = kernels.row_spans([(0, S, range(S, S + t + 1)) for t in range(T)], None)
    out = torch.empty(1, T, H * D, dtype=torch.bfloat16)
    p = spans.data_ptr()
    lib.specdec_attend(vp(q.data_ptr()), ctypes.c_long((H + 2 * HKV) * D), vp(kv.data_ptr()), vp(kt.data_ptr()),
                       ctypes.c_long(slots // 32), H, HKV, D, T, vp(p), vp(p + 8 * T), vp(tails.data_ptr()),
                       vp(p + 16 * T), ctypes.c_float(D ** -0.5), vp(out.data_ptr()), 1)
    qq = q[0, :, :H].double()  # [T, H, D]
    k = keys[0].double().repeat_interleave(H // HKV, dim=1)  # [S + T, H, D]
    v = kv[0, :, :S + T].double().transpose(0, 1).repeat_interleave(H // HKV, dim=1)
    s = torch.einsum("thd,shd->ths", qq, k) * D ** -0.5
    s = s.masked_fill(torch.arange(S + T)[None, None] > S + torch.arange(T)[:, None, None], float("-inf"))
    ref = torch.einsum("ths,shd->thd", s.softmax(-1), v)
    return out.float().view(T, H, D), ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="attention.c before")
    ap.add_argument("new", help="attention.c after")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="compiler flags for both builds, e.g. -mno-avx512bf16")
    a = ap.parse_args()
    missing = [f for f in (a.old, a.new) if not Path(f).is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    old, new, flags = a.old, a.new, a.flags
    tmp = Path(tempfile.mkdtemp())
    libs = {"old": build(old, flags, tmp / "old.so"), "new": build(new, flags, tmp / "new.so")}
    for S, T in ((5, 1), (100, 3), (700, 1), (1000, 9), (300, 16)):
        same, err, differ = True, {}, 0.0
        for seed in range(5):
            got = {n: run(lib, S, T, seed) for n, lib in libs.items()}
            same = same and torch.equal(got["old"][0], got["new"][0])
            differ = max(differ, (got["old"][0] != got["new"][0]).double().mean().item())
            for n, (o, ref) in got.items():
                err[n] = max(err.get(n, 0.0), (o.double() - ref).abs().max().item())
        print(f"S {S} T {T} {' '.join(flags) or 'native'}: bitwise same={same} (outputs differing: {differ:.1%}); "
              "max |out - float64| " + ", ".join(f"{n} {e:.2e}" for n, e in err.items()), flush=True)


if __name__ == "__main__":
    main()
