"""`specdec roofline`: why (and how much) speculation pays on this machine, from measured costs.

The roofline model (Williams, Waterman & Patterson 2009): a kernel that does F FLOPs while moving B bytes takes at
least max(B / bandwidth, F / peak FLOP/s). Its arithmetic intensity F / B, compared with the machine's ridge point
(peak FLOP/s / peak bandwidth), says which floor binds. One decode forward reads every weight to do ~2 FLOPs per
weight (intensity ~1 FLOP/byte for fp32, a few for int4): far below the ridge, so it is bandwidth-bound, and a forward
over T tokens reads the same weights for T times the FLOPs. Speculative verification of K drafted tokens is such a
forward with T = K + 1, so v(T) / v(1), the cost of verifying relative to one decode step, decides the best draft
length (spec/costmodel.py). On a GPU v(T) stays ~1 up to large T; on a small CPU it does not (MACHINE-FACTS), and
this command measures it.

What it measures, all in one process so the ratios are comparable:
- STREAM-style bandwidth (McCalpin): copy, triad and read-only over arrays far larger than the caches;
- achieved FLOP/s of a large matmul in the model's activation dtype;
- the peak rates of the instruction the quantized kernel's integer dot products run on (VPDPBUSD, or VPMADDUBSW on
  AVX2) and of f32 FMAs (kernels.instruction_peaks), against which the kernel's own rate per extra row reads as a
  fraction: how much a faster kernel could still flatten v(T);
- v(T): one target forward over T new tokens against a KV cache holding `context` tokens, exactly as speculative
  verification runs it (`exact=True`);
- c: seconds per drafted token of a draft model (-md), relative to v(1); 0 for n-gram lookup;
- of a mixture-of-experts model: the bytes a forward over T tokens reads (the fixed part + the union of the T tokens'
  routed experts, expected_distinct_experts under uniform routing, and as its routers actually spread random
  tokens), and v(T) / v(1) measured vs predicted for it and for a dense model of the same active bytes: verifying
  costs a MoE model more than a dense one because every extra token may bring experts of its own.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..config import ModelArgs
from ..kernels import instruction_peaks, matmul_isa
from ..sampling import generator
from ..spec.costmodel import best_k, expected_tokens_iid, interpolate, speedup

DEFAULT_TS = (1, 2, 4, 8, 16, 32, 64)
FULL_TS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64)  # every T a K <= 8 verification uses, then the trend
QUICK_TS = (1, 2, 4)
K_MAX = 8
PREFILL_T = 512


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync(device: torch.device | str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _time(fn: Callable[[], object], device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------------------------
# machine peaks


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int = 512 * 2**20, repeats: int = 7,
                      kinds: Sequence[str] = ("copy", "triad", "read")) -> dict:
    """STREAM-style memory bandwidth in GB/s (1e9 bytes/s), median of `repeats`, over float32 arrays of `nbytes` each.

    Bytes are counted as STREAM counts them: copy b <- a moves 2 arrays, triad a <- b + s c moves 3, read-only
    (a.sum()) 1 (write-allocate traffic is not counted). The default 512 MB per array is far larger than the host's
    caches (MACHINE-FACTS: working sets up to ~128 MB stay in cache and read at ~2x main-memory speed); pass a small
    `nbytes` to measure a cache-resident working set instead. Runs are interleaved, one of each kind per repeat, so
    noise from other load hits all kinds alike."""
    n = max(1024, nbytes // 4)
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)  # fill_ = first touch, outside the timing
    b = torch.empty_like(a).fill_(2.0) if {"copy", "triad"} & set(kinds) else None
    c = torch.empty_like(a).fill_(0.5) if "triad" in kinds else None
    ops = {
        "copy": (lambda: b.copy_(a), 2),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3),
        "read": (lambda: a.sum(), 1),
    }
    unknown = set(kinds) - set(ops)
    if unknown:
        raise ValueError(f"unknown bandwidth kinds {sorted(unknown)}: use copy, triad, read")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:  # warm-up: page tables, thread pool
        _time(ops[k][0], device)
    for _ in range(repeats):
        for k in kinds:
            times[k].append(_time(ops[k][0], device))
    out = {k: ops[k][1] * n * 4 / statistics.median(times[k]) / 1e9 for k in kinds}
    out["array_bytes"] = n * 4
    out["repeats"] = repeats
    return out


def measure_matmul(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", n: int = 2048,
                   repeats: int = 5) -> float:
    """Achieved FLOP/s (2 n^3 per product) of an [n, n] @ [n, n] matmul in `dtype`, median of `repeats`."""
    g = generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    _time(lambda: torch.mm(a, b, out=out), device)
    times = [_time(lambda: torch.mm(a, b, out=out), device) for _ in range(repeats)]
    return 2.0 * n**3 / statistics.median(times)


def matmul_peak(dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 2048, repeats: int = 5) -> float:
    """The machine's dense matmul yardstick for a model in `dtype`: the faster of a GEMM in that dtype and in f32.
    On CPUs without bf16 units PyTorch's bf16 GEMM runs far below its f32 one (~1 GFLOP/s against 182 on the 12-02
    AMD host, where compute utilization then read 13940%, and one 2048^3 product took a minute), so the dtype is
    first probed at 256^3 and measured at full size only when the probe is within 4x of f32."""
    best = measure_matmul(torch.float32, device, n, repeats)
    if dtype != torch.float32 and measure_matmul(dtype, device, 256, 2) > 0.25 * best:
        best = max(best, measure_matmul(dtype, device, n, repeats))
    return best


def measure_kernel_rate(model, t: int = 8, repeats: int = 9) -> float | None:
    """The marginal FLOP/s of the kernel a quantized model's matmuls run: one of its own FFN linears (a MoE layer's
    first expert, else a dense layer's gate-up), cache-resident, timed on t rows and on 1 row; 2 (t - 1) N K FLOPs
    over the time difference. This, not a dense bf16 GEMM's peak, is what each row a verification adds costs where
    the weights are read anyway (the int8 / int4 kernels run far below the AMX GEMM peak). None for a model whose
    linears are not quantized."""
    layer = next((layer for layer in model.layers if layer.moe is not None), model.layers[0])
    lin = layer.moe.experts[0][0] if layer.moe is not None else getattr(layer, "w13", None)
    if lin is None or not getattr(lin, "native", False):
        return None
    g = generator().manual_seed(0)
    k = model.args.dim  # a gate-up projection reads the hidden state
    xs = {n: torch.randn(1, n, k, generator=g).to(model.device, model.dtype) for n in (1, t)}
    med = {}
    for n, x in xs.items():
        for _ in range(3):  # warm: the weights into cache
            lin(x)
        calls = lambda x=x: [lin(x) for _ in range(10)]  # noqa: E731  (10 calls a timing: one is ~100 us)
        med[n] = statistics.median(_time(calls, model.device) for _ in range(repeats)) / 10
    extra = med[t] - med[1]
    return 2.0 * (t - 1) * lin.out_features * k / extra if extra > 0 else None


# ---------------------------------------------------------------------------------------------------------------
# model costs


def _random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _cache_for(model, context: int, t_max: int):
    if context < 0:
        raise ValueError("--context must be >= 0")
    if context + t_max > model.max_len:
        raise ValueError(f"--context {context} plus T = {t_max} new tokens exceeds the model's context window of "
                         f"{model.max_len}: lower --context or raise -c")
    return model.new_cache(context + t_max)


def forward_costs(model, context: int, ts: Sequence[int] = DEFAULT_TS, exact: bool = True, repeats: int = 5,
                  warmup: int = 2, progress: Callable[[str], None] | None = None) -> dict[int, float]:
    """Median seconds of one target forward over T new tokens, for each T in `ts`, against a KV cache already
    holding `context` tokens: v(T) of spec/costmodel.py.

    The cache is prefilled once (random tokens; the values do not change the cost), then each forward writes slots
    [context, context + T) and `rollback(context)` forgets them. All logits are computed, as verification needs
    them. exact=True with T > 1 is how speculative verification runs (each query attends alone over its prefix,
    bitwise equal to decode steps; see Transformer.__call__). The T values are interleaved within each repeat, so
    noise on a shared machine hits them alike (those up to K_MAX + 1 apart from larger ones); `warmup` rounds are
    excluded."""

    ts = sorted(set(ts))
    cache = _cache_for(model, context, max(ts))
    vocab = model.args.vocab_size
    times: dict[int, list[float]] = {t: [] for t in ts}
    with torch.inference_mode():
        if context:
            model.prefill(_random_tokens(context, vocab, 0), cache)
        inputs = {t: (torch.tensor([_random_tokens(t, vocab, t)], device=model.device),
                      torch.arange(context, context + t, device=model.device)) for t in ts}
        # the draft-length range (T <= K_MAX + 1) is interleaved apart from larger T: a T = 1 forward right after
        # a T = 64 one runs ~10% slower (the CPU is still recovering from the heavy one), which would make the
        # verification ratios look flatter than generation sees them
        groups = [[t for t in ts if t <= K_MAX + 1], [t for t in ts if t > K_MAX + 1]]
        for group in (g for g in groups if g):
            for r in range(warmup + repeats):
                if progress:
                    progress(f"target forwards T={group[0]}..{group[-1]}: round {r + 1}/{warmup + repeats}"
                             + (" (warm-up)" if r < warmup else ""))
                for t in group:
                    ids, pos = inputs[t]
                    dt = _time(lambda ids=ids, pos=pos: model(ids, pos, cache, exact=exact), model.device)
                    cache.rollback(context)
                    if r >= warmup:
                        times[t].append(dt)
    return {t: statistics.median(v) for t, v in times.items()}


def draft_cost(draft_model, context: int, n_tokens: int = 8, repeats: int = 5, warmup: int = 1) -> float:
    """Seconds per drafted token of a draft model: `n_tokens` successive T = 1 forwards (last logits only, then an
    argmax, as the draft-model proposer drafts greedily) after `context` cached tokens; median over repeats."""

    cache = _cache_for(draft_model, context, n_tokens)
    dev = draft_model.device
    vocab = draft_model.args.vocab_size
    per_token = []
    with torch.inference_mode():
        if context:
            draft_model.prefill(_random_tokens(context, vocab, 1), cache)

        def run() -> None:
            tok = 0
            for i in range(n_tokens):
                logits, _ = draft_model(torch.tensor([[tok]], device=dev),
                                        torch.arange(context + i, context + i + 1, device=dev), cache,
                                        last_only=True, exact=True)
                tok = int(torch.argmax(logits[0, -1]))

        for r in range(warmup + repeats):
            dt = _time(run, dev)
            cache.rollback(context)
            if r >= warmup:
                per_token.append(dt / n_tokens)
    return statistics.median(per_token)


# ---------------------------------------------------------------------------------------------------------------
# counts


def kv_bytes_per_token(args: ModelArgs, element_size: int) -> int:
    """Bytes of K and V one token occupies in the cache, all layers together (MLA: its one latent vector,
    kv_lora_rank + rope dims, per layer)."""
    if args.attention == "mla":
        return args.n_layers * (args.kv_lora_rank + args.qk_rope_dim) * element_size
    return args.n_layers * 2 * args.n_kv_heads * args.head_dim * element_size


def matmul_params(args: ModelArgs) -> int:
    """Weights every token multiplies: q, k, v, o, gate, up, down in each layer, and the output head.

    A mixture-of-experts layer counts its router, its shared experts and the k routed experts a token runs (not
    all E); MLA counts q (or q_a, q_b), kv_a, the absorbed up-projections W_UK, W_UV and o."""
    D = args.dim
    if args.attention == "mla":
        H, qk, r = args.n_heads, args.qk_nope_dim + args.qk_rope_dim, args.kv_lora_rank
        q = D * args.q_lora_rank + args.q_lora_rank * H * qk if args.q_lora_rank else D * H * qk
        attn = q + D * (r + args.qk_rope_dim) + H * (args.qk_nope_dim + args.v_head_dim) * r + H * args.v_head_dim * D
    else:
        q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        attn = D * q_out + 2 * D * kv_out + q_out * D
    dense = attn + 3 * D * args.ffn_dim
    moe = attn + D * args.n_experts + 3 * D * args.moe_ffn_dim * (args.n_experts_used + args.n_shared_experts)
    n_moe = sum(args.moe_layers) if args.n_experts else 0
    return (args.n_layers - n_moe) * dense + n_moe * moe + args.vocab_size * D


def expected_distinct_experts(n_experts: int, k: int, t: int) -> float:
    """Expected number of distinct experts that t tokens touch in one layer, each token routed to k of E experts.

    Assumption: uniform, independent routing (each token's k experts a uniformly random k-subset of the E, the
    tokens independent of each other). Then one expert is missed by one token with probability 1 - k / E and by all
    t with (1 - k / E)^t, so E[distinct] = E (1 - (1 - k / E)^t): k for t = 1, growing towards E. Real routers are
    skewed (popular experts) and consecutive tokens correlated, both of which make the union smaller than this, so
    this is an upper estimate of the experts a verification reads; measured_distinct_experts() counts them."""
    if t <= 0 or k <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** t)


def moe_layout(model) -> dict | None:
    """What a forward of a mixture-of-experts model reads, split into the part every forward reads whatever T
    (attention, router, shared experts, dense layers, head, norms) and the routed experts (per MoE layer: the bytes
    of one expert); None for a dense model."""
    layers = [layer for layer in model.layers if getattr(layer, "moe", None) is not None]
    if not layers:
        return None
    args = model.args
    expert_bytes = [layer.moe.expert_bytes() for layer in layers]
    return {"n_experts": args.n_experts, "k": args.n_experts_used, "n_shared": args.n_shared_experts,
            "moe_layers": len(layers), "n_layers": args.n_layers, "expert_bytes": expert_bytes,
            "fixed_bytes": model.weight_bytes - args.n_experts_used * sum(expert_bytes),
            "active_bytes": model.weight_bytes, "all_bytes": model.weight_bytes
            + (args.n_experts - args.n_experts_used) * sum(expert_bytes)}


def moe_weight_bytes(layout: dict | None, active_bytes: int, t: int, distinct: Sequence[float] | None = None) -> int:
    """Bytes of weights one forward over t tokens reads: the fixed part + per MoE layer (the distinct experts the t
    tokens touch) x (one expert's bytes). distinct: measured distinct experts per MoE layer for this t; None: the
    uniform-routing expectation (expected_distinct_experts). A dense model (layout None) reads active_bytes
    whatever t; at t = 1 a MoE model reads exactly Transformer.weight_bytes (k experts per layer)."""
    if layout is None:
        return active_bytes
    if distinct is None:
        distinct = [expected_distinct_experts(layout["n_experts"], layout["k"], t)] * layout["moe_layers"]
    return round(layout["fixed_bytes"] + sum(d * b for d, b in zip(distinct, layout["expert_bytes"], strict=True)))


def measured_distinct_experts(model, context: int, ts: Sequence[int], seed: int = 7) -> dict[int, list[int]]:
    """Distinct routed experts each MoE layer actually ran in one exact forward over T random tokens after
    `context` cached ones, for each T (models/moe.py records it per call): the measured counterpart of
    expected_distinct_experts(). Random tokens, so this measures the router's spread on this model's weights, not
    the correlation of real text."""
    layers = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    cache = _cache_for(model, context, max(ts))
    vocab = model.args.vocab_size
    out = {}
    with torch.inference_mode():
        if context:
            model.prefill(_random_tokens(context, vocab, 0), cache)
        for t in sorted(set(ts)):
            ids = torch.tensor([_random_tokens(t, vocab, seed + t)], device=model.device)
            model(ids, torch.arange(context, context + t, device=model.device), cache, exact=True)
            cache.rollback(context)
            out[t] = [moe.last_distinct for moe in layers]
    return out


def forward_counts(args: ModelArgs, weight_bytes: int, kv_bytes_per_token: int, t: int, context: int) -> dict:
    """Bytes moved and FLOPs of one forward over t new tokens after `context` cached tokens.

    bytes = the weights, read once whatever t (`weight_bytes`, as the model stores them; of a MoE model those a
    forward over t tokens reads, moe_weight_bytes) + the KV cache read for context + t tokens + the t new tokens' K
    and V written. Activations are not counted: at these sizes they stay in cache.
    flops = 2 x (matmul parameters incl. the output head) x t + attention, per layer 2 x 2 x t x (context + t) x
    n_heads x head_dim (q k^T and p v, each a multiply-add per element; the causal half of the new block is counted
    as if attended, and sliding-window layers as if full, so this is an upper bound; MLA, absorbed: 2 x t x
    (context + t) x n_heads x (2 kv_lora_rank + rope dims)). Norms, RoPE and softmax are left out (O(t x dim),
    negligible)."""
    kv_read = kv_bytes_per_token * (context + t)
    kv_written = kv_bytes_per_token * t
    if args.attention == "mla":  # absorbed: every head scores [r + d_r] latents and sums r-wide values per slot
        per_slot = args.n_heads * (2 * args.kv_lora_rank + args.qk_rope_dim)
        attention = args.n_layers * 2 * t * (context + t) * per_slot
    else:
        attention = args.n_layers * 2 * 2 * t * (context + t) * args.n_heads * args.head_dim
    flops = 2 * matmul_params(args) * t + attention
    nbytes = weight_bytes + kv_read + kv_written
    return {"bytes": nbytes, "flops": flops, "intensity": flops / nbytes if nbytes else float("inf"),
            "weight_bytes": weight_bytes, "kv_read_bytes": kv_read, "kv_written_bytes": kv_written,
            "attention_flops": attention}


# ---------------------------------------------------------------------------------------------------------------
# predictions


def verify_curve(costs: dict[int, float]) -> Callable[[int], float]:
    """v(T) / v(1) from measured seconds per T (T = 1 required), interpolated as --draft-max auto does
    (costmodel.interpolate)."""
    if 1 not in costs:
        raise ValueError("the verify curve needs the cost of T = 1")
    return lambda t: interpolate(costs, t, prior_slope=0.0) / costs[1]


def predict(v: Callable[[int], float], c: float, alpha: float, k_max: int = K_MAX) -> dict:
    """Predicted speedup for K = 1..k_max under i.i.d. acceptance alpha (costmodel), and the best K (0 = plain)."""
    acc = [alpha] * k_max
    k_best, s_best = best_k(acc, c, v, k_max)
    return {"alpha": alpha, "c": c, "k": list(range(1, k_max + 1)),
            "speedup": [speedup(acc[:k], c, v) for k in range(1, k_max + 1)],
            "expected_tokens": [expected_tokens_iid(alpha, k) for k in range(1, k_max + 1)],
            "best_k": k_best, "best_speedup": s_best}


# ---------------------------------------------------------------------------------------------------------------
# the command


def parse_alphas(text: str) -> list[float]:
    try:
        alphas = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--alpha must be a number or a comma list of numbers in [0, 1], not '{text}'") from None
    if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"--alpha must be a number or a comma list of numbers in [0, 1], not '{text}'")
    return alphas


def run_roofline(target, draft=None, context: int = 256, alphas: Sequence[float] = (0.7,), quick: bool = False,
                 progress: Callable[[str], None] = log) -> dict:
    """Measure everything and return the report dict (what --json writes)."""
    from .run import machine_info

    model = target.model
    dev = model.device
    ts = QUICK_TS if quick else FULL_TS
    repeats, warmup = (2, 1) if quick else (7, 2)
    _cache_for(model, context, max(ts))  # refuse a bad --context before the long measurements
    bw_bytes = 8 * 2**20 if quick else 512 * 2**20

    progress(f"memory bandwidth: copy, triad, read over {bw_bytes / 1e6:.0f} MB float32 arrays ...")
    bw = measure_bandwidth(dev, bw_bytes, repeats=3 if quick else 7)
    wb = model.weight_bytes
    progress(f"read bandwidth over a working set the size of the weights ({wb / 1e6:.0f} MB) ...")
    wset = min(wb, bw_bytes)  # (capped: beyond the arrays' size the read speed is main memory's already)
    bw_model = measure_bandwidth(dev, wset, repeats=3 if quick else 7, kinds=("read",))["read"]
    mm_n = 256 if quick else 2048
    progress(f"matmul {mm_n}x{mm_n} @ {mm_n}x{mm_n} in {_dtype_name(model.dtype)} ...")
    flops_peak = matmul_peak(model.dtype, dev, mm_n, repeats=3 if quick else 5)
    kernel_rate = measure_kernel_rate(model, repeats=3 if quick else 9)  # what a verify's extra rows cost
    instr = None
    if dev.type == "cpu" and matmul_isa() is not None:
        progress("instruction peaks: the kernel's integer dot product and f32 FMA, every thread at once ...")
        instr = instruction_peaks(0.01 if quick else 0.05)
    progress(f"target forwards over T = {', '.join(map(str, ts))} new tokens after {context} cached ...")
    costs = forward_costs(model, context, ts, exact=True, repeats=repeats, warmup=warmup, progress=progress)
    c_draft = None
    draft_s = None
    if draft is not None:
        progress("draft model: seconds per drafted token ...")
        draft_s = draft_cost(draft.model, context, repeats=repeats, warmup=warmup)
        c_draft = draft_s / costs[1]

    read_bw = bw["read"] * 1e9
    kvt = kv_bytes_per_token(model.args, torch.empty((), dtype=model.dtype).element_size())
    layout = moe_layout(model)
    wbt = lambda t: moe_weight_bytes(layout, wb, t)  # noqa: E731  (wb whatever t for a dense model)
    rows = []
    for t in ts:
        n = forward_counts(model.args, wbt(t), kvt, t, context)
        s = costs[t]
        floors = (n["bytes"] / read_bw, n["flops"] / flops_peak)
        rows.append({"t": t, "seconds": s, "ratio": s / costs[1], "bandwidth_floor_s": floors[0],
                     "bandwidth_floor_at_weight_size_s": n["bytes"] / (bw_model * 1e9), "compute_floor_s": floors[1],
                     "x_roofline": s / max(floors), "achieved_gb_s": n["bytes"] / s / 1e9,
                     "achieved_gflop_s": n["flops"] / s / 1e9, "intensity": n["intensity"], "bytes": n["bytes"],
                     "flops": n["flops"]})
    ridge = flops_peak / read_bw
    phases = {"prefill": forward_counts(model.args, wbt(PREFILL_T), kvt, PREFILL_T, 0),
              "decode": forward_counts(model.args, wbt(1), kvt, 1, context)}
    for k in (1, 2, 4, 8):
        phases[f"verify K={k}"] = forward_counts(model.args, wbt(k + 1), kvt, k + 1, context)
    for name, n in phases.items():
        n["t"] = PREFILL_T if name == "prefill" else (1 if name == "decode" else int(name.split("=")[1]) + 1)
        n["context"] = 0 if name == "prefill" else context
        n["bound"] = "memory" if n["intensity"] < ridge else "compute"
        n["x_ridge"] = n["intensity"] / ridge

    v = verify_curve(costs)
    proposers = [("ngram", 0.0)] + ([("draft", c_draft)] if c_draft is not None else [])
    predictions = [dict(predict(v, c, a), proposer=name) for name, c in proposers for a in alphas]
    machine = machine_info()
    machine.update(device=str(dev), cpu_capability=_cpu_capability())
    moe = None
    if layout is not None:
        progress("mixture of experts: distinct experts each layer runs in one forward over T random tokens ...")
        distinct = measured_distinct_experts(model, context, ts)
        moe = moe_report(model.args, layout, kvt, context, costs, distinct, read_bw, kernel_rate or flops_peak)
    report = {
        "machine": machine,
        "model": {"path": str(target.path), "name": _model_name(target), "file_type": target.file_type,
                  "quant": model.quant, "dtype": _dtype_name(model.dtype), "weight_bytes": wb,
                  "kv_bytes_per_token": kvt, "params_matmul": matmul_params(model.args),
                  "args": {k: getattr(model.args, k) for k in ("arch", "dim", "n_layers", "n_heads", "n_kv_heads",
                                                                "head_dim", "ffn_dim", "vocab_size")}},
        "draft_model": None if draft is None else {"path": str(draft.path), "name": _model_name(draft),
                                                   "weight_bytes": draft.model.weight_bytes,
                                                   "seconds_per_token": draft_s, "c": c_draft},
        "peaks": {"bandwidth_gb_s": {k: bw[k] for k in ("copy", "triad", "read")},
                  "bandwidth_array_bytes": bw["array_bytes"], "read_gb_s_at_weight_size": bw_model,
                  "read_bytes_at_weight_size": wset,
                  "matmul_gflop_s": flops_peak / 1e9, "kernel_gflop_s": kernel_rate / 1e9 if kernel_rate else None,
                  "matmul_n": mm_n, "matmul_dtype": _dtype_name(model.dtype),
                  "ridge_flop_per_byte": ridge,
                  # two operations a multiply-add, as the FLOP counts above
                  "instructions": None if instr is None else {
                      "isa": instr["isa"], "int_instruction": instr["int_instruction"],
                      "int_gop_s": 2 * instr["int_macs_s"] / 1e9, "fma_instruction": instr["fma_instruction"],
                      "fma_gflop_s": 2 * instr["fma_macs_s"] / 1e9}},
        "forward": rows,
        "phases": phases,
        "verify_curve": {str(t): v(t) for t in range(1, K_MAX + 2)},
        "predictions": predictions,
        "settings": {"context": context, "alphas": list(alphas), "quick": quick, "exact": True, "ts": list(ts),
                     "repeats": repeats, "warmup": warmup, "k_max": K_MAX, "threads": torch.get_num_threads()},
    }
    if moe is not None:  # only MoE models have the key: dense reports stay as they were
        report["moe"] = moe
    return report


def predicted_ratios(bytes_of: Callable[[int], float], flops_of: Callable[[int], float], t: int, read_bw: float,
                     flops_peak: float, v1: float) -> tuple[float, float, float]:
    """Three predictions of v(t) / v(1) from bytes and FLOPs per forward (`flops_peak`: the rate FLOPs run at; for
    a quantized model the kernel's marginal rate, measure_kernel_rate, as its extra rows are what grows with t):
    - roofline: max(bytes / read bandwidth, FLOPs / matmul peak) at t over the same at 1;
    - calibrated: the T = 1 forward's measured time v1 spread over its bytes (the achieved decode GB/s, per-op
      overheads included), so t tokens take bytes(t) at that rate plus their extra FLOPs at the matmul peak:
      (v1 bytes(t) / bytes(1) + (FLOPs(t) - FLOPs(1)) / peak) / v1;
    - overhead: what v1 spends beyond reading its bytes at the read bandwidth is a fixed cost per forward (the
      per-op and per-layer work that does not grow with bytes), and the bytes of t tokens stream at that bandwidth:
      (o + bytes(t) / bw + (FLOPs(t) - FLOPs(1)) / peak) / v1, o = max(0, v1 - bytes(1) / bw). Where extra bytes
      (a MoE verify's union of experts) are read at a better rate than the T = 1 forward's, calibrated
      overestimates (DeepSeek-V2-Lite-shaped, docs/results/moe-decode.txt)."""
    floor = lambda x: max(bytes_of(x) / read_bw, flops_of(x) / flops_peak)  # noqa: E731
    extra = (flops_of(t) - flops_of(1)) / flops_peak
    calibrated = bytes_of(t) / bytes_of(1) + extra / v1
    fixed = max(0.0, v1 - bytes_of(1) / read_bw)
    return floor(t) / floor(1), calibrated, (fixed + bytes_of(t) / read_bw + extra) / v1


def moe_report(args: ModelArgs, layout: dict, kvt: int, context: int, costs: dict[int, float],
               distinct: dict[int, list[int]], read_bw: float, flops_peak: float) -> dict:
    """The "moe" part of a roofline report: per T, the distinct experts (expected under uniform independent routing,
    and measured), the bytes read, and v(T) / v(1) measured vs predicted (module predicted_ratios) for this MoE
    model and for a dense model of the same active bytes per token (the same FLOPs, weights read once whatever T)."""
    wb = layout["active_bytes"]
    weights = {"moe": lambda t: moe_weight_bytes(layout, wb, t),  # uniform routing
               "measured": lambda t: moe_weight_bytes(layout, wb, t, distinct.get(t)),  # the measured routing
               "dense": lambda t: wb}  # a dense model of the same active bytes: its weights read once whatever t
    curve = []
    for t in sorted(costs):
        pred = {}
        for name, w in weights.items():
            n = lambda x, w=w: forward_counts(args, w(x), kvt, x, context)  # noqa: E731
            pred[name] = predicted_ratios(lambda x, n=n: n(x)["bytes"], lambda x, n=n: n(x)["flops"], t, read_bw,
                                          flops_peak, costs[1])
        curve.append({"t": t, "expected_distinct": expected_distinct_experts(layout["n_experts"], layout["k"], t),
                      "measured_distinct": sum(distinct[t]) / len(distinct[t]) if t in distinct else None,
                      "weight_bytes": weights["moe"](t), "weight_bytes_measured_routing": weights["measured"](t),
                      "measured_ratio": costs[t] / costs[1],
                      "moe_roofline_ratio": pred["moe"][0], "moe_calibrated_ratio": pred["moe"][1],
                      "moe_measured_routing_calibrated_ratio": pred["measured"][1],
                      "moe_overhead_ratio": pred["moe"][2], "moe_measured_routing_overhead_ratio": pred["measured"][2],
                      "dense_roofline_ratio": pred["dense"][0], "dense_calibrated_ratio": pred["dense"][1]})
    return {**{k: layout[k] for k in ("n_experts", "k", "n_shared", "moe_layers", "n_layers", "fixed_bytes",
                                       "active_bytes", "all_bytes")},
            "expert_bytes": layout["expert_bytes"][0] if len(set(layout["expert_bytes"])) == 1
            else layout["expert_bytes"],
            "routing_assumption": "uniform independent: each token a uniformly random k-subset of the E experts, "
                                  "tokens independent; E[distinct of T tokens] = E (1 - (1 - k/E)^T)",
            "measured_routing": "distinct experts per MoE layer in one exact forward over T random tokens",
            "curve": curve}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:
        return None


def _model_name(loaded) -> str:
    return Path(loaded.path).name


def print_report(r: dict) -> None:
    p, m = r["peaks"], r["model"]
    bw = p["bandwidth_gb_s"]
    print(f"model: {m['name']} ({m['file_type']}, quant {m['quant']}, {m['dtype']} activations), "
          f"{m['weight_bytes'] / 1e6:.1f} MB of weights read per forward")
    print(f"machine: {r['machine']['cpu']}, {r['settings']['threads']} threads, torch {r['machine']['torch']}")
    wset = p.get("read_bytes_at_weight_size", m["weight_bytes"]) / 1e6
    wset_name = "the weights' size" if wset >= m["weight_bytes"] / 1e6 else "the weights' size capped at the arrays'"
    print(f"bandwidth ({p['bandwidth_array_bytes'] / 1e6:.0f} MB arrays): copy {bw['copy']:.1f} GB/s, "
          f"triad {bw['triad']:.1f} GB/s, read {bw['read']:.1f} GB/s; read over {wset:.0f} MB ({wset_name}): "
          f"{p['read_gb_s_at_weight_size']:.1f} GB/s")
    if r["settings"].get("quick"):
        print("(--quick: arrays this small may stay in cache, so the bandwidth floors below can be far too low)")
    print(f"matmul {p['matmul_n']}^3 in {p['matmul_dtype']}: {p['matmul_gflop_s']:.1f} GFLOP/s; "
          f"ridge point {p['ridge_flop_per_byte']:.1f} FLOP/byte (peak FLOP/s / read GB/s)")
    ins = p.get("instructions")
    if ins:
        print(f"instruction peaks ({r['settings']['threads']} threads, {ins['isa']} path): {ins['int_instruction']} "
              f"{ins['int_gop_s']:.0f} GOP/s (int8 multiply-adds x 2), {ins['fma_instruction']} "
              f"{ins['fma_gflop_s']:.0f} GFLOP/s")
    if p.get("kernel_gflop_s"):
        of_peak = f", {p['kernel_gflop_s'] / ins['int_gop_s']:.0%} of {ins['int_instruction']}'s peak" if ins else ""
        print(f"quantized matmul kernel: {p['kernel_gflop_s']:.1f} GFLOP/s for each row beyond the first (an FFN "
              f"linear of the model, cache-resident){of_peak}: the rate of a verification's extra rows")
    print(f"\ntarget forward over T new tokens after {r['settings']['context']} cached (exact verification, "
          f"medians of {r['settings']['repeats']}):")
    print("| T | ms per forward | ratio to T=1 | bandwidth floor ms | achieved GB/s | achieved GFLOP/s | "
          "FLOP/byte |")
    print("|---|---|---|---|---|---|---|")
    for row in r["forward"]:
        print(f"| {row['t']} | {row['seconds'] * 1e3:.2f} | {row['ratio']:.2f} | {row['bandwidth_floor_s'] * 1e3:.2f} "
              f"| {row['achieved_gb_s']:.1f} | {row['achieved_gflop_s']:.1f} | {row['intensity']:.2f} |")
    t1 = r["forward"][0]
    bound = max(t1["bandwidth_floor_s"], t1["compute_floor_s"])
    print(f"decode (T=1) takes {t1['x_roofline']:.1f}x its roofline floor ({bound * 1e3:.2f} ms; "
          f"{t1['bandwidth_floor_at_weight_size_s'] * 1e3:.2f} ms at the read speed over {wset:.0f} MB)"
          + ("; the rest is per-op overhead, not memory traffic" if t1["x_roofline"] > 2 else ""))
    if r.get("moe"):
        print_moe(r["moe"])
    print(f"\narithmetic intensity vs the ridge ({p['ridge_flop_per_byte']:.1f} FLOP/byte):")
    for name, n in r["phases"].items():
        print(f"  {name:<12} T={n['t']:<4} {n['intensity']:8.2f} FLOP/byte  {n['x_ridge']:6.2f}x the ridge: "
              f"{n['bound']}-bound")
    preds = r["predictions"]
    print("\npredicted speedup over plain decoding (i.i.d. acceptance alpha, speedup = E(K) / (K c + v(K+1)); "
          "c = draft cost per token / v(1)):")
    cols = [f"{q['proposer']} a={q['alpha']:g} c={q['c']:.2f}" for q in preds]
    print("| K | v(K+1)/v(1) | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for i, k in enumerate(preds[0]["k"]):
        vals = " | ".join(f"{q['speedup'][i]:.2f}" for q in preds)
        print(f"| {k} | {r['verify_curve'][str(k + 1)]:.2f} | {vals} |")
    for q in preds:
        verdict = "plain decoding (speculation is a loss)" if q["best_k"] == 0 else f"K = {q['best_k']}"
        print(f"best K, {q['proposer']} alpha {q['alpha']:g}: {verdict}, predicted {q['best_speedup']:.2f}x")


def print_moe(moe: dict) -> None:
    """The mixture-of-experts table of a roofline report: verification cost, MoE vs dense of the same active size."""
    eb = moe["expert_bytes"] if isinstance(moe["expert_bytes"], int) else max(moe["expert_bytes"])
    print(f"\nmixture of experts: {moe['moe_layers']} of {moe['n_layers']} layers route each token to {moe['k']} of "
          f"{moe['n_experts']} experts ({eb / 1e6:.2f} MB each"
          + (f", + {moe['n_shared']} shared" if moe["n_shared"] else "") + f"); a token reads "
          f"{moe['active_bytes'] / 1e6:.1f} MB ({moe['fixed_bytes'] / 1e6:.1f} MB whatever T + its experts) of "
          f"{moe['all_bytes'] / 1e6:.1f} MB")
    print("verifying T tokens reads the union of their experts: E (1 - (1 - k/E)^T) per layer under uniform "
          "independent routing (measured: random tokens through this model's routers). v(T)/v(1), measured vs "
          "predicted for this model and for a dense model of the same active bytes (roofline: max of the floors; "
          "calibrated: bytes at the T=1 forward's achieved GB/s + extra FLOPs at the matmul kernel's rate (the "
          "quantized kernel's marginal rate where there is one, else the matmul peak); overhead: the "
          "T=1 forward's time beyond its bytes at STREAM read is fixed, bytes stream at STREAM read):")
    print("| T | experts/layer expected | measured | MB read | v(T)/v(1) measured | MoE calibrated | MoE calibrated, "
          "measured routing | MoE overhead | MoE roofline | dense calibrated | dense roofline |")
    print("|---" * 11 + "|")
    for c in moe["curve"]:
        md = "-" if c["measured_distinct"] is None else f"{c['measured_distinct']:.1f}"
        print(f"| {c['t']} | {c['expected_distinct']:.1f} | {md} | {c['weight_bytes'] / 1e6:.1f} | "
              f"{c['measured_ratio']:.2f} | {c['moe_calibrated_ratio']:.2f} | "
              f"{c['moe_measured_routing_calibrated_ratio']:.2f} | {c['moe_overhead_ratio']:.2f} | "
              f"{c['moe_roofline_ratio']:.2f} | {c['dense_calibrated_ratio']:.2f} | {c['dense_roofline_ratio']:.2f} |")


def cmd_roofline(args) -> int:
    from ..loader import load_args as load_model

    alphas = parse_alphas(args.alpha)
    target = load_model(args)
    draft = load_model(args, "model_draft", target) if args.model_draft else None
    report = run_roofline(target, draft, args.context, alphas, args.quick)
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        log(f"wrote {args.json}")
    if args.png:
        from .plots import plot_roofline

        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_roofline(report, args.png)
        log(f"wrote {args.png}")
    return 0
