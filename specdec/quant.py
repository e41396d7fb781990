"""Linear layers: plain (f32 / bf16) and weight-only int8 / int4, on PyTorch's own CPU kernels.

Decoding reads every weight once per token, so bytes per weight set the speed. The weight-only kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) want bf16 activations: with f32 activations they take a slow
path (see MACHINE-FACTS.md), so quantized layers cast their input to bf16 and the result back.

- int8: symmetric, one scale per output row (absmax / 127).
- int4: asymmetric, one (scale, zero) per group of 32 input columns, like GGUF's Q4_1: w = (q - 8) * scale + zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32


def has_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class Linear(nn.Module):
    """y = x W^T (+ b) with W stored in the activation dtype."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(w.to(dtype), requires_grad=False)  # [N, K]
        self.bias = nn.Parameter(b.to(dtype), requires_grad=False) if b is not None else None  # [N]
        self.bits = torch.finfo(dtype).bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear(nn.Module):
    """Weight-only int8, one bf16 scale per output row, bf16 activations into `_weight_int8pack_mm`."""

    bits = 8

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        super().__init__()
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scale", scale.to(torch.bfloat16))  # [N]
        self.bias = nn.Parameter(b.float(), requires_grad=False) if b is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 2


class Int4Linear(nn.Module):
    """Weight-only int4, asymmetric per group of 32 (as GGUF Q4_1), bf16 activations into
    `_weight_int4pack_mm_for_cpu`."""

    bits = 4

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, group: int = INT4_GROUP):
        super().__init__()
        n, k = w.shape
        g = w.float().reshape(n, k // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.group = group
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16))
        self.bias = nn.Parameter(b.float(), requires_grad=False) if b is not None else None
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales_zeros.numel() * 2


def make_linear(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype, quant: str) -> nn.Module:
    """The linear layer for weight `w` [N, K] under a quantization choice ("none", "int8", "int4")."""
    if quant == "int4" and w.device.type == "cpu" and has_int4_kernel() and w.shape[1] % INT4_GROUP == 0:
        return Int4Linear(w, b)
    if quant in ("int8", "int4") and w.device.type == "cpu":
        return Int8Linear(w, b)
    return Linear(w, b, dtype)
