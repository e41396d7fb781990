"""Static KV cache indexed by slot.

Slots [0, length) hold the keys and values of the tokens seen so far; a forward over T tokens writes slots
[length, length + T). Rolling back a rejected draft is moving `length` back (no copy). Tree verification writes every
candidate node into consecutive slots and then `keep()` compacts the accepted path into place. `pos` records each
slot's RoPE position, which sliding-window layers compare against.
"""

from __future__ import annotations

import torch


class ContextFull(Exception):
    """The context window is full."""


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (n_layers, 1, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, Hkv, S, D]
        self.pos = torch.zeros(max_len, dtype=torch.long, device=device)  # [S] RoPE position of each slot
        self.max_len = max_len
        self.length = 0

    def reserve(self, t: int) -> int:
        """Start slot for `t` new tokens; raises ContextFull when they don't fit."""
        if self.length + t > self.max_len:
            raise ContextFull(f"context window of {self.max_len} tokens is full ({self.length} used, {t} more asked)")
        return self.length

    def rollback(self, length: int) -> None:
        """Forget every slot from `length` on (rejected draft tokens)."""
        assert 0 <= length <= self.length
        self.length = length

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep only `slots` (absolute, ascending, each >= start) after `start`, moved to [start, start+len(slots))."""
        n = len(slots)
        if slots != list(range(start, start + n)):
            idx = torch.tensor(slots, device=self.k.device)
            self.k[:, :, :, start:start + n] = self.k[:, :, :, idx]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, idx]
            self.pos[start:start + n] = self.pos[idx]
        self.length = start + n

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
