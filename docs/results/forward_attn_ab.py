"""Interleaved A/B of attention.c builds inside whole SmolLM2 forwards: the same process, the same model and cache;
forward.c is handed each build's specdec_attend / specdec_rope_store in turn, call by call, so the host's drift
(~1.5x within minutes here) hits every build alike. Medians of 40 forwards over T new tokens after CTX cached, exact
(verification) plan, and with --batch B, of a batched decode step: B sequences of CTX cached tokens, one row each:

    python docs/results/forward_attn_ab.py CTX NAME=FILE.c[:-DFLAG ...] [NAME=FILE.c ...] [--chains 1,2,4,8,9]
        [--batch 8] [--model GGUF] [--n 40]
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

from attention_bench import build  # docs/results/, the folder of this script
from forward_mm_ab import ab_parser, compare

from specdec import kernels


def main() -> None:
    ap = ab_parser(__doc__, chains="1,2,4,8,9", batch="", n=40, builds="NAME=FILE.c[:-DFLAG ...]")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    fwd = kernels.forward_lib()
    libs, builds = [], {}
    for arg in a.builds:
        name, _, src = arg.partition("=")
        if not name or not Path(src.partition(":")[0]).is_file():
            ap.error(f"{arg!r}: expected NAME=FILE.c[:-DFLAG ...] with an existing FILE.c")
        libs.append(lib := build(src, tmp / f"{name}.so"))  # kept loaded
        fns = [ctypes.cast(f, ctypes.c_void_p).value for f in (lib.specdec_rope_store, lib.specdec_attend)]
        builds[name] = lambda fns=fns: fwd.fns.__setitem__(slice(1, 3), fns)
    compare(a.model, a.ctx, a.chains, a.batch, builds, a.n)


if __name__ == "__main__":
    main()
