"""Static KV cache indexed by slot.

Slots [0, length) hold the keys and values of the tokens seen so far; a forward over T tokens writes slots
[length, length + T). Rolling back a rejected draft is moving `length` back (no copy). Tree verification writes every
candidate node into consecutive slots and then `keep()` compacts the accepted path into place. `pos` records each
slot's RoPE position, which sliding-window layers compare against.
"""

from __future__ import annotations

import math
import mmap

import torch

from . import kernels


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose memory is taken only as it is written (on CPU: an anonymous mapping, whose pages the
    kernel zero-fills on first touch; torch.zeros would write, and so commit, all of it at once). A cache sized for
    -c 4096 thus costs only the slots a conversation fills."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size < 1 << 20:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # 2 MB pages where the kernel allows: fewer TLB misses in attention
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class ContextFull(Exception):
    """The context window is full."""


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", batch: int = 1, transposed_keys: bool = False):
        # keys and values side by side, so one copy writes both: kv[l, :, s, :Hkv] = K, kv[l, :, s, Hkv:] = V
        # batch > 1 only for sequences that advance in lockstep (train-mtp samples one prompt several times)
        self.kv = lazy_zeros((n_layers, batch, max_len, 2 * n_kv_heads, head_dim), dtype, device)
        # per-layer views as attention reads them: [B, Hkv, S, D] (made once; slicing them per step is one op)
        self.k_all = [self.kv[i, :, :, :n_kv_heads].transpose(1, 2) for i in range(n_layers)]
        self.v_all = [self.kv[i, :, :, n_kv_heads:].transpose(1, 2) for i in range(n_layers)]
        # the keys again, in transposed tiles [layers, Hkv, tiles, D, 32], for the attention kernel
        # (specdec/kernels/attention.c computes 32 scores at a time from a tile)
        self.kt = kernels.key_tiles(n_layers, n_kv_heads, head_dim, max_len, dtype) if transposed_keys else None
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
            idx = torch.tensor(slots, device=self.kv.device)
            self.kv[:, :, start:start + n] = self.kv[:, :, idx]
            if self.kt is not None:
                kernels.store_keys(self.kv, self.kt, start, start + n)
            self.pos[start:start + n] = self.pos[idx]
        self.length = start + n

    @property
    def nbytes(self) -> int:
        extra = self.kt.numel() * self.kt.element_size() if self.kt is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra
