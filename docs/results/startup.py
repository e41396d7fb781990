"""Whole-process `generate -n 64` against llama.cpp's `llama-completion` on the same files: wall time and peak RSS
(GNU time), interleaved, medians of --repeats, and the summed RSS of each one's process tree (sampled in a run of
its own: specdec's generate encodes the prompt in a helper process). specdec runs with its layout cache warm (a
first run converts and is reported apart), llama.cpp with -c 4096 like specdec's default context.

    python docs/results/startup.py --llama-cpp /path/to/llama.cpp/build/bin --json docs/results/startup.json \\
        smollm2 gemma3-270m /path/to/llama-3.1-8b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "The capital of France is"


# Python as installed: bytecode cached (PYTHONDONTWRITEBYTECODE, set on some hosts, made every run compile specdec's
# modules from source again: ~45 ms a run here; the first run below writes the cache)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stderr) of one command under GNU time."""
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], capture_output=True, text=True, timeout=3600,
                       env=ENV)
    m = re.search(r"TIME ([\d.]+) (\d+)", r.stderr)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{cmd[0]} failed: {r.stderr[-400:]}")
    return float(m[1]), int(m[2]) / 1024, r.stderr


def tree_rss_mb(pid: int) -> float:
    """Resident MB of a process and all its descendants now (/proc: statm, and each task's children list)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def tree_peak(cmd: list[str], runs: int = 3) -> float:
    """Peak MB of the summed RSS of a command's whole process tree, sampled every 5 ms in runs of its own, median of
    `runs` (GNU time's %M is the largest single process's peak: a helper process beside the main one would not
    count)."""
    import time

    peaks = []
    for _ in range(runs):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, tree_rss_mb(proc.pid))
            time.sleep(0.005)
        peaks.append(peak)
    return statistics.median(peaks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="aliases or GGUF paths")
    ap.add_argument("--llama-cpp", required=True, help="folder holding llama-completion")
    ap.add_argument("--specdec", default=str(Path(sys.executable).with_name("specdec")))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from specdec.loader import resolve_model_path

    rows = []
    for model in a.models:
        path = str(resolve_model_path(model))
        ours = [a.specdec, "generate", "-m", model, "-p", PROMPT, "-n", "64", "--temp", "0", "--spec", "none",
                "--ignore-eos"]
        theirs = [str(Path(a.llama_cpp) / "llama-completion"), "-m", path, "-p", PROMPT, "-n", "64", "--temp", "0",
                  "-t", "2", "-c", "4096", "-no-cnv", "--ignore-eos"]
        first = timed(ours)  # converts the layout if it is not cached yet
        got: dict[str, list[tuple[float, float]]] = {"specdec": [], "llama.cpp": []}
        load_s = []
        for _ in range(a.repeats):
            w, m, err = timed(ours)
            got["specdec"].append((w, m))
            load_s.append(float(re.search(r"load ([\d.]+) s", err)[1]))
            w, m, _ = timed(theirs)
            got["llama.cpp"].append((w, m))
        med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for k, v in got.items()}
        tree = {"specdec": tree_peak(ours), "llama.cpp": tree_peak(theirs)}
        row = {"model": model, "file_mb": Path(path).stat().st_size / 2**20, "first_run_wall_s": first[0],
               "first_run_rss_mb": first[1], "specdec_wall_s": med["specdec"][0], "specdec_rss_mb": med["specdec"][1],
               "specdec_load_s": statistics.median(load_s), "llama_wall_s": med["llama.cpp"][0],
               "llama_rss_mb": med["llama.cpp"][1], "specdec_tree_rss_mb": tree["specdec"],
               "llama_tree_rss_mb": tree["llama.cpp"]}
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print("| model | file | specdec load (cached) | specdec wall / peak RSS | llama.cpp wall / peak RSS | wall ratio | "
          "RSS ratio | process-tree peak, sampled: specdec / llama.cpp |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['file_mb']:.0f} MB | {r['specdec_load_s']:.2f} s | {r['specdec_wall_s']:.2f} s / "
              f"{r['specdec_rss_mb']:.0f} MB | {r['llama_wall_s']:.2f} s / {r['llama_rss_mb']:.0f} MB | "
              f"{r['specdec_wall_s'] / r['llama_wall_s']:.2f}x | {r['specdec_rss_mb'] / r['llama_rss_mb']:.2f}x | "
              f"{r['specdec_tree_rss_mb']:.0f} / {r['llama_tree_rss_mb']:.0f} MB |")
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt": PROMPT, "n": 64, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
