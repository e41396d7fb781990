"""Would cutting a sampled draft by its known uniforms pay? Under coupled sampling (sampling.Draws) the uniform u of
every position is known before the forward, and a low u selects the top candidates (inverse CDF over ranked
candidates): a draft could stop at its first position with u > tau. Simulated on the plain sampled texts of
Spec-Bench rag and summarization prompts, 2 seeds each, with docs/results/ngram_sampling.py's replay and costs (v(T)
measured here), against the draft-length policy alone and the oracle length.

    python docs/results/ucut_sim.py [PROMPTS_PER_CATEGORY]      (docs/results/zen2-1205.txt)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ngram_sampling as ns  # noqa: E402

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.spec.autok import AutoDraftLength  # noqa: E402
from specdec.spec.costmodel import best_k  # noqa: E402

TAUS = (0.5, 0.7, 0.8, 0.9, 0.95)


def simulate_cut(texts: list[tuple], curve: list[float], tau: float) -> float:
    """ngram_sampling.simulate's policy, each draft cut at its first position with u > tau -> speedup over plain."""
    tokens = cost = 0.0
    for out, rows in texts:
        pol, j = AutoDraftLength(ns.K), 1
        while j < len(out):
            cls, cand, m, us = rows[j - 1]
            k = 0
            if cand:
                pol.watch(cand, cls)
                k = min(best_k(pol.acceptance(cls), 0.0, curve.__getitem__, ns.K)[0], len(cand))
                k = min(k, next((i for i, u in enumerate(us) if u > tau), len(us)))
            emitted = out[j:j + min(k, m) + 1]
            pol.emitted(emitted)
            tokens, cost, j = tokens + len(emitted), cost + curve[k + 1], j + len(emitted)
    return tokens / cost


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    t = load(None)
    tok = t.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
    for temp in (0.8, 0.3):
        for cat in ("rag", "summarization"):
            ps = [tok.encode_chat([{"role": "user", "content": p.text}]) for p in load_prompts(bench, cat, n)]
            curve = ns.verify_curve(t.model, int(statistics.mean(len(p) for p in ps)) + 128)
            texts = []
            for x in ps:
                for seed in (1, 2):
                    r = generate(t.model, tok, x, ns.params_at(temp, seed), max_tokens=256)
                    texts.append((r.tokens, ns.replay(x, r.tokens, seed)))
            policy = ns.simulate(texts, curve, oracle=False)[1]
            oracle = ns.simulate(texts, curve, oracle=True)[1]
            cells = " ".join(f"tau {tau}: {simulate_cut(texts, curve, tau):.3f}x" for tau in TAUS)
            print(f"{cat} T={temp}: policy {policy:.3f}x, oracle {oracle:.3f}x | {cells}", flush=True)


if __name__ == "__main__":
    main()
