"""Decode speed with the decoder layers run by kernels/forward.c (one call per forward) against the layer-by-layer
Python path (six kernel calls per layer), same process, interleaved, medians: plain greedy decoding (`-n 160`,
past end-of-sequence) and n-gram speculation on a rewrite prompt. Both paths write the same tokens (checked).

    python docs/results/forward_fast.py [MODEL ...] --json docs/results/forward-fast.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402

CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
REWRITE = ("Rewrite the following paragraph, fixing any spelling mistakes but changing nothing else:\n\n"
           "The lighthouse stood on the edge of the cliff for more than a hundred years. Every night the keeper "
           "climbed the long spiral staircase, lit the great lamp, and watched the beam sweep across the dark water.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["smollm2"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    print("| model | mode | Python path tok/s | forward.c tok/s | speedup |\n|---|---|---|---|---|")
    for name in a.models:
        t = load(name)
        m, tok = t.model, t.tokenizer
        if m.fast_layers() is None:
            print(f"| {name} | - | forward.c does not run this model's layers | | |")
            continue
        for mode, text in (("plain", CHAT), ("ngram", REWRITE)):
            ids = tok.encode_chat([{"role": "user", "content": text}])
            speed: dict[bool, list[float]] = {True: [], False: []}
            tokens: dict[bool, list[int]] = {}
            for _ in range(a.repeats):
                for fast in (False, True):
                    m._fast = False if fast else None  # False: recomputed (on); None: off
                    spec = SpecConfig(kind="ngram" if mode == "ngram" else "none")
                    r = generate(m, tok, ids, SamplingParams(), max_tokens=a.n, ignore_eos=True,
                                 proposer=build_proposer(spec, t, SamplingParams()), draft_length=spec.policy())
                    speed[fast].append(r.stats.decode_tok_s)
                    tokens[fast] = r.tokens
            m._fast = False
            assert tokens[True] == tokens[False], "forward.c changed the output"
            slow, fast_ = statistics.median(speed[False]), statistics.median(speed[True])
            rows.append({"model": name, "mode": mode, "python_tok_s": slow, "forward_c_tok_s": fast_,
                         "speedup": fast_ / slow, "runs": {"python": speed[False], "forward_c": speed[True]}})
            print(f"| {name} | {mode} | {slow:.1f} | {fast_:.1f} | {fast_ / slow:.2f}x |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
