"""Peer engines for `specdec bench --peer`, run on the same model files and prompts in the same run.

- `hf`: Hugging Face transformers `generate` (greedy) on the same GGUF / folder (dequantized, fp32): plain, prompt
  lookup (`prompt_lookup_num_tokens=10`), and assisted generation (`assistant_model`) when a draft model is given.
  Decode time = time(n tokens) - time(1 token), so the prefill is excluded as for specdec.
- `llama.cpp:DIR`: a llama.cpp build the user points at: `llama-completion` or `llama-cli` (plain; `llama-simple`
  if neither was built, which runs llama.cpp's default thread count), `llama-lookup` (n-gram) and
  `llama-speculative` (draft model), greedy, at the same -n and threads; decode speed is parsed from their own
  reports (the "eval time" line of llama_perf_context_print for plain decoding, "decoded N tokens in S seconds" for
  the speculative tools, which exclude the prompt).

Each peer returns (decode seconds, tokens or None, counters) per prompt.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import torch


class HFPeer:
    """transformers `generate`, greedy; mode plain / prompt-lookup / assisted."""

    def __init__(self, model, mode: str = "plain", assistant=None):
        self.model, self.mode, self.assistant = model, mode, assistant
        self.name = {"plain": "hf", "lookup": "hf prompt-lookup", "assisted": "hf assisted"}[mode]
        self.models = "target (fp32)" + (" + draft" if mode == "assisted" else "")
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    @staticmethod
    def load(path: Path, dtype: torch.dtype = torch.float32):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF conversion bar
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        try:
            if path.is_dir():
                return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        finally:
            os.environ.pop("TQDM_DISABLE", None)

    def run(self, ids: list[int], text: str, n: int) -> tuple[float, list[int] | None, dict]:
        x = torch.tensor([ids])
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        if self.mode == "lookup":
            kw["prompt_lookup_num_tokens"] = 10
        elif self.mode == "assisted":
            kw["assistant_model"] = self.assistant
        with torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            out = self.model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
            tn = time.perf_counter() - t
        return max(tn - t1, 1e-9), out[0, len(ids):].tolist(), {}


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_EVAL = re.compile(r"(?<!prompt )\beval time\s*=\s*([\d.]+) ms /\s*(\d+) runs")
_COUNT = re.compile(r"\b(n_drafted|n_accept|n_draft)\s*=\s*(\d+)")


def parse_llama_output(text: str) -> tuple[float, int, dict]:
    """(decode seconds, decoded tokens, counters) from a llama.cpp tool's log."""
    counters = {k: int(v) for k, v in _COUNT.findall(text)}
    m = _DECODED.search(text)
    if m:
        return float(m.group(2)), int(m.group(1)), counters
    evals = _EVAL.findall(text)
    if evals:
        ms, runs = evals[-1]
        return float(ms) / 1000.0, int(runs), counters
    raise ValueError("no timing found in llama.cpp's output (is it a llama.cpp build of 2024 or later?)")


class LlamaCppPeer:
    """A llama.cpp build: llama-simple / llama-lookup / llama-speculative on the same GGUF files."""

    TOOLS = {"plain": ("llama-completion", "llama-cli", "llama-simple"), "lookup": ("llama-lookup",),
             "speculative": ("llama-speculative",)}

    def __init__(self, build_dir: str | Path, mode: str, model: Path, draft: Path | None = None,
                 draft_max: int = 4, threads: int | None = None):
        self.dir = Path(build_dir)
        exe = next((e for e in (self.find(self.dir, tool) for tool in self.TOOLS[mode]) if e), None)
        if exe is None:
            raise ValueError(f"{' / '.join(self.TOOLS[mode])} not found under {self.dir}: point --peer llama.cpp:DIR "
                             f"at a llama.cpp build (its bin/ folder or the build folder)")
        self.exe, self.mode, self.model, self.draft = exe, mode, model, draft
        self.draft_max, self.threads = draft_max, threads or torch.get_num_threads()
        self.name = {"plain": "llama.cpp", "lookup": "llama.cpp lookup", "speculative": "llama.cpp speculative"}[mode]
        self.models = "target (GGUF)" + (" + draft" if mode == "speculative" else "")
        self.weight_bytes = model.stat().st_size

    @staticmethod
    def find(build_dir: Path, tool: str) -> Path | None:
        for cand in (build_dir / tool, build_dir / "bin" / tool, build_dir / "build" / "bin" / tool):
            if cand.is_file() and os.access(cand, os.X_OK):
                return cand
        return None

    def command(self, text: str, n: int) -> list[str]:
        if self.exe.name == "llama-simple":  # takes no sampling or thread flags: greedy, default threads
            return [str(self.exe), "-m", str(self.model), "-n", str(n), text]
        cmd = [str(self.exe), "-m", str(self.model), "-p", text, "-n", str(n), "--temp", "0", "-t", str(self.threads),
               "-c", "4096", "--ignore-eos"]  # n tokens every run, as the specdec rows count them per token
        if self.mode == "plain":
            return cmd + ["-no-cnv"]  # one completion, no chat loop
        cmd += [self.draft_flag(), str(self.draft_max)]
        if self.mode == "speculative":
            cmd += ["-md", str(self.draft)]
        return cmd

    def draft_flag(self) -> str:
        """The draft-length flag this build takes: `--spec-draft-n-max` in recent llama.cpp, `--draft-max` before
        (read once from the tool's -h)."""
        if not hasattr(self, "_draft_flag"):
            r = subprocess.run([str(self.exe), "-h"], capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
            self._draft_flag = "--spec-draft-n-max" if "--spec-draft-n-max" in r.stdout + r.stderr else "--draft-max"
        return self._draft_flag

    def run(self, ids: list[int], text: str, n: int) -> tuple[float, list[int] | None, dict]:
        r = subprocess.run(self.command(text, n), capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise ValueError(f"{self.exe.name} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        seconds, tokens, counters = parse_llama_output(r.stderr + r.stdout)
        if tokens <= 0 or seconds <= 0:  # it stopped at once: no decode speed to report (the row shows "-")
            return 0.0, None, counters
        # report per n - 1 tokens like the other rows
        return seconds * (n - 1) / tokens, None, counters


def build_peers(specs: list[str], target, draft, draft_max: str) -> list:
    """Peer objects for the --peer values (hf, llama.cpp:DIR)."""
    peers = []
    for spec in specs:
        if spec == "hf":
            model = HFPeer.load(target.path)
            peers += [HFPeer(model, "plain"), HFPeer(model, "lookup")]
            if draft is not None:
                peers.append(HFPeer(model, "assisted", HFPeer.load(draft.path)))
        elif spec.startswith("llama.cpp:"):
            if target.path.is_dir():
                raise ValueError("--peer llama.cpp needs GGUF files")
            k = int(draft_max) if str(draft_max).isdigit() else 4
            d = spec.split(":", 1)[1]
            peers += [LlamaCppPeer(d, "plain", target.path), LlamaCppPeer(d, "lookup", target.path, draft_max=k)]
            if draft is not None:
                peers.append(LlamaCppPeer(d, "speculative", target.path, draft.path, draft_max=k))
        else:
            raise ValueError(f"unknown --peer '{spec}': use hf or llama.cpp:DIR")
    return peers


def batched_peer(build_dir: str, model: Path, batches: list[int], n: int, threads: int | None = None,
                 prompt_len: int = 128) -> list[dict]:
    """llama.cpp's llama-batched-bench on the same file: text-generation throughput (S_TG, all sequences together)
    for each batch size, prompt_len prompt tokens and n generated tokens per sequence."""
    exe = LlamaCppPeer.find(Path(build_dir), "llama-batched-bench")
    if exe is None:
        raise ValueError(f"llama-batched-bench not found under {build_dir}")
    cmd = [str(exe), "-m", str(model), "-c", str(max(batches) * (prompt_len + n) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(n), "-npl", ",".join(map(str, batches)), "-t",
           str(threads or torch.get_num_threads())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise ValueError(f"llama-batched-bench failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return parse_batched_bench(r.stdout + r.stderr)


def parse_batched_bench(text: str) -> list[dict]:
    """Rows of llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ..."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit() and cells[2].isdigit():
            out.append({"pp": int(cells[0]), "tg": int(cells[1]), "batch": int(cells[2]),
                        "pp_tok_s": float(cells[5]), "tg_tok_s": float(cells[7])})
    if not out:
        raise ValueError("no table found in llama-batched-bench's output")
    return out
