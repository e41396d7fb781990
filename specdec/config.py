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
}
SUPPORTED = "llama (incl. Llama-3.x rope scaling, SmolLM2), mistral, qwen2, qwen3, mimo, gemma3"


def cache_dir() -> Path:
    """Where derived files are kept (compiled kernels, converted tokenizers, layout-cache entries, assembled model
    files): $SPECDEC_CACHE or ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


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

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise ModelError(f"unknown architecture '{self.arch}': specdec supports {SUPPORTED}")
        if not self.sliding_layers:
            self.sliding_layers = [self.sliding_window is not None] * self.n_layers
        if self.query_scale is None:
            self.query_scale = 1.0 / math.sqrt(self.head_dim)

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
