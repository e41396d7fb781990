"""Linear layers: plain (f32 / bf16) and weight-only int8 / int4.

Decoding reads every weight once per token, so bytes per weight set the speed. Quantized layers run on specdec's
matmul kernel (specdec/kernels/matmul.c: activations quantized to int8 per group of 32, exact integer dot products
with AVX-512 VNNI or AVX2, batch-invariant) when the CPU has either, ~2.5x faster than PyTorch's weight-only kernels
at one token and ~2x at 8 (AVX-512; AVX2 2.5-4x, docs/results/avx2-matmul.txt); else on PyTorch's
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which want bf16 activations: with f32 activations they take
a slow path (see MACHINE-FACTS.md), so those layers cast their input to bf16 and the result back.

- int8: symmetric, one scale per output row (absmax / 127).
- int4: asymmetric, one (scale, zero) per group of 32 input columns, like GGUF's Q4_1: w = (q - 8) * scale + zero;
  a GGUF Q4_K tensor keeps its own two-level scales instead (format kernels.Q4K: exact, 4.625 bits a weight, not 5).
- Q6_K / Q5_K / Q5_0 / Q5_1: a GGUF tensor in one of these as it is (formats kernels.Q6K / Q5K / Q5: 6.5625 /
  5.625 / 5.5 / 6 bits a weight, not int8's 8), where the kernel runs (AVX-512 VNNI or AVX2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import kernels

if TYPE_CHECKING:
    from .weights import Q5Codes, Q6Codes, Q501Codes, Rows

INT4_GROUP = 32
CHUNK = 4096  # rows an int4 requantization takes at a time (int8: ROWS8)
ROWS8 = 256  # rows an int8 requantization takes at a time: its temporaries stay in cache (a 14336 x 4096 matrix in
             # 0.13 s, 0.25 s by 4096 rows with a temporary per operation; docs/results/first-load-torch-1206.txt)


def has_int4_kernel() -> bool:
    return _int4_mm is not None and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


_int8_mm = torch.ops.aten._weight_int8pack_mm.default
_int4_mm = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_int4_mm = _int4_mm.default if _int4_mm is not None else None


class Linear:
    """y = x W^T (+ b) with W stored in the activation dtype.

    Linear layers are plain objects, not nn.Modules: a decode step of a small model calls ~120 of them, and
    nn.Module's call and attribute machinery would cost more than some of the matmuls."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
        self.weight = w.to(dtype).contiguous()  # [N, K]
        self.bias = b.to(dtype) if b is not None else None  # [N]
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.bias is not None and not x.is_contiguous():
            # a strided input with a bias takes a path whose rows depend on the batch (bf16, measured): a copy
            # keeps this layer batch-invariant, as the rest of the model is
            x = x.contiguous()
        return F.linear(x, self.weight, self.bias)

    def apply(self, x: torch.Tensor, norm=None, swiglu: bool = False, residual: torch.Tensor | None = None
              ) -> torch.Tensor:
        """The ops around a transformer's projections: [residual +] [SwiGLU of] (norm(x) W^T), where norm is an
        RMSNorm (models.transformer.RMSNorm) and SwiGLU = silu(first half) * second half. One fused kernel call
        where the layer has one (matmul.c), else these PyTorch ops."""
        y = self(norm(x) if norm is not None else x)
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y + residual if residual is not None else y

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) as float32 (an output head's logits)."""
        return self(x).float()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of W as float32 [..., K]: embedding lookups from the table a tied output head holds,
        with no second (float) copy of it."""
        return self.weight[ids].float()


class _Native(Linear):
    """Quantized layers packed for specdec's matmul kernel when `native` (bits, weight = codes, scales, zeros)."""

    native: bool
    bits: int
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def _kernel(self, x: torch.Tensor, norm=None, swiglu: bool = False, residual: torch.Tensor | None = None,
                widen: bool = False) -> torch.Tensor:
        return kernels.matmul(x, self.bits, self.weight, self.scales, self.zeros, self.out_features,
                              norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
                              swiglu, residual, widen)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b on PyTorch's weight-only kernel (when the layer is not `native`)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if not self.native:
            return self._fallback(x)
        y = self._kernel(x)
        return y + self.bias if self.bias is not None else y

    def apply(self, x: torch.Tensor, norm=None, swiglu: bool = False, residual: torch.Tensor | None = None
              ) -> torch.Tensor:
        if self.native and self.bias is None and not (swiglu and self.out_features % 32):
            return self._kernel(x, norm, swiglu, residual)
        return super().apply(x, norm, swiglu, residual)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float() from one kernel pass: the kernel rounds to x's dtype and stores the widened value (a
        separate .float() of a SmolLM2 head's bf16 logits cost ~50 us a step; docs/results/widen-logits-1206h.txt)."""
        if not self.native or self.bias is not None:
            return super().logits(x)
        return self._kernel(x, widen=True)


def _bf16_call(x: torch.Tensor, mm, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """Run a weight-only kernel `mm` on x [..., K] as 2-D bf16, casting only when x is not bf16 already."""
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = mm(x2 if dtype == torch.bfloat16 else x2.to(torch.bfloat16))
    if bias is not None:
        y = y + bias
    y = y.view(*shape[:-1], n)
    return y if dtype == torch.bfloat16 else y.to(dtype)


class Int8Linear(_Native):
    """Weight-only int8, one bf16 scale per output row: specdec's matmul kernel, else bf16 activations into
    `_weight_int8pack_mm`."""

    bits = 8

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        q = torch.empty(w.shape, dtype=torch.int8)  # [N, K]
        scale = torch.empty(w.shape[0])  # [N]
        for r in range(0, w.shape[0], ROWS8):  # by rows: an f32 temporary per chunk, not per matrix
            x = w[r:r + ROWS8].float()
            s = scale[r:r + ROWS8] = (torch.linalg.vector_norm(x, float("inf"), dim=1) / 127.0).clamp(min=1e-12)
            q[r:r + ROWS8] = (x / s[:, None]).round_().clamp_(-127, 127)
        self.scales = scale.to(torch.bfloat16)  # [N]
        self.bias = b.to(torch.bfloat16) if b is not None else None  # [N]
        self.out_features = w.shape[0]
        self.native = kernels.matmul_supports(*w.shape, w.device)
        self.weight = kernels.pack_int8(q) if self.native else q

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_call(x, lambda x2: _int8_mm(x2, self.weight, self.scales), self.bias, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native:  # codes [N/16, K/32, 8, 64]: 64 bytes = 16 lanes (rows) x 4 inputs, stored as q + 128
            nb, G = self.weight.shape[:2]
            codes = self.weight.view(nb, G, 8, kernels.LANES, 4)[ids // kernels.LANES, :, :, ids % kernels.LANES]
            q = codes.reshape(*ids.shape, G * kernels.GROUP).float() - 128.0
        else:
            q = self.weight[ids].float()
        return q * self.scales[ids].float()[..., None]

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, mul: float = 1.0) -> torch.Tensor:
        """Embedding rows `ids` [...] as activations [..., K] in `dtype`, times mul: rows(ids).to(dtype) * mul, with
        the same roundings in one kernel call where the weight is in the kernel's layout (kernels.rows_int8)."""
        if self.native and dtype in kernels.DTYPES:
            return kernels.rows_int8(self.weight, self.scales, ids, dtype, mul)
        x = self.rows(ids).to(dtype)
        return x * torch.tensor(mul, dtype=dtype) if mul != 1.0 else x

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, self.bias) if t is not None]


class Int4Linear(_Native):
    """Weight-only int4, asymmetric per group of 32 (as GGUF Q4_1): specdec's matmul kernel, else bf16 activations
    into `_weight_int4pack_mm_for_cpu`."""

    bits = 4

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, group: int = INT4_GROUP, lookup: bool = False):
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.uint8)
        scale, zero = torch.empty(n, k // group), torch.empty(n, k // group)
        for r in range(0, n, CHUNK):  # by rows: an f32 temporary per chunk, not per matrix
            g = w[r:r + CHUNK].float().reshape(-1, k // group, group)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            sc = ((hi - lo) / 15.0).clamp(min=1e-12)
            q[r:r + CHUNK] = torch.round((g - lo) / sc).clamp(0, 15).reshape(-1, k)
            scale[r:r + CHUNK], zero[r:r + CHUNK] = sc[..., 0], (lo + 8.0 * sc)[..., 0]  # w = (q - 8) scale + zero
        self._pack(q, scale, zero, b, group, lookup)

    @classmethod
    def from_codes(cls, codes: tuple[torch.Tensor, ...], b: torch.Tensor | None, lookup: bool = False) -> Int4Linear:
        """From codes q [N, K] (0..15) and per-group scale, zero [N, K/32] (w = (q - 8) scale + zero), e.g. a GGUF
        Q4_0 / Q4_1 / Q4_K tensor's own codes (weights.LazyWeights.codes), so no requantization error is added: Q4_K's
        own scales (d, dmin, sc, mn: codes[3:]) are kept as they are where the kernel runs, the others' scale and zero
        are rounded to bf16."""
        self = cls.__new__(cls)
        q, scale, zero = codes[:3]
        self._pack(q.to(torch.uint8), scale.float(), zero.float(), b, INT4_GROUP, lookup, codes[3:] or None)
        return self

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, b: torch.Tensor | None, group: int,
              lookup: bool = False, q4k: tuple[torch.Tensor, ...] | None = None) -> None:
        """q [N, K] uint8 codes, scale / zero [N, K / group] f32; lookup: rows() will be asked (an embedding); q4k:
        Q4_K's (d, dmin, sc, mn) of the same weights."""
        n, k = q.shape
        self.group = group
        self.bias = b.to(torch.bfloat16) if b is not None else None  # [N]
        self.out_features = n
        self.native = group == kernels.GROUP and kernels.matmul_supports(n, k, q.device)
        if self.native and q4k is not None:  # matmul.c: codes [N/16, K/32, 4, 64], Q4_K's scales [N/16, K/256, 320]
            self.bits, self.zeros = kernels.Q4K, None
            self.weight, self.scales = kernels.pack_codes4(q), kernels.pack_q4k(*q4k)
        elif self.native:  # matmul.c: codes [N/16, K/32, 4, 64], scales and zeros [N/16, K/32, 16]
            self.weight, self.scales, self.zeros = kernels.pack_int4(q, scale, zero)
            if not bool(self.zeros.any()):  # symmetric (GGUF Q4_0): no zeros to read, 1/9 fewer bytes per weight
                self.zeros = None
        else:  # PyTorch's: packed [N, K/2] uint8, scales_zeros [K/g, N, 2]
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.scales_zeros = sz.to(torch.bfloat16)
            if lookup:  # [N, K] for rows(), as PyTorch's packed layout is opaque
                self.codes = q

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_call(x, lambda x2: _int4_mm(x2, self.weight, self.group, self.scales_zeros), self.bias,
                          self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.native:  # codes [N/16, K/32, 4, 64]: instruction 2j in the low nibbles, 2j + 1 in the high ones
            blk, lane = ids // kernels.LANES, ids % kernels.LANES
            q = kernels.unpack_codes4(self.weight, blk, lane).float()  # [..., G, 32]
            if self.bits == kernels.Q4K:  # w = q d sc - dmin mn
                s, m = kernels.unpack_q4k(self.scales, blk, lane)
                return (q * s[..., None] + m[..., None]).flatten(-2)
            s = self.scales[blk, :, lane].float()  # [..., G]
            z = self.zeros[blk, :, lane].float() if self.zeros is not None else torch.zeros_like(s)
        else:
            G = self.codes.shape[1] // self.group
            q = self.codes[ids].float().reshape(*ids.shape, G, self.group)
            sz = self.scales_zeros.float()[:, ids]  # [G, ..., 2]
            s, z = sz[..., 0].movedim(0, -1), sz[..., 1].movedim(0, -1)
        return ((q - 8.0) * s[..., None] + z[..., None]).flatten(-2)

    def tensors(self) -> list[torch.Tensor]:
        """What a forward reads (rows() codes of the fallback layout are not)."""
        parts = (self.weight, self.scales, self.zeros) if self.native else (self.weight, self.scales_zeros)
        parts = tuple(t for t in parts if t is not None)
        return [t for t in (*parts, self.bias) if t is not None]


class Int6Linear(_Native):
    """GGUF Q6_K kept as it is: 6-bit codes, an int8 scale per 16 inputs and an f16 factor per 256 (w = d sc
    (q - 32)), in matmul.c's Q6K layout (kernels.pack_q6k); or Q5_K (Q5Codes): 5-bit codes with Q4_K's scales
    (w = d sc q - dmin mn), in its Q5K layout (kernels.pack_q5k); or Q5_0 / Q5_1 (Q501Codes): 5-bit codes with an f16
    d (and m) per 32 (w = d q + m), in its Q5 layout (kernels.pack_q5). Only made where the kernel runs it
    (supported())."""

    native = True  # (bits, the kernel's format code kernels.Q6K, Q5K or Q5, is set on the instance)

    def __init__(self, codes: Q6Codes | Q5Codes | Q501Codes, b: torch.Tensor | None):
        from .weights import Q5Codes, Q501Codes

        if isinstance(codes, Q501Codes):
            self.bits = kernels.Q5
            self.weight, self.scales, self.zeros = kernels.pack_q5(*codes)
        elif isinstance(codes, Q5Codes):
            self.bits = kernels.Q5K
            self.weight, self.scales = kernels.pack_q5k(*codes)
        else:
            self.bits = kernels.Q6K
            self.weight, self.scales = kernels.pack_q6k(*codes)
        self.bias = b.to(torch.bfloat16) if b is not None else None  # [N]
        self.out_features = codes[0].shape[0]

    @staticmethod
    def supported(codes: Q6Codes | Q5Codes | Q501Codes) -> bool:
        """Whether matmul.c takes this tensor as Q6K / Q5K / Q5: whole blocks of 16 rows, on the CPU, with the
        kernel (AVX-512 VNNI or AVX2)."""
        q = codes[0]
        return kernels.matmul_supports(*q.shape, q.device)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        blk, lane = ids // kernels.LANES, ids % kernels.LANES
        if self.bits == kernels.Q5:
            return kernels.unpack_q5(self.weight, self.scales, self.zeros, blk, lane)
        unpack = kernels.unpack_q5k if self.bits == kernels.Q5K else kernels.unpack_q6k
        return unpack(self.weight, self.scales, blk, lane)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, self.zeros, self.bias) if t is not None]


class StackedLinear(_Native):
    """Layers in different formats stacked by rows as one (format kernels.STACK: one kernel call, each block of rows
    computed as its part alone computes it): a fused q|k|v whose v a Q4_K_M file stores in Q6_K and q, k in Q4_K
    keeps q and k at 4.625 bits a weight instead of making the whole layer int8 (weights.LazyWeights.code_runs)."""

    bits = kernels.STACK
    native = True
    bias = None

    def __init__(self, parts: list[_Native]):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.weight = self.scales = kernels.stack_table(parts)  # (the kernel reads the table; codes are the parts')

    @staticmethod
    def stackable(parts: list[Linear]) -> bool:
        return all(isinstance(p, _Native) and p.native and p.bias is None and p.out_features % kernels.LANES == 0
                   for p in parts)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        out, start = None, 0
        for p in self.parts:
            inside = (ids >= start) & (ids < start + p.out_features)
            if bool(inside.any()):
                r = p.rows(ids[inside] - start)
                out = ids.new_zeros(*ids.shape, r.shape[-1], dtype=r.dtype) if out is None else out
                out[inside] = r
            start += p.out_features
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]


def make_linear(w: torch.Tensor | Callable[[], torch.Tensor | Rows], b: torch.Tensor | None, dtype: torch.dtype,
                quant: str, source_bits: float = 32.0, codes: tuple | None = None, lookup: bool = False) -> Linear:
    """The linear layer for weight `w` [N, K] (or a function that makes it) under a quantization choice.

    "none" / "int8" / "int4" apply to every layer; "auto" keeps each tensor's precision class from the file:
    int4 for tensors stored with at most 5 bits per weight (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K), int8 for the rest (Q5_*,
    Q6_K, Q8_0, floats). A 5-bit format requantized to 4 bits loses too much: Gemma-3-270M Q4_K_M, whose layers are
    mostly Q5_0, fell to 84% top-1 agreement with its f32 model that way (docs/results/quant-quality-gemma.json).
    codes: the file's own codes (LazyWeights.codes), used as they are when the layer becomes int4 in our kernel's
    layout, or under "auto" Int6Linear for Q6_K / Q5_K / Q5_0 / Q5_1 codes (Q6Codes, Q5Codes, Q501Codes) where the
    kernel takes them; lookup: the layer is (also) an embedding table, rows() will be asked."""
    from .weights import Q5Codes, Q6Codes, Q501Codes

    if isinstance(codes, Q6Codes | Q5Codes | Q501Codes):
        if quant == "auto" and Int6Linear.supported(codes):
            return Int6Linear(codes, b)
        codes = None  # requantized (int8 under "auto")
    if quant == "auto":
        quant = "int4" if source_bits <= 5.01 else "int8"
    if quant == "int4" and codes is not None and codes[0].device.type == "cpu" and has_int4_kernel():
        return Int4Linear.from_codes(codes, b, lookup)
    w = w() if callable(w) else w  # a tensor, or weights.Rows (read by ranges of rows)
    if quant == "int4" and w.device.type == "cpu" and has_int4_kernel() and w.shape[1] % INT4_GROUP == 0:
        return Int4Linear(w, b, lookup=lookup)
    if quant in ("int8", "int4") and w.device.type == "cpu":
        return Int8Linear(w, b)
    return Linear(w if isinstance(w, torch.Tensor) else w[:], b, dtype)


def linear_state(lin: Linear) -> tuple[dict[str, torch.Tensor], dict]:
    """A layer as (tensors, plain attributes), for the layout cache (weights/layout.py); a StackedLinear's parts'
    tensors are named "{part}.{name}" (its table is made again when it is loaded)."""
    if isinstance(lin, StackedLinear):
        tensors, parts = {}, []
        for i, p in enumerate(lin.parts):
            t, a = linear_state(p)
            tensors.update({f"{i}.{k}": v for k, v in t.items()})
            parts.append([type(p).__name__, a])
        return tensors, {"parts": parts}
    items = vars(lin).items()
    return ({k: v for k, v in items if isinstance(v, torch.Tensor)},
            {k: v for k, v in items if not isinstance(v, torch.Tensor)})


def linear_from_state(cls_name: str, tensors: dict[str, torch.Tensor], attrs: dict) -> Linear:
    """The layer linear_state() described, around the given tensors (no copy, no conversion)."""
    if cls_name == "StackedLinear":
        return StackedLinear([linear_from_state(c, {k.split(".", 1)[1]: v for k, v in tensors.items()
                                                    if k.split(".", 1)[0] == str(i)}, a)
                              for i, (c, a) in enumerate(attrs["parts"])])
    cls = {c.__name__: c for c in (Linear, Int8Linear, Int4Linear, Int6Linear)}[cls_name]
    lin = cls.__new__(cls)
    vars(lin).update(attrs)
    vars(lin).update(tensors)
    return lin
