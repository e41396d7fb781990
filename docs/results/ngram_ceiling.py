"""How far can n-gram drafting go on this machine? A replay of greedy outputs under the speedup model.

Generates the default model's greedy outputs for Spec-Bench prompts (plain decoding), then replays each output step
by step as the generation loop would see it: at every step a drafting policy proposes tokens from the context
(prompt + output so far), the number accepted is the length of the draft's agreement with the real continuation,
and the step costs v(K + 1) (the target forward over the pending token and K drafted tokens, relative to one decode
step; default: the roofline's measured curve). It prints, per category, tokens per target forward and the predicted
speedup sum(tokens) / sum(v) (drafting and per-step bookkeeping taken as free, so real runs land below) for:
  - specdec's proposer (most recent match of the last n = 4..2 tokens) at fixed K;
  - the same candidate with an oracle K (drafting exactly the tokens that will be accepted);
  - an oracle candidate (the earlier occurrence, of any suffix length >= 1, whose continuation agrees longest) and
    oracle K: the ceiling of any prompt-lookup method at this verification cost;
  - the same with free verification (v = 1): the ceiling if verification cost nothing.

    python docs/results/ngram_ceiling.py --category summarization,rag --limit 5 --json docs/results/ngram-ceiling.json
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec.bench.prompts import load_prompts
from specdec.bench.run import chat_prompt_ids
from specdec.cache import common_prefix
from specdec.generate import generate
from specdec.loader import load
from specdec.sampling import SamplingParams

ROOFLINE_V = [1.0, 1.10, 1.21, 1.38, 1.93, 2.0, 2.1, 2.2, 2.31]  # specdec roofline, v(T) for T = 1..9


agree = common_prefix  # how many of a draft's tokens the real continuation agrees with


def lookup(ctx: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """specdec's NgramProposer: the most recent earlier occurrence of the last n tokens, n = n_max..n_min."""
    for n in range(n_max, n_min - 1, -1):
        suffix = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == suffix:
                return ctx[s + n:s + n + k]
    return []


def best_candidate(ctx: list[int], truth: list[int]) -> list[int]:
    """The earlier occurrence of any suffix (1..5 tokens) whose continuation agrees longest with the truth."""
    best: list[int] = []
    for n in range(1, 6):
        suffix = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == suffix:
                cont = ctx[s + n:s + n + 16]
                if agree(cont, truth) > agree(best, truth):
                    best = cont
    return best


def replay(prompt: list[int], out: list[int], policy, v) -> tuple[int, float, int]:
    """-> (tokens after the first, summed cost, target forwards) of one output under a drafting policy."""
    t, cost, steps = 1, 0.0, 0
    while t < len(out):
        draft = policy(prompt + out[:t], out[t:])
        t += min(agree(draft, out[t:]) + 1, len(out) - t)
        cost += v(len(draft) + 1)
        steps += 1
    return len(out) - 1, cost, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--category", default="summarization,rag")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--v", default=",".join(map(str, ROOFLINE_V)), help="v(T) / v(1) for T = 1, 2, ...")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    vs = [float(x) for x in args.v.split(",")]
    v = lambda t: vs[t - 1] if t <= len(vs) else vs[-1] + 0.2 * (t - len(vs))  # noqa: E731
    lm = load(None)
    prompts = load_prompts(args.prompts, args.category, args.limit)
    runs = []
    for p in prompts:
        ids = chat_prompt_ids(lm.tokenizer, p, True)
        r = generate(lm.model, lm.tokenizer, ids, SamplingParams(), max_tokens=args.n)
        runs.append((p.category, ids, r.tokens))
        print(f"{p.category}: {len(ids)} prompt tokens, {len(r.tokens)} generated", flush=True)

    def trimmed(policy):  # oracle K: draft only what will be accepted
        return lambda ctx, truth: (d := policy(ctx, truth))[:agree(d, truth)]

    policies = {f"lookup K={k}": (lambda ctx, truth, k=k: lookup(ctx, 2, 4, k), v) for k in (1, 2, 3, 4, 8)}
    policies["lookup, oracle K"] = (trimmed(lambda ctx, truth: lookup(ctx, 2, 4, 16)), v)
    policies["oracle candidate + K"] = (trimmed(best_candidate), v)
    policies["oracle, free verify"] = (trimmed(best_candidate), lambda t: 1.0)
    table = {}
    print("| policy | category | tokens per forward | predicted speedup |\n|---|---|---|---|")
    for name, (policy, cost) in policies.items():
        for cat in sorted({c for c, _, _ in runs}):
            tot = [replay(ids, out, policy, cost) for c, ids, out in runs if c == cat]
            toks, spent, steps = (sum(x[i] for x in tot) for i in range(3))
            table.setdefault(name, {})[cat] = {"tokens_per_forward": toks / steps, "speedup": toks / spent}
            print(f"| {name} | {cat} | {toks / steps:.2f} | {toks / spent:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"v": vs, "category": args.category, "limit": args.limit, "n": args.n, "table": table}, f,
                      indent=1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
