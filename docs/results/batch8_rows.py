"""What a batch-8 step costs against its draft rows, on 8 Spec-Bench summarization prompts in lockstep (prefilled
first, then stepped together until all finish; greedy, -n 128): the forward's milliseconds by the step's number of
draft rows (steps where all 8 sequences run), the engine's F(8) estimate (engine.attribute's draft-free cost), the
lockstep tok/s and the mean accepted length.

    python docs/results/batch8_rows.py auto      (or none, ngram)
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import specdec.engine as engine  # noqa: E402
from specdec.api import LLM  # noqa: E402
from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.run import GREEDY, chat_prompt_ids  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.spec import SpecConfig  # noqa: E402

BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "auto"
    target = load(None)
    ids = [chat_prompt_ids(target.tokenizer, p, True) for p in load_prompts(str(BENCH), "summarization", 8)]
    log: list[tuple[int, int, float, float | None]] = []  # (sequences, draft rows, forward s, F(n) before)
    attribute = engine.attribute

    def logged(forward_s: float, drafts: list[int], row_cost: dict) -> list[float]:
        log.append((len(drafts), sum(drafts), forward_s, row_cost.get(len(drafts))))
        return attribute(forward_s, drafts, row_cost)

    engine.attribute = logged
    llm = LLM.of(target, None, SpecConfig(kind=kind), max_batch=8)
    llm.generate(ids[:1], GREEDY, max_tokens=8, progress=False)  # warm-up
    seqs = [llm.engine.add(llm.sequence(p, GREEDY, 128, False)) for p in ids]
    while [s for s in seqs if s.finish is None and not s.decoding]:  # the prefills, not timed
        llm.engine.step()
    log.clear()
    t0, before = time.perf_counter(), sum(len(s.out) for s in seqs)
    while any(s.finish is None for s in seqs):
        llm.engine.step()
    seconds, tokens = time.perf_counter() - t0, sum(len(s.out) for s in seqs) - before
    full = [x for x in log if x[0] == 8]
    by_rows = collections.defaultdict(list)
    for _, rows, forward_s, _ in full:
        by_rows[rows].append(forward_s * 1e3)
    print(f"{kind}: {tokens / seconds:.1f} tok/s in lockstep, {len(log)} steps, {len(full)} with all 8 sequences, "
          f"mean accepted {statistics.mean(s.stats.mean_accepted_length for s in seqs):.2f}")
    for rows in sorted(by_rows):
        ms = statistics.median(by_rows[rows])
        print(f"  {rows} draft rows: {len(by_rows[rows])} steps, median forward {ms:.2f} ms")
    estimates = [b * 1e3 for *_, b in full if b]
    if estimates:
        print(f"  F(8), the engine's draft-free estimate: median {statistics.median(estimates):.2f} ms")


if __name__ == "__main__":
    main()
