"""Issue 16's learning curve carried forward: how many training tokens the SmolLM2 EAGLE-3 heads would need for a
first-position acceptance of 0.6, and what making and training on them costs on this CPU.

Acceptance grows about linearly in log(training tokens) over the measured points (eagle3-curve.json, held-out
Spec-Bench mt_bench + summarization, greedy), as learning curves of this kind do (Kaplan et al. 2020 state it as
loss against data, a power law). The fit a + b log10(tokens) over every point, and over the points before the curve
flattened (an optimistic slope), each solved for the target; the cost per token is this CPU's measured rate of each
stage of the documented pipeline (HISTORY.md, 12-07 fifth: make-data at batch 16, the trunk's features, one
epoch of training) and the features' size on disk (bf16, as train-mtp keeps them).

    python docs/results/eagle3_extrapolate.py --png docs/results/eagle3-extrapolate.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# seconds per token of each stage and feature bytes per token, measured on 12-07 (HISTORY.md, "12-07, fifth"):
# 1.80M answer tokens in 39 min; 3.0M tokens' features in 34 min and 13.8 GB; one epoch over them in 56 min
STAGES = {"make-data": 39 * 60 / 1.80e6, "features": 34 * 60 / 3.0e6, "train (1 epoch)": 56 * 60 / 3.0e6}
FEATURE_BYTES = 13.8e9 / 3.0e6


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares acceptance = a + b log10(tokens) -> (a, b)."""
    xs = [math.log10(t) for t, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--curve", default=str(HERE / "eagle3-curve.json"))
    ap.add_argument("--target", type=float, default=0.6, help="first-position acceptance (issue 16: 0.6)")
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    rows = sorted(json.loads(Path(a.curve).read_text())["rows"], key=lambda r: r["train_tokens"])
    points = [(r["train_tokens"], r["all"]["cumulative"][0]) for r in rows]
    print("measured (both categories, first position):")
    for r, (t, y) in zip(rows, points, strict=True):
        print(f"  {t / 1e6:6.2f}M tokens: {y:.3f}  ({r['heads']}; {r.get('note', '')[:50]})")
    fits = {"every point": fit(points), "before the flattening": fit(points[:-1])}
    per_token = sum(STAGES.values())
    print(f"\ncost per training token here: {' + '.join(f'{k} {v * 1e3:.2f} ms' for k, v in STAGES.items())} = "
          f"{per_token * 1e3:.2f} ms; features {FEATURE_BYTES / 1e3:.1f} KB")
    print(f"\n| fit | slope per 10x tokens | tokens for {a.target} | CPU hours (one epoch) | features on disk |")
    print("|---|---|---|---|---|")
    out = {}
    for name, (a0, b) in fits.items():
        need = 10 ** ((a.target - a0) / b)
        hours, disk = need * per_token / 3600, need * FEATURE_BYTES / 1e9
        out[name] = {"intercept": a0, "slope_per_decade": b, "tokens": need, "cpu_hours": hours, "disk_gb": disk}
        print(f"| {name} | {b:+.3f} | {need / 1e6:.0f}M | {hours:.0f} | {disk:.0f} GB |")
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        ax.plot([t for t, _ in points], [y for _, y in points], "o", label="measured (held-out, greedy)")
        top = max(v["tokens"] for v in out.values()) * 1.5
        for name, v in out.items():
            xs = [points[0][0], top]
            ax.plot(xs, [v["intercept"] + v["slope_per_decade"] * math.log10(x) for x in xs], "--",
                    label=f"fit, {name}: {v['tokens'] / 1e6:.0f}M tokens, {v['cpu_hours']:.0f} CPU h")
        ax.axhline(a.target, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("first-position acceptance")
        ax.set_title("SmolLM2-135M EAGLE-3 heads: issue 16's 0.6, extrapolated")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
