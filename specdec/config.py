"""Model configuration: one plain dataclass, filled from GGUF metadata or a Hugging Face config.json.

Behaviour is never inferred from a file name: every difference between architectures is a field here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

# architecture names as GGUF / config.json spell them -> the model family that runs them
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mimo": "llama",  # XiaomiMiMo: a qwen2 trunk (q/k/v bias) plus MTP layers
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    # mixture of experts (models/moe.py): GQA attention as in the Llama family
    "qwen3_moe": "moe",
    "glm4_moe": "moe",
    # multi-head latent attention (models/mla.py) + mixture of experts
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}
SUPPORTED = ("llama (incl. Llama-3.x rope scaling, SmolLM2), mistral, qwen2, qwen3, mimo, gemma3, qwen3_moe, glm4_moe, "
             "deepseek_v2, deepseek_v3")


def cache_dir() -> Path:
    """Where derived files are kept (compiled kernels, converted tokenizers, layout-cache entries, assembled model
    files): $SPECDEC_CACHE or ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim) after a load's transient buffers:
    freed but still resident, they count in peak RSS. Parsing Gemma 3's 262k-token tokenizer.json: 511 -> 329 MB
    after torch and the tokenizer; building the shipped EAGLE-3 heads of the default model: `specdec generate`
    peak 439 -> 386 MB (docs/results/rss-heads-1206.txt)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(s) + 1 (Peng et al. 2023; DeepSeek-V2's yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class ModelError(Exception):
    """A model file or configuration specdec cannot use; the message says what to do."""


@dataclass
class ModelArgs:
    """Shapes and switches of a decoder-only transformer (Llama family or Gemma 3)."""

    arch: str  # as the file names it: llama, mistral, qwen2, qwen3, mimo, gemma3
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3" | "linear", "factor": ..., ...} as in HF config.json; None = plain RoPE
    rope_scaling: dict | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    # sliding-window attention: window size, and which layers use it (True = sliding, False = full)
    sliding_window: int | None = None
    sliding_layers: list[bool] = field(default_factory=list)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), None = rope_theta
    query_scale: float | None = None  # softmax scale; None = 1/sqrt(head_dim)
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(dim)
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # Gemma: extra norm after attention and after the FFN
    final_logit_softcap: float | None = None
    n_mtp_layers: int = 0  # native multi-token-prediction modules shipped in the file (not counted in n_layers)
    # how the file lays them out: "deepseek" (DeepSeek-V3 / GLM-4.5 / llama.cpp nextn: module 1 reads the trunk's
    # hidden state after its final norm) or "mimo" (XiaomiMiMo: before it); None = no MTP modules. See models/mtp.py
    mtp_layout: str | None = None
    # partial rotary embedding (GLM-4.5: half of each head rotates): rotated dims per head; None = head_dim
    rotary_dim: int | None = None
    # YaRN's attention factor (Peng et al. 2023), multiplying RoPE's cos and sin as transformers does
    rope_attention_factor: float = 1.0

    # mixture of experts (models/moe.py); n_experts = 0: every layer is dense
    n_experts: int = 0
    n_experts_used: int = 0  # top-k experts per token
    moe_ffn_dim: int = 0  # each routed expert's hidden size
    n_shared_experts: int = 0  # shared experts, run on every token as one FFN of n_shared * moe_ffn_dim
    moe_layers: list[bool] = field(default_factory=list)  # which layers are MoE (else dense, ffn_dim)
    # "softmax" (Qwen3-MoE, DeepSeek-V2) or "sigmoid" (DeepSeek-V3, GLM-4.5: scores + a correction bias choose)
    router: str = "softmax"
    router_groups: int = 1  # group-limited routing: experts in n groups, tokens pick from the best topk_groups
    router_topk_groups: int = 1
    router_group_score: str = "top2"  # how a group scores: "max" (DeepSeek-V2) or "top2" sum (DeepSeek-V3)
    norm_topk_prob: bool = False  # renormalize the k chosen weights to sum to 1
    routed_scaling: float = 1.0  # multiplies the routed experts' weights

    # multi-head latent attention (models/mla.py, DeepSeek-V2 / V3); attention "gqa" (the Llama family) or "mla"
    attention: str = "gqa"
    q_lora_rank: int | None = None  # None: a plain q projection
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise ModelError(f"unknown architecture '{self.arch}': specdec supports {SUPPORTED}")
        if not self.sliding_layers:
            self.sliding_layers = [self.sliding_window is not None] * self.n_layers
        if not self.moe_layers:
            self.moe_layers = [self.n_experts > 0] * self.n_layers
        if self.query_scale is None:
            qk_dim = self.qk_nope_dim + self.qk_rope_dim if self.attention == "mla" else self.head_dim
            self.query_scale = 1.0 / math.sqrt(qk_dim)

    @property
    def family(self) -> str:
        return FAMILIES[self.arch]

    def n_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the trunk (and output head)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.dim * self.ffn_dim
        total = self.n_layers * (attn + ffn)
        head = self.vocab_size * self.dim
        total += head if include_embedding or not self.tie_embeddings else 0
        if not self.tie_embeddings and include_embedding:
            total += head
        return total
