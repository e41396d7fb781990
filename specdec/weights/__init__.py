"""Model files -> (ModelArgs, lazily loaded tensors under canonical names).

Canonical tensor names follow llama.cpp's GGUF names (``token_embd``, ``blk.N.attn_q``, ``output_norm`` ...), with
PyTorch's [out_features, in_features] layout, rotary halves in Hugging Face's order ("rotate_half"), and norm weights
as multipliers (Gemma's ``1 + w`` already folded in). Both readers present the same view, so the model code has a
single loading path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelArgs, ModelError


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors produced on access (dequantized / converted one at a time, so peak memory stays low)."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]], source_bytes: dict[str, int],
                 numel: dict[str, int]):
        self._loaders = loaders
        self.source_bytes = source_bytes  # bytes each tensor occupies in the file (for bandwidth accounting)
        self._numel = numel

    def bits(self, *names: str) -> float:
        """Most bits per weight among `names` in the file (32 when unknown)."""
        out = 0.0
        for name in names:
            numel = self._numel.get(name)
            out = max(out, 8.0 * self.source_bytes[name] / numel if numel else 32.0)
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass
class LoadedModel:
    args: ModelArgs
    weights: LazyWeights
    path: Path
    file_type: str  # e.g. "GGUF Q4_1", "safetensors bf16"
    extra: dict = field(default_factory=dict)


def read_model(path: str | Path) -> LoadedModel:
    """Open a GGUF file or a Hugging Face folder (config.json + safetensors)."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"model not found: {p}")
    if p.is_dir():
        from .hf import read_hf

        return read_hf(p)
    from .gguf import read_gguf

    return read_gguf(p)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (interleaved rotary pairs -> rotate_half halves), per head along dim 0."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
