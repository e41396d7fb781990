"""The attention kernel against PyTorch SDPA, side by side in one process: plain and n-gram decoding tok/s.

The same model runs each prompt with its attention kernel (Transformer.kernel, the default) and without it (one
SDPA call per verified row, what a machine without a C compiler gets), interleaved prompt by prompt so machine
drift hits both alike. Each implementation's speculative output is checked against its own plain output (the two
implementations round differently, so their texts may differ from each other at near-ties).

    python docs/results/kernel_vs_sdpa.py --category mt_bench,summarization,rag --limit 3 --repeats 3 \
        --json docs/results/kernel-vs-sdpa.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdec.bench.prompts import load_prompts
from specdec.bench.run import chat_prompt_ids
from specdec.generate import generate
from specdec.loader import load
from specdec.sampling import SamplingParams
from specdec.spec.autok import AutoDraftLength
from specdec.spec.ngram import NgramProposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--category", default="mt_bench,summarization,rag")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = load(None)
    model, tok = lm.model, lm.tokenizer
    if not model.kernel:
        raise SystemExit("the attention kernel is not available here (no C compiler?): nothing to compare")
    prompts = load_prompts(args.prompts, args.category, args.limit)
    caches = {}
    for kernel in (True, False):
        model.kernel = kernel
        caches[kernel] = model.new_cache()
    seconds: dict[tuple[str, bool, str], list[float]] = {}
    tokens: dict[tuple[str, str], int] = {}
    for i, p in enumerate(prompts):
        ids = chat_prompt_ids(tok, p, True)
        for _ in range(args.repeats):
            for kernel in (True, False):
                model.kernel = kernel
                for mode in ("plain", "ngram"):
                    proposer = NgramProposer() if mode == "ngram" else None
                    r = generate(model, tok, ids, SamplingParams(), max_tokens=args.n, proposer=proposer,
                                 draft_length=AutoDraftLength() if proposer else None, cache=caches[kernel])
                    key = (p.category, kernel, mode)
                    seconds.setdefault(key + (str(i),), []).append(r.stats.decode_s)
                    tokens[(p.category, str(i))] = r.stats.decode_tokens
                    if mode == "plain":
                        plain = r.tokens
                    elif r.tokens != plain:
                        raise SystemExit(f"n-gram output differs from plain decoding on prompt {i} (kernel={kernel})")
        print(f"prompt {i + 1}/{len(prompts)} ({p.category}) done", flush=True)
    rows = []
    print("| category | attention | plain tok/s | ngram tok/s | ngram speedup |\n|---|---|---|---|---|")
    for cat in dict.fromkeys(p.category for p in prompts):
        idx = [str(i) for i, p in enumerate(prompts) if p.category == cat]
        toks = sum(tokens[(cat, i)] for i in idx)
        for kernel in (True, False):
            rate = {m: toks / sum(statistics.median(seconds[(cat, kernel, m, i)]) for i in idx)
                    for m in ("plain", "ngram")}
            rows.append({"category": cat, "kernel": kernel, "plain_tok_s": rate["plain"], "ngram_tok_s": rate["ngram"]})
            print(f"| {cat} | {'kernel' if kernel else 'SDPA per row'} | {rate['plain']:.1f} | {rate['ngram']:.1f} | "
                  f"{rate['ngram'] / rate['plain']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"category": args.category, "limit": args.limit, "repeats": args.repeats, "n": args.n,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
