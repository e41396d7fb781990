"""Decoder-only transformers: the Llama family (llama, Llama-3 rope scaling, SmolLM2, mistral, qwen2 with q/k/v bias,
qwen3 with q/k RMSNorm) and Gemma 3 text models, in one readable file.

Gemma 3 differs from Llama in switches, not in kind, so it shares this forward: embeddings scaled by sqrt(dim),
"sandwich" norms (after attention and after the FFN too), GeGLU instead of SwiGLU, q/k RMSNorm, and sliding-window
layers with their own RoPE base. Every such switch is a ModelArgs field.

The model knows nothing about speculation: ``model(tokens, positions, cache, parents) -> (logits, hidden)``.
Projections are fused (q|k|v in one matrix, gate|up in another) so a decode step runs 4 matmuls per layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import kernels
from ..cache import KVCache, KVPool, LayerCache
from ..config import ModelArgs, ModelError
from ..quant import StackedLinear, make_linear
from ..spec.tree import paths as tree_paths
from ..spec.tree import tree_mask


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies [D/2], with linear, llama3 (Llama-3.1 "rope_type": "llama3"), GGUF freq-factor or
    YaRN (Peng et al. 2023, arXiv 2309.00071; DeepSeek-V2/V3) scaling, computed as transformers does. YaRN's
    attention factor (its mscale on cos / sin) is args.rope_attention_factor, applied by Rope."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":  # llama.cpp stores the llama3 adjustment as per-frequency divisors
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        factor, old = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `old`
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(fast), correction_dim(slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / ((hi + 0.001 if lo == hi else hi) - lo))
        extrapolate = 1 - ramp.clamp(0, 1)  # 1: keep the frequency (high ones), 0: interpolate it by `factor`
        return inv / factor * (1 - extrapolate) + inv * extrapolate
    raise ModelError(f"rope scaling '{kind}' is not supported")


class Rope:
    """cos / sin tables [S, D] for one RoPE base; rotate_half is a roll by D/2 with the sign folded into sin.

    Partial rotary (inv_freq shorter than D / 2, GLM-4.5): frequency i turns dims i and D/2 + i, and the other dims
    keep cos = 1, sin = 0. The weight readers lay each head's rotated halves out that way (weights.partial_rotary).
    scale multiplies cos and sin of the rotated dims (YaRN's attention factor)."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device, dim: int | None = None,
                 scale: float = 1.0):
        half = (dim or 2 * inv_freq.numel()) // 2
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [S, r/2]
        rotated = torch.arange(half) < inv_freq.numel()  # [D/2]
        freqs = F.pad(freqs, (0, half - inv_freq.numel()))  # [S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        gain = torch.where(torch.cat([rotated, rotated]), scale, 1.0)  # [D]
        self.cos = (emb.cos() * gain).to(dtype=dtype, device=device)  # [S, D]
        self.sin = (emb.sin() * sign * gain).to(dtype=dtype, device=device)  # [S, D]

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin f32 [T, D] at `positions`, as kernels.rope_store() takes them."""
        return self.cos[positions].float().contiguous(), self.sin[positions].float().contiguous()

    def tables(self, positions: torch.Tensor, n_rot: int, n_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, n_rot + n_keep, D] for `positions` [T]: the first n_rot heads (q and k) rotate, the last
        n_keep heads (v) get cos = 1, sin = 0, so one fused op handles the whole q|k|v projection."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, D]
        T, D = cos.shape[0], cos.shape[-1]
        cos = torch.cat([cos.expand(T, n_rot, D), cos.new_ones(T, n_keep, D)], dim=1)
        sin = torch.cat([sin.expand(T, n_rot, D), sin.new_zeros(T, n_keep, D)], dim=1)
        return cos[None], sin[None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin, for x [B, T, H, D] (rotate_half = roll by D/2, sign folded into sin)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), x / sqrt(mean(x^2) + eps) * w, computed as one fused LayerNorm.

    The vector [x, -x] has mean exactly zero and variance mean(x^2), so LayerNorm over it, cut to its first half,
    is RMSNorm. On CPU this is 4 small ops instead of the ~8 that F.rms_norm decomposes into, and a decode step of a
    small model is made of such small ops. `weight` is [2, D] (w stacked twice) or None."""
    return F.layer_norm(torch.stack([x, x.neg()], dim=-2), (2, x.shape[-1]), weight, None, eps)[..., 0, :]


class RMSNorm:
    """An RMSNorm's weight in both forms it is used in: [2, D] in the model dtype for rms_norm(), f32 [D] for the
    matmul kernel, which applies it to a projection's input rows itself (Linear.apply)."""

    def __init__(self, w: torch.Tensor, eps: float, dtype: torch.dtype):
        self.twice = torch.stack([w, w]).to(dtype)
        self.weight = w.float().contiguous()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.twice, self.eps)


class AttentionPlan:
    """How a forward's T new queries attend, decided once per forward and shared by every layer.

    - "kernel": every query attends its own cache slots in specdec/kernels/attention.c, which computes each row the
      same way whatever the other rows are: decode steps, exact chains and trees, and every forward of a model whose
      whole stack runs in forward.c (quantized Llama-family / Gemma 3 layers on CPU: batch-invariant matmuls too),
      prefill chunks included (faster than "masked" there: 727 against 625 tok/s for a 926-token prompt,
      docs/results/prefill-exact-1205.txt), so a slot's entries are the same whichever forward wrote them (what
      Engine's prompt cache rests on);
    Without the kernel (no C compiler, GPU, f16), PyTorch's SDPA, one call per row where exactness needs it:
    - "single": T = 1, the query attends every cached slot (the plain decode step);
    - "rows": an exact chain: each query attends alone over its own prefix, the very call a decode step makes;
    - "paths": an exact tree: each node attends alone over the prompt and its root-to-node path, laid out in
      consecutive slots as they will be once the path is accepted;
    - "masked": all queries in one kernel call with a [T, L] mask (prefill, non-exact trees). Faster than "rows",
      but attention kernels are not batch-invariant, so results differ from decode steps in the last bits.
    """

    def __init__(self, kind: str, full=None, sliding=None, paths: list[torch.Tensor] | None = None,
                 slots: torch.Tensor | None = None):
        # full / sliding: [T, L] masks ("masked"), or kernels.row_spans() ("kernel"), for full-attention and
        # sliding-window layers; slots: int64 [T] the absolute pool slot each row's key and value go to ("kernel",
        # whose rows may belong to several sequences)
        self.kind, self.full, self.sliding, self.paths, self.slots = kind, full, sliding, paths, slots

    @functools.cached_property
    def slot_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile, lane) of each of `slots` in the attention kernel's key tiles, made once for every layer."""
        return self.slots // kernels.TILE, self.slots % kernels.TILE


class Block:
    """One transformer layer: pre-norm attention and gated FFN, residuals around. Attention is GQA (RoPE, optional
    q/k norm) or, for DeepSeek-V2/V3, multi-head latent attention (models/mla.py); the FFN is dense or a mixture
    of experts (models/moe.py).

    A plain object holding tensors (not an nn.Module): at decode time each layer is ~20 tiny ops, and Module's
    __call__ / __getattr__ machinery would cost as much as they do."""

    def __init__(self, args: ModelArgs, src, prefix: str, dtype: torch.dtype, quant: str, sliding: bool,
                 device: torch.device | None = None, moe: bool = False):
        """src: the weights (weights.LazyWeights, or CachedWeights from the layout cache); prefix: this layer's
        tensor names, e.g. "blk.3." (MTP modules: "mtp.0."); moe: the FFN is a mixture of experts."""
        from .mla import MLAttention
        from .moe import MoE

        a = args
        device = device or torch.device("cpu")
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.eps, self.scale, self.sliding = a.norm_eps, a.query_scale, sliding
        self.gelu = a.activation == "gelu_tanh"
        self.sandwich = a.sandwich_norms

        def linear(key: str, names: tuple[str, ...], bias: tuple[str, ...] = ()):
            full = [prefix + n for n in names]

            def make():
                w = lambda: torch.cat([src[n].to(device) for n in full])  # noqa: E731
                b = torch.cat([src[prefix + n].to(device) for n in bias]) if bias else None
                codes = src.codes(*full) if quant in ("auto", "int4") and device.type == "cpu" else None
                runs = src.code_runs(*full) if codes is None and quant == "auto" and device.type == "cpu" else None
                if runs and b is None:  # parts stored in different formats (Q4_K q, k and Q6_K v): each its own
                    parts = [make_linear(lambda r=r: torch.cat([src[n] for n in r]), None, dtype, quant,
                                         src.bits(*r), src.codes(*r)) for r in runs]
                    if StackedLinear.stackable(parts):
                        return StackedLinear(parts)
                return make_linear(w, b, dtype, quant, src.bits(*full), codes)

            return src.linear(prefix + key, make)

        norm = lambda n: RMSNorm(src.raw(prefix + n).to(device), a.norm_eps, dtype)  # noqa: E731
        self.attn_norm, self.ffn_norm = norm("attn_norm"), norm("ffn_norm")
        self.mla = MLAttention(a, src, prefix, dtype, linear, norm, quant, device) if a.attention == "mla" else None
        if self.mla is None:
            self.wqkv = linear("wqkv", ("attn_q", "attn_k", "attn_v"),
                               ("attn_q.bias", "attn_k.bias", "attn_v.bias") if a.qkv_bias else ())
            self.wo = linear("wo", ("attn_output",))
        self.moe = MoE(a, src, prefix, dtype, quant, device, self.ffn_norm) if moe else None
        if self.moe is None:
            self.w13 = linear("w13", ("ffn_gate", "ffn_up"))
            self.w2 = linear("w2", ("ffn_down",))
            self.ffn_dim = self.w13.out_features // 2
        self.post_attention_norm = norm("post_attention_norm") if a.sandwich_norms else None
        self.post_ffw_norm = norm("post_ffw_norm") if a.sandwich_norms else None
        # q/k RMSNorm weights, one row per q head then per k head: [H + Hkv, D]
        self.qk_norm = torch.cat([src.raw(prefix + "attn_q_norm").expand(a.n_heads, -1),
                                  src.raw(prefix + "attn_k_norm").expand(a.n_kv_heads, -1)]
                                 ).to(device, dtype) if a.qk_norm and self.mla is None else None
        self.qk_norm_f32 = self.qk_norm.float().contiguous() if self.qk_norm is not None else None  # forward.c's

    def linears(self) -> list:
        """The attention's and the dense FFN's linear layers (a MoE layer's experts: self.moe)."""
        attn = self.mla.linears() if self.mla is not None else [self.wqkv, self.wo]
        return attn + ([self.w13, self.w2] if self.moe is None else [])

    def attend(self, q: torch.Tensor, c: LayerCache, end: int, mask: torch.Tensor | None, window: int | None
               ) -> torch.Tensor:
        """Scaled dot-product attention of q [B, H, T, D] over the sequence's slots [first, end), GQA without
        copies."""
        first = max(0, end - window) if window else 0
        return F.scaled_dot_product_attention(q, c.keys(c.base + first, c.base + end),
                                              c.v_all[:, :, c.base + first:c.base + end], attn_mask=mask,
                                              scale=self.scale, enable_gqa=self.n_heads != self.n_kv)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (all experts of a MoE layer)."""
        norms = [n.twice for n in (self.attn_norm, self.ffn_norm, self.post_attention_norm, self.post_ffw_norm) if n]
        linears = [t for lin in self.linears() for t in lin.tensors()]
        extra = self.mla.tensors() if self.mla is not None else []
        extra += self.moe.tensors() if self.moe is not None else []
        return linears + norms + extra + ([self.qk_norm] if self.qk_norm is not None else [])

    def active_bytes(self) -> int:
        """Bytes one token's forward reads: every tensor but the routed experts it did not choose."""
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        if self.moe is not None:
            total -= (self.moe.args.n_experts - self.moe.args.n_experts_used) * self.moe.expert_bytes()
        return total

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], c: LayerCache, start: int,
                 plan: AttentionPlan, window: int | None) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim].

        rope: cos, sin: Rope.rows() [T, D] for the "kernel" plan, else Rope.tables() [1, T, H + 2 Hkv, D];
        c: this layer's cache (cache.LayerCache); start: the sequence's cached tokens before these T (the SDPA
        plans write slots [start, start + T) of its slot; the "kernel" plan writes plan.slots, rows of several
        sequences possibly); plan: how the T queries attend (see AttentionPlan); window: sliding-window size of
        this layer, or None."""
        if self.mla is not None:
            x = self.mla(x, self.attn_norm, rope, c, start, plan)
        else:
            x = self.attention(x, rope, c, start, plan, window)
        if self.moe is not None:  # exact plans: each row routed alone, see models/moe.py
            return self.moe(x, exact=plan.kind != "masked")
        return self.ffn(x)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], c: LayerCache, start: int,
                  plan: AttentionPlan, window: int | None, qkv_in: torch.Tensor | None = None) -> torch.Tensor:
        """GQA attention with its residual: x [B, T, dim] -> [B, T, dim]. qkv_in: the projections' input when it is
        not attn_norm(x) (EAGLE-3's draft layer projects [norm(embedding); norm(x)], models/eagle3.py)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        qkv = (self.wqkv.apply(x, norm=self.attn_norm) if qkv_in is None else self.wqkv(qkv_in)).view(B, T, -1, D)
        if self.qk_norm is not None:
            qk = rms_norm(qkv[:, :, :H + Hkv], None, self.eps) * self.qk_norm
            qkv = torch.cat([qk, qkv[:, :, H + Hkv:]], dim=2)
        if plan.kind == "kernel":  # RoPE, the cache writes and attention in two calls
            kernels.rope_store(qkv, c.kv, c.kt, *rope, plan.slots, H, Hkv)
            o = kernels.attend(qkv, c.kv, c.kt, H, Hkv, *(plan.sliding if window else plan.full), self.scale)
        else:
            o = self.attend_torch(qkv, rope, c, start, plan, window)
            o = o.transpose(1, 2).reshape(B, T, H * D)
        if self.sandwich:  # Gemma: the norm comes between the projection and the residual add
            return x + self.post_attention_norm(self.wo(o))
        return self.wo.apply(o, residual=x)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The dense gated FFN with its residual: x [B, T, dim] -> [B, T, dim]."""
        h = self.w13.apply(x, norm=self.ffn_norm, swiglu=not self.gelu)  # [B, T, ffn] (SwiGLU) or [B, T, 2 ffn]
        if self.gelu:
            gate, up = h.split(self.ffn_dim, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        if self.sandwich:
            return x + self.post_ffw_norm(self.w2(h))
        return self.w2.apply(h, residual=x)

    def attend_torch(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], c: LayerCache, start: int,
                     plan: AttentionPlan, window: int | None) -> torch.Tensor:
        """RoPE, cache writes and attention in PyTorch ops (every plan but "kernel") -> [B, H, T, D]."""
        H, T = self.n_heads, qkv.shape[1]
        L = start + T
        b = c.base
        qkv = apply_rope(qkv, *rope)
        new_kv = qkv[:, :, H:]  # [B, T, 2 Hkv, D]
        c.write(b + start, new_kv)
        q = qkv[:, :, :H].transpose(1, 2)  # [B, H, T, D]
        if plan.kind == "masked":
            mask = plan.sliding if window else plan.full
            return self.attend(q, c, L, mask, None)
        if plan.kind == "rows":
            return torch.cat([self.attend(q[:, :, i:i + 1], c, start + i + 1, None, window) for i in range(T)], dim=2)
        if plan.kind == "paths":
            outs = []
            for i, path in enumerate(plan.paths):
                # lay this node's root-to-node path into consecutive slots: exactly the cache a decode step of
                # this token would see after the path had been accepted
                c.write(b + start, new_kv[:, path])
                outs.append(self.attend(q[:, :, i:i + 1], c, start + len(path), None, window))
            c.write(b + start, new_kv)  # node order again, for cache.keep() after verification
            return torch.cat(outs, dim=2)
        # a single new token sees every earlier slot
        return self.attend(q, c, L, None, window)


def make_rope(args: ModelArgs, max_len: int, dtype: torch.dtype, device) -> Rope:
    """The RoPE tables of a model: over each head (GQA; its first rotary_dim dims for partial rotary) or over MLA's
    decoupled rope dims, with the model's scaling and YaRN attention factor."""
    dim = args.qk_rope_dim if args.attention == "mla" else args.head_dim
    rotated = args.rotary_dim or dim
    inv = rope_inv_freq(rotated, args.rope_theta, args.rope_scaling)
    return Rope(inv, max_len, dtype, device, dim=dim, scale=args.rope_attention_factor)


def cache_shape(args: ModelArgs) -> tuple[int, int]:
    """(KV heads, head size) of a cache slot: MLA keeps one vector, the kv latent and the rope key."""
    if args.attention == "mla":
        return 1, args.kv_lora_rank + args.qk_rope_dim
    return args.n_kv_heads, args.head_dim


def layer_records(layers: list[Block], window: int | None) -> torch.Tensor | None:
    """kernels/forward.c's records of `layers` (int64 [layers, 27]: the four linear layers' codes, scales, zeros,
    bits and rows, the two norms, sliding or not, then Gemma 3's q / k norms, sandwich norms and GELU flag) when
    every one is a Llama-family or Gemma 3 dense layer whose linear layers run in the matmul kernel and the forward
    kernel is built; else None (the records point into tensors the layers keep)."""
    if kernels.forward_lib() is None:
        return None
    rows = []
    for layer in layers:
        lins = tuple(getattr(layer, name, None) for name in ("wqkv", "wo", "w13", "w2"))
        if (layer.moe is not None or layer.mla is not None
                or not all(getattr(lin, "native", False) and lin.bias is None for lin in lins)
                or lins[2].out_features % 32):
            return None
        row = []
        for lin in lins:
            row += [lin.weight.data_ptr(), lin.scales.data_ptr(),
                    lin.zeros.data_ptr() if getattr(lin, "zeros", None) is not None else 0, lin.bits,
                    lin.out_features]
        qk = layer.qk_norm_f32.data_ptr() if layer.qk_norm_f32 is not None else 0
        post = [n.weight.data_ptr() if n is not None else 0 for n in (layer.post_attention_norm, layer.post_ffw_norm)]
        rows.append(row + [layer.attn_norm.weight.data_ptr(), layer.ffn_norm.weight.data_ptr(),
                           int(layer.sliding and window is not None), qk, *post, int(layer.gelu)])
    return torch.tensor(rows, dtype=torch.int64)


class Transformer:
    """Token embedding -> blocks -> final norm -> output head (tied to the embedding or not).

    Built layer by layer from lazily loaded weights, directly on the target device, so peak memory is about one
    dequantized layer above the final footprint."""

    def __init__(self, args: ModelArgs, weights, dtype: torch.dtype = torch.float32, quant: str = "none",
                 max_len: int | None = None, device: str | torch.device = "cpu", progress=None):
        self.args, self.dtype, self.quant = args, dtype, quant
        self.device = dev = torch.device(device)
        self.max_len = max_len or min(args.max_seq_len, 4096)
        w = weights
        codes = lambda n: w.codes(n) if quant in ("auto", "int4") and dev.type == "cpu" else None  # noqa: E731
        # the tables by ranges of rows where they are requantized (weights.Rows: no f32 copy of a whole vocabulary)
        embed = lambda: w.rows("token_embd") if dev.type == "cpu" else w["token_embd"].to(dev)  # noqa: E731
        # the embedding is looked up from a layer's table (Linear.rows): the output head's when they are tied, so a
        # quantized model keeps no float copy of it
        table = lambda: make_linear(embed, None, dtype, quant, w.bits("token_embd"), codes("token_embd"),  # noqa
                                    lookup=True)
        if args.tie_embeddings:
            self.output = self.embed = w.linear("output", table)
        else:
            head = lambda: w.rows("output") if dev.type == "cpu" else w["output"].to(dev)  # noqa: E731
            self.output = w.linear("output", lambda: make_linear(head, None, dtype, quant, w.bits("output"),
                                                                 codes("output")))
            self.embed = w.linear("token_embd", table)
        if self.embed.out_features != args.vocab_size:
            raise ModelError(f"token_embd has {self.embed.out_features} rows, config says vocab {args.vocab_size}")
        self.output_norm = torch.stack([w.raw("output_norm")] * 2).to(dev, dtype)  # [2, dim], see rms_norm
        self.output_norm_f32 = self.output_norm[0].float().contiguous()  # [dim], as forward.c's final norm takes it
        self.layers: list[Block] = []
        for i in range(args.n_layers):
            prefix = f"blk.{i}."
            if f"{prefix}attn_norm" not in w:
                raise ModelError(f"the model file lacks layer {i}: it is incomplete")
            try:
                self.layers.append(Block(args, w, prefix, dtype, quant, args.sliding_layers[i], dev,
                                         moe=args.moe_layers[i]))
            except KeyError as e:
                raise ModelError(f"layer {i} lacks tensor {e}: the file is incomplete or not {args.arch}") from e
            if progress:
                progress(i + 1, args.n_layers)
        self.rope = self.rope_local = make_rope(args, self.max_len, dtype, dev)
        if args.rope_local_theta is not None:
            self.rope_local = Rope(rope_inv_freq(args.head_dim, args.rope_local_theta, None), self.max_len, dtype, dev)
        self.embed_scale = torch.tensor(args.embed_scale, dtype=dtype, device=dev)
        self.embed_mul = float(self.embed_scale)  # the scale as rounded to dtype, for Int8Linear.lookup
        # the attention kernel where dtype, device and head size allow (MLA: over its latent slots, attend_latent)
        if args.attention == "mla":
            self.kernel = kernels.kernel_supports(dtype, dev, cache_shape(args)[1], args.kv_lora_rank)
        else:
            self.kernel = kernels.kernel_supports(dtype, dev, args.head_dim)
        # layers whose inputs the hidden output also carries (EAGLE-3 heads set them; n_layers = the last output)
        self.aux_layers: tuple[int, ...] = ()

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.args.n_layers, *cache_shape(self.args), max_len or self.max_len, self.dtype, self.device,
                       transposed_keys=self.kernel, latent=self.args.attention == "mla")

    def new_pool(self, n_slots: int, max_len: int | None = None) -> KVPool:
        """A cache pool for up to n_slots sequences decoded together (engine.Engine)."""
        return KVPool(self.args.n_layers, *cache_shape(self.args), max_len or self.max_len, n_slots, self.dtype,
                      self.device, transposed_keys=self.kernel, latent=self.args.attention == "mla")

    @property
    def weight_format(self) -> str:
        """The linear layers' formats in memory, e.g. "int4 x120, int8 x1" (quant "auto" mixes them)."""
        import collections

        names = {"Int4Linear": "int4", "Int8Linear": "int8", "Linear": str(self.dtype).removeprefix("torch.")}
        lins = [lin for layer in self.layers for lin in layer.linears()] + [self.output]
        lins += [lin for layer in self.layers if layer.moe for pair in layer.moe.experts for lin in pair]
        lins = [p for lin in lins for p in getattr(lin, "parts", [lin])]  # a StackedLinear's parts
        own = {kernels.Q4K: "q4_k", kernels.Q5K: "q5_k", kernels.Q6K: "q6_k"}  # the GGUF formats kept as they are

        def name(lin) -> str:
            if getattr(lin, "bits", 0) == kernels.Q5:  # Q5_0 stores no m
                return "q5_0" if lin.zeros is None else "q5_1"
            return own[lin.bits] if getattr(lin, "bits", 0) in own else names[type(lin).__name__]

        counts = collections.Counter(name(lin) for lin in lins)
        return ", ".join(f"{k} x{v}" for k, v in counts.most_common())

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a one-token forward reads: every layer's matrices and norms (of a MoE layer: the router,
        the shared experts and k routed experts) and the output head (a lookup reads only T rows of the embedding
        table, which is not counted)."""
        tensors = self.output.tensors() + [self.output_norm]
        return sum(layer.active_bytes() for layer in self.layers) + sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def row_tails(cache: KVCache, start: int, T: int, parents: list[int] | None
                  ) -> list[tuple[int, int, Sequence[int]]]:
        """kernels.row_spans() rows for T new tokens of one sequence after `start` cached ones: a chain (row i ends
        with slots start..start+i, a range) or a tree (the root, then each node's root-to-node path of rows)."""
        b = cache.base + start
        if parents is None:
            return [(cache.base, start, range(b, b + i + 1)) for i in range(T)]
        return [(cache.base, start, [b + r for r in p]) for p in [[0]] + tree_paths(parents)]

    def kernel_plan(self, rows: list[tuple[int, int, list[int]]], slots: list[int]) -> AttentionPlan:
        """The "kernel" plan for rows (row_tails() of one or several sequences) writing at absolute `slots`."""
        full = kernels.row_spans(rows, None)
        window = self.args.sliding_window
        sliding = kernels.row_spans(rows, window) if window else full
        return AttentionPlan("kernel", full, sliding, slots=torch.tensor(slots, dtype=torch.int64))

    def _plan(self, positions: torch.Tensor, cache: KVCache, start: int, T: int, parents: list[int] | None,
              exact: bool) -> AttentionPlan:
        if cache.kt is not None and (T == 1 or exact or self.fast_layers() is not None):
            b = cache.base + start
            return self.kernel_plan(self.row_tails(cache, start, T, parents), list(range(b, b + T)))
        if T == 1:
            return AttentionPlan("single")
        if exact and parents is None:
            return AttentionPlan("rows")
        if exact:
            rows = [[0]] + tree_paths(parents)  # the root, then every node
            return AttentionPlan("paths", paths=[torch.tensor(p, device=self.device) for p in rows])
        dev = self.device
        new = tree_mask(parents, dev) if parents is not None else torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        full = torch.cat([torch.ones(T, start, dtype=torch.bool, device=dev), new], dim=1)  # [T, L]
        window = self.args.sliding_window
        if window is None or start + T <= window:
            return AttentionPlan("masked", full, full)
        sliding = full & ((positions[:, None] - cache.pos[None, :start + T]) < window)
        return AttentionPlan("masked", full, sliding)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int, plan: AttentionPlan,
                last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded rows x [1, T, dim] through every layer, the final norm and the head -> (logits [1, T', V]
        float32, hidden [1, T, dim]); last: the rows whose logits are wanted (all when None)."""
        a = self.args
        if a.attention == "mla":  # one rope key shared by the heads: [1, T, 1, rope_dim] tables
            rope = rope_local = self.rope.tables(positions, 1, 0)
        elif plan.kind == "kernel":  # rows of the tables, for kernels.rope_store()
            rope = self.rope.rows(positions)
            rope_local = rope if self.rope_local is self.rope else self.rope_local.rows(positions)
        else:  # whole [1, T, H + 2 Hkv, D] tables, for apply_rope()
            rope = self.rope.tables(positions, a.n_heads + a.n_kv_heads, a.n_kv_heads)
            rope_local = rope if self.rope_local is self.rope else self.rope_local.tables(
                positions, a.n_heads + a.n_kv_heads, a.n_kv_heads)
        # EAGLE-3's features: the inputs of the aux layers side by side, then the final hidden state (none in plain
        # decoding); aux layers may repeat (tiny test models clip them), a column each
        aux = self.aux_layers or ()
        feats = torch.empty(x.shape[1], (len(aux) + 1) * a.dim, dtype=x.dtype) if aux else None
        fast = self.fast_layers() if plan.kind == "kernel" else None
        h = None
        if fast is not None:
            x, h = self._layers_in_c(fast, x, rope, rope_local, cache, plan, feats)
        else:
            for i, layer in enumerate(self.layers):
                for j in (j for j, k in enumerate(aux) if k == i):
                    feats[:, j * a.dim:(j + 1) * a.dim] = x[0]
                x = layer(x, rope_local if layer.sliding else rope, cache.layer(i), start, plan,
                          a.sliding_window if layer.sliding else None)
        for j in (j for j, k in enumerate(aux) if k == a.n_layers):
            feats[:, j * a.dim:(j + 1) * a.dim] = x[0]
        if (h is None and plan.kind == "kernel" and x.device.type == "cpu" and x.dtype in kernels.DTYPES
                and kernels.forward_lib() is not None):
            h = kernels.rms_norm(x, self.output_norm_f32, a.norm_eps)  # forward.c's final norm, as fast paths do
        elif h is None:
            h = rms_norm(x, self.output_norm, a.norm_eps)
        logits = self.output.logits(h if last is None else h[:, last])
        if self.args.final_logit_softcap:
            cap = self.args.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        # the hidden state MTP modules read: after the final norm, except MiMo's, which reads the residual stream
        # before it (see models/mtp.py); EAGLE-3 heads read the inputs of the aux layers, followed by h
        if aux:
            feats[:, -a.dim:] = h[0]
            return logits, feats[None]
        return logits, (x if a.mtp_layout == "mimo" else h)

    def fast_layers(self) -> torch.Tensor | None:
        """Every layer's record for kernels/forward.c (layer_records()) when the whole stack can run there; else
        None (cached)."""
        if getattr(self, "_fast", False) is not False:
            return self._fast
        a = self.args
        ok = self.device.type == "cpu" and self.dtype in kernels.DTYPES and a.attention != "mla"
        self._fast = layer_records(self.layers, a.sliding_window) if ok else None
        return self._fast

    def _layers_in_c(self, records: torch.Tensor, x: torch.Tensor, rope, rope_local, cache: KVCache,
                     plan: AttentionPlan, feats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, dim] through every layer and the final RMSNorm in one kernels/forward.c call on the "kernel"
        plan, which also copies the aux layers' inputs into feats' columns (EAGLE-3's features) -> (x, its final
        norm), both [1, T, dim]. The norm is forward.c's RMSNorm (f32, each row alone), not rms_norm()'s LayerNorm:
        the same formula, its mean of squares summed in another order."""
        a, lib, layer0 = self.args, kernels.forward_lib(), self.layers[0]
        aux = self.aux_layers or ()
        where = getattr(self, "_feat_where", None)
        if where is None or where[0] != aux:  # (layers, columns) of the features forward.c copies out
            cols = [j * a.dim for j in range(len(aux))]
            self._feat_where = where = (aux, torch.tensor([list(aux), cols], dtype=torch.int64).reshape(2, -1))
        where = where[1]
        T, H, Hkv, D = x.shape[1], a.n_heads, a.n_kv_heads, layer0.head_dim
        pool = cache.pool
        ptrs = getattr(pool, "_layer_ptrs", None)
        if ptrs is None:
            ptrs = pool._layer_ptrs = (torch.tensor([c.kv.data_ptr() for c in pool.layers], dtype=torch.int64),
                                       torch.tensor([c.kt.data_ptr() for c in pool.layers], dtype=torch.int64))
        x = x.contiguous().clone()  # updated in place
        qkv = torch.empty(T, (H + 2 * Hkv) * D, dtype=x.dtype)
        o = torch.empty(T, H * D, dtype=x.dtype)
        h = torch.empty(T, layer0.ffn_dim, dtype=x.dtype)  # act(gate) * up: the gate/up matmul's SwiGLU or GELU
        y = torch.empty(T, a.dim, dtype=x.dtype) if layer0.sandwich else o  # a projection before its norm
        normed = torch.empty_like(x)
        (spans_f, tails_f), (spans_s, tails_s) = plan.full, plan.sliding
        (cos, sin), (cos_l, sin_l) = rope, rope_local
        rc = lib.specdec_layers(
            records.data_ptr(), 0, len(self.layers), ptrs[0].data_ptr(), ptrs[1].data_ptr(),
            pool.layers[0].kt.shape[1], T, a.dim, H, Hkv, D, layer0.ffn_dim, layer0.eps, layer0.scale,
            kernels.DTYPES[x.dtype], x.data_ptr(), qkv.data_ptr(), o.data_ptr(), h.data_ptr(), y.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cos_l.data_ptr(), sin_l.data_ptr(), plan.slots.data_ptr(),
            spans_f.data_ptr(), tails_f.data_ptr(), spans_s.data_ptr(), tails_s.data_ptr(), *lib.fns, len(aux),
            where[0].data_ptr(), where[1].data_ptr(), feats.data_ptr() if aux else None, feats.shape[1] if aux else 0,
            self.output_norm_f32.data_ptr(), a.norm_eps, normed.data_ptr())
        if rc != 0:
            raise MemoryError("a kernel ran out of memory") if rc == -1 else ValueError("kernel shapes")
        return x, normed

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        lookup = getattr(self.embed, "lookup", None)
        if lookup is not None:  # an int8 table: one kernel call (quant.Int8Linear.lookup)
            return lookup(tokens, self.dtype, self.embed_mul)
        x = self.embed.rows(tokens).to(self.dtype)
        return x * self.embed_scale if self.args.embed_scale != 1.0 else x

    def forward_batch(self, items: list[tuple[KVCache, list[int], list[int], list[int] | None]]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the rows of several sequences (continuous batching), every row computed exactly as a
        decode step of that sequence alone would compute it (the "kernel" plan: batch-invariant matmuls and
        attention, each row over its own sequence's slots). items: (cache, tokens, positions, parents or None)
        per sequence, their caches slots of one pool; each cache advances by its rows.
        -> (logits [T, V] float32, hidden [T, dim]), rows in item order."""
        rows, slots, toks, pos = [], [], [], []
        for cache, tokens, positions, parents in items:
            if cache.kt is None:
                raise ValueError("batched forwards need the attention kernel: decode each sequence alone")
            start = cache.reserve(len(tokens))
            rows += self.row_tails(cache, start, len(tokens), parents)
            slots += range(cache.base + start, cache.base + start + len(tokens))
            toks += tokens
            pos += positions
        positions = torch.tensor(pos, device=self.device)
        for cache, tokens, positions_i, _ in items:
            cache.pos[cache.length:cache.length + len(tokens)] = torch.tensor(positions_i)
            cache.length += len(tokens)
        plan = self.kernel_plan(rows, slots)
        x = self.embed_rows(torch.tensor([toks], device=self.device))
        logits, hidden = self._layers(x, positions, items[0][0], 0, plan)
        return logits[0], hidden[0]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 parents: list[int] | None = None, last_only: bool = False,
                 exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T], positions [T] -> (logits [1, T or 1, V] float32, hidden [1, T, dim] after the final norm;
        before it for args.mtp_layout "mimo").

        Writes the T new keys/values at cache slots [cache.length, cache.length + T) and advances cache.length.
        parents: a token tree (spec/tree.py): row 0 is the root, row i + 1 is node i with parent row
        parents[i] + 1; positions must then be the rows' depths after the root's position. None = a chain.

        exact: compute every row exactly as a single-token decode step would compute that token after its
        predecessors (bitwise), so verifying a draft can never disagree with plain decoding. The matmul kernels of
        the bf16 / int8 / int4 paths are batch-invariant (row i of a [T, K] x [K, N] product does not depend on T);
        general attention kernels are not, so attention runs in specdec/kernels/attention.c, which is (AttentionPlan
        "kernel", also used by every decode step), or else each query attends alone (AttentionPlan "rows" /
        "paths"). Where the whole stack runs in forward.c every forward is exact, whatever `exact` says."""
        T = tokens.shape[1]
        start = cache.reserve(T)
        L = start + T
        cache.pos[start:L] = positions
        plan = self._plan(positions, cache, start, T, parents, exact)
        logits, hidden = self._layers(self.embed_rows(tokens), positions, cache, start, plan,
                                      torch.tensor([T - 1]) if last_only else None)
        cache.length = L
        return logits, hidden

    def prefill(self, tokens: list[int], cache: KVCache, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a prompt through the model after cache.length cached tokens, in chunks of `chunk` (a sequence's
        chunks depend only on its own tokens, so its prefill is the same whatever else is decoding)
        -> (logits of the last position [V], hidden states [n, dim])."""
        hiddens = []
        logits = None
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            ids = torch.tensor([part], device=self.device)
            pos = torch.arange(cache.length, cache.length + len(part), device=self.device)
            logits, h = self(ids, pos, cache, last_only=True)
            hiddens.append(h[0])
        return logits[0, -1], torch.cat(hiddens)
