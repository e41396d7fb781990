"""Why n-gram drafting pays less under sampling (issue 18): the sampled text, not the verifier, on the default model.

Under coupled verification (sampling.Draws, spec/verify.py) the output is the plain sampled text token for token,
so every drafting policy can be scored offline against that text: a point-mass draft token is accepted iff it equals
the token sampled at its position. For Spec-Bench summarization and rag prompts at temperatures 0, 0.3 and 0.8
(the CLI's top-k 40 / top-p 0.95 / min-p 0.05), in one process:

1. each prompt's plain sampled text (2 seeds when sampling);
2. the n-gram proposer replayed over that text: at every position its candidate (8 tokens) and how many of them
   the text continues with; then
   - acceptance by the position's uniform u (the drafter knows u in advance: if a low u meant "the top token",
     drafts could be sized by it; this shows whether that would help),
   - simulated tokens per forward and speedup over plain (costs: the target's v(T) / v(1) measured here at the
     prompts' mean context) for the draft-length policy speculation uses (spec/autok.py, fresh per generation)
     and for an oracle that knows each candidate's accepted length (the ceiling of any length policy for this
     proposer),
   - a two-branch tree (the two most recent distinct continuations) and the best of all earlier occurrences
     (mean accepted length only: the ceiling of lookup trees);
3. the real runs, plain and `--spec ngram` on the same prompts and seeds (texts checked identical): tok/s and speedup.

    python docs/results/ngram_sampling.py --json docs/results/ngram-sampling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.roofline import forward_costs  # noqa: E402
from specdec.cache import common_prefix  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import Draws, SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402
from specdec.spec.autok import AutoDraftLength  # noqa: E402
from specdec.spec.costmodel import best_k  # noqa: E402
from specdec.spec.ngram import NgramProposer  # noqa: E402

K, BUCKETS = 8, 5


def params_at(temp: float, seed: int) -> SamplingParams:
    return SamplingParams(temp, 40, 0.95, 0.05, seed=seed) if temp else SamplingParams()


def verify_curve(model, ctx: int) -> list[float]:
    """[0, v(1)/v(1), ..., v(K+1)/v(1)]: target forwards over T new tokens after ctx cached (roofline's
    forward_costs, medians of 15), as the draft-length policy tabulates them (non-decreasing from the right)."""
    policy = AutoDraftLength(K)
    policy.verify_s = forward_costs(model, ctx, range(1, K + 2), repeats=15)
    return policy.verify_table(K + 1)


def replay(prompt: list[int], out: list[int], seed: int | None) -> list[tuple]:
    """Per output position j >= 1: (draft class, candidate, accepted length, the candidate positions' u)."""
    draws = Draws(seed) if seed is not None else None
    prop = NgramProposer()  # the shipped n-gram sizes (1..4 since 12-08; 2..4 before)
    prop.begin(prompt + out[:1])
    rows = []
    for j in range(1, len(out)):
        cls, cand = prop.draft_class(), prop.propose(K).tokens
        m = matched(cand, out[j:j + K])
        rows.append((cls, cand, m, [draws.u(j + i) for i in range(len(cand))] if draws else []))
        prop.accept([], out[j])
    return rows


def simulate(texts: list[tuple], curve: list[float], oracle: bool) -> tuple[float, float]:
    """(tokens per forward, speedup over plain) of drafting the replayed candidates with a fresh AutoDraftLength
    per generation (full-information feedback, per-class acceptance, these costs), or with the oracle length."""
    tokens = forwards = cost = 0.0
    for out, rows in texts:
        pol, j = AutoDraftLength(K), 1
        while j < len(out):
            cls, cand, m, _ = rows[j - 1]
            if cand:
                pol.watch(cand, cls)
            if not cand:
                k = 0
            elif oracle:
                k = m if m and (m + 1) / curve[m + 1] > 1.0 else 0
            else:
                k = min(best_k(pol.acceptance(cls), 0.0, curve.__getitem__, K)[0], len(cand))
            emitted = out[j:j + min(k, m) + 1]
            pol.emitted(emitted)
            tokens, forwards, cost, j = tokens + len(emitted), forwards + 1, cost + curve[k + 1], j + len(emitted)
    return tokens / forwards, tokens / cost


matched = common_prefix  # how many tokens of a candidate the text continues with


def lookup_trees(prompt: list[int], out: list[int]) -> dict[str, float]:
    """Sums over positions with a 2..4-token n-gram match: accepted length of the latest occurrence's continuation (the
    proposer's chain), of the better of the two most recent distinct continuations, of the best of all."""
    seq = prompt + out[:1]
    occ: dict[tuple, list[int]] = defaultdict(list)

    def index(i: int) -> None:  # n-grams ending at seq[i - 1]: their continuation starts at i
        for n in (2, 3, 4):
            if i >= n:
                occ[tuple(seq[i - n:i])].append(i)

    for i in range(1, len(seq)):
        index(i)
    acc = {"positions": 0.0, "chain": 0.0, "two_branches": 0.0, "all_occurrences": 0.0}
    for j in range(1, len(out)):
        cands: list[list[int]] = []
        for n in (4, 3, 2):
            starts = occ.get(tuple(seq[-n:]), [])
            if starts:
                cands = [seq[s:s + K] for s in starts]
                break
        actual = out[j:j + K]
        if cands:
            firsts, two = set(), []
            for c in reversed(cands):
                if c and c[0] not in firsts:
                    firsts.add(c[0])
                    two.append(c)
            acc["positions"] += 1
            acc["chain"] += matched(cands[-1], actual)
            acc["two_branches"] += max(matched(c, actual) for c in two[:2])
            acc["all_occurrences"] += max(matched(c, actual) for c in cands)
        seq.append(out[j])
        index(len(seq) - 1)
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="per category")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = load(None)
    tok = t.tokenizer
    bench = "../shared/data/spec_bench/question.jsonl"
    prompts = {cat: [tok.encode_chat([{"role": "user", "content": p.text}]) for p in load_prompts(bench, cat,
                                                                                                   a.prompts)]
               for cat in ("summarization", "rag")}
    curves = {cat: verify_curve(t.model, int(statistics.mean(len(p) for p in ps)) + 128)
              for cat, ps in prompts.items()}
    print("v(T)/v(1), T = 1..9, at each category's mean context + 128:")
    for cat, c in curves.items():
        print(f"  {cat}: {' '.join(f'{x:.2f}' for x in c[1:])}")
    results = []
    print("\n| prompts | temperature | real plain tok/s | real ngram tok/s | real speedup | simulated: policy "
          "tokens/forward, speedup | oracle length | acceptance by u bucket (0-0.2 .. 0.8-1) | mean accepted: "
          "chain / 2-branch tree / all occurrences |\n|---|---|---|---|---|---|---|---|---|")
    for temp in (0.0, 0.3, 0.8):
        for cat, ps in prompts.items():
            seeds = (1, 2) if temp else (None,)
            texts, trees = [], defaultdict(float)
            by_u = [[0, 0] for _ in range(BUCKETS)]
            real = {"plain": [0.0, 0], "ngram": [0.0, 0]}
            for x in ps:
                for seed in seeds:
                    params = params_at(temp, seed or 0)
                    outs = {}
                    for mode in ("plain", "ngram"):
                        spec = SpecConfig(kind="ngram" if mode == "ngram" else "none")
                        r = generate(t.model, tok, x, params, max_tokens=256,
                                     proposer=build_proposer(spec, t, params), draft_length=spec.policy())
                        outs[mode] = r.tokens
                        real[mode][0] += r.stats.decode_s
                        real[mode][1] += r.stats.generated_tokens - 1
                    assert outs["plain"] == outs["ngram"], "coupled sampling must give the plain text"
                    out = outs["plain"]
                    rows = replay(x, out, seed)
                    texts.append((out, rows))
                    for _, _, m, us in rows:
                        for i in range(min(len(us), m + 1)):
                            b = min(int(us[i] * BUCKETS), BUCKETS - 1)
                            by_u[b][0] += i < m
                            by_u[b][1] += 1
                    for k, v in lookup_trees(x, out).items():
                        trees[k] += v
            plain_s, ngram_s = (real[m][1] / real[m][0] for m in ("plain", "ngram"))
            tpf, sim = simulate(texts, curves[cat], oracle=False)
            otpf, osim = simulate(texts, curves[cat], oracle=True)
            u_acc = [round(acc / n, 3) if n else None for acc, n in by_u]
            tree = {k: round(trees[k] / trees["positions"], 3) for k in ("chain", "two_branches", "all_occurrences")}
            row = {"prompts": cat, "temperature": temp, "generations": len(texts), "plain_tok_s": plain_s,
                   "ngram_tok_s": ngram_s, "speedup": ngram_s / plain_s, "sim_tokens_per_forward": tpf,
                   "sim_speedup": sim, "oracle_tokens_per_forward": otpf, "oracle_speedup": osim,
                   "acceptance_by_u": u_acc, "u_counts": [n for _, n in by_u] if temp else None,
                   "mean_accepted_at_matches": tree}
            results.append(row)
            u_txt = " ".join(f"{x:.2f}" for x in u_acc) if temp else "(greedy: no u)"
            print(f"| {cat} | {temp} | {plain_s:.1f} | {ngram_s:.1f} | {ngram_s / plain_s:.2f}x | {tpf:.2f}, "
                  f"{sim:.2f}x | {otpf:.2f}, {osim:.2f}x | {u_txt} | {tree['chain']:.2f} / "
                  f"{tree['two_branches']:.2f} / {tree['all_occurrences']:.2f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"verify_curves": curves, "rows": results,
                                            "threads": torch.get_num_threads()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
