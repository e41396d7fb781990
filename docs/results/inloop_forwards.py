"""Target forwards timed inside the generation loop against the back-to-back curve v(T) (roofline.forward_costs).

Every forward of plain and `--spec ngram` generations (Spec-Bench prompts of one category, each at the given
temperatures, two rounds, the second kept) is timed by wrapping Transformer.__call__; then v(T) is measured back to
back at the prompts' mean context + 128. Prints per mode: decode tok/s, forwards per token, the engine's time
outside forwards per step, and the in-loop median per T against v(T).

    python docs/results/inloop_forwards.py summarization 6 0        # category, prompts, temperatures
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.roofline import forward_costs  # noqa: E402
from specdec.bench.run import chat_prompt_ids  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.models.transformer import Transformer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402


def main() -> int:
    cat, n, temps = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")]
    timed: list[tuple[int, int, float]] = []  # (rows T, first position, seconds)
    call = Transformer.__call__

    def wrapped(self, ids, pos, cache, *a, **k):
        t0 = time.perf_counter()
        out = call(self, ids, pos, cache, *a, **k)
        timed.append((ids.shape[-1], int(pos[0]), time.perf_counter() - t0))
        return out

    t = load(None)
    tok = t.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"
    ps = [chat_prompt_ids(tok, p, chat=True) for p in load_prompts(bench, cat, n)]
    runs: dict[tuple[str, float], list] = {(m, temp): [] for temp in temps for m in ("plain", "ngram")}
    Transformer.__call__ = wrapped
    try:
        for rnd in range(2):
            for x in ps:
                for mode, temp in runs:
                    params = SamplingParams(temp, 40, 0.95, 0.05, seed=7) if temp else SamplingParams()
                    spec = SpecConfig(kind="ngram" if mode == "ngram" else "none")
                    timed.clear()
                    r = generate(t.model, tok, x, params, max_tokens=256, proposer=build_proposer(spec, t, params),
                                 draft_length=spec.policy())
                    if rnd:
                        steps = [(T, p, dt) for T, p, dt in timed if p >= len(x) - 1 and T <= 10]
                        runs[mode, temp].append((r.stats.decode_s, r.stats.generated_tokens - 1, steps))
    finally:
        Transformer.__call__ = call
    v = forward_costs(t.model, int(statistics.mean(len(x) for x in ps)) + 128, range(1, 10), repeats=15)
    print("back-to-back v(T) ms:", " ".join(f"{v[k] * 1e3:.2f}" for k in range(1, 10)))
    for (mode, temp), rows in runs.items():
        decode, tokens = sum(r[0] for r in rows), sum(r[1] for r in rows)
        fw = [f for r in rows for f in r[2]]
        inside = sum(dt for _, _, dt in fw)
        print(f"{mode} T={temp}: {tokens / decode:.1f} tok/s, {len(fw) / tokens:.3f} forwards a token, "
              f"{(decode - inside) / len(fw) * 1e3:.3f} ms a step outside forwards; forwards / sum of v(T): "
              f"{inside / sum(v[T] for T, _, _ in fw):.3f}")
        by_t = defaultdict(list)
        for T, _, dt in fw:
            by_t[T].append(dt)
        for T in sorted(by_t):
            med = statistics.median(by_t[T])
            print(f"   T={T}: {len(by_t[T])} forwards, median {med * 1e3:.2f} ms (v(T) {v[T] * 1e3:.2f}): "
                  f"{med / v[T]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
