"""Tokenization equals Hugging Face's, token for token; chat templates render as transformers renders them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specdec.tokenizer import StreamDecoder, load_tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "Unicode: héllo wörld, 日本語のテキスト, emoji 🚀🔥, Ελληνικά, русский",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\n",
    "Numbers 1234567890 and 3.14159, dates 2026-11-29.",
    "Special markers <|im_start|> and <|im_end|> inside text",
    "\n\n\n   \t  \n",
    "a" * 300,
    "",
]
MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}],
]


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def pair(request, smollm2_path, gemma_path):
    path = smollm2_path if request.param == "smollm2" else gemma_path
    ours = load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, ref


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(pair, text):
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_chat_template_equals_transformers(smollm2_path):
    ours = load_tokenizer(smollm2_path)
    ref = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    for messages in MESSAGES:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen) == ref.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False)
            expected = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
            assert ours.encode_chat(messages, gen) == list(expected)


def test_gemma_builtin_template(gemma_path):
    """This Gemma GGUF ships no template: the built-in Gemma 3 turn format is used."""
    tok = load_tokenizer(gemma_path)
    text = tok.apply_chat_template(MESSAGES[1])
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nName a color.<end_of_turn>\n")
    assert text.endswith("<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n"
                         "<start_of_turn>model\n")
    assert tok.backend.token_to_id("<end_of_turn>") in tok.eog_ids


@pytest.mark.parametrize("text", TEXTS[:5])
def test_stream_decoder_equals_full_decode(pair, text):
    ours, _ = pair
    ids = ours.encode(text, add_special_tokens=False)
    dec = StreamDecoder(ours)
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == ours.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never half a UTF-8 character


def test_special_ids(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    assert tok.eos_id == 2 and tok.backend.id_to_token(2) == "<|im_end|>"
    assert 2 in tok.eog_ids
    assert tok.vocab_size == 49152


def _spm_gguf(path, arch: str):
    """A tokenizer-only GGUF with a small SentencePiece-style vocabulary (tokenizer.ggml.model "llama", as llama.cpp
    writes Llama-2, Mistral and Gemma files): special, byte, normal, control and user-defined tokens, no merges."""
    import gguf

    words = ["hello", "world", "the", "speculative", "decoding", "token"]
    pieces = ["\u2581"] + sorted({c for w in words for c in w})
    for w in words:
        for n in range(2, len(w) + 1):
            pieces += [p for p in (w[:n], "\u2581" + w[:n - 1]) if p not in pieces]
    special = ["<unk>", "<s>", "</s>"] if arch != "gemma3" else ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<start_of_turn>", "<think>", "  "]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types([2 if t == "<unk>" else 3 for t in special] + [6] * 256 + [1] * len(pieces) + [3, 4, 1])
    w.add_bos_token_id(tokens.index("<bos>" if arch == "gemma3" else "<s>"))
    w.add_eos_token_id(tokens.index("<eos>" if arch == "gemma3" else "</s>"))
    w.add_unk_token_id(tokens.index("<unk>"))
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["smollm2", "llama", "gemma3", "qwen2", "deepseek2"])
def test_conversion_equals_auto(tmp_path, smollm2_path, kind):
    """The conversion builds the tokenizer class directly (no model config from the file, which made AutoTokenizer
    parse the vocabulary a second time): the same tokenizer as AutoTokenizer's (its serialization, to_str(), equal),
    the same special tokens and template, on the default model's byte-level BPE and on SentencePiece vocabularies
    under the architectures whose tokenizer classes differ (Llama, Gemma, Qwen2). deepseek2, which transformers
    cannot load as a model, converts too (its reference is the same vocabulary written as llama)."""
    from tokenizers import Tokenizer as FastTokenizer

    from specdec.tokenizer import Tokenizer, _convert_gguf_tokenizer

    path = smollm2_path if kind == "smollm2" else _spm_gguf(tmp_path / f"{kind}.gguf", kind)
    (tmp_path / "ref").mkdir()
    ref_path = _spm_gguf(tmp_path / "ref" / "llama.gguf", "llama") if kind == "deepseek2" else path
    ours = _convert_gguf_tokenizer(path, tmp_path / "ours")
    ref = AutoTokenizer.from_pretrained(str(ref_path.parent), gguf_file=ref_path.name)
    ref.save_pretrained(str(tmp_path / "auto"))
    tok = Tokenizer(ours)
    assert tok.backend.to_str() == FastTokenizer.from_file(str(tmp_path / "auto" / "tokenizer.json")).to_str()
    template = tok.chat_template if ref.chat_template else None  # else ours falls back to a built-in one
    assert (tok.bos_token, tok.eos_token, template) == (ref.bos_token, ref.eos_token, ref.chat_template)
    text = "hello world <think> the <start_of_turn>speculative token"
    assert tok.encode(text) == ref(text)["input_ids"]


@pytest.mark.parametrize("space", [False, True])
def test_compact_json_is_the_same_tokenizer(tmp_path, space):
    """The cached tokenizer.json is rewritten with "a b" merges (less memory to load) unless a merged token holds a
    space, which that form cannot say: pairs are kept then. Either way the file loads as the same tokenizer."""
    import json

    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    from specdec.tokenizer import _compact_tokenizer_json

    first = " " if space else "_"
    vocab = {"a": 0, "b": 1, "ab": 2, first: 3, first + "a": 4, first + "ab": 5}
    tok = FastTokenizer(BPE(vocab, [(first, "a"), (first + "a", "b"), ("a", "b")]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    _compact_tokenizer_json(path)
    merges = json.loads(path.read_text())["model"]["merges"]
    assert merges == ([[" ", "a"], [" a", "b"], ["a", "b"]] if space else ["_ a", "_a b", "a b"])
    again = FastTokenizer.from_file(str(path))
    assert again.to_str() == tok.to_str()
    assert again.encode(first + "ab" + "ab").ids == tok.encode(first + "ab" + "ab").ids == [5, 2]


def test_gguf_without_vocabulary_is_one_line(tmp_path, monkeypatch):
    """A GGUF that carries no vocabulary (tokenizer.ggml.model "none") fails in one line that says what to give."""
    from tiny_models import write_gguf

    from specdec.config import ModelError

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = write_gguf("llama", tmp_path / "m.gguf", tokenizer=False)
    with pytest.raises(ModelError, match="cannot read the tokenizer of .*'none'.*give a GGUF that carries its vocab"):
        load_tokenizer(path)
    assert not list((tmp_path / "cache").rglob("tokenizer.json"))  # nothing half-written is cached
