"""Sampling speed and speculation under sampling, on the default model, in one process (interleaved, medians).

1. Plain decoding (`-n 160`, past end-of-sequence) of one chat prompt at greedy and at each sampler setting: decode
   tok/s, the ratio to greedy, and the sampler's cost per token (1 / tok/s - 1 / greedy tok/s).
2. n-gram drafting at temperatures 0, 0.3, 0.6, 0.8, 1.0 (the CLI's top-k / top-p / min-p) on a rewrite prompt and
   on Spec-Bench summarization prompts: acceptance per position, mean accepted length, speedup over plain sampling
   at the same temperature; and on Spec-Bench rag prompts.

    python docs/results/sampling_speed.py --json docs/results/sampling-speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402
from specdec.spec.stats import Stats  # noqa: E402

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
REWRITE = ("Rewrite the following paragraph, fixing any spelling mistakes but changing nothing else:\n\n"
           "The lighthouse stood on the edge of the cliff for more than a hundred years. Every night the keeper "
           "climbed the long spiral staircase, lit the great lamp, and watched the beam sweep across the dark water. "
           "Ships passing in the night relied on its light to avoid the rocks below. In the morning he wrote the "
           "weather, the passing ships, and the state of the sea in a leather-bound logbook that his grandfather had "
           "started.")
SETTINGS = {
    "greedy": SamplingParams(),
    "CLI defaults (0.8, top-k 40, top-p 0.95, min-p 0.05)": SamplingParams(0.8, 40, 0.95, 0.05),
    "temperature 0.8 only": SamplingParams(0.8),
    "top-k 40": SamplingParams(0.8, 40),
    "top-p 0.95": SamplingParams(0.8, 0, 0.95),
    "min-p 0.05": SamplingParams(0.8, 0, 1.0, 0.05),
    "defaults + repeat/presence/frequency penalties": SamplingParams(0.8, 40, 0.95, 0.05, repetition_penalty=1.1,
                                                                     presence_penalty=0.3, frequency_penalty=0.3),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--summaries", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = load(None)
    tok = t.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": CHAT}])
    runs: dict[str, list[float]] = {k: [] for k in SETTINGS}
    for rep in range(a.repeats):
        for name, p in SETTINGS.items():
            from dataclasses import replace

            r = generate(t.model, tok, ids, replace(p, seed=rep), max_tokens=160, ignore_eos=True)
            runs[name].append(r.stats.decode_tok_s)
    greedy = statistics.median(runs["greedy"])
    speed = []
    print("| sampler | decode tok/s | vs greedy | sampler cost per token |\n|---|---|---|---|")
    for name, v in runs.items():
        m = statistics.median(v)
        cost = (1 / m - 1 / greedy) * 1e3
        speed.append({"setting": name, "tok_s": m, "vs_greedy": m / greedy, "cost_ms": cost, "runs": v})
        print(f"| {name} | {m:.1f} | {m / greedy:.2f}x | {cost:.3f} ms |", flush=True)

    bench = "../shared/data/spec_bench/question.jsonl"
    prompts = {"rewrite": [tok.encode_chat([{"role": "user", "content": REWRITE}])]}
    for cat in ("summarization", "rag"):
        prompts[cat] = [tok.encode_chat([{"role": "user", "content": p.text}])
                        for p in load_prompts(bench, cat, a.summaries)]
    accept = []
    print("\n| prompts | temperature | plain tok/s | ngram tok/s | speedup | mean accepted | acceptance by position |"
          "\n|---|---|---|---|---|---|---|")
    for kind, plist in prompts.items():
        for temp in (0.0, 0.3, 0.6, 0.8, 1.0):
            p = SamplingParams(temp, 40, 0.95, 0.05) if temp else SamplingParams()
            times = {"plain": [], "ngram": []}
            st = Stats()
            toks = {"plain": 0, "ngram": 0}
            for rep in range(3):
                for x in plist:
                    for mode in ("plain", "ngram"):
                        spec = SpecConfig(kind="ngram" if mode == "ngram" else "none")
                        params = SamplingParams(**{**p.__dict__, "seed": 1000 * rep + len(x)})
                        r = generate(t.model, tok, x, params, max_tokens=256, ignore_eos=False,
                                     proposer=build_proposer(spec, t, params), draft_length=spec.policy())
                        times[mode].append(r.stats.decode_s)
                        toks[mode] += r.stats.generated_tokens - 1
                        if mode == "ngram":
                            st.merge(r.stats)
            plain, ngram = toks["plain"] / sum(times["plain"]), toks["ngram"] / sum(times["ngram"])
            per_pos = [round(x, 2) for x in st.acceptance_per_position[:6]]
            accept.append({"prompts": kind, "temperature": temp, "plain_tok_s": plain, "ngram_tok_s": ngram,
                           "speedup": ngram / plain, "mean_accepted": st.mean_accepted_length,
                           "acceptance_per_position": per_pos})
            print(f"| {kind} | {temp} | {plain:.1f} | {ngram:.1f} | {ngram / plain:.2f}x | "
                  f"{st.mean_accepted_length:.2f} | {' '.join(f'{x:.0%}' for x in per_pos)} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"speed": speed, "acceptance": accept, "threads": torch.get_num_threads()},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
