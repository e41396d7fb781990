"""Linear layers: plain (f32 / bf16) and weight-only int8 / int4.

Decoding reads every weight once per token, so bytes per weight set the speed. Quantized layers run on specdec's
matmul kernel (specdec/kernels/matmul.c: activations quantized to int8 per group of 32, exact integer dot products
with AVX-512 VNNI, batch-invariant) when the CPU has it, ~2.5x faster than PyTorch's weight-only kernels at one
token and ~2x at 8; else on PyTorch's (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which want bf16
activations: with f32 activations they take a slow path (see MACHINE-FACTS.md), so those layers cast their input
to bf16 and the result back.

- int8: symmetric, one scale per output row (absmax / 127).
- int4: asymmetric, one (scale, zero) per group of 32 input columns, like GGUF's Q4_1: w = (q - 8) * scale + zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels

INT4_GROUP = 32


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

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


class _Native(Linear):
    """Quantized layers packed for specdec's matmul kernel when `native` (bits, weight = codes, scales, zeros)."""

    native: bool
    bits: int
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def _kernel(self, x: torch.Tensor, norm=None, swiglu: bool = False, residual: torch.Tensor | None = None
                ) -> torch.Tensor:
        return kernels.matmul(x, self.bits, self.weight, self.scales, self.zeros, self.out_features,
                              norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
                              swiglu, residual)

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
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.scales = scale.to(torch.bfloat16)  # [N]
        self.bias = b.to(torch.bfloat16) if b is not None else None  # [N]
        self.out_features = w.shape[0]
        self.native = kernels.matmul_supports(*w.shape, w.device)
        self.weight = kernels.pack_int8(q) if self.native else q

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_call(x, lambda x2: _int8_mm(x2, self.weight, self.scales), self.bias, self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, self.bias) if t is not None]


class Int4Linear(_Native):
    """Weight-only int4, asymmetric per group of 32 (as GGUF Q4_1): specdec's matmul kernel, else bf16 activations
    into `_weight_int4pack_mm_for_cpu`."""

    bits = 4

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, group: int = INT4_GROUP):
        n, k = w.shape
        g = w.float().reshape(n, k // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8.0 * scale  # the kernels compute (q - 8) * scale + zero
        self.group = group
        self.bias = b.to(torch.bfloat16) if b is not None else None  # [N]
        self.out_features = n
        self.native = group == kernels.GROUP and kernels.matmul_supports(n, k, w.device)
        if self.native:  # matmul.c: codes [N/16, K/32, 4, 64], scales and zeros [N/16, K/32, 16]
            self.weight, self.scales, self.zeros = kernels.pack_int4(q, scale.squeeze(-1), zero.squeeze(-1))
        else:  # PyTorch's: packed [N, K/2] uint8, scales_zeros [K/g, N, 2]
            sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales_zeros = sz.to(torch.bfloat16)

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_call(x, lambda x2: _int4_mm(x2, self.weight, self.group, self.scales_zeros), self.bias,
                          self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        parts = (self.weight, self.scales, self.zeros) if self.native else (self.weight, self.scales_zeros)
        return [t for t in (*parts, self.bias) if t is not None]


def make_linear(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype, quant: str,
                source_bits: float = 32.0) -> Linear:
    """The linear layer for weight `w` [N, K] under a quantization choice.

    "none" / "int8" / "int4" apply to every layer; "auto" keeps each tensor's precision class from the file:
    int4 for tensors stored with at most ~5.5 bits per weight (Q4_*, Q5_*, Q2_K..Q5_K), int8 for the rest."""
    if quant == "auto":
        quant = "int4" if source_bits <= 5.6 else "int8"
    if quant == "int4" and w.device.type == "cpu" and has_int4_kernel() and w.shape[1] % INT4_GROUP == 0:
        return Int4Linear(w, b)
    if quant in ("int8", "int4") and w.device.type == "cpu":
        return Int8Linear(w, b)
    return Linear(w, b, dtype)
