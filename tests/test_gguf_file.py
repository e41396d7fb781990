"""specdec's GGUF reader (weights/gguf.GGUFFile) reads what gguf-py's GGUFReader reads: every metadata value (but the
tokenizer's large arrays, which the tokenizer reads itself) with the same Python type, and every tensor's name, type,
shape, offset, size and data, bit for bit, on tiny files of every tensor type and on the default model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_models import QTYPES, write_gguf, write_hf

from specdec.weights.gguf import _TOKENIZER_ARRAYS, GGUFFile


def same_as_gguf_py(path) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.meta) == [k for k in ref.fields if not k.startswith("GGUF.") and k not in _TOKENIZER_ARRAYS]
    for key, value in ours.meta.items():
        expected = ref.fields[key].contents()
        assert value == expected and type(value) is type(expected), key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, int(b.tensor_type), tuple(int(x) for x in b.shape), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_files_read_as_gguf_py_reads_them(qtype, tmp_path):
    same_as_gguf_py(write_gguf("llama", tmp_path / "m.gguf", qtype=qtype, tensor_qtypes={"blk.0.*": "F32"},
                               tokenizer=False))


def test_the_default_model_reads_as_gguf_py_reads_it(smollm2_path):
    same_as_gguf_py(smollm2_path)


def same_by_rows(w) -> None:
    from specdec.quant import Int4Linear, Int8Linear
    from specdec.weights import Rows

    for name in ("token_embd", "output"):
        rows, full = w.rows(name), w[name]
        assert isinstance(rows, Rows) and rows.shape == full.shape
        assert torch.equal(rows[:], full) and torch.equal(rows[3:17], full[3:17])
        assert torch.equal(rows[full.shape[0] - 5:], full[-5:])
        for make in (Int8Linear, Int4Linear):
            a, b = make(rows, None), make(full, None)
            assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True)), (name, make)
    assert not isinstance(w.rows("blk.0.attn_q"), Rows)  # permuted on load: read whole


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q6_K", "Q5_0"])
def test_tables_read_by_rows(qtype, tmp_path):
    """The vocabulary tables (token_embd, an untied output) are requantized from ranges of rows (weights.Rows), so a
    first load never holds them whole in f32: any range of rows is those rows of the whole tensor, and the int8 /
    int4 layers made from the ranges are the layers made from the whole tensor, bit for bit. GGUF and safetensors."""
    from specdec.weights import read_model

    other = "Q8_0" if qtype == "F32" else "F32"
    path = write_gguf("llama", tmp_path / "m.gguf", qtype=other, tied=False, tokenizer=False,
                      tensor_qtypes={"token_embd.weight": qtype, "output.weight": qtype})
    same_by_rows(read_model(path).weights)
    if qtype == "F32":
        folder = write_hf("llama", tmp_path / "hf", dtype=torch.bfloat16, tied=False, tokenizer=False)
        same_by_rows(read_model(folder).weights)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_dequantized_as_gguf_py_dequantizes(qtype):
    """specdec dequantizes Q4_K / Q6_K / Q8_0 in PyTorch (weights.gguf.TORCH_DEQUANT), the rest with gguf-py: either
    way the floats are gguf-py's, bit for bit, on blocks of random bytes (every code, scale and sign pattern; the
    f16 factors kept finite). The int4 codes read from Q4_0 / Q4_1 / Q4_K give the same weights as (q - 8) scale +
    zero, to f32 rounding."""
    from specdec.weights.gguf import INT4_CODES, dequantize_f32, int4_codes

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    g = np.random.default_rng(0)
    rows, cols = 48, 2 * 256
    data = g.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    f16 = (g.standard_normal((rows, cols // block, 2)) * 0.01).astype(np.float16).view(np.uint8)
    at = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,)}[qtype]
    blocks = data.reshape(rows, -1, size)
    for i, a in enumerate(at):  # d (and dmin / m) at their byte offsets in each block
        blocks[:, :, a:a + 2] = f16[..., 2 * i:2 * i + 2]
    ref = torch.from_numpy(gguf.dequantize(data, q).astype(np.float32)).reshape(rows, cols)
    assert torch.equal(dequantize_f32(data, q, (rows, cols)), ref)
    if qtype in INT4_CODES:
        codes, scale, zero = int4_codes(data, q)[:3]
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        w = ((codes.float() - 8).reshape(rows, -1, 32) * scale[..., None] + zero[..., None]).reshape(rows, cols)
        torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-6)
