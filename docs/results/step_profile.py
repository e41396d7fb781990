"""Where a batched engine step's time goes: B Spec-Bench prompts of one category decoded in lockstep (plain, greedy,
-n 96, prefills untimed), the time inside the target's forward_batch against the rest of Engine.step (drafting
bookkeeping, verification, sampling, stats); three runs, then a cProfile of a fourth.

    python docs/results/step_profile.py writing 8      (B >= 2; docs/results/zen2-1205.txt)
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

from specdec.api import LLM
from specdec.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    category = sys.argv[1] if len(sys.argv) > 1 else "writing"
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    n = 96
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows if r.get("category") == category][:b]
    if not prompts:
        sys.exit(f"no prompts of category {category!r} in {PROMPTS}: use one of "
                 f"{', '.join(sorted({r.get('category', '') for r in rows}))}")
    llm = LLM(None, max_batch=b)
    ids = [llm.target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    print("prompt tokens", [len(i) for i in ids])
    model = llm.engine.model
    fwd = {"s": 0.0, "n": 0}
    original = type(model).forward_batch

    def timed(self, items):
        t = time.perf_counter()
        out = original(self, items)
        fwd["s"] += time.perf_counter() - t
        fwd["n"] += 1
        return out

    type(model).forward_batch = timed
    greedy = SamplingParams(temperature=0.0)

    def run(profile: cProfile.Profile | None = None) -> None:
        seqs = [llm.engine.add(llm.sequence(p, greedy, n, True)) for p in ids]
        while waiting := [s for s in seqs if s.finish is None and not s.decoding]:
            llm.engine.step(waiting)
        fwd["s"], fwd["n"] = 0.0, 0
        start = sum(len(s.out) for s in seqs)
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        while any(s.finish is None for s in seqs):
            llm.engine.step(seqs)
        dt = time.perf_counter() - t0
        if profile:
            profile.disable()
        toks, steps = sum(len(s.out) for s in seqs) - start, max(fwd["n"], 1)
        print(f"{category} batch {b}: {toks / dt:.1f} tok/s, {fwd['n']} steps, step {dt / steps * 1e3:.2f} ms, "
              f"forward {fwd['s'] / steps * 1e3:.2f} ms, rest {(dt - fwd['s']) / steps * 1e3:.2f} ms")

    for _ in range(3):
        run()
    p = cProfile.Profile()
    run(p)
    pstats.Stats(p).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
