"""Real runs of `--ngram-min 2` against `--ngram-min 1` (or, with --what cap, single-token drafts of at most 8
against at most 2 tokens: NgramProposer.single_max), for `--spec ngram` and `--spec auto`, beside plain decoding.

For each Spec-Bench prompt of the given categories the five modes (plain, ngram2, ngram1, auto2, auto1; with --what
cap: plain, ngram8, ngram2, auto8, auto2, all with --ngram-min 1) run back to back, their order reversed every other
prompt, so the host's drift hits them alike; the texts are checked identical to plain decoding's (greedy, or the
coupled sampled text at the prompt's seed). Prints decode tok/s ratios over plain per category and temperature
(-n 256, stopping at EOS; sampling: top-k 40 / top-p 0.95 / min-p 0.05).

    python docs/results/ngram_min_ab.py summarization,rag 0,0.8 20 [--what min|cap] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.run import chat_prompt_ids  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402


def proposer(mode: str, what: str, target, params: SamplingParams):
    """(proposer, policy) of a mode: plain, or ngram / auto followed by the --ngram-min (what = "min") or the
    single_max of the n-gram table (what = "cap")."""
    if mode == "plain":
        return None, SpecConfig(kind="none").policy()
    digit = int(mode[-1])
    spec = SpecConfig(kind=mode[:-1], ngram_min=digit if what == "min" else 1)
    prop = build_proposer(spec, target, params)
    if what == "cap":
        (prop if spec.kind == "ngram" else prop.sources["ngram"]).single_max = digit
    return prop, spec.policy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("categories")
    ap.add_argument("temperatures")
    ap.add_argument("prompts", type=int)
    ap.add_argument("--what", choices=("min", "cap"), default="min")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = load(None)
    tok = t.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"
    modes = ("plain", "ngram2", "ngram1", "auto2", "auto1") if a.what == "min" else ("plain", "ngram8", "ngram2",
                                                                                     "auto8", "auto2")
    runs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # "cat|temp|mode" -> [decode s, tokens]
    for cat in a.categories.split(","):
        ps = [chat_prompt_ids(tok, p, chat=True) for p in load_prompts(bench, cat, a.prompts)]
        for temp in (float(x) for x in a.temperatures.split(",")):
            for i, x in enumerate(ps):
                params = SamplingParams(temp, 40, 0.95, 0.05, seed=i + 1) if temp else SamplingParams()
                outs = {}
                for mode in modes if i % 2 == 0 else modes[::-1]:
                    prop, policy = proposer(mode, a.what, t, params)
                    r = generate(t.model, tok, x, params, max_tokens=256, proposer=prop, draft_length=policy)
                    outs[mode] = r.tokens
                    run = runs[f"{cat}|{temp}|{mode}"]
                    run[0] += r.stats.decode_s
                    run[1] += r.stats.generated_tokens - 1
                assert all(o == outs["plain"] for o in outs.values()), f"{cat} prompt {i}: texts differ"
            rate = {m: runs[f"{cat}|{temp}|{m}"][1] / runs[f"{cat}|{temp}|{m}"][0] for m in modes}
            print(cat, temp, " ".join(f"{m} {rate[m] / rate['plain']:.3f}x" for m in modes),
                  f"(plain {rate['plain']:.1f} tok/s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
