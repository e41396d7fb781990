"""How a batched step's forward time is charged to its sequences (engine.attribute), old against new, in one
process: every mode's batch of Spec-Bench prompts decoded under the old rule (rows share the forward equally) and the
new one (an equal share of the draft-free forward, plus the drafts' marginal cost), alternated per round; greedy, so
every output must equal plain's. Prints decode tok/s (the prompts' prefill chunks excluded, as bench --batch).

    python docs/results/batch_share_ab.py [--category summarization] [--limit 8] [-n 128] [--batch 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec.engine as engine
from specdec.api import LLM
from specdec.bench.prompts import load_prompts
from specdec.bench.run import chat_prompt_ids
from specdec.loader import load
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig

NEW = engine.attribute


def old(forward_s: float, drafts: list[int], row_cost: dict[int, float]) -> list[float]:
    rows = len(drafts) + sum(drafts)
    return [forward_s * (1 + k) / rows for k in drafts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--category", default="summarization")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="plain,ngram,auto")
    a = ap.parse_args()
    torch.set_num_threads(2)
    target = load(None)
    ids = [chat_prompt_ids(target.tokenizer, p, True) for p in load_prompts(a.prompts, a.category, a.limit)]
    greedy = SamplingParams(temperature=0.0)
    res: dict[tuple[str, str], list[float]] = {}
    acc: dict[tuple[str, str], list[float]] = {}
    ref = None
    for r in range(a.rounds):
        for rule, fn in (("old", old), ("new", NEW)):
            engine.attribute = fn
            for mode in a.modes.split(","):
                llm = LLM.of(target, None, SpecConfig(kind="none" if mode == "plain" else mode), max_batch=a.batch)
                llm.generate(ids[:1], greedy, max_tokens=8, progress=False)
                t0 = time.perf_counter()
                outs = llm.generate(ids, greedy, max_tokens=a.n, ignore_eos=True, progress=False)
                wall = time.perf_counter() - t0
                prefill = sum(o.stats.prefill_s for o in outs)
                toks = sum(len(o.tokens) for o in outs)
                tokens = [o.tokens for o in outs]
                if ref is None:
                    ref = tokens
                assert tokens == ref, f"{mode} ({rule}) output differs from plain"
                res.setdefault((rule, mode), []).append(toks / (wall - prefill))
                drafted = sum(o.stats.drafted for o in outs)
                acc.setdefault((rule, mode), []).append(drafted / max(toks, 1))
                print(f"round {r} {rule} {mode}: {res[(rule, mode)][-1]:.1f} tok/s", flush=True)
    engine.attribute = NEW
    print(f"\nbatch {a.batch}, {len(ids)} {a.category} prompts, -n {a.n}: decode tok/s (median of {a.rounds}), "
          "drafted tokens per generated token")
    print("| mode | old rule | new rule | new / old |")
    print("|---|---|---|---|")
    for mode in a.modes.split(","):
        o, n = statistics.median(res[("old", mode)]), statistics.median(res[("new", mode)])
        print(f"| {mode} | {o:.1f} ({statistics.median(acc[('old', mode)]):.2f}) | {n:.1f} "
              f"({statistics.median(acc[('new', mode)]):.2f}) | {n / o:.2f} |")
    print("all outputs identical to plain")


if __name__ == "__main__":
    main()
