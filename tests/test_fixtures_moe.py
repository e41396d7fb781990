"""The benchmark fixtures of MoE / MLA shapes (specdec/bench/fixtures.py): tiny variants of each, written as
llama.cpp lays them out (stacked experts, the split MLA tensors) in the Q4_K_M mix llama-quant.cpp gives them,
load in specdec and run a forward; llama.cpp loads them too when SPECDEC_LLAMA_CPP names a build's bin folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from specdec.bench.fixtures import MOE_SHAPES, fixture_tensors, shape, tensor_type, tiny_shape, write_fixture
from specdec.models.transformer import Transformer
from specdec.weights import read_model

SHAPES = list(MOE_SHAPES)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixtures")
    return {(name, q): write_fixture(tiny_shape(name), q, root, progress=False)
            for name in SHAPES for q in ("Q4_K_M", "Q4_0") if q == "Q4_K_M" or name == "deepseek-v2-lite"}


@pytest.mark.parametrize("name,quant", [(n, "Q4_K_M") for n in SHAPES] + [("deepseek-v2-lite", "Q4_0")])
def test_tiny_moe_fixture_loads_and_runs(files, name, quant):
    import gguf

    s = tiny_shape(name)
    lm = read_model(files[(name, quant)])
    a = lm.args
    assert a.arch == ("deepseek_v2" if s.arch == "deepseek2" else "qwen3_moe")
    assert (a.n_experts, a.n_experts_used, a.moe_ffn_dim, a.n_shared_experts) == (4, 2, 160, s.n_shared)
    assert a.moe_layers == [i >= s.first_dense for i in range(s.n_layers)]
    assert a.attention == ("mla" if s.kv_lora_rank else "gqa")
    # the types written are the mix llama.cpp's quantizer picks
    reader = gguf.GGUFReader(files[(name, quant)])
    written = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert written == {n: q for n, _, q in fixture_tensors(s, quant)}
    m = Transformer(a, lm.weights, torch.float32, "none", max_len=32)
    with torch.inference_mode():
        logits, _ = m(torch.tensor([[1, 2, 3, 4]]), torch.arange(4), m.new_cache())
    assert logits.shape == (1, 4, s.vocab) and torch.isfinite(logits).all() and logits.std() > 0


def test_q4_k_m_mix_follows_llama_quant():
    """llama-quant.cpp for expert tensors: ffn_down* (exps and shexp) Q6_K in the use_more_bits layers, the router
    F32, block fallbacks on rows 256 does not divide (DeepSeek-V2-Lite's experts of 1408: Q5_0 / Q8_0)."""
    types = {n: q for n, _, q in fixture_tensors(shape("deepseek-v2-lite"), "Q4_K_M")}
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # 10944 wide, layer 0 (more bits): Q6_K -> Q8_0
    assert types["blk.1.ffn_down_exps.weight"] == "Q8_0" and types["blk.4.ffn_down_exps.weight"] == "Q5_0"
    assert types["blk.1.ffn_down_shexp.weight"] == "Q6_K" and types["blk.4.ffn_down_shexp.weight"] == "Q4_K"
    assert types["blk.5.ffn_gate_inp.weight"] == "F32" and types["blk.5.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.5.attn_k_b.weight"] == "Q5_0" and types["blk.5.attn_v_b.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    q = {n: t for n, _, t in fixture_tensors(shape("qwen3-30b-a3b"), "Q4_K_M")}
    more = [i for i in range(48) if q[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"]
    assert more == [i for i in range(48) if q[f"blk.{i}.attn_v.weight"] == "Q6_K"] and len(more) == 24
    # Mixtral's 8-expert rules
    assert tensor_type("Q4_K_M", "attn_v", 3, 32, 4096, 8) == tensor_type("Q4_K_M", "attn_k", 3, 32, 4096, 8) == "Q8_0"
    assert tensor_type("Q4_K_M", "attn_output", 3, 32, 4096, 8) == "Q5_K"
    # dense shapes: as before, except rows the block does not divide (Qwen2.5-0.5B's 896) now fall back
    assert tensor_type("Q4_K_M", "ffn_down", 0, 16) == "Q6_K" and tensor_type("Q4_K_M", "attn_q", 5, 16) == "Q4_K"
    assert {n: t for n, _, t in fixture_tensors(shape("qwen2.5-0.5b"), "Q4_K_M")}["blk.4.attn_q.weight"] == "Q5_0"


def test_deepseek2_gguf_tokenizer_reads(files):
    """transformers cannot read a deepseek2 GGUF's vocabulary itself: specdec hands it the tokenizer fields alone."""
    from specdec.tokenizer import _convert_gguf_tokenizer, Tokenizer  # noqa: I001

    folder = _convert_gguf_tokenizer(files[("deepseek-v2-lite", "Q4_0")], Path(files[("deepseek-v2-lite", "Q4_0")]
                                                                             ).parent / "tok")
    tok = Tokenizer(folder)
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


@pytest.mark.skipif(not os.environ.get("SPECDEC_LLAMA_CPP"), reason="set SPECDEC_LLAMA_CPP to a llama.cpp bin folder")
@pytest.mark.parametrize("name", SHAPES)
def test_tiny_moe_fixture_loads_in_llama_cpp(tmp_path, name):
    path = write_fixture(tiny_shape(name, n_layers=27) if name == "deepseek-v2-lite" else tiny_shape(name),
                         "Q4_K_M", tmp_path, progress=False)
    r = subprocess.run([str(Path(os.environ["SPECDEC_LLAMA_CPP"]) / "llama-completion"), "-m", str(path), "-p", "hi",
                        "-n", "4", "-no-cnv", "-t", "1", "--temp", "0"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
