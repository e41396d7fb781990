"""Multi-head latent attention (MLA): DeepSeek-V2 (arXiv 2405.04434, sec. 2.1) and DeepSeek-V3 (arXiv 2412.19437).

Per token, with normed input x, H heads, kv_lora_rank r, nope / rope / value head sizes n, d_r, v:
    c_q  = RMSNorm(W_DQ x)                          # q low-rank (q_lora_rank), or q = W_Q x directly
    q    = W_UQ c_q  -> per head [q_nope (n); q_rope (d_r)],   q_rope = RoPE(q_rope)
    c_kv = RMSNorm(W_DKV x)  [r]                    # the compressed latent (kv_a_proj_with_mqa's first r rows)
    k_r  = RoPE(W_KR x)      [d_r]                  # the decoupled rope key, shared by all heads (its last d_r rows)
    k_h  = [W_UK_h c_kv; k_r],  v_h = W_UV_h c_kv   # kv_b_proj = [W_UK_h; W_UV_h] per head
    o    = W_O [softmax(q_h . k_h * scale) v_h]_h

The cache keeps only [c_kv; k_r] per token (r + d_r numbers, 576 for V3, against 2 H (n + d_r) = 49152 for full
K/V): MLA's memory win. And the up-projections are absorbed (sec. 2.1.2, "W_UK can be absorbed into W_UQ, and W_UV
into W_O"): q_h . k_h = (W_UK_h^T q_nope_h) . c_kv + q_rope_h . k_r, so each head's query becomes
[W_UK_h^T q_nope_h; q_rope_h] in latent space and all heads attend one shared key per slot, the cached vector
itself (multi-query attention with heads of r + d_r); the attention-weighted latent o_h is mapped out as
W_UV_h o_h. No per-token K/V is ever expanded, in prefill or decode. (Prefill over long prompts would spend fewer
FLOPs un-absorbed; one code path keeps prefill and decode computing the same function.)

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3) ...; the weight readers de-interleave the rope rows of
q_b / q and kv_a_mqa (weights.deinterleave_rope) so the Llama-family rotate_half tables apply. Softmax scale:
1 / sqrt(n + d_r), times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN-scaled (args.query_scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..cache import LayerCache
from ..config import ModelArgs
from ..quant import make_linear


class MLAttention:
    """One layer's multi-head latent attention with weight absorption (see the module docstring).

    Tensors (canonical names, llama.cpp's): attn_q_a [q_lora, dim], attn_q_a_norm, attn_q_b [H (n + d_r), q_lora]
    (or attn_q [H (n + d_r), dim]), attn_kv_a_mqa [r + d_r, dim], attn_kv_a_norm [r], attn_kv_b [H (n + v), r] (or
    llama.cpp's split attn_k_b [H, r, n] and attn_v_b [H, v, r]), attn_output [dim, H v]."""

    def __init__(self, args: ModelArgs, src, prefix: str, dtype: torch.dtype, linear, norm, quant: str = "none",
                 device: torch.device | None = None):
        """linear(key, names): a (fused) linear layer of tensors `names` under prefix (Block's); norm(name): an
        RMSNorm of tensor `name`; quant: as Block's (the absorbed per-head matrices are quantized unless "none")."""
        a = args
        self.H, self.n, self.dr, self.v, self.r = a.n_heads, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim, a.kv_lora_rank
        self.q_lora, self.scale = a.q_lora_rank, a.query_scale
        # q_a (or q) and kv_a read the same normed input: one fused matmul [q_lora or H (n + d_r) | r + d_r, dim]
        self.w_a = linear("w_qkv_a", ("attn_q_a" if a.q_lora_rank else "attn_q", "attn_kv_a_mqa"))
        self.q_a_norm = norm("attn_q_a_norm") if a.q_lora_rank else None
        self.w_qb = linear("w_q_b", ("attn_q_b",)) if a.q_lora_rank else None
        self.kv_a_norm = norm("attn_kv_a_norm")
        self.wo = linear("wo", ("attn_output",))
        H, n, v, r = self.H, self.n, self.v, self.r

        made: list[tuple[torch.Tensor, torch.Tensor]] = []

        def absorbed() -> tuple[torch.Tensor, torch.Tensor]:  # W_UK [H, n, r], W_UV [H, v, r]; read once
            if not made:
                if prefix + "attn_kv_b" in src:
                    kv_b = src[prefix + "attn_kv_b"].view(H, n + v, r)
                    made.append((kv_b[:, :n], kv_b[:, n:]))
                else:  # llama.cpp's split tensors: attn_k_b [H, r, n] -> [H, n, r]
                    made.append((src[prefix + "attn_k_b"].transpose(1, 2), src[prefix + "attn_v_b"]))
            return made[0]

        def bits() -> float:
            names = ("attn_kv_b",) if prefix + "attn_kv_b" in src else ("attn_k_b", "attn_v_b")
            return src.bits(*(prefix + name for name in names))

        device = device or torch.device("cpu")
        self.uk = self.uv = None
        if quant != "none" and kernels.matmul_supports(r, n, device) and kernels.matmul_supports(v, r, device):
            # per head, quantized as the file's tensor (quant.make_linear), all heads in one kernels.matmul_heads
            # call: q_lat_h = q_nope_h W_UK_h is a layer of weight W_UK_h^T [r, n], o_h W_UV_h^T one of W_UV_h
            def head(key: str, h: int, w):
                return src.linear(f"{prefix}{key}.{h}", lambda: make_linear(w, None, dtype, quant, bits()))

            self.uk = [head("w_uk", h, lambda h=h: absorbed()[0][h].T.contiguous()) for h in range(H)]
            self.uv = [head("w_uv", h, lambda h=h: absorbed()[1][h].contiguous()) for h in range(H)]
            self.uk_ptrs, self.uv_ptrs = kernels.head_pointers(self.uk), kernels.head_pointers(self.uv)
        else:  # in the activation dtype, as plain batched matmuls
            self.w_uk = src.table(prefix + "w_uk", lambda: absorbed()[0].to(dtype).contiguous())
            self.w_uv = src.table(prefix + "w_uv", lambda: absorbed()[1].to(dtype).contiguous())

    def linears(self) -> list:
        return [lin for lin in (self.w_a, self.w_qb, self.wo) if lin is not None]

    def tensors(self) -> list[torch.Tensor]:
        norms = [nm.twice for nm in (self.q_a_norm, self.kv_a_norm) if nm is not None]
        if self.uk is not None:
            return [t for lin in self.uk + self.uv for t in lin.tensors()] + norms
        return [self.w_uk, self.w_uv] + norms

    def __call__(self, x: torch.Tensor, attn_norm, rope: tuple[torch.Tensor, torch.Tensor], c: LayerCache,
                 start: int, plan) -> torch.Tensor:
        """x [B, T, dim] -> x + attention; rope: cos, sin [1, T, 1, d_r]; c: this layer's latent cache (slots of
        [c_kv; k_r], r + d_r wide), written at [start, start + T); plan: a transformer.AttentionPlan ("single",
        "rows", "paths" or "masked")."""
        from .transformer import apply_rope

        B, T, _ = x.shape
        H, n, dr, r = self.H, self.n, self.dr, self.r
        a = self.w_a.apply(x, norm=attn_norm)  # [B, T, q_lora or H (n + d_r) | r + d_r]
        split = a.shape[-1] - r - dr
        q = self.w_qb(self.q_a_norm(a[..., :split])) if self.w_qb is not None else a[..., :split]
        q = q.view(B, T, H, n + dr)
        q_rope = apply_rope(q[..., n:], *rope)  # [B, T, H, d_r]
        latent = torch.cat([self.kv_a_norm(a[..., split:split + r]),
                            apply_rope(a[..., None, split + r:], *rope)[:, :, 0]], dim=-1)  # [B, T, r + d_r]
        # absorb W_UK: each head's query in latent space, [B, H, T, r] then [B, H, T, r + d_r] with its rope part
        heads = self.uk is not None
        if heads:
            q_lat = torch.stack([kernels.matmul_heads(q[i, :, :, :n].transpose(0, 1), self.uk[0].bits, self.uk_ptrs, r)
                                 for i in range(B)])
        else:
            q_lat = torch.matmul(q[..., :n].transpose(1, 2), self.w_uk)
        query = torch.cat([q_lat, q_rope.transpose(1, 2)], dim=-1)
        o = self.attend(query, latent, c, start, plan)  # [B, H, T, r]
        if heads:  # absorb W_UV: [B, H, T, v]
            o = torch.stack([kernels.matmul_heads(o[i], self.uv[0].bits, self.uv_ptrs, self.v) for i in range(B)])
        else:
            o = torch.matmul(o, self.w_uv.transpose(1, 2))
        return self.wo.apply(o.transpose(1, 2).reshape(B, T, H * self.v), residual=x)

    def attend(self, query: torch.Tensor, latent: torch.Tensor, c: LayerCache, start: int, plan) -> torch.Tensor:
        """Write the T new latents [B, T, r + d_r] to the cache, then attention of query [B, H, T, r + d_r] over the
        sequence's slots, every head against the one cached vector per slot -> [B, H, T, r]. The "kernel" plan:
        kernels.attend_latent, rows of one or several sequences at their absolute plan.slots (batch-invariant)."""
        T = latent.shape[1]
        if plan.kind == "kernel":
            tile, lane = plan.slot_tiles
            c.kv[0, plan.slots, 0] = latent[0]
            c.kt[0, tile, :, lane] = kernels.tile_slots(c.kt, latent[0])  # the keys in their tiles too
            o = kernels.attend_latent(query.transpose(1, 2).contiguous(), c.kv, c.kt, self.r, *plan.full, self.scale)
            return o.transpose(1, 2)
        b, L = c.base, start + T
        c.kv[:, b + start:b + L, 0] = latent
        if c.kt is not None:  # a prefill ("masked") of a cache whose decode steps run in the kernel
            kernels.store_keys(c.kv[:, b + start:b + L], c.kt, b + start)

        def over(q: torch.Tensor, end: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            kv = c.kv[:, b:b + end].transpose(1, 2)  # [1, 1, end, r + d_r]: keys, and (first r) values
            return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=True)[..., :self.r]

        if plan.kind == "masked":
            return over(query, L, plan.full)
        if plan.kind == "rows":  # each query alone over its own prefix, as its decode step computes it
            return torch.cat([over(query[:, :, i:i + 1], start + i + 1) for i in range(T)], dim=2)
        if plan.kind == "paths":  # each tree node alone over the prompt and its root-to-node path
            outs = []
            for i, path in enumerate(plan.paths):
                c.kv[:, b + start:b + start + len(path), 0] = latent[:, path]
                outs.append(over(query[:, :, i:i + 1], start + len(path)))
            c.kv[:, b + start:b + L, 0] = latent  # node order again, for cache.keep() after verification
            return torch.cat(outs, dim=2)
        return over(query, L)  # "single": one new token sees every slot
