"""Mixture-of-experts decode on this machine (issue 17's benchmark), per GGUF file, all in one process per file:
- plain greedy decode ms/token in specdec after --context cached tokens, and its GB/s counting only the weights a
  token reads (attention, router, shared experts, head + its k routed experts: Transformer.weight_bytes) and the KV
  cache, against STREAM read bandwidth (bench/roofline.measure_bandwidth);
- v(T) / v(1) for T = 1..8, measured (roofline.forward_costs, exact verification), against the MoE roofline's
  prediction (roofline.moe_report: the union of the T tokens' experts, uniform routing and measured routing) and
  against a dense model of the same active bytes;
- llama.cpp's `llama-bench -p 0 -n 32 -t THREADS` token-generation speed on the same file (interleaved before and
  after specdec's measurements, median of both runs' means).

    python docs/results/moe_decode.py --llama-cpp /path/to/llama.cpp/build/bin --json docs/results/moe-decode.json \\
        out/fixtures/olmoe-1b-7b-Q4_K_M.gguf out/fixtures/deepseek-v2-lite-Q4_K_M.gguf

Make the files with `python -m specdec.bench.fixtures --shape olmoe-1b-7b --quant Q4_K_M -o out/fixtures/`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TS = tuple(range(1, 9))


def llama_bench(bin_dir: str, path: str, threads: int, n: int, repeats: int) -> dict:
    """llama-bench's token-generation test (-p 0 -n n): tokens/s mean and stddev over its repetitions."""
    cmd = [str(Path(bin_dir) / "llama-bench"), "-m", path, "-p", "0", "-n", str(n), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr[-600:]}")
    row = json.loads(r.stdout)[0]
    return {"tok_s": row["avg_ts"], "stddev_tok_s": row["stddev_ts"], "ms_per_token": 1e3 / row["avg_ts"],
            "command": " ".join(cmd)}


def measure(path: str, a) -> dict:
    import torch

    from specdec.bench import roofline as rl
    from specdec.loader import load

    torch.set_num_threads(a.threads)
    loaded = load(path, quant=a.quant, ctx=a.context + 64)
    model = loaded.model
    print(f"{Path(path).name}: {loaded.load_summary()}, {model.weight_format}", file=sys.stderr, flush=True)
    layout = rl.moe_layout(model)
    wb = model.weight_bytes
    kvt = rl.kv_bytes_per_token(model.args, torch.empty((), dtype=model.dtype).element_size())
    stream = rl.measure_bandwidth(model.device, 512 * 2**20, repeats=5, kinds=("read",))["read"]
    flops_peak = rl.matmul_peak(model.dtype, model.device, 1024, repeats=3)
    kernel_rate = rl.measure_kernel_rate(model)  # the quantized kernel's marginal FLOP/s: what extra rows cost
    # plain decode: successive T = 1 forwards, last logits, argmax (as plain greedy decoding runs them)
    decode_s = rl.draft_cost(model, a.context, n_tokens=a.n, repeats=a.repeats, warmup=1)
    costs = rl.forward_costs(model, a.context, TS, exact=True, repeats=a.repeats, warmup=2)
    decode_bytes = wb + kvt * (a.context + (a.n + 1) / 2 + 1)  # weights + the KV read (mean context) and written
    row = {"model": Path(path).name, "path": str(path), "file_bytes": Path(path).stat().st_size,
           "weight_format": model.weight_format, "quant": model.quant, "dtype": str(model.dtype).removeprefix("torch."),
           "active_weight_bytes": wb, "kv_bytes_per_token": kvt, "context": a.context,
           "stream_read_gb_s": stream, "matmul_gflop_s": flops_peak / 1e9,
           "kernel_gflop_s": kernel_rate / 1e9 if kernel_rate else None,
           "decode_ms_per_token": decode_s * 1e3, "decode_gb_s_active": decode_bytes / decode_s / 1e9,
           "decode_share_of_stream": decode_bytes / decode_s / 1e9 / stream,
           "forward_ms": {str(t): costs[t] * 1e3 for t in TS}, "ratio_measured": {str(t): costs[t] / costs[1]
                                                                                 for t in TS}}
    if layout is not None:
        distinct = rl.measured_distinct_experts(model, a.context, TS)
        moe = rl.moe_report(model.args, layout, kvt, a.context, costs, distinct, stream * 1e9,
                            kernel_rate or flops_peak)
        row["moe"] = moe
        row["prediction_error"] = {  # predicted / measured - 1, per T
            key: {str(c["t"]): c[key] / c["measured_ratio"] - 1 for c in moe["curve"]}
            for key in ("moe_calibrated_ratio", "moe_measured_routing_calibrated_ratio", "moe_roofline_ratio",
                        "moe_overhead_ratio", "moe_measured_routing_overhead_ratio", "dense_calibrated_ratio")}
        for key in ("calibrated", "overhead"):
            row[f"max_abs_prediction_error_{key}"] = max(abs(v) for v in
                                                         row["prediction_error"][f"moe_{key}_ratio"].values())
    del loaded, model
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="GGUF paths (fixtures from specdec.bench.fixtures, or real files)")
    ap.add_argument("--llama-cpp", default=None, help="folder holding llama-bench (omit to skip llama.cpp)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the measured forwards")
    ap.add_argument("-n", type=int, default=32, help="decode tokens per timing (and llama-bench -n)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quant", default="auto", help="specdec's in-memory weight format (default auto)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    rows = []
    for path in a.models:
        peer = [llama_bench(a.llama_cpp, path, a.threads, a.n, a.repeats)] if a.llama_cpp else []
        row = measure(path, a)
        if a.llama_cpp:  # after specdec too: the machine is shared, so bracket our run
            peer.append(llama_bench(a.llama_cpp, path, a.threads, a.n, a.repeats))
            ms = statistics.median(p["ms_per_token"] for p in peer)
            row["llama_cpp"] = {"runs": peer, "ms_per_token": ms,
                                "gb_s_active": row["active_weight_bytes"] / ms * 1e3 / 1e9}
            row["specdec_over_llama_cpp_time"] = row["decode_ms_per_token"] / ms
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("moe", "prediction_error")}), file=sys.stderr,
              flush=True)

    print("| model | active MB/token | specdec ms/token | GB/s (active) | of STREAM read | llama.cpp ms/token | "
          "time ratio | max abs error of the MoE prediction, T<=8: calibrated / overhead |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        lc = r.get("llama_cpp")
        err, err2 = r.get("max_abs_prediction_error_calibrated"), r.get("max_abs_prediction_error_overhead")
        print(f"| {r['model']} | {r['active_weight_bytes'] / 1e6:.0f} | {r['decode_ms_per_token']:.1f} | "
              f"{r['decode_gb_s_active']:.1f} | {r['decode_share_of_stream']:.0%} | "
              f"{lc['ms_per_token'] if lc else float('nan'):.1f} | "
              f"{r.get('specdec_over_llama_cpp_time', float('nan')):.2f}x | "
              f"{'-' if err is None else f'{err:.0%} / {err2:.0%}'} |")
    for r in rows:
        if "moe" not in r:
            continue
        print(f"\n{r['model']}: v(T)/v(1) measured vs predicted (calibrated and overhead models, roofline.py's "
              "predicted_ratios; uniform and measured routing; dense same active)")
        print("| T | measured | MoE calibrated | measured routing | MoE overhead | measured routing | dense | "
              "experts/layer expected | measured |\n|---|---|---|---|---|---|---|---|---|")
        for c in r["moe"]["curve"]:
            print(f"| {c['t']} | {c['measured_ratio']:.2f} | {c['moe_calibrated_ratio']:.2f} | "
                  f"{c['moe_measured_routing_calibrated_ratio']:.2f} | {c['moe_overhead_ratio']:.2f} | "
                  f"{c['moe_measured_routing_overhead_ratio']:.2f} | {c['dense_calibrated_ratio']:.2f} | "
                  f"{c['expected_distinct']:.1f} | {c['measured_distinct']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "context": a.context, "n": a.n, "ts": list(TS),
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
