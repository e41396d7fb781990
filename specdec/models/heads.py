"""Drafting heads that read the trunk's hidden state: Medusa-style parallel heads, and the reduced-vocabulary
output head that specdec's own trained heads share with the trunk.

Parallel heads (Medusa-1, Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): head k is one residual SiLU block, h_k = h + SiLU(W_k h + b_k), followed by the trunk's output head,
and predicts the token k + 1 steps after the one h was computed for. No KV cache: K heads cost K small matmuls.

Reduced draft vocabulary (EAGLE-3's d2t, FR-Spec, Zhao et al. 2025): the heads score only the N tokens most frequent
in the target's own training outputs; verification stays lossless because the draft distribution q is simply 0
elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import make_linear
from .transformer import Transformer


class SubsetHead:
    """The trunk's output head restricted to the rows `ids` [V_draft] (a plain matmul over fewer rows)."""

    def __init__(self, trunk: Transformer, ids: torch.Tensor, quant: str | None = None):
        self.ids = ids.to(trunk.device)  # [V_draft] target token ids
        rows = trunk.embed.rows(self.ids) if trunk.args.tie_embeddings else None
        if rows is None:
            raise ValueError("a reduced draft vocabulary needs a model with tied embeddings")
        self.linear = make_linear(rows, None, trunk.dtype, quant or trunk.quant, 8.0)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., V_draft]
        return self.linear(h)

    def tensors(self) -> list[torch.Tensor]:
        return self.linear.tensors()


class ParallelHeads:
    """K Medusa heads over the trunk's final hidden state (inference)."""

    def __init__(self, w: list[tuple[torch.Tensor, torch.Tensor]], head, dtype: torch.dtype, device):
        """w: per head (weight [dim, dim], bias [dim]); head: the output head the heads share."""
        self.weights = [(a.to(device, dtype), b.to(device, dtype)) for a, b in w]
        self.head = head
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.weights)

    def __call__(self, h: torch.Tensor) -> list[torch.Tensor]:
        """h [..., dim] -> logits [..., V] of each head (float32)."""
        h = h.to(self.dtype)
        return [self.head(h + F.silu(F.linear(h, a, b))).float() for a, b in self.weights]
