"""`specdec generate`'s light tokenizer (specdec/light_tokenizer.py): decoding from the table of token texts equals
`tokenizers`' decode, and the helper process encodes prompts as the in-process tokenizer does."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from specdec.light_tokenizer import TABLE, LightTokenizer, PromptEncoder, decoder_chain
from specdec.tokenizer import StreamDecoder, load_tokenizer

TEXTS = ["Hello world!", "Unicode: héllo wörld, 日本語のテキスト, emoji 🚀🔥, Ελληνικά",
         "def f(x):\n\treturn x  # sq\n\n", "  spaces   and\u00a0nbsp ", "<|im_start|>user\nhi<|im_end|>",
         "<start_of_turn>model\n"]


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def pair(request, smollm2_path, gemma_path):
    path = smollm2_path if request.param == "smollm2" else gemma_path
    full = load_tokenizer(path)  # writes the decode table beside the cached tokenizer.json
    light = LightTokenizer.cached(path)
    assert light is not None and (full.folder / TABLE).exists()
    return full, light


def test_every_token_decodes_as_tokenizers_does(pair):
    full, light = pair
    assert light.vocab_size == full.vocab_size and light.eog_ids == full.eog_ids
    assert (light.bos_id, light.eos_id, light.chat_template, light.model_kind) == (
        full.bos_id, full.eos_id, full.chat_template, full.model_kind)
    for skip in (False, True):
        for i in range(full.vocab_size):
            assert light.decode([i], skip) == full.decode([i], skip), i


def test_random_sequences_decode_as_tokenizers_does(pair):
    """Sequences over the whole vocabulary and over the byte tokens alone (invalid UTF-8 runs, cut characters), with
    and without special tokens: the same text, U+FFFD where `tokenizers` puts it."""
    full, light = pair
    rng = random.Random(0)
    byte_ids = [i for i, t in enumerate(light.vocab_texts()) if len(t) == 6 and t.startswith("<0x")]
    byte_ids = byte_ids or list(range(256))  # byte-level vocabularies: their first ids are single bytes
    for n in range(600):
        pool = byte_ids if n % 2 else range(full.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 24))]
        for skip in (False, True):
            assert light.decode(ids, skip) == full.decode(ids, skip), ids
    for text in TEXTS:
        ids = full.encode(text)
        assert light.decode(ids) == full.decode(ids)
        stream = StreamDecoder(light)
        assert "".join(stream.push([t]) for t in ids) + stream.flush() == full.decode(ids)


def test_unknown_decoders_are_left_to_tokenizers():
    assert decoder_chain({"type": "Strip", "content": " ", "start": 1, "stop": 0}) is None
    assert decoder_chain({"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"Regex": " +"},
                                                           "content": " "}]}) is None
    assert decoder_chain({"type": "WordPiece", "prefix": "##"}) is None
    assert decoder_chain({"type": "ByteLevel", "add_prefix_space": True}) is not None


def test_encoding_falls_back_to_the_full_tokenizer(pair):
    full, light = pair
    for text in TEXTS:
        assert light.encode(text) == full.encode(text)


@pytest.mark.parametrize("chat", [False, True])
def test_helper_process_encodes_as_in_process(pair, chat):
    full, _ = pair
    for text in TEXTS:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}] if chat else None
        want = full.encode_chat(messages) if chat else full.encode(text)
        assert PromptEncoder(full.folder, text, messages).ids() == want


@pytest.mark.parametrize("damage", ["{not json", '{"version": 1}', '{"version": 1, "decoder": 5}', ""])
def test_a_damaged_table_means_the_full_tokenizer(tmp_path, monkeypatch, smollm2_path, damage):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = load_tokenizer(smollm2_path).folder
    assert LightTokenizer.cached(smollm2_path) is not None
    (folder / TABLE).write_text(damage)
    assert LightTokenizer.cached(smollm2_path) is None
    load_tokenizer(smollm2_path)  # the full load writes it anew: the helper's path is back
    assert LightTokenizer.cached(smollm2_path) is not None


def test_a_broken_helper_means_encoding_here(tmp_path, smollm2_path):
    folder = tmp_path / "tok"
    shutil.copytree(load_tokenizer(smollm2_path).folder, folder)
    (folder / "tokenizer.json").write_text("{not json")
    assert PromptEncoder(folder, "Hello", None).ids() is None


def run_generate(*args: str, helper: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", SPECDEC_TOKENIZER_HELPER="1" if helper else "0")
    return subprocess.run([sys.executable, "-m", "specdec", "generate", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_generate_with_the_helper_is_generate_without_it(tmp_path, model, gemma_path):
    """The same tokens and text with the prompt encoded beside the load as in-process; the summary line says the
    helper was used (its wait), and only then. The run without it goes first: its full tokenizer load writes the
    decode table the helper's run needs."""
    outs = {}
    for helper in (False, True):
        js = tmp_path / f"{helper}.json"
        r = run_generate("-m", model, "-p", "Name three colors, in French.", "--chat", "-sys", "Be brief.", "-n", "24",
                         "--temp", "0", "--json", str(js), helper=helper)
        assert r.returncode == 0, r.stderr
        assert ("waiting for the prompt's encoder" in r.stderr) == helper
        result = json.loads(js.read_text())
        outs[helper] = (result["tokens"], result["text"], r.stdout)
    assert outs[True] == outs[False]


def test_no_helper_on_one_core(monkeypatch, smollm2_path):
    """With one usable CPU the helper would only compete with the load: generate encodes in-process."""
    from types import SimpleNamespace

    from specdec import cli

    load_tokenizer(smollm2_path)  # the decode table exists
    args = SimpleNamespace(model=str(smollm2_path), chat=False, system=None)
    monkeypatch.setattr(cli, "usable_cpus", lambda: 2)
    early = cli.early_prompt(args, "Hello")
    assert early is not None and early[1].ids() == load_tokenizer(smollm2_path).encode("Hello")
    monkeypatch.setattr(cli, "usable_cpus", lambda: 1)
    assert cli.early_prompt(args, "Hello") is None
