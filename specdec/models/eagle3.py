"""EAGLE-3 draft heads (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), as vLLM's and SGLang's EAGLE-3 models and the `speculators` package define them.

The head reads a fusion of low, middle and high trunk features: the inputs of layers ``aux = (2, L // 2, L - 3)``
(``eagle_aux_hidden_state_layer_ids``), concatenated and projected by ``fc`` [dim, 3 dim]. Its one decoder layer
projects q / k / v from [input_layernorm(Emb(t_{p+1})); hidden_norm(g_p)] (2 dim wide); the residual around attention
is g_p itself (``norm_before_residual`` False), then a gated FFN; logits = lm_head(norm(x)) over the reduced draft
vocabulary, lm_head being the target's own output rows for those tokens (frozen). The next drafting step feeds the
layer's pre-norm output x back as g (no fc), with the drafted token's embedding, one position further: the same
recursion as an MTP module past its trained depth, so spec/mtp.SequentialMTP drafts with it unchanged.

Positions: at index p the layer combines g_p (from trunk position p) with token t_{p+1} and rotates with position p,
as vLLM's EAGLE proposer passes the target's positions (speculators trains with p + 1; attention only sees
differences, so both agree).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import kernels
from ..cache import KVCache
from ..config import ModelArgs
from ..quant import make_linear
from .mtp import module_plan
from .transformer import AttentionPlan, Block, Transformer, cache_shape, make_rope, rms_norm

# our Block's tensor names for the draft layer's, under speculators / vLLM names (the file layout, weights/heads.py)
LAYER_NAMES = {"attn_norm": "layers.0.input_layernorm.weight", "hidden_norm": "layers.0.hidden_norm.weight",
               "attn_q": "layers.0.self_attn.q_proj.weight", "attn_k": "layers.0.self_attn.k_proj.weight",
               "attn_v": "layers.0.self_attn.v_proj.weight", "attn_output": "layers.0.self_attn.o_proj.weight",
               "ffn_norm": "layers.0.post_attention_layernorm.weight", "ffn_gate": "layers.0.mlp.gate_proj.weight",
               "ffn_up": "layers.0.mlp.up_proj.weight", "ffn_down": "layers.0.mlp.down_proj.weight",
               "fc": "fc.weight", "norm": "norm.weight"}


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers: low, middle, high (vLLM's and speculators' default), clipped to [0, n_layers] for
    the tiny test models (n_layers: the trunk's output)."""
    return tuple(min(max(i, 0), n_layers) for i in (2, n_layers // 2, n_layers - 3))  # type: ignore[return-value]


def draft_args(a: ModelArgs) -> ModelArgs:
    """The draft layer's shape: a plain Llama decoder layer (dense SwiGLU FFN of the trunk's dense ffn_dim, full
    RoPE) with the trunk's width, heads and RoPE base (what speculators' and vLLM's EAGLE-3 layers are), whatever the
    trunk's own layers add (Gemma's sandwich norms, GeGLU, q/k norms, sliding windows; q/k/v biases; experts; GLM's
    partial rotary). On an MLA trunk (DeepSeek-V2 / V3), whose heads have no single head_dim, the layer is multi-head
    attention with dim / n_heads per head."""
    mla = a.attention == "mla"
    head_dim = a.dim // a.n_heads if mla else a.head_dim
    return replace(a, arch="llama", qkv_bias=False, qk_norm=False, activation="silu", sandwich_norms=False,
                   sliding_window=None, sliding_layers=[False] * a.n_layers, rope_local_theta=None,
                   head_dim=head_dim, n_kv_heads=a.n_heads if mla else a.n_kv_heads, query_scale=head_dim ** -0.5,
                   final_logit_softcap=None, rotary_dim=None, rope_attention_factor=1.0, n_experts=0,
                   moe_layers=[False] * a.n_layers, attention="gqa", n_mtp_layers=0, mtp_layout=None)


class Eagle3Module:
    """The EAGLE-3 draft layer with fc, norms and the (reduced-vocabulary) head, behind MTPModule's interface."""

    def __init__(self, trunk: Transformer, tensors: dict[str, torch.Tensor], aux: tuple[int, ...], head,
                 dtype: torch.dtype, quant: str):
        """tensors: the file's tensors under speculators names (LAYER_NAMES values); head: the output head over the
        draft vocabulary (models/heads.SubsetHead) or the trunk's."""
        from ..weights import LazyWeights

        a = draft_args(trunk.args)
        self.args: ModelArgs = a
        self.dtype, self.device, self.max_len, self.eps = dtype, trunk.device, trunk.max_len, a.norm_eps
        self.aux = tuple(aux)
        self.in_dim = (len(self.aux) + 1) * a.dim  # the trunk's hidden output with aux layers set: features, then h
        src = LazyWeights.of({f"e3.{ours}": tensors[theirs].float() for ours, theirs in LAYER_NAMES.items()},
                             bits=16.0)
        self.block = Block(a, src, "e3.", dtype, quant, sliding=False, device=self.device)

        def twice(name: str) -> torch.Tensor:  # norm weights as rms_norm() takes them: [2, dim]
            return torch.stack([src.raw(name)] * 2).to(self.device, dtype)

        self.hidden_norm, self.norm = twice("e3.hidden_norm"), twice("e3.norm")
        self.fc = make_linear(src["e3.fc"].to(self.device), None, dtype, quant, 16.0)
        self.head = head
        self.embed = trunk.embed
        self.rope = make_rope(a, self.max_len, trunk.rope.cos.dtype, self.device)  # the layer's own: full rotary
        # the attention kernel where the trunk's dtype and this layer's head size allow: its cache keeps key tiles
        self.kernel = kernels.kernel_supports(dtype, self.device, a.head_dim)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(1, *cache_shape(self.args), max_len or self.max_len, self.dtype, self.device,
                       transposed_keys=self.kernel)

    @property
    def weight_bytes(self) -> int:
        tensors = self.fc.tensors() + self.head.tensors() + [self.hidden_norm, self.norm]
        return self.block.active_bytes() + sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 exact: bool = False, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """h [1, T, in_dim] (the trunk's aux features then its final hidden state; only the features are read) or
        [1, T, dim] (the layer's own previous output), tokens [1, T] (the token after the one h stands for),
        positions [T] -> (logits [1, T or 1, V_draft] float32, x [1, T, dim] the pre-norm output the next step
        reads). Writes T keys / values at the cache's next slots, as MTPModule does."""
        T = tokens.shape[1]
        dim = self.args.dim
        start = cache.reserve(T)
        L = start + T
        cache.pos[start:L] = positions
        h = h.to(self.dtype)
        g = self.fc(h[..., :len(self.aux) * dim]) if h.shape[-1] != dim else h  # [1, T, dim]
        e = self.embed.rows(tokens).to(self.dtype)
        u = torch.cat([rms_norm(e, self.block.attn_norm.twice, self.eps), rms_norm(g, self.hidden_norm, self.eps)],
                      dim=-1)
        a = self.args
        if cache.kt is not None:  # attention.c: rows computed as decode steps compute them (exact whatever T)
            b = cache.base + start
            rope = self.rope.rows(positions)
            full = kernels.row_spans(Transformer.row_tails(cache, start, T, None), None)
            plan = AttentionPlan("kernel", full, full, slots=torch.arange(b, b + T))
        else:
            rope = self.rope.tables(positions, a.n_heads + a.n_kv_heads, a.n_kv_heads)
            plan = module_plan(T, start, exact, self.device)
        x = self.block.ffn(self.block.attention(g, rope, cache.layer(0), start, plan, None, qkv_in=u))
        cache.length = L
        out = x[:, -1:] if last_only else x
        return self.head(rms_norm(out, self.norm, self.eps)).float(), x
