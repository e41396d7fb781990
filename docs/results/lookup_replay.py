"""Lookup drafting replayed on plain texts: which retrieval pays, and how far any lookup could go (issues 15, 18).

Under greedy decoding and under coupled sampling (sampling.Draws) the output is the plain text whatever was drafted,
so a lookup proposer can be scored offline: at every output position j its candidate (8 tokens) is accepted for as
many tokens as the text continues with. For Spec-Bench summarization and rag (and any --categories), at
temperatures 0, 0.3 and 0.8 (the CLI's top-k 40 / top-p 0.95 / min-p 0.05, 2 seeds), each retrieval below is scored
by
- the share of positions it drafts at and its mean accepted length there;
- an oracle draft length: the least total verify cost of the text, by the dynamic program
      C(j) = min over k in 0..m_j of v(k + 1) + C(j + k + 1),   C(n) = 0
  (m_j: the candidate's accepted length at j), as speedup n v(1) / C(0);
- the shipped draft-length policy (spec/autok.py, per-class acceptance, fresh per text) replayed on the candidates;
  both under a verify curve v(T) / v(1) given with --curve (default: the flattest recorded, 12-07 ninth) and under
  the one measured in this run at the category's mean context + 128.
Retrievals: the n-gram table with minimum 2 (the default before 12-08) and 1 (since), 1..3 and 1..6 (a
single-token match drafting as many tokens as NgramProposer.single_max allows: 2 since 12-08, 8 when
lookup-replay-1208.txt was made); the suffix
automaton (longest match); n-gram 1..4 with an alignment pointer that keeps copying past a substituted token where no
n-gram matched; for single-token matches the continuation whose next token follows that token most often.
The ceiling row ("any copy") takes for m_j the longest prefix of the text to come that occurs anywhere earlier
(overlap allowed, as LZ77's copies): the most any lookup could have accepted there, whatever its retrieval.

    python docs/results/lookup_replay.py --prompts 20 --json docs/results/lookup-replay-1208.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ngram_sampling import simulate, verify_curve  # noqa: E402

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.run import chat_prompt_ids  # noqa: E402
from specdec.cache import common_prefix  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec.ngram import NgramProposer  # noqa: E402
from specdec.spec.suffix import SuffixProposer  # noqa: E402

K = 8
FLAT = "1.00,1.03,1.12,1.14,1.30,1.42,1.58,1.74,1.89"  # v(T)/v(1), T = 1..9: ngram-sampling-zen4-1207i.txt


class Lookup:
    """A proposer as a retrieval: (draft class, candidate) each position, then the text's next token."""

    def __init__(self, proposer):
        self.p = proposer

    def begin(self, context: list[int]) -> None:
        self.p.begin(context)

    def candidate(self) -> tuple[int, list[int]]:
        return self.p.draft_class(), self.p.propose(K).tokens

    def accept(self, token: int) -> None:
        self.p.accept([], token)


class Aligned(Lookup):
    """n-gram 1..4; where nothing matched, keep copying from the last match's pointer, which advances one source
    token per output token (a substituted word keeps the alignment; up to 3 source tokens skipped to resync)."""

    def begin(self, context: list[int]) -> None:
        super().begin(context)
        self.ptr, self.misses = None, 0

    def candidate(self) -> tuple[int, list[int]]:
        cls, cand = super().candidate()
        if cand or self.ptr is None or self.misses > 2:
            return cls, cand
        return -1 - self.misses, self.p.tokens[self.ptr:self.ptr + K]

    def accept(self, token: int) -> None:
        n, start = self.p._match()
        if n:
            self.ptr, self.misses = start, 0
        if self.ptr is not None:
            toks = self.p.tokens
            skip = next((d for d in range(4) if self.ptr + d < len(toks) and toks[self.ptr + d] == token), None)
            self.ptr += 1 if skip is None else skip + 1
            self.misses = self.misses + 1 if skip is None else 0 if skip == 0 else self.misses
        super().accept(token)


class Frequent(Lookup):
    """n-gram 2..4; for a single-token match, the latest continuation among those whose first token follows the
    last token most often."""

    def begin(self, context: list[int]) -> None:
        super().begin(context)
        toks = self.p.tokens
        self.after: dict[int, list[int]] = defaultdict(list)
        for i in range(1, len(toks)):
            self.after[toks[i - 1]].append(i)

    def candidate(self) -> tuple[int, list[int]]:
        cls, cand = super().candidate()
        toks = self.p.tokens
        starts = self.after.get(toks[-1], [])
        if cand or not starts:
            return cls, cand
        count: dict[int, int] = defaultdict(int)
        for s in starts:
            count[toks[s]] += 1
        best = max(count.values())
        return 1, toks[max(s for s in starts if count[toks[s]] == best):][:K]

    def accept(self, token: int) -> None:
        super().accept(token)
        self.after[self.p.tokens[-2]].append(len(self.p.tokens) - 1)


RETRIEVALS = {
    "ngram 2..4": lambda: Lookup(NgramProposer(2, 4)),
    "ngram 1..4": lambda: Lookup(NgramProposer(1, 4)),
    "ngram 1..3": lambda: Lookup(NgramProposer(1, 3)),
    "ngram 1..6": lambda: Lookup(NgramProposer(1, 6)),
    "suffix": lambda: Lookup(SuffixProposer()),
    "ngram 1..4 + pointer": lambda: Aligned(NgramProposer(1, 4)),
    "ngram 2..4 + most frequent": lambda: Frequent(NgramProposer(2, 4)),
}


def candidates(make, prompt: list[int], out: list[int]) -> list[tuple]:
    """Per position j >= 1 (position 0 is the prefill's token): (class, candidate, accepted length, no u)."""
    r = make()
    r.begin(prompt + out[:1])
    rows = []
    for j in range(1, len(out)):
        cls, cand = r.candidate()
        rows.append((cls, cand, common_prefix(cand, out[j:j + K]), []))
        r.accept(out[j])
    return rows


def longest_copies(prompt: list[int], out: list[int]) -> list[int]:
    """m_j for j >= 1: the longest prefix of out[j:j + K] that occurs earlier in prompt + out (overlap allowed)."""
    seq = prompt + out
    at: dict[int, list[int]] = defaultdict(list)
    for s in range(len(prompt) + 1):
        at[seq[s]].append(s)
    ms = []
    for here in range(len(prompt) + 1, len(seq)):
        best = 0
        for s in at.get(seq[here], ()):
            m = 0
            while m < K and here + m < len(seq) and seq[s + m] == seq[here + m]:
                m += 1
            best = max(best, m)
        ms.append(best)
        at[seq[here]].append(here)
    return ms


def oracle(ms: list[list[int]], v: list[float]) -> float:
    """n v(1) / C(0) over texts with accepted lengths ms (the program in the docstring; v[T] = v(T) / v(1))."""
    total = 0.0
    for m in ms:
        c = [0.0] * (len(m) + 1)
        for j in range(len(m) - 1, -1, -1):
            c[j] = min(v[k + 1] + c[min(j + k + 1, len(m))] for k in range(min(m[j], len(v) - 2) + 1))
        total += c[0]
    return sum(len(m) for m in ms) / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="per category")
    ap.add_argument("--categories", default="summarization,rag")
    ap.add_argument("--curve", default=FLAT, help="v(T)/v(1) for T = 1..9, comma-separated")
    ap.add_argument("--texts", default=None, help="a JSON file of texts to reuse (written when missing)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = load(None)
    tok = t.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"
    cats = a.categories.split(",")
    prompts = {c: [chat_prompt_ids(tok, p, chat=True) for p in load_prompts(bench, c, a.prompts)]
               for c in cats}
    curves = {c: {"given": [0.0] + [float(x) for x in a.curve.split(",")],
                  "measured": verify_curve(t.model, int(statistics.mean(len(p) for p in ps)) + 128)}
              for c, ps in prompts.items()}
    texts = json.loads(Path(a.texts).read_text()) if a.texts and Path(a.texts).exists() else {}
    for temp in (0.0, 0.3, 0.8):
        for c, ps in prompts.items():
            key = f"{c}|{temp}"
            if key in texts:
                continue
            texts[key] = []
            for i, x in enumerate(ps):
                for seed in ((1, 2) if temp else (0,)):
                    print(f"\r{c} T={temp}: plain text {i + 1}/{len(ps)}", end="", file=sys.stderr, flush=True)
                    params = SamplingParams(temp, 40, 0.95, 0.05, seed=seed) if temp else SamplingParams()
                    texts[key].append([x, generate(t.model, tok, x, params, max_tokens=256).tokens])
    print(file=sys.stderr)
    if a.texts:
        Path(a.texts).write_text(json.dumps(texts))
    for c in cats:
        print(f"v(T)/v(1), {c}: given {a.curve}; measured "
              + ",".join(f"{x:.2f}" for x in curves[c]["measured"][1:]))
    rows = []
    print("\n| prompts | T | retrieval | drafts at | mean accepted there | oracle length (given / measured curve) | "
          "shipped policy (given / measured) |\n|---|---|---|---|---|---|---|")
    for temp in (0.0, 0.3, 0.8):
        for c in cats:
            pairs = texts[f"{c}|{temp}"]
            for name, make in [*RETRIEVALS.items(), ("any copy (ceiling)", None)]:
                if make is None:
                    ms = [longest_copies(x, out) for x, out in pairs]
                    drafted = [m for row in ms for m in row if m]
                    share = len(drafted) / sum(len(row) for row in ms)
                    orc = [oracle(ms, curves[c][k]) for k in ("given", "measured")]
                    pol = [None, None]
                else:
                    reps = [(out, candidates(make, x, out)) for x, out in pairs]
                    drafted = [m for _, r in reps for _, cand, m, _ in r if cand]
                    share = len(drafted) / sum(len(r) for _, r in reps)
                    accepted = [[m for _, _, m, _ in r] for _, r in reps]
                    orc = [oracle(accepted, curves[c][k]) for k in ("given", "measured")]
                    pol = [simulate(reps, curves[c][k], oracle=False)[1] for k in ("given", "measured")]
                row = {"prompts": c, "temperature": temp, "retrieval": name, "texts": len(pairs), "share": share,
                       "mean_accepted": statistics.mean(drafted), "oracle": orc, "policy": pol}
                rows.append(row)
                fmt = " / ".join(f"{x:.2f}x" for x in orc)
                pfmt = " / ".join(f"{x:.2f}x" for x in pol) if pol[0] else "-"
                print(f"| {c} | {temp} | {name} | {share:.0%} | {row['mean_accepted']:.2f} | {fmt} | {pfmt} |",
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
