"""Tokenization equals Hugging Face's, token for token; chat templates render as transformers renders them."""

from __future__ import annotations

import pytest
from tiny_models import write_gguf
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


def test_gguf_architecture_reads_the_header(tmp_path):
    """The tokenizer's conversion reads a GGUF's architecture by walking the header (gguf-py's reader would parse the
    whole vocabulary first): the same value as gguf-py's, None for what is not a readable GGUF."""
    import gguf

    from specdec.weights.gguf import gguf_architecture

    for arch in ("llama", "gemma3", "qwen2"):
        path = write_gguf(arch, tmp_path / f"{arch}.gguf", tokenizer=False)
        assert gguf_architecture(path) == gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
        (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:40])
        assert gguf_architecture(tmp_path / "cut.gguf") is None
    (tmp_path / "text.gguf").write_text("not a model")
    assert gguf_architecture(tmp_path / "text.gguf") is None
