"""Two checkouts of specdec A/B, end to end: `specdec generate` from each, alternated run by run (one process per
run: only ratios measured side by side count on these hosts), over prompt files and speculation modes; medians of the
decode tok/s from each run's --json, and a check that both checkouts generated the same tokens.

    git worktree add /tmp/old <commit>
    python docs/results/tree_ab.py --old /tmp/old --new . --prompt /tmp/long.txt --spec none,auto --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(tree: Path, prompt: Path, spec: str, n: int, extra: list[str]) -> dict:
    """One `specdec generate` from checkout `tree` (its own package first on the path) -> its --json."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "specdec", "generate", "-f", str(prompt), "--chat", "-n", str(n), "--temp", "0",
               "--ignore-eos", "--spec", spec, "--json", out.name, *extra]
        subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--prompt", type=Path, action="append", required=True, help="a prompt file (repeatable)")
    ap.add_argument("--spec", default="none,auto")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a, extra = ap.parse_known_args()
    rows = []
    for prompt in a.prompt:
        for spec in a.spec.split(","):
            speeds: dict[str, list[float]] = {"old": [], "new": []}
            tokens, ctx = {}, 0
            for _ in range(a.rounds):
                for name in ("old", "new"):
                    r = run(getattr(a, name), prompt.resolve(), spec, a.n, extra)
                    speeds[name].append(r["stats"]["decode_tok_s"])
                    tokens[name], ctx = r["tokens"], r["stats"]["prompt_tokens"]
            old, new = (statistics.median(speeds[k]) for k in ("old", "new"))
            row = {"prompt": prompt.name, "prompt_tokens": ctx, "spec": spec, "old": speeds["old"],
                   "new": speeds["new"], "ratio": new / old, "same_tokens": tokens["old"] == tokens["new"]}
            rows.append(row)
            print(f"{prompt.name} ({ctx} prompt tokens) --spec {spec}: old {old:.1f}, new {new:.1f} tok/s "
                  f"({new / old:.3f}x), same tokens: {row['same_tokens']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
