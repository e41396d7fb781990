"""Prefill on the attention kernel's exact plan against the "masked" plan (one PyTorch SDPA call over a [T, L] mask
per layer) that prompts used before 12-05: the default model, a 53-token MT-bench prompt and a 926-token
summarization prompt, chunks of 512, medians of 5, the two alternated. Since 12-05 every forward of a model whose
whole stack runs in forward.c is exact (models/transformer.py's _plan); "masked" is reproduced here by the old rule
(the kernel only for T = 1 or exact forwards).

    python docs/results/prefill_exact.py      (docs/results/prefill-exact-1205.txt)
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specdec.loader import load
from specdec.models.transformer import AttentionPlan, Transformer

BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    torch.set_num_threads(2)
    t = load(None)
    m, tok = t.model, t.tokenizer
    rows = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
    article = [r for r in rows if r["category"] == "summarization"][3]["turns"][0]
    prompts = {"short": tok.encode_chat([{"role": "user", "content": rows[0]["turns"][0]}]),
               "long": tok.encode_chat([{"role": "user", "content": article}])}
    exact_plan = Transformer._plan

    def masked_plan(self, positions, cache, start, T, parents, exact) -> AttentionPlan:
        if T > 1 and not exact:  # the old rule: multi-row forwards that need not be exact went to SDPA
            kt, cache.kt = cache.kt, None
            try:
                return exact_plan(self, positions, cache, start, T, parents, exact)
            finally:
                cache.kt = kt
        return exact_plan(self, positions, cache, start, T, parents, exact)

    times: dict = {}
    with torch.inference_mode():
        for _ in range(5):
            for name, p in prompts.items():
                for plan in ("masked", "exact"):
                    Transformer._plan = masked_plan if plan == "masked" else exact_plan
                    c = m.new_cache(2048)
                    s = time.perf_counter()
                    m.prefill(p, c, 512)
                    times.setdefault((name, plan), []).append(time.perf_counter() - s)
    Transformer._plan = exact_plan
    for (name, plan), v in times.items():
        n = len(prompts[name])
        print(f"{name} ({n} tokens) {plan}: {statistics.median(v) * 1e3:.1f} ms, {n / statistics.median(v):.0f} tok/s")


if __name__ == "__main__":
    main()
