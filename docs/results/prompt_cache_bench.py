"""What prompt caching saves on a conversation's next turn (engine.Engine's prompt_cache, the server's default).

Two-turn conversations on the default model, greedy, -n 128 answers: Spec-Bench's MT-bench questions (their own
second turn) and summarization articles (a follow-up question about the same article). Turn 1 runs, then turn 2
(the conversation so far, the answer as generated, the next question) with the prompt cache on and off, alternated
conversation by conversation in one process: time to the first token of turn 2 (its prefill), tokens it prefilled,
and whether both answers are identical (they must be: the cache is exact).

    python docs/results/prompt_cache_bench.py [--limit 8] [--json docs/results/prompt-cache-1205.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdec.api import LLM
from specdec.loader import load
from specdec.sampling import SamplingParams

BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
FOLLOW_UP = "Now give three keywords for the same article, one line each."


def conversations(limit: int) -> dict[str, list[tuple[str, str]]]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
    mt = [r for r in rows if r.get("category") not in ("summarization", "rag", "qa", "translation", "math_reasoning")
          and len(r["turns"]) > 1]
    summ = [r for r in rows if r.get("category") == "summarization"]
    pick = lambda xs: [xs[i * len(xs) // limit] for i in range(limit)]  # noqa: E731 - evenly spaced
    return {"mt_bench": [(r["turns"][0], r["turns"][1]) for r in pick(mt)],
            "summarization": [(r["turns"][0], FOLLOW_UP) for r in pick(summ)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8, help="conversations per kind")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    target = load(None)
    tok = target.tokenizer
    greedy = SamplingParams()
    llms = {on: LLM.of(target, max_batch=1, prompt_cache=on) for on in (False, True)}
    rows = []
    for kind, convs in conversations(a.limit).items():
        for i, (q1, q2) in enumerate(convs):
            row = {"kind": kind, "conversation": i}
            for on in ((False, True) if i % 2 == 0 else (True, False)):  # alternated
                llm = llms[on]
                turn1 = [{"role": "user", "content": q1}]
                first = llm.generate([tok.encode_chat(turn1)], greedy, max_tokens=128, progress=False)[0]
                turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": q2}]
                second = llm.generate([tok.encode_chat(turn2)], greedy, max_tokens=128, progress=False)[0]
                s = second.stats
                row["on" if on else "off"] = {"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                                              "ttft_ms": s.prefill_s * 1e3, "tokens": second.tokens}
            row["identical"] = row["on"].pop("tokens") == row["off"].pop("tokens")
            rows.append(row)
            print(f"{kind} {i}: turn 2 of {row['on']['prompt_tokens']} tokens, {row['on']['cached_tokens']} cached: "
                  f"first token after {row['off']['ttft_ms']:.0f} ms without the cache, {row['on']['ttft_ms']:.0f} "
                  f"with it; {'same' if row['identical'] else 'DIFFERENT'} answer", flush=True)
    print("\n| conversations | turn-2 prompt tokens (median) | cached (median) | first token without / with cache, "
          "ms (median) | speedup | answers identical |\n|---|---|---|---|---|---|")
    for kind in ("mt_bench", "summarization"):
        rs = [r for r in rows if r["kind"] == kind]
        med = lambda f, rs=rs: statistics.median(f(r) for r in rs)  # noqa: E731
        off, on = med(lambda r: r["off"]["ttft_ms"]), med(lambda r: r["on"]["ttft_ms"])
        print(f"| {kind} ({len(rs)}) | {med(lambda r: r['on']['prompt_tokens']):.0f} | "
              f"{med(lambda r: r['on']['cached_tokens']):.0f} | {off:.0f} / {on:.0f} | {off / on:.1f}x | "
              f"{sum(r['identical'] for r in rs)}/{len(rs)} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
