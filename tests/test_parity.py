"""Our forward pass against Hugging Face transformers on the same weights (final logits, max abs difference).

Tolerance: both sides compute in float32 from identical weights, so they differ only by the order of floating-point
operations (fused q|k|v and gate|up matmuls, a different attention kernel). Over 2-30 layers that is ~1e-6 x the
logit scale on random tiny models and ~1e-4 on real ones (measured: 2.4e-6 on tiny models, 8.6e-5 / 9.9e-5 on
SmolLM2 / Gemma 3 whose logits reach 38 / 98). We allow 1e-4 relative to the largest logit: 10-100x the observed
error, yet far below any real mistake (a wrong RoPE layout, norm offset or scale moves logits by O(1)).
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_gguf_model
from tiny_models import K_QTYPES, transformers_gguf_kwargs, write_gguf, write_hf

from specdec.loader import load
from specdec.models.transformer import Transformer
from specdec.weights import read_model

IDS = [1, 504, 3458, 314, 253, 1789, 30, 2115, 9004, 17, 1380, 2]  # 12 tokens > the tiny gemma3 sliding window (8)
REL_TOL = 1e-4


def ours(path, ids=IDS) -> torch.Tensor:
    lm = read_model(path)
    m = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=256)
    with torch.inference_mode():
        logits, _ = m(torch.tensor([ids]), torch.arange(len(ids)), m.new_cache())
    return logits[0]


def theirs(path, ids=IDS, gguf=None, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    if gguf is not None:
        model = hf_gguf_model(gguf, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= REL_TOL * scale, f"max abs diff {err:.3g} vs logit scale {scale:.3g}"


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama3", True), ("mistral", False), ("qwen2", False),
                                       ("qwen3", True), ("gemma3", False)])
def test_hf_folder(tmp_path, arch, tied):
    folder = write_hf(arch, tmp_path / arch, seed=3, tied=tied)
    assert_close(ours(folder), theirs(folder))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_gguf_f32(tmp_path, arch):
    path = write_gguf(arch, tmp_path / f"{arch}.gguf", seed=4)
    assert_close(ours(path), theirs(None, gguf=path, **transformers_gguf_kwargs(arch)))


def test_gguf_llama3_rope_freqs(tmp_path):
    """llama.cpp stores Llama-3 rope scaling as a rope_freqs tensor, which transformers ignores: our GGUF forward must
    equal transformers running the HF folder of the same weights (with rope_scaling type llama3)."""
    path = write_gguf("llama3", tmp_path / "llama3.gguf", seed=5)
    folder = write_hf("llama3", tmp_path / "llama3_hf", seed=5)
    ids = IDS * 8  # 96 positions: past original_max_position_embeddings (64), where the scaling matters
    assert_close(ours(path, ids), theirs(folder, ids))
    unscaled = theirs(None, ids, gguf=path)  # transformers reads this GGUF without the scaling
    assert (ours(path, ids) - unscaled).abs().max() > 1e-3  # so the scaling really is applied, and it matters


def test_sharded_folder(tmp_path):
    folder = write_hf("qwen2", tmp_path / "sharded", seed=6, shards=3)
    assert (folder / "model.safetensors.index.json").exists()
    assert_close(ours(folder), theirs(folder))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QTYPES])
def test_gguf_quant_types(tmp_path, qtype):
    """Each quantization type dequantizes as transformers' own (independent) dequantizer does."""
    arch = {"Q4_0": "qwen2", "Q5_1": "qwen3", "Q3_K": "gemma3"}.get(qtype, "llama")
    path = write_gguf(arch, tmp_path / f"{qtype}.gguf", qtype=qtype, seed=7, tied=qtype != "Q6_K", tokenizer=False)
    assert_close(ours(path), theirs(None, gguf=path, **transformers_gguf_kwargs(arch, qtype=qtype)))


def test_smollm2_real(smollm2_f32, hf_smollm2, smollm2_path):
    ids = smollm2_f32.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.inference_mode():
        a, _ = smollm2_f32.model(torch.tensor([ids]), torch.arange(len(ids)), smollm2_f32.model.new_cache())
        b = hf_smollm2(torch.tensor([ids])).logits
    assert_close(a[0], b[0])


def test_gemma3_real(gemma_path):
    """Gemma-3-270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors), 600 tokens: past the 512-token sliding window."""
    g = load(gemma_path, dtype="f32", quant="none", ctx=1024)
    ids = g.tokenizer.encode("The history of the printing press. " * 80)[:600]
    with torch.inference_mode():
        a, _ = g.model(torch.tensor([ids]), torch.arange(len(ids)), g.model.new_cache())
    ref = hf_gguf_model(gemma_path)
    with torch.no_grad():
        b = ref(torch.tensor([ids])).logits
    assert_close(a[0], b[0])
