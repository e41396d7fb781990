"""Interleaved A/B of forward.c builds inside whole forwards (what forward_mm_ab.py does for matmul.c): the same
process, model and caches (forward_mm_ab.compare); each build's specdec_layers is handed to the model in turn,
forward by forward, so the host's drift hits every build alike. Medians of --n forwards: a chain of T new tokens
after CTX cached, and B sequences of one new token each (a batched decode step):

    python docs/results/forward_c_ab.py CTX NAME=FILE.c[:DEFINE,...] ... [--model GGUF] [--chains 1] [--batch 8]
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

from forward_mm_ab import ab_parser, compare  # docs/results/, the folder of this script

from specdec import kernels


def main() -> None:
    a = ab_parser(__doc__, chains="1").parse_args()
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

    def use(lib: ctypes.CDLL) -> None:
        kernels.forward_lib = lambda: lib

    compare(a.model, a.ctx, a.chains, a.batch, {name: (lambda lib=lib: use(lib)) for name, lib in libs.items()}, a.n)


if __name__ == "__main__":
    main()
