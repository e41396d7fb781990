"""Native multi-token prediction (MTP): the sequential prediction modules some models ship next to their trunk
(DeepSeek-V3, Liu et al. 2024, sec. 2.2; GLM-4.5; XiaomiMiMo-7B), run as drafters for speculative decoding.

Module d (d = 1..D) at position i combines the previous depth's hidden state h_i^{d-1} with the embedding of token
t_{i+d} and predicts t_{i+d+1}:

    x       = eh_proj([enorm(Emb(t_{i+d})); hnorm(h_i^{d-1})])   # [2 dim] -> [dim]
    x       = Block(x)          # one transformer layer, its own KV cache, RoPE at position i (the trunk's tables)
    h_i^d   = norm(x)           # the module's final norm: shared_head.norm (DeepSeek) / final_layernorm (MiMo)
    logits  = head(h_i^d)       # shared with the trunk unless the file ships the module its own copy

What the reference implementations do (checked in their sources), and what we do:
- Concatenation order. DeepSeek-V3 / GLM-4.5: [enorm(embedding); hnorm(hidden)] (vLLM deepseek_mtp.py and
  glm4_moe_mtp.py, SGLang deepseek_nextn.py, llama.cpp ``ggml_concat(e_norm, h_norm)``, Megatron-LM
  ``MultiTokenPredictionLayer._concat_embeddings``). MiMo: [hidden_layernorm(hidden); token_layernorm(embedding)]
  (vLLM and SGLang mimo_mtp.py). The readers swap MiMo's ``input_proj`` column halves, so the canonical ``eh_proj``
  [dim, 2 dim] always takes [embedding; hidden] and this module has one code path.
- h^0, the trunk hidden state module 1 reads. DeepSeek layout: after the trunk's final norm (vLLM's DeepseekV2Model
  and SGLang return norm(h) as the hidden states the drafter gets; llama.cpp feeds the trunk's ``result_norm``;
  Megatron's decoder applies its final layernorm before the MTP block). MiMo: before the final norm (vLLM's
  MiMoModel.forward, contributed by Xiaomi, returns hidden + residual and applies model.norm only in
  compute_logits; SGLang's MiMo passes the normed state instead, we follow vLLM). ``Transformer`` returns the
  pre-norm residual stream as its hidden output when ``args.mtp_layout == "mimo"``.
- h^d, what depth d + 1 reads from depth d: the module's output after its final norm, the same tensor the head
  reads (Megatron-LM, which trained these modules, feeds ``final_layernorm``'s output to the next depth; SGLang's
  DeepseekModelNextN returns shared_head.norm(h) as the next step's hidden; MiMo's final_layernorm output is both).
  vLLM's deepseek_mtp chains the pre-norm residual stream instead; we follow training.
- Head, norm and embedding sharing: the module's own ``shared_head.head`` / ``embed_tokens`` when the file has them
  (DeepSeek-V3 stores copies of the trunk's), else the trunk's output head / embedding (GLM-4.6 GGUFs, MiMo). A
  module without its own final norm (a GGUF without ``nextn.shared_head_norm``) uses the trunk's output norm.
- vLLM (both layouts) and SGLang (MiMo) zero the embedding at position 0 ("not needed by MTP"); llama.cpp and
  Megatron training don't, and neither do we.

Positions: module d's token at position i is t_{i+d}, combined with h_i^{d-1}; its RoPE position is i (Megatron
rotates the MTP block with the trunk's positions; vLLM and SGLang pass the target's positions).
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..config import ModelArgs, ModelError
from ..quant import make_linear
from .transformer import AttentionPlan, Block, Transformer, cache_shape, rms_norm


def module_plan(T: int, start: int, exact: bool, device) -> AttentionPlan:
    """How a drafting module's T new rows attend after `start` cached ones: one row sees everything; exact rows
    attend alone (as T = 1 calls would); else one causal masked call."""
    if T == 1:
        return AttentionPlan("single")
    if exact:
        return AttentionPlan("rows")
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    full = torch.cat([torch.ones(T, start, dtype=torch.bool, device=device), causal], dim=1)  # [T, start + T]
    return AttentionPlan("masked", full, full)


class MTPModule:
    """One MTP depth: fuse (hidden, next-token embedding), one transformer block, shared head.

    A plain object like Block (not an nn.Module). Its KV cache is its own 1-layer KVCache (``new_cache``)."""

    def __init__(self, trunk: Transformer, src, prefix: str, args: ModelArgs, dtype: torch.dtype, quant: str):
        """src: the weights (weights.LazyWeights or CachedWeights) holding this module's tensors under `prefix`
        (e.g. "mtp.0.": mtp.0.eh_proj, mtp.0.attn_q ...)."""
        dev = trunk.device
        self.args, self.dtype, self.device, self.max_len = args, dtype, dev, trunk.max_len
        self.eps = args.norm_eps

        def twice(name: str) -> torch.Tensor:  # norm weights as rms_norm() takes them: [2, dim]
            w = src.raw(prefix + name)
            return torch.stack([w, w]).to(dev, dtype)

        def linear(name: str, lookup: bool = False):
            return src.linear(prefix + name, lambda: make_linear(lambda: src[prefix + name].to(dev), None, dtype,
                                                                 quant, src.bits(prefix + name), lookup=lookup))

        self.enorm, self.hnorm = twice("enorm"), twice("hnorm")  # [2, dim] each
        self.eh_proj = linear("eh_proj")  # [dim, 2 dim]
        # DeepSeek-V3 / GLM-4.5: the module's block is a MoE layer (it comes after first_k_dense_replace), and
        # MLA on DeepSeek
        self.block = Block(args, src, prefix, dtype, quant, sliding=False, device=dev, moe=args.n_experts > 0)
        self.norm = twice("shared_head_norm") if prefix + "shared_head_norm" in src else trunk.output_norm  # [2, dim]
        self.own_head = prefix + "shared_head_head" in src
        self.head = linear("shared_head_head") if self.own_head else trunk.output  # [V, dim]
        # the module's own copy of the embedding (DeepSeek-V3 ships one), else the trunk's; looked up as rows()
        self.embed = linear("embed_tokens", lookup=True) if prefix + "embed_tokens" in src else trunk.embed
        self.rope = trunk.rope

    def new_cache(self, max_len: int | None = None) -> KVCache:
        a = self.args
        return KVCache(1, *cache_shape(a), max_len or self.max_len, self.dtype, self.device,
                       latent=a.attention == "mla")

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (the embedding lookup not counted; the head counted even if shared)."""
        tensors = self.eh_proj.tensors() + self.head.tensors() + [self.enorm, self.hnorm, self.norm]
        return self.block.active_bytes() + sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 exact: bool = False, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """h [1, T, dim] (depth 1: the trunk's hidden output), tokens [1, T], positions [T] ->
        (logits [1, T, V] float32, h_next [1, T, dim] for depth d + 1).

        At position p, tokens[p] is the token after the one h[p] was computed from (depth 1: the trunk's hidden at
        p with the token at p + 1), and the logits predict the token after tokens[p]. Writes the T new keys/values
        at cache slots [cache.length, cache.length + T) and advances cache.length. exact: each position computed
        exactly as a T = 1 call would (bitwise), as in Transformer.__call__."""
        T = tokens.shape[1]
        start = cache.reserve(T)
        L = start + T
        cache.pos[start:L] = positions
        e = self.embed.rows(tokens).to(self.dtype)  # [1, T, dim]
        x = self.eh_proj(torch.cat([rms_norm(e, self.enorm, self.eps),
                                    rms_norm(h.to(self.dtype), self.hnorm, self.eps)], dim=-1))  # [1, T, dim]
        a = self.args
        rope = (self.rope.tables(positions, 1, 0) if a.attention == "mla"
                else self.rope.tables(positions, a.n_heads + a.n_kv_heads, a.n_kv_heads))
        plan = module_plan(T, start, exact, self.device)
        x = self.block(x, rope, cache.layer(0), start, plan, None)
        cache.length = L
        h_next = rms_norm(x, self.norm, self.eps)  # [1, T, dim]
        return self.head(h_next[:, -1:] if last_only else h_next).float(), h_next


def load_mtp_modules(trunk: Transformer, weights, args: ModelArgs, dtype: torch.dtype = torch.float32,
                     quant: str = "none") -> list[MTPModule]:
    """The file's MTP modules (canonical ``mtp.{i}.*`` tensors), depth 1 first; [] when it has none."""
    if not args.n_mtp_layers:
        return []
    if args.family not in ("llama", "moe", "deepseek"):
        raise ModelError(f"MTP modules are supported on Llama-family, MoE and DeepSeek trunks, not {args.arch}")
    modules = []
    for i in range(args.n_mtp_layers):
        try:
            modules.append(MTPModule(trunk, weights, f"mtp.{i}.", args, dtype, quant))
        except KeyError as e:
            raise ModelError(f"MTP module {i} lacks tensor {e}: the file is incomplete") from e
    return modules
