"""PNG figures for `specdec bench --png` and `specdec roofline --png`.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so nothing depends on a display or on global
pyplot state, and each figure is readable without the printed tables: units on every axis, a title naming the model
and the machine.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _figure(width: float, height: float, ncols: int):
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _machine_line(machine: dict) -> str:
    cpu = machine.get("cpu") or machine.get("processor") or machine.get("platform", "")
    threads = machine.get("threads")
    return f"{cpu}, {threads} threads" if threads else str(cpu)


def plot_bench(report: dict, path: str | Path) -> None:
    """One PNG for a `specdec bench` report (bench/run.py run_bench, plus cmd_bench's "settings"):
    (a) tok/s per mode, grouped by prompt category (plain first), the speedup over plain written on each bar;
    (b) acceptance rate per draft position for each speculative mode, over all prompts."""
    rows = report["rows"]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    modes.sort(key=lambda m: m != "plain")  # stable: plain first, the rest in report order
    by = {(r["category"], r["mode"]): r for r in rows}

    fig, (ax, ax2) = _figure(13, 5.2, 2)
    width = 0.8 / max(1, len(modes))
    colors = [f"C{i % 10}" for i in range(len(modes))]
    top = max((r["tok_s"] for r in rows if r["tok_s"] is not None), default=1.0)
    for j, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for i, cat in enumerate(categories):
            r = by.get((cat, mode))
            if r is None or r["tok_s"] is None:  # a peer that produced nothing
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(r["tok_s"])
            labels.append(f"{r['speedup']:.2f}x")
        bars = ax.bar(xs, ys, width * 0.92, label=mode, color=colors[j])
        for bar, text in zip(bars, labels, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.01, text, ha="center",
                    va="bottom", fontsize=7, rotation=90 if len(modes) > 4 else 0)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=30 if len(categories) > 4 else 0, ha="right" if len(categories) > 4
                       else "center")
    ax.set_ylim(0, top * 1.45)  # headroom for the legend above the bars
    ax.set_xlabel("prompt category")
    ax.set_ylabel("decode speed (tokens/s, median of repeats)")
    ax.set_title("(a) decode speed per mode; speedup over plain on each bar")
    ax.legend(fontsize=8, loc="upper center", ncols=min(4, len(modes)))
    ax.grid(axis="y", alpha=0.3)

    spec = [r for r in rows if r["category"] == "all" and r.get("acceptance_per_position")]
    for j, r in enumerate(spec):
        acc = r["acceptance_per_position"]
        ax2.plot(range(1, len(acc) + 1), [100 * a for a in acc], marker="o",
                 color=colors[modes.index(r["mode"])] if r["mode"] in modes else f"C{j}",
                 label=f"{r['mode']}: {r['mean_accepted']:.2f} tokens/forward")
    if spec:
        n = max(len(r["acceptance_per_position"]) for r in spec)
        ax2.set_xticks(range(1, n + 1))
        ax2.legend(fontsize=7.5, loc="upper center", ncols=2, title="mean accepted (bonus included)",
                   title_fontsize=7.5)
    else:
        ax2.text(0.5, 0.5, "no speculative mode in this report", ha="center", va="center",
                 transform=ax2.transAxes)
    ax2.set_ylim(0, 140)  # headroom for the legend above 100%
    ax2.set_yticks(range(0, 101, 20))
    ax2.set_xlabel("draft position (1 = first drafted token)")
    ax2.set_ylabel("accepted (% of drafts that reached the position)")
    ax2.set_title("(b) acceptance per draft position, all prompts")
    ax2.grid(alpha=0.3)

    s = report.get("settings", {})
    model = Path(s["model"]).name if s.get("model") else "model"
    detail = ", ".join(x for x in (s.get("quant") and f"quant {s['quant']}", s.get("dtype")) if x)
    fig.suptitle(f"specdec bench: {model}{f' ({detail})' if detail else ''}, greedy, "
                 f"{s.get('n_predict', '?')} tokens per prompt\non {_machine_line(report.get('machine', {}))}")
    fig.tight_layout()
    fig.savefig(path)


def plot_roofline(report: dict, path: str | Path) -> None:
    """One PNG for a `specdec roofline` report (bench/roofline.py run_roofline):
    (left) target forward time vs T new tokens, with the bandwidth floor (bytes / read GB/s) and the compute floor
    (FLOPs / matmul FLOP/s); (right) predicted speedup vs draft length K for each acceptance rate, best K marked."""
    rows = report["forward"]
    p = report["peaks"]
    moe = report.get("moe")
    if moe:  # a third panel: MoE verification cost vs a dense model of the same active size
        fig, (ax, ax2, ax3) = _figure(19, 5.2, 3)
        _plot_moe(ax3, moe)
    else:
        fig, (ax, ax2) = _figure(13, 5.2, 2)
    ts = [r["t"] for r in rows]
    ax.plot(ts, [r["seconds"] * 1e3 for r in rows], "o-", color="C0", lw=2, label="measured forward (median)")
    ax.plot(ts, [r["bandwidth_floor_s"] * 1e3 for r in rows], "--", color="C1",
            label=f"bandwidth floor: bytes / {p['bandwidth_gb_s']['read']:.1f} GB/s (read)")
    cached = [r.get("bandwidth_floor_at_weight_size_s") for r in rows]
    if all(cached) and abs(cached[0] / rows[0]["bandwidth_floor_s"] - 1) > 0.1:
        ax.plot(ts, [c * 1e3 for c in cached], "--", color="C1", alpha=0.45,
                label=f"bandwidth floor at {p['read_gb_s_at_weight_size']:.1f} GB/s (read over "
                      f"{p.get('read_bytes_at_weight_size', 0) / 1e6:.0f} MB, up to the weights' size)")
    ax.plot(ts, [r["compute_floor_s"] * 1e3 for r in rows], ":", color="C2", lw=2,
            label=f"compute floor: FLOPs / {p['matmul_gflop_s']:.0f} GFLOP/s ({p['matmul_dtype']} matmul)")
    for r in rows:
        if r["t"] & (r["t"] - 1) == 0 and r["t"] > 1:  # label powers of two: the ratio to T = 1
            ax.annotate(f"{r['ratio']:.2f}x", (r["t"], r["seconds"] * 1e3), textcoords="offset points",
                        xytext=(-3, 6), ha="right", fontsize=8, color="C0")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ts)
    ax.set_xticklabels([str(t) for t in ts], fontsize=8)
    top = max(max(r["seconds"], r["bandwidth_floor_s"], r["compute_floor_s"]) for r in rows) * 1e3
    ax.set_ylim(top=top * 3)
    ax.set_xlabel("T, new tokens per forward (log scale; verifying K drafts is T = K + 1)")
    ax.set_ylabel("time per target forward (ms, log scale)")
    ax.set_title(f"forward cost after {report['settings']['context']} cached tokens (labels: ratio to T = 1)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")

    preds = report["predictions"]
    k_max = max((max(q["k"]) for q in preds), default=8)
    for i, q in enumerate(preds):
        color = f"C{i % 10}"
        style = "-" if q["proposer"] == "ngram" else "--"
        name = "n-gram" if q["proposer"] == "ngram" else "draft model"
        ax2.plot([0] + q["k"], [1.0] + q["speedup"], style, marker="o", ms=4, color=color,
                 label=f"{name}, alpha {q['alpha']:g}, c {q['c']:.2f}")
        ax2.plot([q["best_k"]], [q["best_speedup"]], "*", ms=16, color=color, markeredgecolor="black")
        ax2.annotate(f"best K={q['best_k']}", (q["best_k"], q["best_speedup"]), textcoords="offset points",
                     xytext=(6, 6), fontsize=8, color=color)
    ax2.axhline(1.0, color="gray", lw=1, ls="-.", label="plain decoding (1.0x)")
    ax2.set_xticks(range(0, k_max + 1))
    ax2.set_xlabel("K, drafted tokens per step (0 = plain decoding)")
    ax2.set_ylabel("predicted speedup over plain decoding (x)")
    ax2.set_title("predicted speedup = E(K) / (K c + v(K+1)), i.i.d. acceptance alpha")
    values = [1.0] + [x for q in preds for x in q["speedup"]]
    ax2.set_ylim(min(values) * 0.6, max(values) * 1.08)  # headroom for the labels, room below for the legend
    ax2.legend(fontsize=8, loc="lower left")
    ax2.grid(alpha=0.3)

    m = report["model"]
    fig.suptitle(f"specdec roofline: {m['name']} ({m['file_type']}, quant {m['quant']}, {m['dtype']} activations)\n"
                 f"on {_machine_line(report['machine'])}")
    fig.tight_layout()
    fig.savefig(path)


def _plot_moe(ax, moe: dict) -> None:
    """v(T) / v(1) of a mixture-of-experts model: measured, predicted from the distinct experts T tokens touch, and
    predicted for a dense model of the same active bytes per token."""
    c = moe["curve"]
    ts = [x["t"] for x in c]
    ax.plot(ts, [x["measured_ratio"] for x in c], "o-", color="C0", lw=2, label="measured")
    ax.plot(ts, [x["moe_calibrated_ratio"] for x in c], "s--", color="C3",
            label="MoE predicted: E(1-(1-k/E)^T) experts/layer, calibrated")
    if any(x["measured_distinct"] is not None for x in c):
        ax.plot(ts, [x["moe_measured_routing_calibrated_ratio"] for x in c], ":", color="C3", alpha=0.6,
                label="MoE predicted, measured routing")
    ax.plot(ts, [x["dense_calibrated_ratio"] for x in c], "^--", color="C7",
            label="dense model, same active bytes, calibrated")
    ax.plot(ts, [x["moe_roofline_ratio"] for x in c], "-", color="C3", alpha=0.35, label="MoE roofline")
    ax.plot(ts, [x["dense_roofline_ratio"] for x in c], "-", color="C7", alpha=0.35, label="dense roofline")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ts)
    ax.set_xticklabels([str(t) for t in ts], fontsize=8)
    ax.set_xlabel("T, new tokens per forward (log scale)")
    ax.set_ylabel("v(T) / v(1), forward time relative to one decode step")
    ax.set_title(f"MoE verification: {moe['k']} of {moe['n_experts']} experts per token, "
                 f"{moe['moe_layers']} MoE layers")
    ax.legend(fontsize=7.5, loc="upper left")
    ax.grid(alpha=0.3, which="both")
