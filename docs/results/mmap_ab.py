"""`specdec generate` with the cached layout mapped (--mmap) and read into memory in 2 MB pages (--no-mmap), one
process per run, alternated for --rounds: load seconds, prompt and decode tok/s from the summary line, peak RSS
(GNU time). Medians per model and mode.

    python docs/results/mmap_ab.py --rounds 3 -n 256 smollm2 gemma3-270m /path/to/llama-3.2-1b-Q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(cmd: list[str]) -> dict:
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(r.stderr[-500:])
    err = r.stderr
    return {"load_s": float(re.search(r"load ([\d.]+) s", err)[1]),
            "prompt_tok_s": float(re.search(r"prompt \d+ tokens, ([\d.]+) tok/s", err)[1]),
            "decode_tok_s": float(re.search(r"generated \d+ tokens, ([\d.]+) tok/s", err)[1]),
            "wall_s": float(re.search(r"TIME ([\d.]+) (\d+)", err)[1]),
            "rss_mb": int(re.search(r"TIME ([\d.]+) (\d+)", err)[2]) / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--spec", default="none")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    exe = str(Path(sys.executable).with_name("specdec"))
    rows = []
    for model in a.models:
        got: dict[str, list[dict]] = {"--mmap": [], "--no-mmap": []}
        base = [exe, "generate", "-m", model, "-p", PROMPT, "-n", str(a.n), "--temp", "0", "--spec", a.spec,
                "--ignore-eos"]
        run(base + ["-n", "4"])  # the layout converted and cached, if it was not
        for _ in range(a.rounds):
            for flag, runs in got.items():
                runs.append(run(base + [flag]))
        med = {flag: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for flag, runs in got.items()}
        rows.append({"model": model, "runs": got, "median": med})
        m, r = med["--mmap"], med["--no-mmap"]
        print(f"{model}: decode {m['decode_tok_s']:.1f} -> {r['decode_tok_s']:.1f} tok/s "
              f"({r['decode_tok_s'] / m['decode_tok_s']:.2f}x), prompt {m['prompt_tok_s']:.0f} -> "
              f"{r['prompt_tok_s']:.0f}, load {m['load_s']:.2f} -> {r['load_s']:.2f} s, wall {m['wall_s']:.2f} -> "
              f"{r['wall_s']:.2f} s, peak RSS {m['rss_mb']:.0f} -> {r['rss_mb']:.0f} MB", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"n": a.n, "spec": a.spec, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
