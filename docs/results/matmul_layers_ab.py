"""matmul.c builds (files, with -D defines) on the default model's real linear layers, alternated per cell in one
process: median microseconds per call for T rows, a check that every build gives bitwise the same rows ("DIFF!" where
not), and the forward's matmul total (30 layers + the output head).

    TS=1,2,4,8,16 python docs/results/matmul_layers_ab.py base=specdec/kernels/matmul.c other=/tmp/v.c:DEF=1,X=2
    (docs/results/zen2-1205.txt)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from specdec import kernels
from specdec.loader import load

sys.path.insert(0, str(Path(__file__).parent))
from matmul_ab import build, per_call_us  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    m = load(None).model
    layer = m.layers[3]
    linears = [("qkv", layer.wqkv, 576), ("o", layer.wo, 576), ("w13", layer.w13, 576), ("w2", layer.w2, 1536),
               ("head", m.output, 576)]
    ts = [int(t) for t in os.environ.get("TS", "1,2,4,8,16").split(",")]
    lib = kernels.matmul_lib()
    with tempfile.TemporaryDirectory() as tmp:
        dlls = []
        for i, spec in enumerate(sys.argv[1:]):
            name, rest = spec.split("=", 1)
            src, _, defs = rest.partition(":")
            dlls.append((name, build(Path(src), Path(tmp) / f"ab_{i}.so", tuple(d for d in defs.split(",") if d))))
        total = {name: dict.fromkeys(ts, 0.0) for name, _ in dlls}
        try:
            with torch.inference_mode():
                for label, lin, k in linears:
                    cells = []
                    for T in ts:
                        x = torch.randn(1, T, k).bfloat16()
                        outs, us = [], {}
                        for rep in range(3):
                            for name, dll in dlls:
                                kernels.matmul_lib = lambda dll=dll: dll
                                if rep == 0:
                                    outs.append(lin(x))
                                us.setdefault(name, []).append(per_call_us(lambda lin=lin, x=x: lin(x), 0.01))
                        same = all(torch.equal(outs[0], o) for o in outs)
                        med = {name: statistics.median(v) for name, v in us.items()}
                        for name in med:
                            total[name][T] += med[name] * (1 if label == "head" else m.args.n_layers)
                        cell = "/".join(f"{med[n]:.0f}" for n, _ in dlls)
                        cells.append(f"T={T}: {cell}" + ("" if same else " DIFF!"))
                    print(label, " ".join(cells), flush=True)
        finally:
            kernels.matmul_lib = lambda: lib
    print(f"forward matmul ms ({m.args.n_layers} layers + head):",
          " ".join(f"T={T}: " + "/".join(f"{total[n][T] / 1e3:.2f}" for n, _ in dlls) for T in ts))


if __name__ == "__main__":
    main()
