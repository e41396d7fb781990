"""specdec's GGUF reader (weights/gguf.GGUFFile) reads what gguf-py's GGUFReader reads: every metadata value (but the
tokenizer's large arrays, which the tokenizer reads itself) with the same Python type, and every tensor's name, type,
shape, offset, size and data, bit for bit, on tiny files of every tensor type and on the default model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_models import QTYPES, write_gguf

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
