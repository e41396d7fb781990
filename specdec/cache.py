"""KV caches indexed by slot: a pool of sequence slots (KVPool) and one sequence's view of it (KVCache).

Slots [0, length) hold the keys and values of the tokens seen so far; a forward over T tokens writes slots
[length, length + T). Rolling back a rejected draft is moving `length` back (no copy). Tree verification writes every
candidate node into consecutive slots and then `keep()` compacts the accepted path into place. `pos` records each
slot's RoPE position, which sliding-window layers compare against. Where the attention kernel runs, the keys are kept
only in its transposed tiles and the cache proper holds the values (one copy of each, as llama.cpp's K and V).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import kernels


def anonymous_memory(size: int, huge: bool = True) -> mmap.mmap:
    """size bytes of anonymous memory (zero-filled by the kernel on first touch), advised into 2 MB transparent huge
    pages where the kernel allows (huge). Private where the platform has the flag, not mmap's default MAP_SHARED:
    Linux backs a shared anonymous mapping with shmem, which transparent huge pages leave alone unless shmem_enabled
    says otherwise (it says never by default)."""
    if not hasattr(mmap, "MAP_PRIVATE") or not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: its anonymous mapping
        return mmap.mmap(-1, size)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose memory is taken only as it is written (on CPU: an anonymous mapping, whose pages the
    kernel zero-fills on first touch; torch.zeros would write, and so commit, all of it at once). A cache sized for
    -c 4096 thus costs only the slots a conversation fills. In 4 KB pages: 2 MB ones would commit each layer's first
    2 MB at its first token (SmolLM2, `generate -n 64`: peak RSS 353 -> 443 MB; its mapping was shared until 12-06,
    which kept the huge-page advice it had from taking effect)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    if size < 1 << 20:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(anonymous_memory(size, huge=False), dtype=dtype, count=count).view(shape)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ContextFull(Exception):
    """The context window is full."""


@dataclass
class LayerCache:
    """One layer's view of a pool: kv [1, S, 2 Hkv, D] (keys then values per slot) or, where the keys are in the
    attention kernel's tiles kt [Hkv, S / 32, D / P, 32, P] (kernels.key_tiles), kv [1, Hkv, S, D] the values alone,
    head by head (k_all None); k_all / v_all [1, Hkv, S, D] views of kv; base: the first slot of the sequence the
    caller works on (SDPA paths; the kernel takes absolute slots). A latent (MLA) cache keeps its one vector per slot
    in kv and, for the kernel, in kt."""

    kv: torch.Tensor
    k_all: torch.Tensor | None
    v_all: torch.Tensor
    kt: torch.Tensor | None
    base: int = 0

    def keys(self, a: int, b: int) -> torch.Tensor:
        """The keys of absolute slots [a, b): [1, Hkv, b - a, D] (a copy out of the tiles where they live there)."""
        return self.k_all[:, :, a:b] if self.k_all is not None else kernels.tile_keys(self.kt, a, b)[None]

    def write(self, a: int, new_kv: torch.Tensor) -> None:
        """Store new_kv [1, T, 2 Hkv, D] (keys then values, RoPE applied) at absolute slots [a, a + T)."""
        if self.k_all is None:  # values here, keys only in their tiles
            Hkv = new_kv.shape[2] // 2
            self.kv[:, :, a:a + new_kv.shape[1]] = new_kv[:, :, Hkv:].transpose(1, 2)
            kernels.store_keys(new_kv[:, :, :Hkv], self.kt, a)
        else:
            self.kv[:, a:a + new_kv.shape[1]] = new_kv


class KVPool:
    """KV storage for up to n_slots sequences of up to max_len tokens each (continuous batching).

    Sequence slot j owns positions [j M, (j + 1) M) of one long slot space (M = max_len rounded up to the kernel's
    tiles of 32), so one attention-kernel call serves rows of many sequences: each row attends its own absolute
    slots. Memory is taken only as slots are written (lazy_zeros), so a pool of 16 x 4096 costs what its sequences
    fill. With transposed_keys (the attention kernel) the keys are only in the tiles kt and the values are stored
    head by head, values [layers, 1, Hkv, S, D], so that the kernel reads one head's values as one stream (side by
    side, a head's rows were 384 bytes apart in SmolLM2's cache, and a decode step's attention at 1500 cached slots
    took 1.24x as long: docs/results/values-head-major-1206.txt); kv is then the slot-major view of them,
    kv[l, 0, s] = the Hkv values of slot s, which slot copies (keep, copy_from, entries) index. Else keys and values
    are side by side, so one copy writes both: kv[l, 0, s, :Hkv] = K, kv[l, 0, s, Hkv:] = V (values is kv).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, n_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", transposed_keys: bool = False, latent: bool = False):
        """latent: multi-head latent attention (models/mla.py): a slot holds one vector of head_dim (the compressed
        kv latent and the rope key, [kv_lora_rank + rope_dim]) instead of 2 Hkv heads; kv [layers, 1, S, 1, D],
        k_all / v_all are both views of it, and its key tiles (transposed_keys) are [layers, 1, tiles, D / P, 32, P]."""
        self.max_len = max_len
        self.stride = -(-max_len // kernels.TILE) * kernels.TILE  # slots between sequences, whole tiles
        S = self.stride * n_slots
        if latent:
            n_kv_heads = 1
        # keys only in the tiles: non-latent caches of the attention kernel
        self.split = split = transposed_keys and not latent
        heads = 1 if latent else n_kv_heads if split else 2 * n_kv_heads
        if split:
            self.values = lazy_zeros((n_layers, 1, heads, S, head_dim), dtype, device)
            self.kv = self.values.transpose(2, 3)  # [layers, 1, S, Hkv, D], a view
        else:
            self.kv = self.values = lazy_zeros((n_layers, 1, S, heads, head_dim), dtype, device)
        # per-layer views as attention reads them: [1, Hkv, S, D] (made once; slicing them per step is one op)
        self.k_all = [None if split else self.kv[i, :, :, :n_kv_heads].transpose(1, 2) for i in range(n_layers)]
        self.v_all = [self.kv[i, :, :, heads - n_kv_heads:].transpose(1, 2) for i in range(n_layers)]
        # the keys in transposed tiles [layers, Hkv, tiles, D / P, 32, P], for the attention kernel (attention.c
        # computes 32 scores at a time from a tile): their only copy, except in a latent cache, whose vectors are
        # also values
        self.kt = kernels.key_tiles(n_layers, n_kv_heads, head_dim, S, dtype) if transposed_keys else None
        self.pos = torch.zeros(S, dtype=torch.long, device=device)  # [S] RoPE position of each slot
        self.n_slots = n_slots
        self.free = list(range(n_slots))
        self.kept: dict[int, list[int]] = {}  # free slot -> the tokens whose keys and values it still holds
        self.released: dict[int, int] = {}  # free slot -> when it was released (a counter)
        self._clock = 0
        self.layers = [LayerCache(self.values[i], self.k_all[i], self.v_all[i],
                                  self.kt[i] if self.kt is not None else None) for i in range(n_layers)]

    def acquire(self, max_len: int | None = None, tokens: Sequence[int] = ()) -> KVCache:
        """A free slot's cache. With `tokens` (a prompt), the free slot whose kept entries (release(..., kept))
        begin with the longest prefix of them: its cache's `reused` says how many leading tokens' keys and values
        are already in place (copied into a slot that keeps nothing when the match keeps more than is shared, so
        a conversation's entries outlive another one on the same system prompt). Else (or when none shares a
        token) the lowest slot that keeps nothing, then the one released longest ago (so the same sequence mix
        reuses the same memory, and kept entries live longest)."""
        if not self.free:
            raise ContextFull(f"all {self.n_slots} cache slots are in use")
        best, reused = self._longest(tokens)
        empty = [j for j in self.free if j not in self.kept]
        source = None
        if best is not None and len(self.kept[best]) > reused and empty:
            # the best match holds more than this prompt shares (another conversation on the same system prompt):
            # copy the shared entries into a slot that keeps nothing, and keep the longer entry for its own sequel
            source, best = best, empty[0]
        if best is None:
            best = min(self.free, key=lambda j: (j in self.kept, self.released[j] if j in self.kept else 0, j))
        self.free.remove(best)
        self.kept.pop(best, None)
        cache = KVCache(pool=self, slot=best, max_len=max_len)
        cache.reused = min(reused, cache.max_len)
        if source is not None and cache.reused:
            held = KVCache(pool=self, slot=source)
            held.length = len(self.kept[source])
            cache.copy_from(held, cache.reused)
            cache.length = 0  # the caller sets how much of it to use
        return cache

    def _longest(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """(the free slot whose kept entries hold the longest prefix of `tokens` (None: no slot holds any), its
        length); the lowest such slot on ties."""
        best, n = None, 0
        for slot in self.free:
            m = common_prefix(self.kept.get(slot, ()), tokens)
            if m > n:
                best, n = slot, m
        return best, n

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the best free slot's kept entries hold (what acquire() would reuse)."""
        return self._longest(tokens)[1]

    def release(self, cache: KVCache, kept: Sequence[int] | None = None) -> None:
        """Free a sequence's slot. kept: the tokens whose keys and values its slots [0, len(kept)) hold, computed
        exactly as any prefill of them would (the engine's exact prefill and decode steps): a later acquire() with a
        prompt that begins with them starts from there (prompt caching)."""
        if cache.slot in self.free or cache.pool is not self:
            raise ValueError("cache slot released twice or into another pool")
        self.free.append(cache.slot)
        self.free.sort()
        self._clock += 1
        self.released[cache.slot] = self._clock
        if kept:
            assert len(kept) <= cache.length
            self.kept[cache.slot] = list(kept)

    @property
    def nbytes(self) -> int:
        extra = self.kt.numel() * self.kt.element_size() if self.kt is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra


class KVCache:
    """One sequence's cache: slots [0, length) of its pool slot hold the keys and values of its tokens so far.

    KVCache(n_layers, ...) makes a private one-slot pool; KVPool.acquire() hands out slots of a shared pool."""

    def __init__(self, n_layers: int = 0, n_kv_heads: int = 0, head_dim: int = 0, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", transposed_keys: bool = False,
                 *, pool: KVPool | None = None, slot: int = 0, latent: bool = False):
        if pool is None:
            pool = KVPool(n_layers, n_kv_heads, head_dim, max_len, 1, dtype, device, transposed_keys, latent)
            pool.free.remove(slot)
        self.pool, self.slot = pool, slot
        self.base = slot * pool.stride  # this sequence's first slot in the pool
        self.max_len = min(max_len or pool.max_len, pool.max_len)
        # the whole pool, slot-major: [layers, 1, S, 2 Hkv (Hkv: values only), D], [layers, Hkv, tiles, D / P, 32, P]
        self.kv, self.kt = pool.kv, pool.kt
        self.pos = pool.pos[self.base:self.base + self.max_len]  # [max_len] RoPE position of each slot (a view)
        self.length = 0
        self.reused = 0  # leading prompt tokens whose keys and values the slot already held (KVPool.acquire)

    def layer(self, i: int) -> LayerCache:
        view = self.pool.layers[i]
        return view if self.base == 0 else LayerCache(view.kv, view.k_all, view.v_all, view.kt, self.base)

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
        """Keep only `slots` (ascending, each >= start) after `start`, moved to [start, start+len(slots))."""
        n = len(slots)
        if slots != list(range(start, start + n)):
            b = self.base
            idx = torch.tensor(slots, device=self.kv.device) + b
            self.kv[:, :, b + start:b + start + n] = self.kv[:, :, idx]
            if self.pool.split:  # the keys, tile lane to tile lane
                to = torch.arange(b + start, b + start + n, device=idx.device)
                T = kernels.TILE
                self.kt[:, :, to // T, :, to % T] = self.kt[:, :, idx // T, :, idx % T]
            elif self.kt is not None:
                kernels.store_keys(self.kv[:, :, b + start:b + start + n], self.kt, b + start)
            self.pos[start:start + n] = self.pos[idx - b]
        self.length = start + n

    def copy_from(self, other: KVCache, n: int) -> None:
        """Take the first n slots of another cache of the same pool (a shared prompt, prefilled once)."""
        assert other.pool is self.pool and n <= min(other.length, self.max_len)
        a, b = other.base, self.base
        self.kv[:, :, b:b + n] = self.kv[:, :, a:a + n]
        if self.pool.split:  # whole tiles: both sequences start on a tile (the pool's stride is whole tiles)
            T, tiles = kernels.TILE, -(-n // kernels.TILE)
            self.kt[:, :, b // T:b // T + tiles] = self.kt[:, :, a // T:a // T + tiles]
        elif self.kt is not None:
            kernels.store_keys(self.kv[:, :, b:b + n], self.kt, b)
        self.pos[:n] = other.pos[:n]
        self.length = n

    def entries(self, a: int, b: int) -> torch.Tensor:
        """This sequence's slots [a, b), every layer, wherever their keys are kept: [layers, b - a, 2 Hkv, D] (keys
        then values; a latent cache: [layers, b - a, 1, D])."""
        values = self.kv[:, 0, self.base + a:self.base + b]
        if not self.pool.split:
            return values
        keys = kernels.tile_keys(self.kt, self.base + a, self.base + b).transpose(1, 2)
        return torch.cat([keys, values], dim=2)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes // self.pool.n_slots
