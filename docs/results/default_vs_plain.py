"""`specdec generate` as a user runs it (no flags: --spec auto, llama.cpp's sampling defaults) against
`--spec none`, one process per run, on short chat prompts: decode tok/s and load time from the summary line,
interleaved, medians per prompt of --repeats runs, the same seed for both. Issue 15's "never slower by default".

    python docs/results/default_vs_plain.py --json docs/results/default-vs-plain.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

# short open chat prompts of the kind a newcomer types (not from Spec-Bench, not from the training prompts)
PROMPTS = [
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Why do leaves change colour in autumn?",
    "Write a haiku about a train station at night.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a hash table is to a beginner.",
    "Suggest a name for a small bakery and say why.",
    "What causes the seasons on Earth?",
    "How can I make my emails clearer?",
]


def run(cmd: list[str]) -> tuple[float, float, int]:
    """(decode tok/s, load s, generated tokens) of one `specdec generate` run, from its summary line."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"generate failed: {r.stderr[-400:]}")
    m = re.search(r"generated (\d+) tokens, ([\d.]+) tok/s", r.stderr)
    load = re.search(r"load ([\d.]+) s", r.stderr)
    return float(m[2]), float(load[1]), int(m[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specdec", default=str(Path(sys.executable).with_name("specdec")))
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for i, prompt in enumerate(PROMPTS):
        base = [a.specdec, "generate", "--chat", "-p", prompt, "-n", str(a.n), "--seed", str(a.seed)]
        got: dict[str, list[tuple[float, float, int]]] = {"default": [], "none": []}
        for _ in range(a.repeats):
            got["default"].append(run(base))
            got["none"].append(run(base + ["--spec", "none"]))
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), v[0][2])
               for k, v in got.items()}
        rows.append({"prompt": prompt, "default_tok_s": med["default"][0], "none_tok_s": med["none"][0],
                     "speedup": med["default"][0] / med["none"][0], "default_load_s": med["default"][1],
                     "none_load_s": med["none"][1], "default_tokens": med["default"][2],
                     "none_tokens": med["none"][2]})
        print(f"{i + 1}/{len(PROMPTS)} {rows[-1]['speedup']:.2f}x", file=sys.stderr)
    speedups = [r["speedup"] for r in rows]
    summary = {"median_speedup": statistics.median(speedups),
               "geomean_speedup": statistics.geometric_mean(speedups),
               "median_load_default_s": statistics.median(r["default_load_s"] for r in rows),
               "median_load_none_s": statistics.median(r["none_load_s"] for r in rows)}
    print("| prompt | default tok/s | --spec none tok/s | speedup | load default / none (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt'][:48]} | {r['default_tok_s']:.1f} | {r['none_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['default_load_s']:.2f} / {r['none_load_s']:.2f} |")
    print(f"\nmedian speedup {summary['median_speedup']:.2f}x, geometric mean {summary['geomean_speedup']:.2f}x; "
          f"median load {summary['median_load_default_s']:.2f} s (default) vs {summary['median_load_none_s']:.2f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"n": a.n, "repeats": a.repeats, "seed": a.seed, "rows": rows,
                                            "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
