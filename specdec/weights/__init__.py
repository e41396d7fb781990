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


class Q6Codes(tuple):
    """A GGUF Q6_K tensor's own codes and scales, (q [N, K] uint8 in 0..63, sc [N, K/16] int8, d [N, K/256] f32)
    with w = d sc (q - 32): what quant.Int6Linear keeps (weights.gguf.q6_codes)."""


class Q5Codes(tuple):
    """A GGUF Q5_K tensor's own codes and scales, (q [N, K] uint8 in 0..31, d, dmin [N, K/256] f32, sc, mn [N, K/32]
    uint8) with w = d sc q - dmin mn per group of 32: what quant.Int6Linear keeps as format Q5K
    (weights.gguf.q5_codes)."""


class Q501Codes(tuple):
    """A GGUF Q5_0 / Q5_1 tensor's own codes and factors, (q [N, K] uint8 in 0..31, d, m [N, K/32] f32) with
    w = d q + m per group of 32 (Q5_0: m = -16 d): what quant.Int6Linear keeps as format Q5
    (weights.gguf.q501_codes)."""


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors produced on access (dequantized / converted one at a time, so peak memory stays low).

    The model is built through three methods, so that the layout cache (weights/layout.py) can record what it keeps
    and give it back later without converting anything: `raw(name)` for tensors kept as they are (norms), and
    `linear(key, make)` / `table(key, make)` for layers and tables the model makes from source tensors (reading
    them with `w[name]` inside `make`). With a `recorder` (a layout.LayoutWriter), each is written to the cache as
    it is made and the model built here is only a scaffold (its layers hold no weights); the loader then maps the
    finished entry."""

    def __init__(self, loaders: dict[str, Callable[[], torch.Tensor]], source_bytes: dict[str, int],
                 numel: dict[str, int], codes: dict[str, Callable[[], tuple]] | None = None,
                 rows: dict[str, Rows] | None = None):
        self._loaders = loaders
        self._rows = rows or {}
        self.source_bytes = source_bytes  # bytes each tensor occupies in the file (for bandwidth accounting)
        self._numel = numel
        # codes taken from the file without dequantizing: int4 (GGUF Q4_0 / Q4_1 / Q4_K): name -> () -> (q, scale,
        # zero) with q [N, K] in 0..15 and scale, zero [N, K / 32] (w = (q - 8) scale + zero), then Q4_K's own
        # scales (gguf.int4_codes); Q6_K / Q5_K / Q5_0, Q5_1: name -> () -> Q6Codes / Q5Codes / Q501Codes
        self._codes = codes or {}
        self.recorder = None
        self.linears: dict[str, dict] = {}  # what was recorded: key -> {"class", "attrs"}

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], bits: float = 32.0) -> LazyWeights:
        """Tensors already in memory (e.g. read from a heads file), each counted as `bits` per weight."""
        numel = {n: t.numel() for n, t in tensors.items()}
        return cls({n: (lambda t=t: t) for n, t in tensors.items()}, {n: int(k * bits / 8) for n, k in numel.items()},
                   numel)

    def bits(self, *names: str) -> float:
        """Most bits per weight among `names` in the file (32 when unknown)."""
        out = 0.0
        for name in names:
            numel = self._numel.get(name)
            out = max(out, 8.0 * self.source_bytes[name] / numel if numel else 32.0)
        return out

    def codes(self, *names: str) -> tuple[torch.Tensor, ...] | None:
        """The codes of `names` stacked by rows (as torch.cat of the matrices would be), when every one of them
        is stored in a 4-bit format with groups of 32 (int4 codes; with Q4_K's own scales when every one is Q4_K) or
        every one in Q6_K (Q6Codes), Q5_K (Q5Codes) or Q5_0 / Q5_1 (Q501Codes); else None (dequantize and
        requantize)."""
        if not names or not all(n in self._codes for n in names):
            return None
        parts = [self._codes[n]() for n in names]
        kind = type(parts[0])
        if any(type(p) is not kind for p in parts):
            return None
        n = min(len(p) for p in parts)
        return kind(torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(n))

    def code_runs(self, *names: str) -> list[tuple[str, ...]] | None:
        """`names` in runs of consecutive names stored alike (bits per weight, and whether the file's codes are kept),
        when some have codes and they are not all alike: e.g. q, k in Q4_K and v in Q6_K -> [(q, k), (v,)]; q, k in
        Q5_0 and v in Q8_0 (made int8) -> [(q, k), (v,)]; each run a layer of its own format stacked into one
        (quant.StackedLinear); else None."""
        if len(names) < 2 or not any(n in self._codes for n in names):
            return None
        runs: list[list[str]] = []
        for n in names:
            if runs and abs(self.bits(n) - self.bits(runs[-1][-1])) < 1e-6 and \
                    (n in self._codes) == (runs[-1][-1] in self._codes):
                runs[-1].append(n)
            else:
                runs.append([n])
        return [tuple(r) for r in runs] if len(runs) > 1 else None

    def rows(self, name: str) -> Rows | torch.Tensor:
        """A matrix to be requantized by rows (quant.Int8Linear / Int4Linear): read a range of rows at a time where
        the reader can (Rows), else the whole tensor."""
        return self._rows.get(name) or self[name]

    def raw(self, name: str) -> torch.Tensor:
        t = self[name]
        if self.recorder is not None:
            self.recorder.add(f"raw.{name}", t)
        return t

    def table(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = make()
        if self.recorder is not None:
            self.recorder.add(f"table.{key}", t)
            return _hollow(t)
        return t

    def linear(self, key: str, make):
        from ..quant import linear_state

        lin = make()
        if self.recorder is not None:
            tensors, attrs = linear_state(lin)
            for name, t in tensors.items():
                self.recorder.add(f"lin.{key}.{name}", t)
            self.linears[key] = {"class": type(lin).__name__, "attrs": attrs}
            for name in tensors:  # the scaffold keeps no weights: the loader maps the entry instead
                part, _, attr = name.rpartition(".")  # a StackedLinear's part's tensor: "{part}.{name}"
                owner = lin.parts[int(part)] if part else lin
                setattr(owner, attr, _hollow(getattr(owner, attr)))
        return lin

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:  # without loading the tensor (Mapping's default would)
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


def _hollow(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of t's dtype and trailing shape, sharing nothing with it (t[:0] would keep t's whole storage
    alive: a first load of an 8B-shaped file held every converted layer until the end of the conversion, 6.4 GB
    resident for a model of 5.0 GiB, peak 6.6 GB against 5.65 GB now, docs/results/first-load-rows-1206.txt)."""
    return t.new_empty((0, *t.shape[1:]))


class Rows:
    """A 2-D source tensor read a range of rows at a time (`rows[a:b]`, f32), for the layers that requantize a matrix
    by rows: the whole matrix never exists in f32. A vocabulary-sized table is the largest tensor of most models
    (Gemma 3: 262k x 640, 671 MB in f32, and gguf-py's dequantization takes as much again in temporaries; a first
    load peaked at 1.88 GB for a 241 MB file, docs/results/first-load-rows-1206.txt)."""

    device = torch.device("cpu")

    def __init__(self, shape: tuple[int, int], read: Callable[[int, int], torch.Tensor]):
        self.shape = torch.Size(shape)
        self._read = read

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("Rows reads contiguous ranges only")
        return self._read(start, stop)


class CachedWeights(Mapping[str, torch.Tensor]):
    """The same interface over a layout cache entry (weights/layout.py): raw tensors, tables and layers come back
    as they were recorded, mapped from the entry; nothing is converted. Asking for a source tensor (which only
    happens if the model code and the entry disagree) raises layout.StaleEntry, and the loader rebuilds."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor]):
        self.meta, self.tensors = meta, tensors
        self.source_bytes: dict[str, int] = meta["source_bytes"]
        self._numel: dict[str, int] = meta["numel"]
        self._names: list[str] = meta["names"]
        self._name_set = set(self._names)
        self.linears: dict[str, dict] = meta["linears"]
        self.recorder = None

    bits = LazyWeights.bits

    def _get(self, name: str) -> torch.Tensor:
        from .layout import StaleEntry

        if name not in self.tensors:
            raise StaleEntry(f"the entry lacks {name}")
        return self.tensors[name]

    def codes(self, *names: str):
        return None

    def code_runs(self, *names: str):
        return None

    def raw(self, name: str) -> torch.Tensor:
        return self._get(f"raw.{name}")

    def rows(self, name: str) -> torch.Tensor:
        return self[name]

    def table(self, key: str, make) -> torch.Tensor:
        return self._get(f"table.{key}")

    def linear(self, key: str, make):
        from ..quant import linear_from_state
        from .layout import StaleEntry

        spec = self.linears.get(key)
        if spec is None:
            raise StaleEntry(f"the entry lacks layer {key}")
        prefix = f"lin.{key}."
        tensors = {n[len(prefix):]: t for n, t in self.tensors.items() if n.startswith(prefix)}
        return linear_from_state(spec["class"], tensors, spec["attrs"])

    def __getitem__(self, name: str) -> torch.Tensor:
        from .layout import StaleEntry

        raise StaleEntry(f"source tensor {name} asked of a cached layout")

    def __contains__(self, name: object) -> bool:
        return name in self._name_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


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


def partial_rotary(w: torch.Tensor, n_heads: int, rotary_dim: int) -> torch.Tensor:
    """Lay out each head's rows (q/k projections, their biases, q/k norm weights with n_heads = 1) for partial
    rotary embedding as models.transformer.Rope applies it: Hugging Face rotates the first rotary_dim dims of a head
    (pairs i, i + rotary_dim / 2) and passes the rest; we pair dims i and D/2 + i, so the rotated halves move to
    [0, rotary_dim / 2) and [D/2, D/2 + rotary_dim / 2), the passed dims fill the rest. A permutation of q and k
    alike, so q . k (and the attention) is unchanged."""
    D = w.shape[0] // n_heads
    half, rh = D // 2, rotary_dim // 2
    if rotary_dim >= D:
        return w
    passed = torch.arange(rotary_dim, D)
    perm = torch.cat([torch.arange(rh), passed[:half - rh], torch.arange(rh, rotary_dim), passed[half - rh:]])
    return w.reshape(n_heads, D, *w.shape[1:])[:, perm].reshape(w.shape)


def deinterleave_rope(w: torch.Tensor, n_heads: int, rope_dim: int) -> torch.Tensor:
    """DeepSeek's rope dims are interleaved pairs (x0, x1), (x2, x3) ...: put each head's last rope_dim rows in
    rotate_half order (evens, then odds), as models/mla.py rotates them. w: [n_heads (nope + rope), ...]."""
    per = w.shape[0] // n_heads
    h = w.reshape(n_heads, per, *w.shape[1:])
    rope = h[:, per - rope_dim:]
    return torch.cat([h[:, :per - rope_dim], rope[:, 0::2], rope[:, 1::2]], dim=1).reshape(w.shape)


def rope_layout(args: ModelArgs, name: str, w: torch.Tensor) -> torch.Tensor:
    """A canonical tensor in the rotary layout the model applies (see partial_rotary, deinterleave_rope); the
    weight readers call this on every tensor they load (also on int4 codes and scales: rows are rows)."""
    short = name.rsplit(".", 2 if name.endswith(".bias") else 1)[-2 if name.endswith(".bias") else -1]
    if args.rotary_dim and args.rotary_dim < args.head_dim:
        heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads, "attn_q_norm": 1, "attn_k_norm": 1}
        if short in heads:
            return partial_rotary(w, heads[short], args.rotary_dim)
    if args.attention == "mla" and short in ("attn_q", "attn_q_b"):
        return deinterleave_rope(w, args.n_heads, args.qk_rope_dim)
    if args.attention == "mla" and short == "attn_kv_a_mqa":
        return deinterleave_rope(w, 1, args.qk_rope_dim)
    return w
