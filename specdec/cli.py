"""Command line: `specdec generate | bench | roofline | train-mtp | make-data | export-heads | serve | bench-serve`,
with flags as llama.cpp users know them.

Every user-facing failure is one line on stderr and a non-zero exit (a traceback only with SPECDEC_DEBUG=1).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

# PyTorch's CPU allocator backs large tensors with transparent huge pages when asked to; the weight matrices then
# cost fewer TLB misses (~4% faster decode measured on SmolLM2). Must be set before torch is imported.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded from a model hub


def at_least(lo: int):
    """An argparse type: an integer >= lo (argparse then says which flag was wrong, in one line)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, not {value}")
        return value

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct Q4_1; "
                        "aliases: smollm2, gemma3-270m)")
    p.add_argument("-t", "--threads", type=at_least(1), default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=at_least(0), default=None,
                   help="context window in tokens (default and 0: 4096, or the model's trained context if shorter); "
                        "more than the trained context is allowed, with a warning")
    p.add_argument("--dtype", default="auto", help="activations: auto, f32, bf16, f16 (auto: bf16 with quantized "
                                                   "weights on CPU and on GPUs, else f32)")
    p.add_argument("--quant", default="auto", help="weights: auto, none, int8, int4 (auto: a quantized GGUF stays "
                                                   "quantized on CPU, see README)")
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    p.add_argument("--mmap", dest="use_mmap", action=argparse.BooleanOptionalAction, default=None,
                   help="map the cached weights (--mmap) or read them into memory in 2 MB pages (--no-mmap: faster "
                        "decoding, slower loading; default: read when they take at most 1 GiB, always in serve)")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling, 0 = off (default 0.05)")
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed, -1 = random (default -1)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize repeating the last --repeat-last-n "
                                                                     "tokens, 1 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the repeat penalty looks back, -1 = the "
                                                                 "whole context (default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty over the generated "
                                                                       "tokens, 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty over the generated "
                                                                        "tokens, 0 = off")
    p.add_argument("-l", "--logit-bias", action="append", default=[], help="TOKEN_ID(+/-)BIAS added to a token's "
                                                                          "logit, e.g. 15043+1 or 15043-inf "
                                                                          "(repeatable)")


def _speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("-md", "--model-draft", default=None, help="draft model (GGUF or HF folder) with the target's "
                                                               "vocabulary; implies --spec draft")
    p.add_argument("--spec", default=None, help="speculation: auto, none, draft, ngram, suffix, mtp (default: draft "
                                               "when -md is given, else auto: each step the best of suffix and "
                                               "n-gram lookup and the model's MTP heads, or no draft)")
    p.add_argument("--heads", default=None, help="MTP heads file from `specdec train-mtp` (default: the model's own "
                                                 "MTP modules, or heads shipped with specdec for it)")
    p.add_argument("--tree", nargs="?", const="2,2", default=None, help="MTP tree drafts: top-k branching per depth, "
                                                                      "e.g. 3,2,1 (--tree alone: 2,2)")
    p.add_argument("--draft-max", default="auto", help="most tokens per draft, or auto: choose each step's draft "
                                                       "length (0..8) from measured acceptance and costs (default)")
    p.add_argument("--draft-min", type=int, default=0, help="drafts shorter than this are not verified (default 0)")
    p.add_argument("--draft-p-min", type=float, default=0.8, help="stop drafting when the draft model's top "
                                                                   "probability falls below P (default 0.8)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram to look up (default 1)")
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
    g.add_argument("-f", "--file", default=None, help="read the prompt from a file; a .jsonl file holds several "
                                                     "prompts ({\"prompt\": ...} or Spec-Bench rows), generated "
                                                     "--batch at a time, one JSON line out per prompt")
    g.add_argument("--batch", type=int, default=8, help="prompts decoded together with -f FILE.jsonl (default 8)")
    g.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (default 256)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-sys", "--system", default=None, help="system message (turns --chat on)")
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
    b.add_argument("--limit", type=at_least(1), default=None, help="at most this many prompts per category")
    b.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate per prompt (default 128)")
    b.add_argument("--repeats", type=at_least(1), default=3,
                   help="runs per prompt and mode (with --batch: rounds of the lockstep measure, batch sizes "
                        "interleaved); the median is reported")
    b.add_argument("--batch", default=None, help="batched throughput instead: comma-separated batch sizes, e.g. "
                                                 "1,2,4,8,16 (every prompt through the engine, that many at a "
                                                 "time; aggregate and per-sequence tok/s)")
    b.add_argument("--peer", action="append", default=[], help="also run a peer engine in the same run: hf "
                                                               "(transformers), llama.cpp:DIR (a llama.cpp build)")
    b.add_argument("--json", default=None, help="write every number to this JSON file")
    b.add_argument("--png", default=None, help="bar chart of tok/s per mode and category, and acceptance per "
                                               "draft position, to this PNG")
    b.add_argument("--no-chat", action="store_true", help="use prompts as raw text instead of the chat template")
    b.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens, past end-of-sequence "
                                                             "(default: stop there, as Spec-Bench does)")

    r = sub.add_parser("roofline", help="measure this machine's bandwidth and FLOP/s and the model's forward cost "
                                        "over T tokens; predict the speedup of each draft length")
    _common(r)
    r.add_argument("-md", "--model-draft", default=None, help="also measure this draft model's cost per drafted "
                                                               "token (default: n-gram drafting, cost 0)")
    r.add_argument("--context", type=int, default=256, help="tokens already in the KV cache (default 256)")
    r.add_argument("--alpha", default="0.7", help="acceptance rate(s) for the predictions, e.g. 0.5,0.7,0.9 "
                                                   "(default 0.7)")
    r.add_argument("--png", default=None, help="write the roofline and predicted-speedup figure to this PNG")
    r.add_argument("--json", default=None, help="write every number to this JSON file")
    r.add_argument("--quick", action="store_true", help="small arrays, few T values and repeats (a smoke test)")

    d = sub.add_parser("demo", help="the same prompts decoded plainly and with the default speculation, side by side")
    _common(d)
    d.add_argument("-n", "--n-predict", type=int, default=160, help="tokens per answer (default 160)")
    d.add_argument("--repeats", type=at_least(1), default=3,
                   help="rounds of plain then speculative decoding per prompt, speeds and speedup their medians "
                        "(default 3: one short run swings with this machine's speed)")

    t = sub.add_parser("train-mtp", help="train MTP heads for a model by self-distillation")
    _common(t)
    t.add_argument("-o", "--output", required=True, help="heads file to write (.safetensors)")
    t.add_argument("--kind", default="sequential", help="sequential (DeepSeek-V3-style modules), parallel (Medusa "
                                                        "heads) or eagle3 (EAGLE-3: fused low/mid/high features, "
                                                        "training-time test); default sequential")
    t.add_argument("--depth", type=at_least(1), default=1,
                   help="modules / heads to train; eagle3: training-time-test steps (default 1)")
    t.add_argument("--data", default=None, help="train on the answers of a `specdec make-data` JSONL instead of "
                                                "generating them from --prompts")
    t.add_argument("--decay", type=float, default=1.0, help="eagle3: loss weight decay^k of step k (default 1)")
    t.add_argument("--data-tokens", type=at_least(0), default=0,
                   help="with --data: train on a seeded random subset of about this many tokens (default all)")
    t.add_argument("--prompts", default=None, help="training prompts JSONL (self-instruct seed tasks or "
                                                   "{\"prompt\": ...}); default shared/data/"
                                                   "train_prompts_seed_tasks.jsonl beside the project")
    t.add_argument("--samples", type=at_least(1), default=2, help="answers the model writes per prompt (default 2)")
    t.add_argument("--max-new", type=at_least(1), default=160, help="tokens per answer (default 160)")
    t.add_argument("--temp", type=float, default=0.8, help="sampling temperature of the answers (default 0.8)")
    t.add_argument("--epochs", type=at_least(1), default=4, help="passes over the data (default 4)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    t.add_argument("--vocab", type=at_least(0), default=8192, help="draft vocabulary size, 0 = full (default 8192)")
    t.add_argument("--ffn", type=at_least(0), default=0, help="FFN width of a sequential module (default: the model's)")
    t.add_argument("--feature-weight", type=float, default=1.0, help="weight of the feature-regression loss "
                                                                    "(EAGLE); 0 = distillation only (default 1)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    t.add_argument("--noise", type=float, default=0.0, help="std of noise on input hidden states (default 0)")
    t.add_argument("--limit", type=at_least(1), default=None, help="use only the first N prompts (default all)")
    t.add_argument("-s", "--seed", type=int, default=0, help="seed (default 0)")
    t.add_argument("--work", default=None, help="work directory for resumable stages (default OUTPUT.work)")

    md = sub.add_parser("make-data", help="self-generated training data (Magpie): the model writes prompts, then "
                                          "answers them")
    _common(md)
    md.add_argument("-o", "--output", required=True, help="JSONL file to write, one line per prompt (a partial one "
                                                         "is continued); settings and filter counts in "
                                                         "OUTPUT.meta.json")
    md.add_argument("--n-prompts", type=int, default=1000, help="Magpie prompts to keep, past the filters (default "
                                                                "1000)")
    md.add_argument("--temps", default="0,0.5,0.8,1.0", help="answer temperatures, one answer each, 0 = greedy "
                                                             "(default 0,0.5,0.8,1.0)")
    md.add_argument("--max-new", type=int, default=256, help="tokens per answer (default 256)")
    md.add_argument("--prompt-temp", type=float, default=1.0, help="temperature of the prompts (default 1.0)")
    md.add_argument("--prompt-max", type=int, default=96, help="tokens per prompt; longer ones are dropped "
                                                               "(default 96)")
    md.add_argument("--seed-prompts", default=None, help="seed prompts answered first (self-instruct seed tasks or "
                                                        "{\"prompt\": ...}), or none (default ../shared/data/"
                                                        "train_prompts_seed_tasks.jsonl)")
    md.add_argument("--batch", type=int, default=8, help="sequences per engine run (default 8)")
    md.add_argument("--no-filter", action="store_true", help="keep every prompt except empty ones and Spec-Bench "
                                                             "look-alikes (no length, loop, language, dedup filters)")
    md.add_argument("-s", "--seed", type=int, default=0, help="seed (default 0)")

    x = sub.add_parser("export-heads", help="write a heads file as a checkpoint vLLM / SGLang load")
    _common(x)
    x.add_argument("file", help="heads file from `specdec train-mtp`, trained for -m MODEL")
    x.add_argument("--format", required=True, help="speculators or eagle3 (EAGLE-3 heads), medusa (parallel heads), "
                                                  "deepseek-mtp (sequential modules)")
    x.add_argument("-o", "--output", required=True, help="directory to write (config.json, model.safetensors)")
    x.add_argument("--verifier", default=None, help="speculators format: the target's Hugging Face id or path, "
                                                    "recorded as the verifier (default: none)")

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: continuous batching, speculative decoding")
    _common(sv)
    _speculative(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    sv.add_argument("-np", "--parallel", type=int, default=4, help="requests decoded together, the engine's slots "
                                                                  "(default 4)")
    sv.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false",
                    help="prefill every request's whole prompt (default: a prompt that begins with a finished "
                         "request's text reuses its keys and values, as llama-server's cache_prompt; exact)")
    sv.add_argument("--max-queue", type=int, default=None, help="requests that may wait for a slot; more get 503 "
                                                                "with Retry-After (default 4 x --parallel)")
    sv.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), help="require 'Authorization: Bearer "
                                                                                 "KEY' (default: $SPECDEC_API_KEY, "
                                                                                 "else none)")

    from .bench.serve import add_arguments

    add_arguments(sub.add_parser("bench-serve", help="load generator: N concurrent streaming clients against any "
                                                     "OpenAI-compatible server; tok/s, TTFT, inter-token latency"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = os.environ.get("SPECDEC_DEBUG") == "1"
    try:
        for flag in ("json", "png"):  # before anything loads: a run's results were lost at its end
            check_output(getattr(args, flag, None), f"--{flag}")
        if args.command == "generate":
            return cmd_generate(args)  # it imports torch once its prompt's encoder has started
        set_threads(args, defer_meta=args.command in ("serve", "demo"))
        if args.command == "bench":
            from .bench.run import cmd_bench

            return cmd_bench(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "train-mtp":
            return cmd_train_mtp(args)
        if args.command == "make-data":
            return cmd_make_data(args)
        if args.command == "export-heads":
            return cmd_export_heads(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "bench-serve":
            from .bench.serve import cmd_bench_serve

            return cmd_bench_serve(args)
        if args.command == "roofline":
            from .bench.roofline import cmd_roofline

            return cmd_roofline(args)
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


def check_output(path: str | None, flag: str) -> None:
    """Refuse an output file that could not be written, before the run (a folder, or a place this user may not
    write); its missing folders are made, as bench always did."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make its folder ({e.strerror})") from None
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path} cannot be written here: give another path")


class _DeferredTorchModule(types.ModuleType):
    """Stands in for `torch._meta_registrations` while torch is first imported, and runs the real module the first
    time anything reads from it. That module registers Python shape functions for the "meta" device (fake tensors:
    torch.compile, torch.export, transformers' empty-weight model init), which specdec's own model never uses;
    importing it is ~0.3 s of torch's ~1.2 s import and 18 MB (docs/results/startup-meta-1207g.txt). Ops on real
    tensors never consult it; without it, meta-device fft / conv / multinomial raise NotImplementedError."""

    NAME = "torch._meta_registrations"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # the import system probing the stub (__spec__, __path__, ...)
            raise AttributeError(attr)
        import importlib

        if sys.modules.get(self.NAME) is self:
            del sys.modules[self.NAME]
        return getattr(importlib.import_module(self.NAME), attr)


def set_threads(args, defer_meta: bool = False) -> None:
    """Import torch (the first import of it: ~1.2 s) and give it -t's thread count. The first import runs with the
    cycle collector paused and then freezes what it made (gc.freeze: ~170k objects no collection scans again):
    collecting them while they were made (~370 collections) cost 0.12 s of the import's 1.26 s, and one full
    collection over them afterwards 53-64 ms, a pause in whatever was decoding then
    (docs/results/startup-gc-1207d.txt). With defer_meta (the commands that only run specdec's own model: generate,
    serve, demo), torch's meta-device registrations wait for first use (_DeferredTorchModule)."""
    import gc

    if defer_meta and "torch" not in sys.modules:
        sys.modules.setdefault(_DeferredTorchModule.NAME, _DeferredTorchModule(_DeferredTorchModule.NAME))
    if "torch" not in sys.modules and gc.isenabled():
        gc.disable()
        try:
            import torch
        finally:
            gc.enable()
        gc.freeze()
    import torch

    if getattr(args, "threads", None):
        if args.threads > usable_cpus():
            print(f"specdec: -t {args.threads} is more threads than the {usable_cpus()} CPUs this process may use: "
                  "they take turns, and decoding slows down", file=sys.stderr)
        torch.set_num_threads(args.threads)


def load_model(args, which: str = "model", target=None, tokenizer=None):
    from .loader import load_args

    return load_args(args, which, target, tokenizer)


def spec_config(args, target=None, params=None):
    """(SpecConfig, resolved MTP drafter or None) from the speculation flags. Without --spec: draft with -md, else
    auto (suffix and n-gram lookup, plus the model's MTP modules or shipped heads, chosen step by step).
    --draft-max may list several values (bench): the first one is used here. params: the one sampling setting this
    process generates with (`specdec generate`), under which auto's memory may say its shipped heads lose: they are
    then not loaded (spec.auto_mtp)."""
    from .spec import SpecConfig, auto_mtp, resolve_mtp
    from .spec.config import draft_length, parse_tree

    mtp = None
    kind = args.spec or ("draft" if args.model_draft else "auto")
    if kind == "auto" and target is not None and params is not None:
        mtp = auto_mtp(target, params, args.heads)
    elif kind in ("mtp", "auto") and target is not None:
        mtp = resolve_mtp(target, args.heads) or ()  # () : resolved, none there
    if kind == "draft" and not args.model_draft:
        raise ValueError("--spec draft needs a draft model: give -md DRAFT")
    values = [v.strip() for v in str(args.draft_max).split(",") if v.strip()] or ["auto"]
    for v in values:
        draft_length(v, 0)  # validates
    spec = SpecConfig(kind=kind, draft_max=values[0], draft_min=args.draft_min, draft_p_min=args.draft_p_min,
                      ngram_min=args.ngram_min, ngram_max=args.ngram_max, tree=parse_tree(args.tree),
                      heads=args.heads)
    spec.validate()
    return spec, mtp


def format_spec_stats(s, kind: str) -> str:
    """The speculative-decoding summary lines (vLLM's counters)."""
    if s.drafted == 0:
        return f"speculative ({kind}): no drafts were proposed"
    per_pos = " ".join(f"{a:.0%}" for a in s.acceptance_per_position)
    other = max(0.0, s.decode_s - s.draft_s - s.verify_s)
    sources = "; ".join(f"{name}: {d} drafts, {k} drafted, {a} accepted, {e / d:.2f} tokens per forward"
                        for name, (d, k, a, e) in s.by_source.items()) if len(s.by_source) > 1 or kind == "auto" else ""
    return (f"speculative ({kind}): {s.drafts} drafts, {s.drafted} drafted, {s.accepted} accepted "
            f"({s.acceptance_rate:.1%}); per position {per_pos}; mean accepted length {s.mean_accepted_length:.2f} "
            f"tokens per target forward{' | by source: ' + sources if sources else ''}\ntime: drafting "
            f"{s.draft_s:.2f} s, verification {s.verify_s:.2f} s, other {other:.2f} s")


def sampling_params(args):
    """SamplingParams from the sampling flags (validated)."""
    import re

    from .sampling import SamplingParams

    bias = []
    for item in args.logit_bias:
        m = re.fullmatch(r"\s*(\d+)\s*([+-]\s*(?:inf|\d+(?:\.\d*)?|\.\d+))\s*", item)
        if not m:
            raise ValueError(f"--logit-bias takes TOKEN_ID(+/-)BIAS like 15043+1 or 15043-inf, not '{item}'")
        bias.append((int(m[1]), float(m[2].replace(" ", ""))))
    p = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                       seed=None if args.seed < 0 else args.seed, repetition_penalty=args.repeat_penalty,
                       repeat_last_n=args.repeat_last_n, presence_penalty=args.presence_penalty,
                       frequency_penalty=args.frequency_penalty, logit_bias=tuple(bias))
    p.validate()
    return p


def read_prompt(args) -> str:
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            raise ValueError(f"prompt file not found: {args.file}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the prompt file {args.file}: {e}") from None
    if args.prompt is None:
        raise ValueError("no prompt: give -p TEXT or -f FILE")
    return args.prompt


def chat_messages(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def prompt_tokens(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return tokenizer.encode(text)
    return tokenizer.encode_chat(chat_messages(text, system))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def early_prompt(args, text: str):
    """(light tokenizer, PromptEncoder) for a model whose tokenizer is cached with its decode table: the prompt is
    encoded in a helper process while this one imports torch and loads (light_tokenizer.py); else None. Runs
    before anything imports torch."""
    from .config import ModelError
    from .paths import resolve_model_path

    if os.environ.get("SPECDEC_TOKENIZER_HELPER") == "0" or usable_cpus() < 2:  # one core: nothing to overlap
        return None
    try:
        path = resolve_model_path(args.model)
    except (ModelError, OSError):  # the load reports it as it always does
        return None
    from .light_tokenizer import LightTokenizer, PromptEncoder

    light = LightTokenizer.cached(path)
    if light is None:
        return None
    return light, PromptEncoder(light.folder, text, chat_messages(text, args.system) if args.chat else None)


def cmd_generate(args) -> int:
    import json
    import time

    batch_file = bool(args.file and args.file.lower().endswith(".jsonl"))
    if args.file and args.prompt is not None:
        raise ValueError("give the prompt with -p TEXT or -f FILE, not both")
    args.chat = args.chat or args.system is not None  # a system message is a chat's
    text = "" if batch_file else read_prompt(args)
    if args.n_predict <= 0:
        raise ValueError("-n must be > 0")
    early = None if batch_file else early_prompt(args, text)
    set_threads(args, defer_meta=True)
    from .generate import generate

    params = sampling_params(args)
    kind = spec_config(args)[0].kind  # flags are checked before the (slow) load
    if args.model_draft and kind not in ("draft", "auto"):  # (a server keeps its -md for requests that ask for it)
        raise ValueError(f"-md drafts with --spec draft (the default with -md) or auto, not --spec {kind}: drop one "
                         "of them")
    if args.tree and kind not in ("mtp", "auto"):
        raise ValueError(f"--tree shapes the MTP heads' drafts (--spec mtp or auto), not --spec {kind}")
    if args.model_draft:
        from .loader import check_model_file

        check_model_file(args.model_draft)  # a missing or broken draft file is named before the target loads
    # the helper's ids are collected before the weights are touched, so its memory (190 MB for Gemma's tokenizer,
    # built in ~1.1 s) is freed before the model's pages come in: docs/results/startup-meta-1207g.txt
    t = time.perf_counter()
    ids = early[1].ids() if early else None
    wait = time.perf_counter() - t
    target = load_model(args, tokenizer=early[0] if early else None)
    if early:
        target.load_split["waiting for the prompt's encoder"] = wait
        target.load_seconds += wait
    vocab = target.model.args.vocab_size
    if outside := [t for t, _ in params.logit_bias if t >= vocab]:
        raise ValueError(f"--logit-bias token id {outside[0]} is outside the vocabulary (0..{vocab - 1})")
    spec, mtp = spec_config(args, target, params)
    kind = spec.kind
    # auto takes the draft model as one more source (spec/__init__.py); until 12-07 `--spec auto -md` ignored it
    draft = load_model(args, "model_draft", target) if args.model_draft and kind in ("draft", "auto") else None
    from .spec import build_proposer

    if batch_file:
        return generate_batch(args, target, draft, spec, mtp, params)
    proposer = build_proposer(spec, target, params, draft, mtp)
    if ids is None:
        ids = prompt_tokens(target.tokenizer, text, args.chat, args.system)

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(target.model, target.tokenizer, ids, params, max_tokens=args.n_predict, stop=args.stop,
                      on_text=on_text, ignore_eos=args.ignore_eos, proposer=proposer, draft_length=spec.policy())
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = result.stats
    print(f"\n{target.load_summary()} | {target.file_type}; in memory {target.model.weight_format}, "
          f"{str(target.model.dtype).removeprefix('torch.')} activations | prompt {s.prompt_tokens} tokens, "
          f"{s.prefill_tok_s:.1f} tok/s | generated {s.generated_tokens} tokens, {s.decode_tok_s:.1f} tok/s | "
          f"finish: {result.finish_reason}", file=sys.stderr)
    if proposer is not None:
        print(format_spec_stats(s, kind if kind != "mtp" else f"mtp, {mtp[0]} heads: {mtp[3]}"), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                       "load_s": target.load_seconds, "load": {"kind": target.load_kind, **target.load_split},
                       "stats": s.to_dict()}, f, indent=1)
    return 0


def generate_batch(args, target, draft, spec, mtp, params) -> int:
    """-f prompts.jsonl: every prompt through the batched engine; JSON lines in prompt-finish order on stdout."""
    import json
    import time

    from .api import LLM
    from .bench.prompts import load_prompts

    if args.batch < 1:
        raise ValueError("--batch must be >= 1")
    prompts = load_prompts(args.file)
    ids = [prompt_tokens(target.tokenizer, p.text, args.chat, args.system) for p in prompts]
    ctx = target.model.max_len
    long = next((i for i, x in enumerate(ids) if len(x) >= ctx), None)
    if long is not None:  # named before any decoding (the engine's refusal named no prompt)
        raise ValueError(f"{args.file}: prompt {prompts[long].id} has {len(ids[long])} tokens but the context is "
                         f"{ctx}: raise -c or shorten it")
    llm = LLM.of(target, draft, spec, max_batch=args.batch, mtp=mtp)

    def emit(i: int, out) -> None:
        print(json.dumps({"index": i, "id": prompts[i].id, "text": out.text, "finish_reason": out.finish_reason,
                          "generated_tokens": len(out.tokens)}), flush=True)

    t0 = time.perf_counter()
    outs = llm.generate(ids, params, max_tokens=args.n_predict, stop=args.stop, ignore_eos=args.ignore_eos,
                        on_output=emit)
    wall = time.perf_counter() - t0
    n = sum(len(o.tokens) for o in outs)
    print(f"{target.load_summary()} | {len(outs)} prompts, batch {args.batch}: {n} tokens in {wall:.2f} s, "
          f"{n / wall:.1f} tok/s aggregate", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"outputs": [{"index": i, "id": p.id, "text": o.text, "tokens": o.tokens,
                                    "finish_reason": o.finish_reason, "stats": o.stats.to_dict()}
                                   for i, (p, o) in enumerate(zip(prompts, outs, strict=True))],
                       "batch": args.batch, "load_s": target.load_seconds, "wall_s": wall,
                       "generated_tokens": n}, f, indent=1)
    return 0


def cmd_serve(args) -> int:
    """`specdec serve`: the models load in the background once the server listens (server.serve)."""
    from .server import serve

    spec_config(args)  # flags are checked before the server starts
    if args.use_mmap is None:  # a server decodes for hours: its weights in 2 MB pages whatever their size (an
        args.use_mmap = False  # 8B-shaped file decoded 1.11x for 3.4 s more loading; README, Loading); --mmap maps

    def load():
        target = load_model(args)
        spec, mtp = spec_config(args, target)
        draft = load_model(args, "model_draft", target) if args.model_draft else None
        return spec, target, draft, mtp

    return serve(load, host=args.host, port=args.port, parallel=args.parallel, max_queue=args.max_queue,
                 api_key=args.api_key, model=args.model, prompt_cache=args.cache_prompt)


DEMO_PROMPTS = [
    ("rewrite a passage given in the prompt",
     "Rewrite the following paragraph, fixing any spelling mistakes but changing nothing else:\n\nThe lighthouse "
     "stood on the edge of the cliff for more than a hundred years. Every night the keeper climbed the long spiral "
     "staircase, lit the great lamp, and watched the beam sweep across the dark water. Ships passing in the night "
     "relied on its light to avoid the rocks below. In the morning he wrote the wether, the passing ships, and the "
     "state of the sea in a leather-bound logbook that his grandfather had started."),
    ("an open chat question", "Explain in a few sentences why speculative decoding makes LLM inference faster."),
]


def cmd_demo(args) -> int:
    """The main job of `make demo`: each prompt decoded plainly, then with the default speculation (greedy, so the
    texts must be identical), alternated --repeats times; the medians of both speeds and of the rounds' speedups
    printed (this host's speed drifts within seconds, and one answer decodes in well under a second)."""
    import statistics

    from .generate import generate
    from .sampling import SamplingParams
    from .spec import SpecConfig, build_proposer, resolve_mtp

    if args.n_predict < 1:  # before the load
        raise ValueError("-n must be >= 1")
    target = load_model(args)
    tok, greedy = target.tokenizer, SamplingParams()
    spec = SpecConfig(kind="auto")
    mtp = resolve_mtp(target) or ()
    rounds = f"medians of {args.repeats} alternated rounds" if args.repeats > 1 else "one round"
    print(f"specdec demo: {target.path.name}, greedy; plain decoding, then the default speculation (--spec auto: "
          f"suffix and n-gram lookup{' + the MTP heads shipped for this model' if mtp else ''}, chosen step by step); "
          f"{rounds}\n")
    generate(target.model, tok, tok.encode("Hello"), greedy, max_tokens=4)  # warm-up
    rows, same = [], True
    for what, text in DEMO_PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        speeds, ok = [], True
        for _ in range(args.repeats):
            plain = generate(target.model, tok, ids, greedy, max_tokens=args.n_predict)
            fast = generate(target.model, tok, ids, greedy, max_tokens=args.n_predict,
                            proposer=build_proposer(spec, target, greedy, mtp=mtp), draft_length=spec.policy())
            ok &= plain.tokens == fast.tokens
            speeds.append((plain.stats.decode_tok_s, fast.stats.decode_tok_s, fast.stats.mean_accepted_length))
        same &= ok
        print(f"### {what}\n> {text[:140]}{'...' if len(text) > 140 else ''}\n\n{fast.text.strip()}\n")
        p, f, mal = (statistics.median(x) for x in zip(*speeds, strict=True))
        rows.append((what, p, f, statistics.median(b / a for a, b, _ in speeds), mal, ok))
    print("| prompt | plain tok/s | speculative tok/s | speedup | tokens per target forward | same text |")
    print("|---|---|---|---|---|---|")
    for what, p, f, up, mal, ok in rows:
        print(f"| {what} | {p:.1f} | {f:.1f} | {up:.2f}x | {mal:.2f} | {'yes' if ok else 'NO'} |")
    print(f"\n{target.load_summary()}")
    if not same:
        print("error: speculative output differs from plain output", file=sys.stderr)
        return 1
    return 0


def cmd_train_mtp(args) -> int:
    import math

    from .train.data import SEED_TASKS
    from .train.mtp import TrainConfig, train_mtp

    prompts = args.prompts or str(SEED_TASKS)  # found from any folder, as make-data's
    for flag, value, ok in (("--lr", args.lr, args.lr > 0), ("--noise", args.noise, args.noise >= 0),
                            ("--weight-decay", args.weight_decay, args.weight_decay >= 0),
                            ("--feature-weight", args.feature_weight, args.feature_weight >= 0),
                            ("--decay", args.decay, 0 < args.decay <= 1), ("--temp", args.temp, args.temp >= 0)):
        if not (ok and math.isfinite(value)):  # before answers and features are made (they took minutes first)
            raise ValueError(f"{flag} {value} is out of range: see specdec train-mtp --help")
    if not args.output.endswith(".safetensors"):
        raise ValueError(f"-o {args.output}: heads are written as safetensors, give a FILE.safetensors")
    if args.data and not Path(args.data).exists():
        raise ValueError(f"training data not found: {args.data} (write it with `specdec make-data -o FILE`)")
    if not args.data and not Path(prompts).exists():
        raise ValueError(f"training prompts not found: {prompts} (give --prompts FILE)")
    if args.kind not in ("sequential", "parallel", "eagle3"):
        raise ValueError("--kind must be sequential, parallel or eagle3")
    cfg = TrainConfig(kind=args.kind, depth=args.depth, samples=args.samples, max_new=args.max_new,
                      temperature=args.temp, epochs=args.epochs, lr=args.lr, seed=args.seed, vocab=args.vocab,
                      ffn_dim=args.ffn, prompts=prompts, limit=args.limit or 0, feature_weight=args.feature_weight,
                      weight_decay=args.weight_decay, noise=args.noise, data=args.data or "", decay=args.decay,
                      data_tokens=args.data_tokens)
    torch_seed(args.seed)
    target = load_model(args)
    if args.vocab > target.model.args.vocab_size:
        raise ValueError(f"--vocab {args.vocab} is more than the model's {target.model.args.vocab_size} tokens "
                         "(0 = all of them)")
    summary = train_mtp(target, args.output, cfg, args.work)
    last = summary["log"][-1] if summary["log"] else {}
    print(f"wrote {args.output}: {summary['kind']} x{summary['depth']}, {summary['tokens']} training tokens, "
          f"draft vocabulary {summary['draft_vocab']}, top-1 agreement {last.get('top1')}, "
          f"{summary['total_s']:.0f} s", file=sys.stderr)
    return 0


def cmd_make_data(args) -> int:
    from .train.data import SEED_TASKS, DataConfig, FilterConfig, make_data, meta_path, seed_prompts

    try:
        temps = tuple(float(t) for t in args.temps.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--temps takes comma-separated temperatures like 0,0.5,0.8,1.0, not '{args.temps}'") from None
    seeds = None if args.seed_prompts == "none" else args.seed_prompts or str(SEED_TASKS)
    cfg = DataConfig(n_prompts=args.n_prompts, temps=temps, max_new=args.max_new, prompt_temp=args.prompt_temp,
                     prompt_max=args.prompt_max, seed_prompts=seeds, batch=args.batch, seed=args.seed,
                     filters=FilterConfig(quality=not args.no_filter))
    cfg.validate()  # flags and the seed prompts are checked before the (slow) load
    seed_prompts(seeds)
    target = load_model(args)
    s = make_data(target, args.output, cfg)
    dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items())
    print(f"wrote {args.output} (+ {meta_path(args.output).name}): {s['lines']} prompts, {s['seed']} seed + "
          f"{s['magpie']} Magpie of {s['candidates']} candidates (dropped: {dropped}; seed prompts like Spec-Bench: "
          f"{s['seed_spec_bench']}) | this run: {s['answers']} answers, {s['tokens']} tokens in {s['seconds']:.1f} s, "
          f"{s['tokens'] / max(s['seconds'], 1e-9):.1f} tok/s", file=sys.stderr)
    if s["magpie"] < s["wanted"]:
        print(f"warning: only {s['magpie']} of {s['wanted']} Magpie prompts passed the filters in {s['candidates']} "
              "candidates", file=sys.stderr)
    return 0


def cmd_export_heads(args) -> int:
    import json

    from .weights.export import check_format, export_heads

    if not Path(args.file).is_file():
        raise ValueError(f"heads file not found: {args.file}")
    header = check_format(args.file, args.format)  # before the (slow) load
    target = load_model(args)
    out = export_heads(args.file, target, args.format, args.output, verifier=args.verifier)
    method = {"speculators": "eagle3", "eagle3": "eagle3", "medusa": "medusa", "deepseek-mtp": "mtp"}[args.format]
    k = 3 if header["kind"] == "eagle3" else header["depth"]
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": k})
    print(f"wrote {out} ({args.format} layout); serve it with: vllm serve TARGET --speculative-config '{spec}'",
          file=sys.stderr)
    return 0


def torch_seed(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def entry() -> None:
    """The `specdec` command: main(), then exit without the interpreter's teardown. Tearing down torch's modules
    and thread pools takes ~0.25 s after the work is done (measured here on a 1.2 s `generate -n 64`); output is
    flushed and every file written is closed by then (auto's memory of what paid, spec/auto.py, is written first:
    os._exit skips atexit)."""
    rc = main()
    auto = sys.modules.get("specdec.spec.auto")
    if auto is not None:
        auto.write_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    entry()
