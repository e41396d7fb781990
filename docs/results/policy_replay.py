"""Issue 15: can a better draft-length policy close the gap to the oracle? The suffix-automaton source replayed over
the target's own greedy outputs, with the draft-length policy speculation uses (spec/autok.AutoDraftLength, learned
across a category's prompts as `--spec auto` carries it) against variants whose draft class adds information, and
against an oracle that knows each candidate's accepted length.

Greedy outputs are what speculation emits whatever it drafts, so each policy is scored offline on the same texts:
tokens per forward weighted by the verify cost v(T) / v(1) measured here at the category's mean context (roofline's
forward_costs), i.e. the simulated speedup over plain decoding. 20 Spec-Bench prompts per category, 256 tokens.

    python docs/results/policy_replay.py --json docs/results/policy-replay-1207d.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.spec.autok import AutoDraftLength  # noqa: E402
from specdec.spec.suffix import SuffixProposer, match_class  # noqa: E402

K = 8
CATEGORIES = ("summarization", "rag", "translation", "qa", "math_reasoning", "mt_bench")
ClassFn = Callable[[SuffixProposer, tuple[int, int] | None], int]


def base_class(src: SuffixProposer, last: tuple[int, int] | None) -> int:
    """What speculation uses: the match length's class."""
    return src.draft_class()


def streak_class(src: SuffixProposer, last: tuple[int, int] | None) -> int:
    """The match class, split by whether the previous step's draft was accepted whole (a copy going on)."""
    full = last is not None and last[0] > 0 and last[1] == last[0]
    return src.draft_class() + (100 if full else 0)


def last_accepted_class(src: SuffixProposer, last: tuple[int, int] | None) -> int:
    """The match class, split by how many tokens the previous step accepted (0, 1, 2, 3+)."""
    return src.draft_class() + 100 * (0 if last is None else min(last[1], 3))


def fine_class(src: SuffixProposer, last: tuple[int, int] | None) -> int:
    """Finer match lengths: 0-8 one each, then 9-15, 16-31, 32+."""
    n, _ = src.sam.match()
    n = n if n >= src.min_match else 0
    return n if n <= 8 else 12 if n < 16 else 16 if n < 32 else 32


VARIANTS: dict[str, tuple[Callable[[], AutoDraftLength], ClassFn]] = {
    "match length (as shipped)": (lambda: AutoDraftLength(K), base_class),
    "+ previous draft whole": (lambda: AutoDraftLength(K), streak_class),
    "+ previous accepted count": (lambda: AutoDraftLength(K), last_accepted_class),
    "finer match lengths": (lambda: AutoDraftLength(K), fine_class),
    "decay 0.9": (lambda: AutoDraftLength(K, decay=0.9), base_class),
    "decay 0.98": (lambda: AutoDraftLength(K, decay=0.98), base_class),
}


def outputs(n_prompts: int) -> dict[str, tuple[list[tuple[list[int], list[int]]], list[float]]]:
    """Per category: (prompt ids, greedy output) pairs and the verify cost table [0, v(1)/v(1), .., v(K+1)/v(1)]."""
    from specdec.bench.prompts import load_prompts
    from specdec.bench.roofline import forward_costs
    from specdec.generate import generate
    from specdec.loader import load
    from specdec.sampling import SamplingParams

    target = load(None)
    tok, bench = target.tokenizer, Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench"
    res = {}
    for cat in CATEGORIES:
        prompts = [tok.encode_chat([{"role": "user", "content": p.text}])
                   for p in load_prompts(str(bench / "question.jsonl"), cat, n_prompts)]
        outs = []
        for i, ids in enumerate(prompts):
            outs.append((ids, generate(target.model, tok, ids, SamplingParams(), max_tokens=256).tokens))
            print(f"{cat}: {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
        policy = AutoDraftLength(K)
        ctx = int(statistics.mean(len(p) for p in prompts)) + 128
        policy.verify_s = forward_costs(target.model, ctx, range(1, K + 2), repeats=15)
        res[cat] = (outs, policy.verify_table(K + 1))
    return res


def simulate(outs, table: list[float], make: Callable[[], AutoDraftLength], cls_of: ClassFn,
             oracle: bool = False) -> float:
    """Simulated speedup: tokens emitted / sum of v(k + 1) / v(1) over the steps. The policy carries over from one
    prompt to the next (spec/auto.py's `learned`); the oracle drafts exactly the candidate's accepted length."""
    policy, tokens, cost = make(), 0, 0.0
    for ids, out in outs:
        policy.watching = []
        src, last, i = SuffixProposer(), None, 0
        src.begin(list(ids))
        while i < len(out):
            cand = src.propose(K).tokens
            m = 0
            while m < len(cand) and i + m < len(out) and cand[m] == out[i + m]:
                m += 1
            k = 0
            if cand:
                cls = cls_of(src, last)
                policy.watch(cand, cls)
                k = m if oracle else policy.choose(cls, table.__getitem__)
                k = min(k, len(cand), len(out) - i - 1)
            emitted = out[i:i + min(k, m) + 1]
            policy.emitted(emitted)
            last = (k, min(k, m))
            src.accept(emitted[:-1], emitted[-1])
            tokens, cost, i = tokens + len(emitted), cost + table[k + 1], i + len(emitted)
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="per category")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = outputs(a.prompts)
    rows = []
    print("| category | v(2..9) / v(1) | oracle | " + " | ".join(VARIANTS) + " |")
    print("|---" * (3 + len(VARIANTS)) + "|")
    for cat, (outs, table) in res.items():
        row = {"category": cat, "verify_curve": table[1:], "oracle": simulate(outs, table, *VARIANTS[
            "match length (as shipped)"], oracle=True)}
        row.update({name: simulate(outs, table, make, cls) for name, (make, cls) in VARIANTS.items()})
        rows.append(row)
        print(f"| {cat} | {' '.join(f'{v:.2f}' for v in table[2:])} | {row['oracle']:.3f}x | "
              + " | ".join(f"{row[name]:.3f}x" for name in VARIANTS) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({"k_max": K, "match_classes": [match_class(n) for n in range(20)],
                                            "rows": rows}, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
