"""Issue 13: why batch 8's lockstep speed on this host comes in two modes (steps of ~6.5 ms in some rounds, ~8.7 ms in
others, batch 1 steady). Rounds of 8 Spec-Bench mt_bench prompts decoded in lockstep (greedy, 64 tokens, prefills
untimed); after each round, in the same process, the CPU time / wall time and context switches of the round (do the
OpenMP threads sleep and get woken, or spin?) and the peak rates of the kernel's instructions (matmul.c's
specdec_peak: VPDPBUSD and FMA, every thread): if the slow rounds were a slower clock or a neighbour on the same
execution ports, the peaks would drop with them.

    python docs/results/batch_mode_probe.py [ROUNDS]
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec import kernels  # noqa: E402
from specdec.api import LLM  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    llm = LLM(None, max_batch=8)
    tok = llm.target.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
    ids = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in load_prompts(str(bench), "mt_bench", 8)]
    for r in range(rounds):
        for b in (1, 8):
            seqs = [llm.engine.add(llm.sequence(p, SamplingParams(temperature=0.0), 64, True)) for p in ids[:b]]
            while waiting := [s for s in seqs if s.finish is None and not s.decoding]:
                llm.engine.step(waiting)
            u0, w0, steps = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), []
            while any(s.finish is None for s in seqs):
                t = time.perf_counter()
                llm.engine.step(seqs)
                steps.append(time.perf_counter() - t)
            u1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - w0
            cpu = u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime
            peaks = kernels.instruction_peaks(0.05, 1) if b == 8 else None
            extra = (f" | VPDPBUSD {2 * peaks['int_macs_s'] / 1e9:.0f} GOP/s, FMA {2 * peaks['fma_macs_s'] / 1e9:.0f} "
                     "GFLOP/s" if peaks else "")
            print(f"round {r} batch {b}: {b * len(steps) / sum(steps):.0f} tok/s, median step "
                  f"{statistics.median(steps) * 1e3:.2f} ms, cpu/wall {cpu / wall:.2f}, voluntary switches "
                  f"{u1.ru_nvcsw - u0.ru_nvcsw}, involuntary {u1.ru_nivcsw - u0.ru_nivcsw}{extra}", flush=True)


if __name__ == "__main__":
    main()
