"""Decoder-only transformers: the Llama family (llama, Llama-3 rope scaling, SmolLM2, mistral, qwen2 with q/k/v bias,
qwen3 with q/k RMSNorm) and Gemma 3 text models, in one readable file.

Gemma 3 differs from Llama in switches, not in kind, so it shares this forward: embeddings scaled by sqrt(dim),
"sandwich" norms (after attention and after the FFN too), GeGLU instead of SwiGLU, q/k RMSNorm, and sliding-window
layers with their own RoPE base. Every such switch is a ModelArgs field.

The model knows nothing about speculation: ``forward(tokens, positions, cache, tree_mask) -> (logits, hidden)``.
Projections are fused (q|k|v in one matrix, gate|up in another) so a decode step runs 4 matmuls per layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..config import ModelArgs, ModelError
from ..quant import make_linear


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies [D/2], with linear, llama3 (Llama-3.1 "rope_type": "llama3") or GGUF freq-factor
    scaling, computed as transformers does."""
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
    raise ModelError(f"rope scaling '{kind}' is not supported")


class Rope:
    """cos / sin tables [S, D] for one RoPE base; rotate_half is a roll by D/2 with the sign folded into sin."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device):
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
        half = inv_freq.numel()
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.cos = emb.cos().to(dtype=dtype, device=device)  # [S, D]
        self.sin = (emb.sin() * sign).to(dtype=dtype, device=device)  # [S, D]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T], shaped [1, T, 1, D] to broadcast over heads."""
        return self.cos[positions][None, :, None], self.sin[positions][None, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, for x [B, T, H, D]."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


class Block(nn.Module):
    """One transformer layer: pre-norm attention (GQA, RoPE, optional q/k norm) and gated FFN, residuals around."""

    def __init__(self, args: ModelArgs, w: dict, dtype: torch.dtype, quant: str, sliding: bool):
        super().__init__()
        a = args
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.eps, self.scale, self.sliding = a.norm_eps, a.query_scale, sliding
        self.gelu = a.activation == "gelu_tanh"
        self.sandwich = a.sandwich_norms
        bias = None
        if a.qkv_bias:
            bias = torch.cat([w["attn_q.bias"], w["attn_k.bias"], w["attn_v.bias"]])
        self.wqkv = make_linear(torch.cat([w["attn_q"], w["attn_k"], w["attn_v"]]), bias, dtype, quant)
        self.wo = make_linear(w["attn_output"], None, dtype, quant)
        self.w13 = make_linear(torch.cat([w["ffn_gate"], w["ffn_up"]]), None, dtype, quant)
        self.w2 = make_linear(w["ffn_down"], None, dtype, quant)
        self.ffn_dim = w["ffn_gate"].shape[0]
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if a.sandwich_norms else [])
        norms += ["attn_q_norm", "attn_k_norm"] if a.qk_norm else []
        for name in norms:
            self.register_buffer(name, w[name].to(dtype))  # [dim] or [head_dim]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: int, mask: torch.Tensor | None, window: int | None) -> torch.Tensor:
        """x [B, T, dim]; k_cache / v_cache [B, Hkv, S, D] (slots [start, start+T) are written here);
        mask [T, L] bool (True = attend) or None (attend every slot < L); window: for T=1 decode of a sliding
        layer, attend only the last `window` slots."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        L = start + T
        qkv = self.wqkv(self.norm(x, self.attn_norm)).view(B, T, H + 2 * Hkv, D)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        if hasattr(self, "attn_q_norm"):
            q, k = self.norm(q, self.attn_q_norm), self.norm(k, self.attn_k_norm)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache[:, :, start:L] = k.transpose(1, 2)
        v_cache[:, :, start:L] = v.transpose(1, 2)
        first = max(0, L - window) if window else 0
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, first:L], v_cache[:, :, first:L],
                                           attn_mask=mask, scale=self.scale, enable_gqa=H != Hkv)  # [B, H, T, D]
        o = self.wo(o.transpose(1, 2).reshape(B, T, H * D))
        x = x + (self.norm(o, self.post_attention_norm) if self.sandwich else o)
        gate, up = self.w13(self.norm(x, self.ffn_norm)).split(self.ffn_dim, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        f = self.w2(act * up)
        return x + (self.norm(f, self.post_ffw_norm) if self.sandwich else f)


class Transformer(nn.Module):
    """Token embedding -> blocks -> final norm -> output head (tied to the embedding or not)."""

    def __init__(self, args: ModelArgs, weights, dtype: torch.dtype = torch.float32, quant: str = "none",
                 max_len: int | None = None, device: str | torch.device = "cpu", progress=None):
        super().__init__()
        self.args, self.dtype, self.quant = args, dtype, quant
        self.device = torch.device(device)
        self.max_len = min(max_len or args.max_seq_len, args.max_seq_len)
        embed = weights["token_embd"]  # [V, dim]
        if embed.shape[0] != args.vocab_size:
            raise ModelError(f"token_embd has {embed.shape[0]} rows, config says vocab {args.vocab_size}")
        # quantized models keep the embedding table in bf16: a lookup reads T rows, so it costs memory, not speed
        self.register_buffer("embed", embed.to(torch.bfloat16 if quant != "none" else dtype))  # [V, dim]
        self.output = make_linear(embed if args.tie_embeddings else weights["output"], None, dtype, quant)
        del embed
        self.register_buffer("output_norm", weights["output_norm"].to(dtype))  # [dim]
        layers = []
        for i in range(args.n_layers):
            prefix = f"blk.{i}."
            w = {n[len(prefix):]: weights[n] for n in weights if n.startswith(prefix) and ".hf." not in n}
            if not w:
                raise ModelError(f"the model file lacks layer {i}: it is incomplete")
            try:
                layers.append(Block(args, w, dtype, quant, args.sliding_layers[i]))
            except KeyError as e:
                raise ModelError(f"layer {i} lacks tensor {e}: the file is incomplete or not {args.arch}") from e
            if progress:
                progress(i + 1, args.n_layers)
        self.layers = nn.ModuleList(layers)
        inv = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
        self.rope = Rope(inv, self.max_len, dtype, "cpu")
        self.rope_local = self.rope
        if args.rope_local_theta is not None:
            self.rope_local = Rope(rope_inv_freq(args.head_dim, args.rope_local_theta, None), self.max_len, dtype, "cpu")
        self.to(self.device)
        for r in {id(self.rope): self.rope, id(self.rope_local): self.rope_local}.values():
            r.cos, r.sin = r.cos.to(self.device), r.sin.to(self.device)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_len or self.max_len, self.dtype, self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (every linear layer, the norms; the embedding rows are negligible)."""
        return sum(m.nbytes for m in self.modules() if hasattr(m, "nbytes") and m is not self) + sum(
            b.numel() * b.element_size() for n, b in self.named_buffers() if n.endswith("norm"))

    def _masks(self, positions: torch.Tensor, cache: KVCache, start: int, T: int, tree_mask: torch.Tensor | None):
        """Attention masks [T, L] (True = attend) for full and sliding layers, shared by every layer."""
        L = start + T
        window = self.args.sliding_window
        if T == 1:  # a single new token sees every earlier slot; sliding layers just slice the last `window`
            return None, None
        new = tree_mask if tree_mask is not None else torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        full = torch.cat([torch.ones(T, start, dtype=torch.bool, device=self.device), new], dim=1)  # [T, L]
        if window is None or L <= window:
            return full, full
        sliding = full & ((positions[:, None] - cache.pos[None, :L]) < window)
        return full, sliding

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                tree_mask: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T], positions [T] -> (logits [1, T or 1, V] float32, hidden [1, T, dim] after the final norm).

        Writes the T new keys/values at cache slots [cache.length, cache.length + T) and advances cache.length.
        tree_mask [T, T] bool says which new tokens each new token may see (default: causal, i.e. a chain)."""
        T = tokens.shape[1]
        start = cache.reserve(T)
        L = start + T
        cache.pos[start:L] = positions
        x = F.embedding(tokens, self.embed).to(self.dtype)
        if self.args.embed_scale != 1.0:
            x = x * torch.tensor(self.args.embed_scale, dtype=self.dtype)
        full, sliding = self._masks(positions, cache, start, T, tree_mask)
        rope = self.rope.tables(positions)
        rope_local = rope if self.rope_local is self.rope else self.rope_local.tables(positions)
        window = self.args.sliding_window if T == 1 else None
        for i, layer in enumerate(self.layers):
            if layer.sliding:
                x = layer(x, rope_local, cache.k[i], cache.v[i], start, sliding, window)
            else:
                x = layer(x, rope, cache.k[i], cache.v[i], start, full, None)
        cache.length = L
        h = F.rms_norm(x, self.output_norm.shape, self.output_norm, self.args.norm_eps)
        logits = self.output(h[:, -1:] if last_only else h).float()
        if self.args.final_logit_softcap:
            cap = self.args.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits, h
