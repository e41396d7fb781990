"""specdec's n-gram drafting beside llama.cpp's lookup decoding (llama-lookup), same prompts, same run.

For Spec-Bench prompts (chat-formatted with the model's template, given to llama-lookup as text with its special
tokens), greedy, -n 256 stopping at EOS, 2 threads: llama-lookup with no draft (--spec-draft-n-max 0: its plain
decoding through the same loop) and with drafts of up to --llama-draft n-gram tokens (default 3, llama.cpp's own;
its n-gram cache looks up 1..4 tokens, LLAMA_NGRAM_MIN / MAX), then specdec plain and `--spec ngram` in this
process. Prints decode tok/s and the speedup of each over its own plain decoding, and whether each speculative text
equals its plain text (llama.cpp verifies a batch of drafted tokens with other float roundings than one token at a
time, so its greedy text can change; specdec's must not).

    python docs/results/lookup_peer.py LLAMA_CPP_BIN_DIR --prompts 8 [--llama-draft 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from specdec.bench.prompts import load_prompts  # noqa: E402
from specdec.bench.run import chat_prompt_ids  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.loader import load  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.spec import SpecConfig, build_proposer  # noqa: E402

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def llama_lookup(bin_dir: Path, model: str, prompt_file: str, draft: int) -> tuple[int, float, str]:
    """(tokens decoded, seconds, the generated text) of one llama-lookup run."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    r = subprocess.run([str(bin_dir / "llama-lookup"), "-m", model, "-f", prompt_file, "-n", "256", "-t", "2",
                        "--temp", "0", "-c", "4096", "--spec-draft-n-max", str(draft)],
                       capture_output=True, text=True, env=env, timeout=600)
    m = DECODED.search(r.stderr + r.stdout)
    if r.returncode or not m or not r.stdout.strip():  # the text comes on stdout: never compare two empty ones
        raise RuntimeError(f"llama-lookup failed (rc {r.returncode}): {r.stderr[-400:]}")
    return int(m.group(1)), float(m.group(2)), r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bin_dir", type=Path)
    ap.add_argument("--prompts", type=int, default=8, help="per category")
    ap.add_argument("--categories", default="summarization,rag")
    ap.add_argument("--llama-draft", type=int, default=3, help="llama-lookup's --spec-draft-n-max")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = load(None)
    tok = t.tokenizer
    bench = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"
    greedy = SamplingParams()
    rows = []
    print("| category | prompts | llama-lookup plain tok/s | llama-lookup n-gram tok/s | speedup | texts equal "
          "| specdec plain tok/s | specdec ngram tok/s | speedup | texts equal |")
    print("|---" * 10 + "|")
    for cat in a.categories.split(","):
        acc = {k: [0, 0.0] for k in ("llama_plain", "llama_lookup", "specdec_plain", "specdec_ngram")}
        same = {"llama": 0, "specdec": 0}
        prompts = load_prompts(bench, cat, a.prompts)
        for i, p in enumerate(prompts):
            print(f"\r{cat}: prompt {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
            ids = chat_prompt_ids(tok, p, chat=True)
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(tok.decode(ids))
            try:
                texts = {}
                for name, draft in (("llama_plain", 0), ("llama_lookup", a.llama_draft)):
                    n, s, texts[name] = llama_lookup(a.bin_dir, str(t.path), f.name, draft)
                    acc[name][0] += n
                    acc[name][1] += s
            finally:
                os.unlink(f.name)
            same["llama"] += texts["llama_plain"] == texts["llama_lookup"]
            outs = {}
            for name, kind in (("specdec_plain", "none"), ("specdec_ngram", "ngram")):
                spec = SpecConfig(kind=kind)
                r = generate(t.model, tok, ids, greedy, max_tokens=256, proposer=build_proposer(spec, t, greedy),
                             draft_length=spec.policy())
                outs[name] = r.tokens
                acc[name][0] += r.stats.generated_tokens - 1
                acc[name][1] += r.stats.decode_s
            same["specdec"] += outs["specdec_plain"] == outs["specdec_ngram"]
        print(file=sys.stderr)
        rate = {k: n / s for k, (n, s) in acc.items()}
        row = {"category": cat, "prompts": len(prompts), **{f"{k}_tok_s": v for k, v in rate.items()},
               "llama_same_texts": same["llama"], "specdec_same_texts": same["specdec"]}
        rows.append(row)
        print(f"| {cat} | {len(prompts)} | {rate['llama_plain']:.1f} | {rate['llama_lookup']:.1f} | "
              f"{rate['llama_lookup'] / rate['llama_plain']:.2f}x | {same['llama']}/{len(prompts)} | "
              f"{rate['specdec_plain']:.1f} | {rate['specdec_ngram']:.1f} | "
              f"{rate['specdec_ngram'] / rate['specdec_plain']:.2f}x | {same['specdec']}/{len(prompts)} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
