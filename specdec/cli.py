"""Command line: `specdec generate | bench`, with flags as llama.cpp users know them.

Every user-facing failure is one line on stderr and a non-zero exit (a traceback only with SPECDEC_DEBUG=1).
"""

from __future__ import annotations

import argparse
import os
import sys

# PyTorch's CPU allocator backs large tensors with transparent huge pages when asked to; the weight matrices then
# cost fewer TLB misses (~4% faster decode measured on SmolLM2). Must be set before torch is imported.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded from a model hub


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct Q4_1; "
                        "aliases: smollm2, gemma3-270m)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context window in tokens (default 4096)")
    p.add_argument("--dtype", default="auto", help="activations: auto, f32, bf16, f16 (auto: bf16 with quantized "
                                                   "weights on CPU and on GPUs, else f32)")
    p.add_argument("--quant", default="auto", help="weights: auto, none, int8, int4 (auto: a quantized GGUF stays "
                                                   "quantized on CPU, see README)")
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling, 0 = off (default 0.05)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random (default -1)")


def _speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("-md", "--model-draft", default=None, help="draft model (GGUF or HF folder) with the target's "
                                                               "vocabulary; implies --spec draft")
    p.add_argument("--spec", default=None, help="speculation: none, draft, ngram (default: draft when -md is given, "
                                               "else none)")
    p.add_argument("--draft-max", default="auto", help="most tokens per draft, or auto: choose each step's draft "
                                                       "length (0..8) from measured acceptance and costs (default)")
    p.add_argument("--draft-min", type=int, default=0, help="drafts shorter than this are not verified (default 0)")
    p.add_argument("--draft-p-min", type=float, default=0.8, help="stop drafting when the draft model's top "
                                                                   "probability falls below P (default 0.8)")
    p.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram to look up (default 2)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest n-gram to look up (default 4)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Fast local LLM inference through lossless "
                                     "speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _common(g)
    _sampling(g)
    _speculative(g)
    g.add_argument("-p", "--prompt", default=None, help="prompt text")
    g.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    g.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (default 256)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-sys", "--system", default=None, help="system message (with --chat)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--json", default=None, help="also write the result and statistics as JSON to this file")

    b = sub.add_parser("bench", help="benchmark decoding modes side by side")
    _common(b)
    _speculative(b)
    b.add_argument("--mode", default=None, help="comma-separated modes to run: plain, draft (needs -md), ngram "
                                                "(default: all that apply)")
    b.add_argument("--prompts", default=None, help="JSONL prompts (Spec-Bench question.jsonl or {\"prompt\": ...})")
    b.add_argument("--category", default=None, help="only prompts of these Spec-Bench categories (comma-separated)")
    b.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    b.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate per prompt (default 128)")
    b.add_argument("--repeats", type=int, default=3, help="runs per prompt and mode; the median is reported")
    b.add_argument("--peer", action="append", default=[], help="also run a peer engine: hf")
    b.add_argument("--json", default=None, help="write every number to this JSON file")
    b.add_argument("--no-chat", action="store_true", help="use prompts as raw text instead of the chat template")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = os.environ.get("SPECDEC_DEBUG") == "1"
    try:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            from .bench.run import cmd_bench

            return cmd_bench(args)
        raise AssertionError(args.command)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure becomes one line; SPECDEC_DEBUG=1 shows the traceback
        if debug:
            raise
        from .cache import ContextFull
        from .config import ModelError

        kind = "" if isinstance(e, ModelError | ContextFull | ValueError | OSError) else f"{type(e).__name__}: "
        print(f"error: {kind}{e}", file=sys.stderr)
        return 1


def progress_bar(desc: str):
    """A tqdm progress bar on stderr for loading; returns (callback(i, n), close())."""
    from tqdm import tqdm

    bar = None

    def update(i: int, n: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=n, desc=desc, unit="layer", file=sys.stderr, leave=False,
                       disable=not sys.stderr.isatty())
        bar.n = i
        bar.refresh()

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def load_model(args, which: str = "model"):
    from .loader import load

    update, close = progress_bar(f"loading {which.replace('_', ' ')}")
    try:
        return load(getattr(args, which), dtype=args.dtype, quant=args.quant, device=args.device,
                    ctx=args.ctx_size, progress=update)
    finally:
        close()


def spec_kind(args) -> str:
    kind = args.spec or ("draft" if args.model_draft else "none")
    if kind == "draft" and not args.model_draft:
        raise ValueError("--spec draft needs a draft model: give -md DRAFT")
    if args.draft_min < 0:
        raise ValueError("--draft-min must be >= 0")
    for v in str(args.draft_max).split(","):
        draft_length(v, 0)  # validates
    return kind


def draft_length(value: str, draft_min: int):
    """A draft-length policy from a --draft-max value: "auto" or a number of tokens."""
    from .spec.autok import AutoDraftLength, FixedDraftLength

    if value == "auto":
        return AutoDraftLength(8, draft_min)
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--draft-max must be auto or a number, not '{value}'") from None
    if k < 0:
        raise ValueError("--draft-max must be >= 0")
    return FixedDraftLength(k, draft_min)


def format_spec_stats(s, kind: str) -> str:
    """The speculative-decoding summary lines (vLLM's counters)."""
    if s.drafted == 0:
        return f"speculative ({kind}): no drafts were proposed"
    per_pos = " ".join(f"{a:.0%}" for a in s.acceptance_per_position)
    other = max(0.0, s.decode_s - s.draft_s - s.verify_s)
    return (f"speculative ({kind}): {s.drafts} drafts, {s.drafted} drafted, {s.accepted} accepted "
            f"({s.acceptance_rate:.1%}); per position {per_pos}; mean accepted length {s.mean_accepted_length:.2f} "
            f"tokens per target forward\ntime: drafting {s.draft_s:.2f} s, verification {s.verify_s:.2f} s, "
            f"other {other:.2f} s")


def read_prompt(args) -> str:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is None:
        raise ValueError("no prompt: give -p TEXT or -f FILE")
    return args.prompt


def prompt_tokens(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode_chat(messages)


def cmd_generate(args) -> int:
    import json

    from .generate import generate
    from .sampling import SamplingParams

    text = read_prompt(args)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=None if args.seed < 0 else args.seed)
    params.validate()
    if args.n_predict <= 0:
        raise ValueError("-n must be > 0")
    kind = spec_kind(args)
    target = load_model(args)
    draft = load_model(args, "model_draft") if kind == "draft" else None
    from .spec import build_proposer

    proposer = build_proposer(kind, target, params, draft, args.draft_p_min, args.ngram_min, args.ngram_max)
    ids = prompt_tokens(target.tokenizer, text, args.chat, args.system)

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(target.model, target.tokenizer, ids, params, max_tokens=args.n_predict, stop=args.stop,
                      on_text=on_text, ignore_eos=args.ignore_eos, proposer=proposer,
                      draft_length=draft_length(args.draft_max, args.draft_min))
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = result.stats
    print(f"\nload {target.load_seconds:.2f} s ({target.file_type}, {target.model.quant} weights, "
          f"{str(target.model.dtype).removeprefix('torch.')} activations) | prompt {s.prompt_tokens} tokens, "
          f"{s.prefill_tok_s:.1f} tok/s | generated {s.generated_tokens} tokens, {s.decode_tok_s:.1f} tok/s | "
          f"finish: {result.finish_reason}", file=sys.stderr)
    if proposer is not None:
        print(format_spec_stats(s, kind), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                       "load_s": target.load_seconds, "stats": s.to_dict()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
