"""The quantized matmul kernel (specdec/kernels/matmul.c): the packed layouts compute what the algorithm in its header
says (checked against an independent re-statement in PyTorch), close to the dequantized weights, and batch-invariant
(row t of a T-row product is bitwise the 1-row product of that row, whatever T and the thread count)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.quant import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(kernels.matmul_lib() is None,
                                reason="no C compiler, or neither AVX-512 VNNI nor AVX2 on this CPU")


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 5] *= 20  # an outlier column, as real layers have
    return w


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as matmul.c quantizes them: int8 codes per group of 32 with d = max|x| / 127."""
    T, K = x.shape
    v = x.float().reshape(T, K // 32, 32)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # (127.0 / amax rounds differently)
    return torch.round(v * inv).clamp(-127, 127).double(), (amax / 127.0).double()  # [T, G, 32], [T, G, 1]


def int4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Linear's quantization: codes [N, G, 32], scale and zero [N, G] as bf16 values."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return q, scale.bfloat16().double(), (lo + 8.0 * scale).bfloat16().double()


def dequant_int4(w: torch.Tensor) -> torch.Tensor:
    q, s, z = int4_codes(w)
    return ((q.double() - 8) * s[..., None] + z[..., None]).reshape(w.shape)


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8Linear's quantization: codes [N, K], scale [N] as bf16 values."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).double(), scale.bfloat16().double()


def dequant_int8(w: torch.Tensor) -> torch.Tensor:
    q, scale = int8_codes(w)
    return q * scale[:, None]


def reference_int4(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    qx, d = quantized_rows(x)
    q, s, z = int4_codes(w)
    dot = torch.einsum("tgj,ngj->tng", qx, q.double())  # exact integer sums
    sx = qx.sum(-1)[:, None, :]  # [T, 1, G]
    return (d[:, None, :, 0] * (s[None] * (dot - 8 * sx) + z[None] * sx)).sum(-1)


def reference_int8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    qx, d = quantized_rows(x)
    q, scale = int8_codes(w)
    dot = torch.einsum("tgj,ngj->tng", qx, q.reshape(w.shape[0], -1, 32))
    return (d[:, None, :, 0] * dot).sum(-1) * scale[None]


CASES = [(Int4Linear, reference_int4, dequant_int4, 960, 576), (Int4Linear, reference_int4, dequant_int4, 576, 1536),
         (Int8Linear, reference_int8, dequant_int8, 4096, 576), (Int8Linear, reference_int8, dequant_int8, 48, 64)]


@pytest.mark.parametrize("cls,reference,dequantized,n,k", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_computes_its_algorithm(cls, reference, dequantized, n, k, dtype):
    w = weights(n, k, seed=n + k)
    lin = cls(w, None)
    assert lin.native
    x = (torch.randn(7, k, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (7, n)
    ref = reference(x, w)
    rounding = 2e-3 if dtype == torch.bfloat16 else 1e-5  # the output's own rounding (bf16), f32 sums otherwise
    torch.testing.assert_close(y.double(), ref, atol=rounding * ref.abs().max().item(), rtol=rounding)
    # and quantizing the activations costs little: close to the same weights times exact activations
    exact = x.double() @ dequantized(w).T
    assert (y.double() - exact).abs().max() <= 0.015 * exact.abs().max()


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_rows_are_batch_invariant(cls):
    lin = cls(weights(576, 1536, seed=3), None)
    # up to 17 rows: passes of every size the register blockings use, split unevenly
    # (13 rows: 5 + 4 + 4 on AVX2, whose passes take up to 6)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = lin(x)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for T in range(1, 18):
                assert torch.equal(lin(x[:T]), whole[:T])
                assert torch.equal(lin(x[T - 1:T]), whole[T - 1:T])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_widened_logits_are_the_rounded_outputs(cls, dtype):
    """logits(): float32 from one kernel pass, bitwise the layer's output in x's dtype widened (a bf16 input's
    outputs rounded to bf16 inside the kernel, not left at float32 precision)."""
    lin = cls(weights(64, 96, seed=8), None)
    x = (torch.randn(5, 96, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    y = lin.logits(x)
    assert y.dtype == torch.float32 and torch.equal(y, lin(x).float())
    if dtype == torch.bfloat16:  # every value a bf16 value: its low 16 bits zero
        assert not (y.view(torch.int32) & 0xFFFF).any()
        wide = kernels.matmul(x, lin.bits, lin.weight, lin.scales, lin.zeros, lin.out_features, widen=True)
        assert torch.equal(wide, y)


def test_bias_and_unsupported_shapes():
    w, b = weights(64, 96, seed=5), torch.randn(64)
    lin = Int4Linear(w, b)
    assert lin.native
    x = torch.randn(3, 96).bfloat16()
    torch.testing.assert_close(lin(x).float(), Int4Linear(w, None)(x).float() + b.bfloat16().float(), atol=0.05,
                               rtol=0.01)
    odd = Int8Linear(weights(40, 64, seed=6), None)  # 40 rows: not whole blocks of 16, PyTorch's kernel instead
    assert not odd.native
    assert odd(x[:, :64]).shape == (3, 40)


def test_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_NO_KERNELS", "matmul")
    kernels.matmul_lib.cache_clear()
    try:
        assert not Int4Linear(weights(64, 64, seed=7), None).native
    finally:
        kernels.matmul_lib.cache_clear()


def test_fused_norm_swiglu_residual():
    """Linear.apply in one kernel call: close to the same ops in PyTorch, and batch-invariant too."""
    from specdec.models.transformer import RMSNorm

    k, ffn = 576, 1536
    norm = RMSNorm(1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(8)), 1e-5, torch.bfloat16)
    w13, w2 = Int4Linear(weights(2 * ffn, k, seed=9), None), Int4Linear(weights(k, ffn, seed=10), None)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(11)).bfloat16() * 3
    h = w13.apply(x, norm=norm, swiglu=True)
    gate, up = w13(norm(x)).float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert h.shape == (6, ffn)
    torch.testing.assert_close(h.float(), ref, atol=0.03 * ref.abs().max().item(), rtol=0.05)
    y = w2.apply(h, residual=x)
    torch.testing.assert_close(y.float(), x.float() + w2(h).float(), atol=0.02, rtol=0.01)
    for T in range(1, 7):
        assert torch.equal(w13.apply(x[T - 1:T], norm=norm, swiglu=True), h[T - 1:T])
        assert torch.equal(w2.apply(h[:T], residual=x[:T]), y[:T])


def test_fused_gelu_gate():
    """swiglu = 2 (Gemma's FFN in forward.c): GELU (tanh approximation) of the gate half times the up half, on the
    very f32 sums the plain product gives, so it is torch's gelu of those within float rounding; rows batch-invariant.
    Gates from about -20 to 20 cover both branches of its sigmoid (exp of -|2 z| only) and its saturation."""
    k, ffn = 640, 2048
    w13 = Int4Linear(weights(2 * ffn, k, seed=12), None)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(13)) * 4
    gate, up = w13(x).chunk(2, dim=-1)
    assert gate.min() < -10 and gate.max() > 10
    h = w13._kernel(x, swiglu=2)
    ref = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    torch.testing.assert_close(h.double(), ref, atol=2e-6 * ref.abs().max().item(), rtol=1e-5)
    assert not torch.equal(h, w13._kernel(x, swiglu=True))  # not the SiLU
    for T in range(1, 6):
        assert torch.equal(w13._kernel(x[T - 1:T], swiglu=2), h[T - 1:T])


@pytest.mark.skipif(kernels.matmul_lib() is None, reason="no matmul kernel on this CPU")
def test_symmetric_int4_reads_no_zeros():
    """Codes with every zero 0 (GGUF Q4_0) keep no zeros tensor; the kernel then uses -8 s itself: bitwise the
    result of reading stored zeros, and rows() (embedding lookups) agree."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 128), generator=g)
    scale = torch.rand(64, 4, generator=g) * 0.01 + 0.001
    sym = Int4Linear.from_codes((q, scale, torch.zeros(64, 4)), None)
    asym = Int4Linear.from_codes((q, scale, torch.full((64, 4), 1e-3)), None)
    assert sym.zeros is None and asym.zeros is not None
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    zeros = torch.zeros_like(asym.zeros)
    stored = kernels.matmul(x, 4, sym.weight, sym.scales, zeros, 64)
    assert torch.equal(sym(x), stored)
    ids = torch.tensor([0, 17, 63])
    ref = ((q[ids].float() - 8).reshape(3, 4, 32) * scale[ids].to(torch.bfloat16).float()[..., None]).reshape(3, 128)
    torch.testing.assert_close(sym.rows(ids), ref)


def q4k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF Q4_K bytes for an [n, k] tensor: every code and 6-bit scale pattern, f16 d and dmin finite."""
    g = np.random.default_rng(seed)
    data = g.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    data[..., 0:4] = (np.abs(g.standard_normal((n, k // 256, 2))) * 0.002).astype(np.float16).view(np.uint8)
    return data.reshape(n, -1)


def q4k_linear(n: int, k: int, seed: int) -> tuple[Int4Linear, torch.Tensor]:
    """A Q4_K tensor as the GGUF loader makes it (its own codes and scales), and its weights as gguf-py dequantizes
    them (f32, exact: d sc q - dmin mn)."""
    from specdec.weights.gguf import int4_codes

    data = q4k_blocks(n, k, seed)
    w = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)
    return Int4Linear.from_codes(int4_codes(data, gguf.GGMLQuantizationType.Q4_K), None), w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q4k_scales_are_used_as_they_are(dtype):
    """A GGUF Q4_K tensor keeps its own two-level scales (format Q4K: 8-bit scale and minimum codes per 32, f16 d
    and dmin per 256: 4.625 bits a weight, not the 5 of bf16 scale and zero): the kernel computes the header's sums
    with d sc and -dmin mn exact (against a float64 re-statement, to f32 rounding), rows() gives gguf-py's weights
    bit for bit, and rows are batch-invariant on every pass size."""
    n, k = 96, 768
    lin, w = q4k_linear(n, k, seed=5)
    assert lin.native and lin.bits == kernels.Q4K and lin.zeros is None
    assert sum(t.numel() * t.element_size() for t in lin.tensors()) == n * k * 37 // 64  # 4.625 bits a weight
    x = (torch.randn(11, k, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    y = lin(x)
    qx, d = quantized_rows(x)
    wq = w.double().reshape(n, k // 32, 32)
    dot = torch.einsum("tgj,ngj->tng", qx, wq)  # the weights are exact in f64: d sc q - dmin mn
    ref = (d[:, None, :, 0] * dot).sum(-1)
    rounding = 2e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=rounding * ref.abs().max().item(), rtol=rounding)
    ids = torch.tensor([0, 15, 16, 95, 40])
    assert torch.equal(lin.rows(ids), w[ids])
    for T in range(1, 12):
        assert torch.equal(lin(x[:T]), y[:T]) and torch.equal(lin(x[T - 1:T]), y[T - 1:T])
    # the fused paths take the format too: SwiGLU over gate|up rows, residual add
    h = lin.apply(x, swiglu=True)
    gate, up = y.float().chunk(2, dim=-1)
    torch.testing.assert_close(h.float(), torch.nn.functional.silu(gate) * up, atol=0.02 * gate.abs().max().item(),
                               rtol=0.02)


def test_q4k_without_its_scales_rounds_them():
    """Without Q4_K's own scales (a stack of Q4_K with another format), the codes keep bf16 scale and zero: the
    same weights to bf16 rounding, not exactly, which is what the Q4K format is for."""
    lin, w = q4k_linear(64, 512, seed=6)
    rounded = Int4Linear.from_codes(_codes_only(64, 512, seed=6), None)
    assert rounded.bits == 4 and rounded.zeros is not None
    ids = torch.arange(64)
    assert torch.equal(lin.rows(ids), w)
    assert not torch.equal(rounded.rows(ids), w)
    torch.testing.assert_close(rounded.rows(ids), w, atol=2e-2 * w.abs().max().item(), rtol=1e-2)


@pytest.mark.skipif(kernels.matmul_isa() is None, reason="no matmul kernel on this CPU")
@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_K", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q6k_q5k_codes_are_used_as_they_are(qtype, dtype):
    """A GGUF Q6_K / Q5_K / Q5_0 / Q5_1 tensor kept as it is (format Q6K: 6-bit codes, int8 scale per 16, f16 d per
    256: 6.5625 bits a weight; Q5K: 5-bit codes with Q4_K's scales: 5.625 bits; Q5: 5-bit codes with f16 d, and m for
    Q5_1, per 32: 5.5 / 6 bits; int8 takes 8): the kernel computes the header's sums (against float64 with gguf-py's
    weights, to f32 rounding), rows() gives gguf-py's weights bit for bit, rows are batch-invariant, and the loader's
    path (make_linear under "auto") takes it; under "int8" it is requantized as asked. (Both kernel paths, AVX-512
    VNNI and AVX2, have every one of these formats.)"""
    from specdec.quant import Int6Linear, make_linear
    from specdec.weights.gguf import q5_codes, q6_codes, q501_codes

    n, k = 80, 512
    qt = gguf.GGMLQuantizationType[qtype]
    legacy = lambda data: q501_codes(data, qt)  # noqa: E731
    size, per, f16_at, own, code, bits = {"Q6_K": (210, 256, (208,), q6_codes, kernels.Q6K, 105 / 128),
                                          "Q5_K": (176, 256, (0, 2), q5_codes, kernels.Q5K, 45 / 64),
                                          "Q5_0": (22, 32, (0,), legacy, kernels.Q5, 11 / 16),
                                          "Q5_1": (24, 32, (0, 2), legacy, kernels.Q5, 3 / 4)}[qtype]
    g = np.random.default_rng(7)
    data = g.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for a in f16_at:  # d (and Q5_1's m, Q5_K's dmin): small f16 values, m of either sign
        sign = np.sign(g.standard_normal((n, k // per, 1))) if a == 2 and per == 32 else 1
        data[..., a:a + 2] = (sign * np.abs(g.standard_normal((n, k // per, 1))) * 0.001).astype(np.float16).view(
            np.uint8)
    data = data.reshape(n, -1)
    w = torch.from_numpy(gguf.dequantize(data, qt).astype(np.float32)).reshape(n, k)
    codes = own(data)
    lin = make_linear(lambda: w, None, torch.bfloat16, "auto", 8.0 * size / per, codes)
    assert isinstance(lin, Int6Linear) and lin.bits == code
    assert isinstance(make_linear(lambda: w, None, torch.bfloat16, "int8", 8.0 * size / per, codes), Int8Linear)
    assert sum(t.numel() * t.element_size() for t in lin.tensors()) == n * k * bits
    ids = torch.tensor([0, 15, 16, 79, 33])
    assert torch.equal(lin.rows(ids), w[ids])
    x = (torch.randn(13, k, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    y = lin(x)
    qx, d = quantized_rows(x)
    dot = torch.einsum("tgj,ngj->tng", qx, w.double().reshape(n, k // 32, 32))  # exact weights in f64
    ref = (d[:, None, :, 0] * dot).sum(-1)
    rounding = 2e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=rounding * ref.abs().max().item(), rtol=rounding)
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for T in range(1, 14):
                assert torch.equal(lin(x[:T]), y[:T]) and torch.equal(lin(x[T - 1:T]), y[T - 1:T])
    finally:
        torch.set_num_threads(threads)
    r = torch.randn(13, n, generator=torch.Generator().manual_seed(4)).to(dtype)
    torch.testing.assert_close(lin.apply(x, residual=r).float(), (r + y).float(), atol=0.05, rtol=0.01)


def test_stacked_parts_compute_as_each_alone():
    """A StackedLinear (format STACK: a Q4_K part over a Q6_K or int8 part, as a Q4_K_M file's q|k over its v) gives
    bitwise the concatenation of its parts' own outputs, for every row count, and through the fused residual add;
    a table whose parts do not add up to the layer's rows is refused (ValueError), not read past."""
    from specdec.quant import StackedLinear, make_linear
    from specdec.weights.gguf import q6_codes

    n, k = 64, 512
    top, _ = q4k_linear(n, k, seed=11)
    g = np.random.default_rng(12)
    data = g.integers(0, 256, (32, k // 256, 210), dtype=np.uint8)
    data[..., 208:210] = (np.abs(g.standard_normal((32, k // 256, 1))) * 0.001).astype(np.float16).view(np.uint8)
    data = data.reshape(32, -1)
    w6 = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType.Q6_K).astype(np.float32)).reshape(32, k)
    bottom = make_linear(lambda: w6, None, torch.bfloat16, "auto", 6.5625, q6_codes(data))  # Q6K
    stacked = StackedLinear([top, bottom])
    assert stacked.out_features == 96 and stacked.tensors() == top.tensors() + bottom.tensors()
    x = (torch.randn(10, k, generator=torch.Generator().manual_seed(13)) * 2).bfloat16()
    y = stacked(x)
    assert torch.equal(y, torch.cat([top(x), bottom(x)], dim=-1))
    for T in range(1, 11):
        assert torch.equal(stacked(x[T - 1:T]), y[T - 1:T])
    r = torch.randn(10, 96).bfloat16()
    assert torch.equal(stacked.apply(x, residual=r), kernels.matmul(x, kernels.STACK, stacked.weight, stacked.scales,
                                                                    None, 96, residual=r))
    ids = torch.tensor([0, 63, 64, 95])
    assert torch.equal(stacked.rows(ids), torch.cat([top.rows(ids[:2]), bottom.rows(ids[2:] - 64)]))
    with pytest.raises(ValueError):
        kernels.matmul(x, kernels.STACK, stacked.weight, stacked.scales, None, 112)


def _codes_only(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    from specdec.weights.gguf import int4_codes

    return int4_codes(q4k_blocks(n, k, seed), gguf.GGMLQuantizationType.Q4_K)[:3]


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heads_in_one_call_equal_each_head_alone(cls, dtype):
    """matmul_heads (MLA's absorbed per-head matrices): head h of one call over H heads is bitwise that head's own
    matmul, for every T; a symmetric head (no zeros) among asymmetric ones included."""
    H, n, k = 5, 48, 64
    layers = [cls(weights(n, k, seed=h), None) for h in range(H)]
    if cls is Int4Linear:
        g = torch.Generator().manual_seed(3)
        q, scale = torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
        layers[2] = Int4Linear.from_codes((q, scale, torch.zeros(n, k // 32)), None)  # symmetric: no zeros to read
        assert layers[2].zeros is None and layers[0].zeros is not None
    ptrs = kernels.head_pointers(layers)
    g = torch.Generator().manual_seed(1)
    for T in (1, 3, 7, 9):
        x = torch.randn(H, T, k, generator=g).to(dtype)
        y = kernels.matmul_heads(x, layers[0].bits, ptrs, n)
        assert y.shape == (H, T, n) and y.dtype == dtype
        for h, lin in enumerate(layers):
            assert torch.equal(y[h], lin.apply(x[h])), (T, h)
            for t in range(T):  # and each row alone
                assert torch.equal(y[h, t:t + 1], kernels.matmul_heads(x[:, t:t + 1], lin.bits, ptrs, n)[h])


@pytest.mark.skipif(not kernels.set_amx(True), reason="no AMX on this CPU / build / OS")
@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amx_rows_are_the_vnni_rows(cls, dtype):
    """The AMX path (tiles of 10 to 16 rows: verification, batches, prefill) gives bitwise the outputs of the VNNI
    path, for every T (full and partial tiles, across tile boundaries, VNNI passes of up to 9 rows), fused norm /
    SwiGLU / residual included; and T = 1 is VNNI's."""
    from specdec.models.transformer import RMSNorm

    k, n = 576, 1536
    lin = cls(weights(2 * n, k, seed=21), None)
    norm = RMSNorm(1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(22)), 1e-5, dtype)
    x = (torch.randn(37, k, generator=torch.Generator().manual_seed(23)) * 2).to(dtype)
    r = torch.randn(37, 2 * n, generator=torch.Generator().manual_seed(24)).to(dtype)
    runs = {}
    try:
        for on in (False, True):
            assert kernels.set_amx(on) == on
            runs[on] = [(lin(x[:T]), lin.apply(x[:T], norm=norm, swiglu=True), lin.apply(x[:T], residual=r[:T]))
                        for T in (1, 2, 5, 9, 10, 12, 15, 16, 17, 26, 31, 37)]
    finally:
        kernels.set_amx(True)
    for amx, vnni in zip(runs[True], runs[False], strict=True):
        for a, v in zip(amx, vnni, strict=True):
            assert torch.equal(a, v)
    whole = runs[True][-1][0]  # and each row alone (VNNI) is its row of 37 (AMX)
    for t in (0, 15, 16, 36):
        assert torch.equal(lin(x[t:t + 1]), whole[t:t + 1])
    for T in (10, 12, 26, 31):  # rows on a partial tile (and after a full one) are their rows of 37 too
        assert torch.equal(runs[True][[1, 2, 5, 9, 10, 12, 15, 16, 17, 26, 31, 37].index(T)][0], whole[:T])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mul", [1.0, 25.298221281347036])  # 1, and Gemma-3-270M's embedding scale sqrt(640)
def test_int8_rows_lookup_is_the_pytorch_ops_in_one_call(dtype, mul, monkeypatch):
    """An embedding lookup from a tied int8 head (Int8Linear.lookup) is bitwise rows(ids).to(dtype) * mul, the ops
    it replaces, computed by the kernel (specdec_rows_int8): rows on both sides of 16-row blocks, any order."""
    lin = Int8Linear(weights(64, 96, 3), None)
    assert lin.native
    calls = []
    real = kernels.rows_int8
    monkeypatch.setattr(kernels, "rows_int8", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.tensor([[0, 15, 16, 63, 31, 0], [17, 47, 48, 1, 2, 62]])
    m = torch.tensor(mul, dtype=dtype)  # the model's scale tensor, in its dtype
    ref = lin.rows(ids).to(dtype) * m if mul != 1.0 else lin.rows(ids).to(dtype)
    got = lin.lookup(ids, dtype, float(m))
    assert calls and got.dtype == dtype and got.shape == (2, 6, 96)
    assert torch.equal(got, ref)
    for bad in (64, -1):  # not a row: an error, as the PyTorch indexing raises one, never a read past the table
        with pytest.raises(IndexError):
            lin.lookup(torch.tensor([[3, bad]]), dtype, float(m))


@pytest.mark.skipif(kernels.forward_lib() is None, reason="forward.c not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_final_norm_in_c_is_rms_norm(dtype):
    """kernels.rms_norm (forward.c's final norm, each row alone) is RMSNorm: what the PyTorch formulation gives, to
    within one rounding of the output, and a row's result does not depend on the other rows."""
    from specdec.models.transformer import rms_norm

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(1, 5, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    got = kernels.rms_norm(x, w.float().contiguous(), 1e-5)
    ref = rms_norm(x, torch.stack([w, w]), 1e-5)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    one = kernels.rms_norm(x[:, 3:4].clone(), w.float().contiguous(), 1e-5)
    assert torch.equal(one[0, 0], got[0, 3])


@pytest.mark.parametrize("T", [1, 3, 9])
def test_int8_extreme_codes_are_exact(T):
    """int8 codes at both ends (-128, which GGUF Q8_0 blocks may hold, and 127) against activation codes of +-127
    (rows of one magnitude): the largest pair sums AVX2's VPMADDUBSW forms (2 x 128 x 127), which must not saturate.
    The kernel's output is the exact integer dot product rescaled (f32 sums: 1e-5)."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int64)
    q[:16] = -128
    q[16:24] = torch.where(torch.arange(k) % 2 == 0, -128, 127)
    q[24:32] = 127
    scale = torch.rand(n, generator=g).bfloat16() + 0.5
    x = torch.where(torch.rand(T, k, generator=g) < 0.5, -1.0, 1.0)
    x[0, :64] = 1.0  # a row whose codes are all +127, then all -127 against the -128 rows
    x[0, 64:] = -1.0
    if T > 1:
        x[1:] *= torch.rand(T - 1, 1, generator=g) + 0.5
    y = kernels.matmul(x, 8, kernels.pack_int8(q.to(torch.int8)), scale, None, n)
    qx, d = quantized_rows(x)
    dot = torch.einsum("tgj,ngj->tng", qx, q.double().reshape(n, -1, 32))
    ref = (d[:, None, :, 0] * dot).sum(-1) * scale.double()[None]
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def _every_format_outputs() -> dict[str, torch.Tensor]:
    """Outputs of one layer per weight format (int4, int8, Q4K, Q5K, Q5_0, Q5_1, Q6K; random GGUF blocks, fixed
    seeds), and of int4 with the fused SiLU and GELU gates, for 1, 3, 4, 7 and 13 rows of f32 and bf16 activations:
    what test_avx2_path_is_the_avx512_path compares between two builds of the kernel."""
    from specdec.quant import make_linear
    from specdec.weights.gguf import own_codes

    g = np.random.default_rng(21)
    n, k = 48, 512
    layers = {"int4": Int4Linear(weights(n, k, 1), None), "int8": Int8Linear(weights(n, k, 2), None)}
    for qtype, size, per, f16_at in (("Q4_K", 144, 256, (0, 2)), ("Q5_K", 176, 256, (0, 2)), ("Q5_0", 22, 32, (0,)),
                                     ("Q5_1", 24, 32, (0, 2)), ("Q6_K", 210, 256, (208,))):
        data = g.integers(0, 256, (n, k // per, size), dtype=np.uint8)
        for a in f16_at:
            data[..., a:a + 2] = (g.standard_normal((n, k // per, 1)) * 0.001).astype(np.float16).view(np.uint8)
        codes = own_codes(data.reshape(n, -1), gguf.GGMLQuantizationType[qtype])
        layers[qtype] = make_linear(lambda: None, None, torch.bfloat16, "int4" if qtype == "Q4_K" else "auto",
                                    8.0 * size / per, codes)
    out = {}
    glu = Int4Linear(weights(64, k, 3), None)  # gate | up halves for the fused SiLU and GELU
    for name, lin in layers.items():
        for T in (1, 3, 4, 7, 13):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(T, k, generator=torch.Generator().manual_seed(T)) * 2).to(dtype)
                out[f"{name} T={T} {dtype}"] = lin(x)
                if name == "int4":
                    out[f"swiglu T={T} {dtype}"] = glu._kernel(x * 4, swiglu=True)
                    out[f"gelu T={T} {dtype}"] = glu._kernel(x * 4, swiglu=2)
    return out


@pytest.mark.skipif(kernels.matmul_isa() != "AVX-512 VNNI", reason="needs a CPU that runs both kernel paths")
def test_avx2_path_is_the_avx512_path(tmp_path):
    """Both kernel paths compute the same integers and the same float operations (matmul.c's header): the AVX2 build
    (compiled here with -march=haswell, in a subprocess) gives bitwise the AVX-512 build's outputs for every weight
    format, at row counts on both sides of each path's pass sizes and fused-minimum limits."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-avx2"
    wrapper.write_text(f'#!/bin/sh\nexec {cc} "$@" -march=haswell\n')
    wrapper.chmod(0o755)
    here = Path(__file__).parent
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from specdec import kernels; "
            "assert kernels.matmul_isa() == 'AVX2', kernels.matmul_isa(); "
            "p = kernels.instruction_peaks(0.002, 1); "  # the roofline's yardstick on that path too
            "assert p['int_instruction'] == 'VPMADDUBSW ymm' and p['int_macs_s'] > 0 and p['fma_macs_s'] > 0, p; "
            "from test_matmul import _every_format_outputs; torch.save(_every_format_outputs(), sys.argv[2])")
    out = tmp_path / "avx2.pt"
    subprocess.run([sys.executable, "-c", code, str(here), str(out)], check=True, timeout=600,
                   env={**os.environ, "CC": str(wrapper)})
    theirs, ours = torch.load(out), _every_format_outputs()
    assert theirs.keys() == ours.keys()
    assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []


def test_threads_that_come_and_go_leave_no_row_buffers_behind():
    """Calls of a few rows keep their quantized rows in buffers of each thread's own (matmul.c thread_rows); a
    thread's exit frees them (a thread-specific key's destructor). 200 short-lived threads, each with its own OpenMP
    team, calling a 2-row product of K = 16384: the build that kept them for good grew RSS by ~22 MB here."""
    import os
    import threading

    lin = Int4Linear(weights(32, 16384, 0), None)
    x = torch.randn(2, 16384).bfloat16()

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    def call_in_a_thread() -> None:
        t = threading.Thread(target=lin, args=(x,))
        t.start()
        t.join()

    for _ in range(5):
        call_in_a_thread()
    before = rss_mb()
    for _ in range(200):
        call_in_a_thread()
    assert rss_mb() - before < 8.0
