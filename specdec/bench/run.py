"""`specdec bench`: every decoding mode (and optional peer engines) on the same prompts, in one process and one run.

Runs are interleaved (for each repeat, for each prompt, every mode in turn) so that noise on a shared machine hits all
modes alike; each (mode, prompt) keeps the median of its repeats. Greedy decoding throughout, so every speculative
output must equal the plain output token for token: any difference is reported loudly.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..generate import Result, generate
from ..sampling import SamplingParams
from ..spec.stats import Stats
from .prompts import Prompt, load_prompts

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Mode:
    """A decoding mode: how to build its proposer and draft-length policy for one generation."""

    name: str
    models: str
    make: Callable[[], tuple[object | None, object | None]]
    draft_bytes: int = 0  # weight bytes a drafting forward reads (a draft model's), for GB/s


@dataclass
class Cell:
    """Results of one mode on one prompt: one entry per repeat."""

    results: list[Result] = field(default_factory=list)

    @property
    def median(self) -> Result:
        """The repeat with the median decode time (the lower middle one for an even count): its time, counts and
        time shares are reported together, so they describe the same run."""
        ordered = sorted(self.results, key=lambda r: r.stats.decode_s)
        return ordered[(len(ordered) - 1) // 2]


def peak_rss_mb() -> float:
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import psutil

    return {"cpu": cpu_name(), "platform": platform.platform(), "processor": platform.processor(),
            "cpus": psutil.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def chat_prompt_ids(tokenizer, prompt: Prompt, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
    return tokenizer.encode(prompt.text)


# bench mode -> (kind of MTP heads, tree drafts?)
MTP_MODES = {"mtp": ("sequential", False), "mtp-tree": ("sequential", True), "medusa": ("parallel", False),
             "medusa-tree": ("parallel", True), "eagle3": ("eagle3", False), "eagle3-tree": ("eagle3", True)}


def plain_mode() -> Mode:
    return Mode("plain", "target", lambda: (None, None))


def cmd_bench(args) -> int:
    from ..loader import load_args as load_model
    from ..spec import resolve_mtp

    prompts = load_prompts(args.prompts, args.category, args.limit)
    if not prompts:
        raise ValueError("no prompts to run")
    if args.n_predict <= 1:
        raise ValueError("-n must be > 1")
    target = load_model(args)
    if args.mode:
        modes_wanted = [m.strip() for m in args.mode.split(",") if m.strip()]
    else:  # every mode that applies to this model
        modes_wanted = ["plain", "auto", "ngram", "suffix"] + (["draft"] if args.model_draft else [])
        if resolve_mtp(target, args.heads, "sequential"):
            modes_wanted += ["mtp", "mtp-tree"]
        if resolve_mtp(target, None, "parallel"):
            modes_wanted += ["medusa", "medusa-tree"]
        if resolve_mtp(target, None, "eagle3"):
            modes_wanted += ["eagle3", "eagle3-tree"]
    if args.batch:
        return cmd_batch_bench(args, target, prompts, [m for m in modes_wanted if not m.endswith("-tree")])
    modes = build_modes(modes_wanted, target, args)
    from .peers import build_peers

    draft = load_model(args, "model_draft", target) if args.model_draft and args.peer else None
    peers = build_peers(args.peer, target, draft, args.draft_max)
    peaks = machine_peaks(target.model)
    report = run_bench(target, modes, peers, prompts, args.n_predict, args.repeats, chat=not args.no_chat,
                       ignore_eos=args.ignore_eos, peaks=peaks)
    report["settings"] = {"model": str(target.path), "file_type": target.file_type, "quant": target.model.quant,
                          "dtype": str(target.model.dtype).removeprefix("torch."), "n_predict": args.n_predict,
                          "repeats": args.repeats, "prompts": args.prompts or "builtin", "category": args.category,
                          "limit": args.limit, "chat": not args.no_chat, "modes": modes_wanted, "peers": args.peer,
                          "ignore_eos": args.ignore_eos, "load_s": target.load_seconds}
    print_report(report)
    if args.png:
        from .plots import plot_bench

        plot_bench(report, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if report["mismatches"] else 0


def build_modes(names: list[str], target, args) -> list[Mode]:
    """One Mode per (speculation kind, --draft-max value): `--draft-max auto,2,4,8` gives four rows per kind."""
    from ..loader import load_args as load_model
    from ..spec import SpecConfig, build_proposer, resolve_mtp
    from ..spec.config import parse_tree

    ks = [v.strip() for v in str(args.draft_max).split(",") if v.strip()]
    modes = []
    draft = None
    for name in names:
        if name == "plain":
            modes.append(plain_mode())
            continue
        kind, mtp, tree, models, draft_bytes = name, None, None, "target", 0
        if name == "draft":
            if not args.model_draft:
                raise ValueError("mode draft needs a draft model: give -md DRAFT")
            draft = draft or load_model(args, "model_draft", target)
            build_proposer(SpecConfig(kind="draft"), target, GREEDY, draft)  # refuses a mismatched vocabulary now
            models, draft_bytes = "target + draft", draft.model.weight_bytes
        elif name in MTP_MODES:
            kind = "mtp"
            heads_kind, tree_mode = MTP_MODES[name]
            mtp = resolve_mtp(target, args.heads if heads_kind != "parallel" else None, heads_kind)
            if mtp is None:
                raise ValueError(f"mode {name} needs {heads_kind} MTP heads for this model (specdec train-mtp)")
            tree = parse_tree(args.tree or "2,1") if tree_mode else None
            models = f"target + {mtp[0]} heads"
        elif name == "auto":  # the default: suffix lookup + the model's MTP heads (+ a draft model when given)
            mtp = resolve_mtp(target, args.heads) or ()
            if args.model_draft:
                draft = draft or load_model(args, "model_draft", target)
            models = "target" + (f" + {mtp[0]} heads" if mtp else "") + (" + draft" if draft else "")
        elif name not in ("ngram", "suffix"):
            raise ValueError(f"unknown mode '{name}': use plain, auto, ngram, suffix, draft, {', '.join(MTP_MODES)}")
        for k in ks:
            label = f"{name} (K {k})" if len(ks) > 1 or k != "auto" else name
            spec = SpecConfig(kind=kind, draft_max=k, draft_min=args.draft_min, draft_p_min=args.draft_p_min,
                              ngram_min=args.ngram_min, ngram_max=args.ngram_max, tree=tree)
            spec.validate()

            def make(spec=spec, draft=draft, mtp=mtp):
                return build_proposer(spec, target, GREEDY, draft, mtp), spec.policy()

            modes.append(Mode(label, models, make, draft_bytes=draft_bytes))
    if "plain" not in names:
        modes.insert(0, plain_mode())  # every speedup is measured against plain decoding in the same run
    return modes


def machine_peaks(model) -> dict:
    """This run's yardsticks, measured once before the runs: STREAM read bandwidth (512 MB arrays) and the FLOP/s
    of a large matmul in the model's activation dtype or f32, whichever is faster (bench/roofline.py matmul_peak)."""
    from .roofline import matmul_peak, measure_bandwidth

    bw = measure_bandwidth(model.device, kinds=("read",), repeats=5)
    return {"read_gb_s": bw["read"], "matmul_flop_s": matmul_peak(model.dtype, model.device)}


def run_bench(target, modes: list[Mode], peers: list, prompts: list[Prompt], n: int, repeats: int,
              chat: bool = True, ignore_eos: bool = False, peaks: dict | None = None) -> dict:
    """Every mode (and peer) on every prompt, `repeats` times, interleaved. Generation stops at end-of-sequence as
    in Spec-Bench (tok/s = generated tokens / decode time, summed over a category's prompts), unless ignore_eos:
    then every run generates n tokens, past the answer's end."""
    from tqdm import tqdm

    model, tok = target.model, target.tokenizer
    ids = [chat_prompt_ids(tok, p, chat) for p in prompts]
    cells = {(m.name, i): Cell() for m in modes for i in range(len(prompts))}
    texts = [tok.decode(x) for x in ids]  # for peers that take text (llama.cpp): the same chat-formatted prompt
    peer_times = {(pe.name, i): [] for pe in peers for i in range(len(prompts))}
    peer_tokens, peer_counts = {}, {}
    # one warm-up generation per mode (allocations, first-touch of the weights)
    for m in modes:
        proposer, policy = m.make()
        generate(model, tok, ids[0], GREEDY, max_tokens=8, proposer=proposer, draft_length=policy, ignore_eos=True)
    total = repeats * len(prompts) * (len(modes) + len(peers))
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for _ in range(repeats):
            for i, x in enumerate(ids):
                for m in modes:
                    proposer, policy = m.make()
                    r = generate(model, tok, x, GREEDY, max_tokens=n, proposer=proposer, draft_length=policy,
                                 ignore_eos=ignore_eos)
                    cells[(m.name, i)].results.append(r)
                    bar.update(1)
                for pe in peers:
                    dt, toks, counts = pe.run(x, texts[i], n)
                    peer_times[(pe.name, i)].append(dt)
                    peer_tokens[(pe.name, i)] = toks
                    peer_counts[(pe.name, i)] = counts
                    bar.update(1)
    # greedy outputs must agree: every mode with plain, and the peers with plain
    mismatches = []
    for i, p in enumerate(prompts):
        ref = cells[("plain", i)].results[0].tokens
        for m in modes:
            for r in cells[(m.name, i)].results:
                if r.tokens != ref:
                    mismatches.append({"mode": m.name, "prompt": p.id, "first_diff": _first_diff(ref, r.tokens)})
                    break
    peer_agreement = {}  # a peer's greedy output vs specdec's plain output (they run other kernels / precisions)
    for pe in peers:
        plain = [cells[("plain", i)].results[0].tokens for i in range(len(prompts))]  # peers run past EOS
        same = [peer_tokens[(pe.name, i)][:len(plain[i])] == plain[i] for i in range(len(prompts))
                if peer_tokens[(pe.name, i)] is not None]
        if same:
            peer_agreement[pe.name] = sum(same) / len(same)
    from .roofline import matmul_params

    categories = sorted({p.category for p in prompts})
    rows = []
    flops_per_row = 2 * matmul_params(model.args)  # a forward's matmul FLOPs per token row
    for cat in categories + ["all"]:
        idx = [i for i, p in enumerate(prompts) if cat in ("all", p.category)]
        cat_rows = []
        for m in modes:
            st = Stats()
            for i in idx:
                st.merge(cells[(m.name, i)].median.stats)
            time_s, toks = st.decode_s, st.generated_tokens - len(idx)
            tok_s = toks / time_s if time_s > 0 else None
            per_s = lambda x, t=time_s: x / t if t > 0 else 0.0  # noqa: E731
            gbs = (model.weight_bytes * per_s(st.forwards) + m.draft_bytes * per_s(st.drafted)) / 1e9
            flops = flops_per_row * per_s(st.forwards + st.drafted)  # every verified row: pending token + drafts
            cat_rows.append({"category": cat, "mode": m.name, "models": m.models, "tok_s": tok_s,
                             "mean_accepted": st.mean_accepted_length, "acceptance": st.acceptance_rate,
                             "acceptance_per_position": st.acceptance_per_position, "gb_s": gbs,
                             "bus": gbs / peaks["read_gb_s"] if peaks else None,
                             "compute": flops / peaks["matmul_flop_s"] if peaks else None,
                             "draft_share": per_s(st.draft_s), "verify_share": per_s(st.verify_s), "tokens": toks,
                             "decode_s": time_s, "sources": _source_shares(st)})
        for pe in peers:
            times = [statistics.median(peer_times[(pe.name, i)]) for i in idx]
            time_s = sum(times) if min(times) > 0 else 0.0  # a prompt it decoded nothing of: no speed for the row
            toks = (n - 1) * len(idx)
            drafted = sum(peer_counts[(pe.name, i)].get("n_drafted", 0) for i in idx)
            accepted = sum(peer_counts[(pe.name, i)].get("n_accept", 0) for i in idx)
            cat_rows.append({"category": cat, "mode": pe.name, "models": pe.models,
                             "tok_s": toks / time_s if time_s > 0 else None, "mean_accepted": None,
                             "acceptance": accepted / drafted if drafted else None, "acceptance_per_position": [],
                             "gb_s": None, "bus": None, "compute": None, "tokens": toks, "decode_s": time_s,
                             "peer": True})
        # every speedup is against specdec's plain decoding in this run, whatever order the modes were given in
        base = next(r["tok_s"] for r in cat_rows if r["mode"] == "plain")
        for r in cat_rows:
            r["speedup"] = r["tok_s"] / base if r["tok_s"] and base else None
        rows += cat_rows
    return {"machine": machine_info(), "peaks": peaks, "rows": rows, "mismatches": mismatches,
            "peer_greedy_agreement": peer_agreement, "peak_rss_mb": peak_rss_mb(),
            "target_weight_bytes": model.weight_bytes,
            "prompts": [{"id": p.id, "category": p.category} for p in prompts]}


def _source_shares(st: Stats) -> dict[str, dict]:
    """Per drafting source: its share of the drafts and its mean accepted length (tokens per verifying forward)."""
    total = sum(row[0] for row in st.by_source.values())
    return {name: {"drafts": d, "share": d / total, "drafted": k, "accepted": a, "mean_accepted": e / d}
            for name, (d, k, a, e) in st.by_source.items() if d}


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def print_report(report: dict) -> None:
    rows = report["rows"]
    peaks = report.get("peaks")
    if peaks:
        print(f"yardsticks (this run): STREAM read {peaks['read_gb_s']:.1f} GB/s, matmul "
              f"{peaks['matmul_flop_s'] / 1e9:.0f} GFLOP/s\n")
    print("| category | mode | models | tok/s | speedup | mean accepted | acceptance | GB/s achieved | memory bus | "
          "compute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        src = " ".join(f"{n} {v['share']:.0%}" for n, v in (r.get("sources") or {}).items() if len(r["sources"]) > 1)
        mode = f"{r['mode']} ({src})" if src else r["mode"]
        print(f"| {r['category']} | {mode} | {r['models']} | {fmt(r['tok_s'], '.1f')} | "
              f"{fmt(r['speedup'], '.2f')} | {fmt(r['mean_accepted'], '.2f')} | {fmt(r['acceptance'], '.1%')} | "
              f"{fmt(r['gb_s'], '.1f')} | {fmt(r.get('bus'), '.0%')} | {fmt(r.get('compute'), '.1%')} |")
    for name, agree in report["peer_greedy_agreement"].items():
        print(f"\n{name}: greedy output identical to specdec plain on {agree:.0%} of prompts (it runs other weights "
              f"and kernels, e.g. dequantized fp32: near-ties can resolve differently)")
    if report["mismatches"]:
        print(f"\n!!! {len(report['mismatches'])} speculative outputs DIFFER from plain greedy output:",
              file=sys.stderr)
        for mm in report["mismatches"]:
            print(f"!!!   mode {mm['mode']} prompt {mm['prompt']} first differs at token {mm['first_diff']}",
                  file=sys.stderr)
    else:
        print("\ngreedy outputs of every mode are identical to plain decoding")
    allrows = {r["mode"]: r for r in rows if r["category"] == "all"}
    summary = ", ".join(f"{m} {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x)" for m, r in allrows.items()
                        if r["tok_s"] is not None)
    print(f"summary: {summary}; peak RSS {report['peak_rss_mb']:.0f} MB", file=sys.stderr)


def cmd_batch_bench(args, target, prompts: list[Prompt], modes: list[str]) -> int:
    """`bench --batch 1,2,4,8`: every prompt through the batched engine at each batch size, per mode; greedy, so
    every output must equal its batch-1 output."""
    from pathlib import Path

    from .peers import batched_peer

    try:
        batches = sorted({int(b) for b in str(args.batch).split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--batch takes batch sizes like 1,2,4,8, not '{args.batch}'") from None
    if not batches or min(batches) < 1:
        raise ValueError("--batch sizes must be >= 1")
    if 1 not in batches:
        batches = [1] + batches  # the reference for speedups and for greedy identity
    modes = ["plain"] + [m for m in modes if m != "plain"]  # speedups are against plain at batch 1, as build_modes
    report = run_batch_bench(target, modes, prompts, args.n_predict, batches, args, chat=not args.no_chat)
    for spec in args.peer:
        if spec.startswith("llama.cpp:"):
            try:
                report["peers"] = batched_peer(spec.split(":", 1)[1], target.path, batches, args.n_predict)
            except (ValueError, OSError, subprocess.SubprocessError) as e:  # keep specdec's numbers
                print(f"specdec: the llama.cpp peer failed ({e}); its rows are left out", file=sys.stderr)
    print_batch_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if report["mismatches"] else 0


def run_batch_bench(target, modes: list[str], prompts: list[Prompt], n: int, batches: list[int], args,
                    chat: bool = True) -> dict:
    import time

    from ..api import LLM
    from ..spec import SpecConfig, resolve_mtp

    ids = [chat_prompt_ids(target.tokenizer, p, chat) for p in prompts]
    rows, mismatches, ref = [], [], {}
    for mode in modes:
        kind = "none" if mode == "plain" else mode
        spec = SpecConfig(kind=kind, draft_max=str(args.draft_max).split(",")[0], ngram_min=args.ngram_min,
                          ngram_max=args.ngram_max)
        mtp = resolve_mtp(target, args.heads) if kind == "mtp" else None
        llms, mode_rows = {}, {}
        for b in batches:
            llm = llms[b] = LLM.of(target, None, spec, max_batch=b, mtp=mtp)
            llm.generate(ids[:1], GREEDY, max_tokens=8, progress=False)  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate(ids, GREEDY, max_tokens=n, ignore_eos=args.ignore_eos, progress=False)
            wall = time.perf_counter() - t0
            toks = sum(len(o.tokens) for o in outs)
            st = Stats()
            for o in outs:
                st.merge(o.stats)
            per_seq = statistics.median(o.stats.decode_tok_s for o in outs if o.stats.decode_tok_s > 0)
            for i, o in enumerate(outs):
                if (mode, 1) in ref and ref[(mode, 1)][i] != o.tokens:
                    mismatches.append({"mode": mode, "batch": b, "prompt": prompts[i].id})
            if b == 1:
                ref[(mode, 1)] = [o.tokens for o in outs]
            # the prompts' prefill chunks run serially inside the steps (Engine.step); without their time, the
            # generated tokens over the decode steps alone: what llama-batched-bench reports as S_TG
            prefill = sum(o.stats.prefill_s for o in outs)
            decode = toks / (wall - prefill) if wall > prefill else 0.0
            mode_rows[b] = {"mode": mode, "batch": b, "aggregate_tok_s": toks / wall, "per_sequence_tok_s": per_seq,
                            "decode_aggregate_tok_s": decode, "prefill_s": prefill, "tokens": toks, "wall_s": wall,
                            "mean_accepted": st.mean_accepted_length, "acceptance": st.acceptance_rate}
        # the lockstep measure, --repeats rounds with the batch sizes interleaved in each: this host's speed drifts
        # by up to 1.7x within minutes (batch 8 read 864 and 1199 tok/s a minute apart), so a batch size's ratio to
        # batch 1 is taken within each round and the median over rounds reported
        runs: dict[int, list[float]] = {b: [] for b in batches}
        timed: dict[int, list[dict]] = {b: [] for b in batches}
        for _ in range(max(1, args.repeats)):
            for b in batches:
                lock_toks, lock_s, lock_outs = lockstep_decode(llms[b], ids, n, b, args.ignore_eos)
                runs[b].append(lock_toks / lock_s if lock_s > 0 else 0.0)
                timed[b].append({"tokens": lock_toks, "seconds": lock_s})
                if (mode, 1) in ref:
                    mismatches += [{"mode": mode, "batch": b, "prompt": prompts[i].id, "lockstep": True}
                                   for i, o in enumerate(lock_outs) if o != ref[(mode, 1)][i]]
        for b in batches:
            r = mode_rows[b]
            r["lockstep_tok_s"], r["lockstep_runs"] = statistics.median(runs[b]), timed[b]
            if 1 in runs and all(runs[1]):
                r["lockstep_vs_batch1"] = statistics.median(x / y for x, y in zip(runs[b], runs[1], strict=True))
            rows.append(r)
            print(f"batch {b} {mode}: {r['aggregate_tok_s']:.1f} tok/s aggregate, {r['decode_aggregate_tok_s']:.1f} "
                  f"without the prefills, {r['lockstep_tok_s']:.1f} in lockstep (median of {len(runs[b])}: "
                  f"{', '.join(f'{x:.1f}' for x in runs[b])})", file=sys.stderr)
    base = next(r["aggregate_tok_s"] for r in rows if r["mode"] == modes[0] and r["batch"] == 1)
    for r in rows:
        r["vs_plain_batch1"] = r["aggregate_tok_s"] / base
    return {"machine": machine_info(), "rows": rows, "mismatches": mismatches, "batches": batches,
            "prompts": [{"id": p.id, "category": p.category} for p in prompts], "n_predict": n,
            "model": str(target.path), "peak_rss_mb": peak_rss_mb()}


def lockstep_decode(llm, ids: list[list[int]], n: int, b: int, ignore_eos: bool
                    ) -> tuple[int, float, list[list[int]]]:
    """llama-batched-bench's decode measure (S_TG) on the same prompts: groups of b prompts, each group prefilled first
    (not timed), then decoded together from the step where every member holds its first token until the last one
    finishes -> (tokens generated in that phase, its seconds, every prompt's output). The continuous-batching run
    instead lets prompts join and leave, so some of its steps run fewer than b rows."""
    import time

    tokens, seconds, outs = 0, 0.0, []
    for g in range(0, len(ids), b):
        seqs = [llm.engine.add(llm.sequence(p, GREEDY, n, ignore_eos)) for p in ids[g:g + b]]
        while waiting := [s for s in seqs if s.finish is None and not s.decoding]:  # prefills alone
            llm.engine.step(waiting)
        start = sum(len(s.out) for s in seqs)
        t0 = time.perf_counter()
        while any(s.finish is None for s in seqs):
            llm.engine.step(seqs)
        seconds += time.perf_counter() - t0
        tokens += sum(len(s.out) for s in seqs) - start
        outs += [s.out for s in seqs]
    return tokens, seconds, outs


def print_batch_report(report: dict) -> None:
    rows = report["rows"]
    base = next((r.get("decode_aggregate_tok_s") for r in rows if r["batch"] == 1), None)
    lock1 = next((r.get("lockstep_tok_s") for r in rows if r["batch"] == 1), None)
    print("| batch | mode | aggregate tok/s | vs batch 1 plain | decode tok/s (prefills excluded) | vs batch 1 | "
          "lockstep decode tok/s (as S_TG) | vs batch 1 | per-sequence tok/s | mean accepted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dec, lock = r.get("decode_aggregate_tok_s"), r.get("lockstep_tok_s")
        cells = f"{dec:.1f} | {dec / base:.2f}" if dec and base else "- | -"
        ratio = r.get("lockstep_vs_batch1") or (lock / lock1 if lock and lock1 else None)  # paired rounds' median
        cells += f" | {lock:.1f} | {ratio:.2f}" if lock and ratio else " | - | -"
        print(f"| {r['batch']} | {r['mode']} | {r['aggregate_tok_s']:.1f} | {r['vs_plain_batch1']:.2f} | {cells} | "
              f"{r['per_sequence_tok_s']:.1f} | {r['mean_accepted']:.2f} |")
    peers = report.get("peers", [])
    peer1 = next((p["tg_tok_s"] for p in peers if p["batch"] == 1), None)
    for peer in peers:
        rel = f"{peer['tg_tok_s'] / peer1:.2f}" if peer1 else "-"
        print(f"| {peer['batch']} | llama.cpp batched-bench (S_TG) | - | - | - | - | {peer['tg_tok_s']:.1f} | {rel} | "
              f"{peer['tg_tok_s'] / peer['batch']:.1f} | - |")
    if report["mismatches"]:
        print(f"\n!!! {len(report['mismatches'])} batched outputs DIFFER from batch 1", file=sys.stderr)
    else:
        print("\nevery batched output is identical to its batch-1 output")
