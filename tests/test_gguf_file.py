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
