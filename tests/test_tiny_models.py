"""The tiny-model fixtures of ``tiny_models.py`` are real GGUF / HF files: transformers loads every one of them.

GGUF loading in transformers needs ``accelerate``; those tests are skipped without it.  Each GGUF with the real
49152-token vocabulary costs ~3-4 s to load (gguf-py parses the vocabulary), so the qtype sweep uses files
written with ``tokenizer=False``; the vocabulary itself is checked once per arch.
"""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_models import (
    ARCHS,
    GGUF_ARCH,
    K_QTYPES,
    QTYPES,
    SMOLLM2_VOCAB_SIZE,
    fast_transformers_gguf_reads,
    hf_config,
    hf_state_dict,
    llama3_rope_freqs,
    llama_permute,
    random_kquant,
    smollm2_gguf_path,
    smollm2_tokenizer_metadata,
    transformers_gguf_kwargs,
    write_gguf,
    write_hf,
)

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers needs accelerate to load GGUF files"
)

# "<|im_start|>Hello world, how are you?<|im_end|>" + two more tokens: T=10 > the gemma3 sliding window (8)
IDS = torch.tensor([[1, 19556, 905, 28, 638, 359, 346, 47, 2, 30000]])
# (arch, tied): untied output heads are covered for three archs
ARCH_CASES = [("llama", True), ("llama3", True), ("mistral", False), ("qwen2", False), ("qwen3", True),
              ("gemma3", False)]


def _forward(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.shape == (1, IDS.shape[1], SMOLLM2_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    # the logits depend on the position (attention and rope do something)
    assert (logits[0, 1:] - logits[0, :-1]).abs().amax() > 1e-2
    assert logits.abs().amax() < 1e3
    return logits


def _load_hf(folder):
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _load_gguf(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                **kwargs).eval()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


@pytest.fixture
def fast_reads():
    with fast_transformers_gguf_reads():
        yield


# ----------------------------------------------------------------------------------------------------------------
# HF folders
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", ARCH_CASES)
def test_hf_folder_loads(tmp_path, arch, tied):
    folder = write_hf(arch, tmp_path / arch, seed=1, tied=tied)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied
    assert cfg["vocab_size"] == SMOLLM2_VOCAB_SIZE
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is (not tied)
    assert "model.embed_tokens.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / f).is_file()

    model = _load_hf(folder)
    assert type(model).__name__ == cfg["architectures"][0]
    assert model.config.tie_word_embeddings is tied
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    if arch == "gemma3":
        types = model.config.layer_types
        assert "sliding_attention" in types and "full_attention" in types
        assert model.config.sliding_window < IDS.shape[1]
    if arch == "qwen3":
        assert model.config.num_attention_heads * model.config.head_dim != model.config.hidden_size
    if arch == "llama3":
        assert model.config.rope_parameters["rope_type"] == "llama3"
    _forward(model)


def test_hf_sharded_bf16(tmp_path):
    one = write_hf("qwen3", tmp_path / "one", seed=3, dtype=torch.bfloat16, tied=False, tokenizer=False)
    sharded = write_hf("qwen3", tmp_path / "sharded", seed=3, dtype=torch.bfloat16, tied=False, shards=3,
                       tokenizer=False)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    sd = hf_state_dict("qwen3", hf_config("qwen3"), seed=3, tied=False)
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in sd.values())
    for name, fname in index["weight_map"].items():
        with safe_open(str(sharded / fname), "pt") as f:
            assert f.get_tensor(name).dtype == torch.bfloat16
    assert json.loads((sharded / "config.json").read_text())["torch_dtype"] == "bfloat16"
    a, b = _forward(_load_hf(one)), _forward(_load_hf(sharded))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hf_tokenizer_is_smollm2(tmp_path):
    folder = write_hf("llama", tmp_path / "m", num_hidden_layers=1)
    tok = AutoTokenizer.from_pretrained(str(folder))
    meta = smollm2_tokenizer_metadata()
    assert len(tok) == SMOLLM2_VOCAB_SIZE
    assert tok.convert_ids_to_tokens(list(range(SMOLLM2_VOCAB_SIZE))) == meta["tokenizer.ggml.tokens"]
    assert tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_token_id == meta["tokenizer.ggml.eos_token_id"] == 2
    assert tok("Hello world, how are you?")["input_ids"] == [19556, 905, 28, 638, 359, 346, 47]
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == meta["tokenizer.chat_template"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------


def _field(reader, key):
    return reader.fields[key].contents()


@needs_accelerate
@pytest.mark.parametrize("arch,tied", ARCH_CASES)
def test_gguf_f32_loads_and_matches_hf_folder(tmp_path, fast_reads, arch, tied):
    """F32 GGUF with the SmolLM2 vocabulary: loads, and equals the HF folder of the same seed in transformers
    (this checks the q/k permutation and the gemma norm shift)."""
    path = write_gguf(arch, tmp_path / f"{arch}.gguf", seed=2, tied=tied)
    model = _load_gguf(path, **transformers_gguf_kwargs(arch))
    logits = _forward(model)
    assert model.config.tie_word_embeddings is tied

    reader = gguf.GGUFReader(path)  # shared with the load above: free
    g = GGUF_ARCH[arch]
    assert _field(reader, "general.architecture") == g
    cfg = hf_config(arch)
    assert _field(reader, f"{g}.block_count") == cfg["num_hidden_layers"]
    assert _field(reader, f"{g}.embedding_length") == cfg["hidden_size"]
    assert _field(reader, f"{g}.attention.head_count_kv") == cfg["num_key_value_heads"]
    meta = smollm2_tokenizer_metadata()
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "tokenizer.ggml.add_bos_token"):
        assert _field(reader, key) == meta[key]
    assert _field(reader, "tokenizer.ggml.tokens") == meta["tokenizer.ggml.tokens"]
    assert _field(reader, "tokenizer.ggml.merges") == meta["tokenizer.ggml.merges"]
    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) is (not tied)
    emb = tensors["token_embd.weight"]
    assert list(emb.shape) == [cfg["hidden_size"], SMOLLM2_VOCAB_SIZE]  # ne0 = columns
    assert emb.tensor_type == gguf.GGMLQuantizationType.F32
    if arch == "qwen2":
        assert "blk.0.attn_q.bias" in tensors
    if arch in ("qwen3", "gemma3"):
        assert "blk.0.attn_q_norm.weight" in tensors and "blk.0.attn_k_norm.weight" in tensors
    if arch == "gemma3":
        assert "blk.0.post_attention_norm.weight" in tensors and "blk.0.post_ffw_norm.weight" in tensors
        assert _field(reader, "gemma3.attention.sliding_window") == cfg["sliding_window"]
        assert _field(reader, "gemma3.attention.key_length") == cfg["head_dim"]
        # stored as 1 + w
        assert abs(float(np.mean(tensors["output_norm.weight"].data)) - 1.0) < 0.1
    if arch == "llama3":
        np.testing.assert_array_equal(tensors["rope_freqs.weight"].data, llama3_rope_freqs(cfg))

    if arch == "llama3":
        # transformers ignores rope_freqs: it runs the GGUF as llama3 *without* scaling
        plain = _forward(_load_hf(write_hf(arch, tmp_path / "hf-plain", seed=2, tied=tied, rope_scaling=None,
                                           tokenizer=False)))
        torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)
        scaled = _forward(_load_hf(write_hf(arch, tmp_path / "hf", seed=2, tied=tied, tokenizer=False)))
        assert (scaled - logits).abs().amax() > 1e-3
    else:
        ref = _forward(_load_hf(write_hf(arch, tmp_path / "hf", seed=2, tied=tied, tokenizer=False)))
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@needs_accelerate
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_qtype_loads(tmp_path, qtype):
    """Every tensor type, each with another arch (without the vocabulary, so the files parse quickly)."""
    i = QTYPES.index(qtype)
    arch = ARCHS[i % len(ARCHS)]
    tied = i % 2 == 0
    path = write_gguf(arch, tmp_path / "q.gguf", qtype=qtype, seed=4, tied=tied, tokenizer=False)
    reader = gguf.GGUFReader(path)
    qt = gguf.GGMLQuantizationType[qtype]
    for t in reader.tensors:
        if len(t.shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        else:
            assert t.tensor_type == qt, t.name
            assert int(t.shape[0]) % gguf.GGML_QUANT_SIZES[qt][0] == 0
            w = gguf.quants.dequantize(t.data[:64], t.tensor_type)
            assert np.isfinite(w).all() and 0.01 < float(np.std(w)) < 0.5, t.name
    assert ("output.weight" in {t.name for t in reader.tensors}) is (not tied)

    kwargs = transformers_gguf_kwargs(arch, qtype=qtype)
    model = _load_gguf(path, **kwargs)
    assert model.config.tie_word_embeddings is tied
    logits = _forward(model)
    if qtype not in K_QTYPES:
        # the same model as F32, up to rounding / quantisation
        f32 = _forward(_load_gguf(write_gguf(arch, tmp_path / "f.gguf", seed=4, tied=tied, tokenizer=False),
                                  **kwargs))
        assert _corr(logits, f32) > (0.999 if qtype in ("F16", "BF16", "Q8_0") else 0.9)


@needs_accelerate
def test_gguf_mixed_qtypes(tmp_path):
    mix = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0", "blk.0.*": "Q2_K", "blk.1.*": "Q3_K",
           "blk.2.ffn_*": "Q5_K", "blk.3.attn_*": "BF16"}
    path = write_gguf("gemma3", tmp_path / "mix.gguf", qtype="Q4_K", tensor_qtypes=mix, tied=False,
                      tokenizer=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "Q6_K" and types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q2_K" and types["blk.1.ffn_up.weight"] == "Q3_K"
    assert types["blk.2.ffn_down.weight"] == "Q5_K" and types["blk.2.attn_q.weight"] == "Q4_K"
    assert types["blk.3.attn_output.weight"] == "BF16" and types["blk.0.attn_norm.weight"] == "F32"
    _forward(_load_gguf(path, **transformers_gguf_kwargs("gemma3", qtype="Q4_K")))


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def test_smollm2_gguf_path():
    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"


@pytest.mark.parametrize("qtype", K_QTYPES)
def test_random_kquant_blocks(qtype):
    qt = gguf.GGMLQuantizationType[qtype]
    raw = random_kquant(qtype, 8, 512, seed=5, std=0.05)
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    assert raw.dtype == np.uint8 and raw.shape == (8, 512 // block * nbytes)
    w = gguf.quants.dequantize(raw, qt)
    assert w.shape == (8, 512) and np.isfinite(w).all()
    assert 0.025 < float(np.std(w)) < 0.1 and abs(float(np.mean(w))) < 0.02
    assert len(np.unique(w)) > 100
    np.testing.assert_array_equal(raw, random_kquant(qtype, 8, 512, seed=5, std=0.05))


def test_llama_permute_is_undone_by_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    q = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    k = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)
    back_q = proc.process(llama_permute(q, 4, 4), "blk.0.attn_q.weight").weights
    back_k = proc.process(llama_permute(k, 4, 2), "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(back_q, q)
    np.testing.assert_array_equal(back_k, k)


def test_llama3_rope_freqs_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config("llama3")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    hd = cfg["head_dim"]
    base = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    factors = llama3_rope_freqs(cfg)
    assert factors.shape == (hd // 2,) and factors.min() == 1.0 and factors.max() == 8.0
    assert ((factors > 1.0) & (factors < 8.0)).any()  # the smooth band is exercised too
    np.testing.assert_allclose(base.numpy() / factors, scaled.numpy(), rtol=1e-5)


def test_configs(tmp_path):
    for arch in ARCHS:
        cfg = hf_config(arch)
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
        kcfg = hf_config(arch, qtype="Q4_K")
        hd = kcfg.get("head_dim") or kcfg["hidden_size"] // kcfg["num_attention_heads"]
        for n in (kcfg["hidden_size"], kcfg["intermediate_size"], kcfg["num_attention_heads"] * hd):
            assert n % 256 == 0
    g = hf_config("gemma3")
    assert g["query_pre_attn_scalar"] == g["head_dim"] == 32
    assert g["layer_types"].count("full_attention") == 1 and len(g["layer_types"]) == 6
    assert transformers_gguf_kwargs("gemma3") == {"query_pre_attn_scalar": 32}
    assert hf_config("gemma3", head_dim=16)["query_pre_attn_scalar"] == 16
    assert "rope_theta" not in hf_config("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="multiple"):
        write_gguf("llama", tmp_path / "x.gguf", qtype="Q4_K", hidden_size=64, tokenizer=False)


def test_deterministic(tmp_path):
    a = write_gguf("qwen2", tmp_path / "a.gguf", qtype="Q4_K", seed=7, tokenizer=False).read_bytes()
    b = write_gguf("qwen2", tmp_path / "b.gguf", qtype="Q4_K", seed=7, tokenizer=False).read_bytes()
    c = write_gguf("qwen2", tmp_path / "c.gguf", qtype="Q4_K", seed=8, tokenizer=False).read_bytes()
    assert a == b != c
    sd1, sd2 = hf_state_dict("llama", seed=7), hf_state_dict("llama", seed=7)
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
