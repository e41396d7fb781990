"""Tokenizer and chat template, from a GGUF file's metadata or a Hugging Face folder's tokenizer.json.

A GGUF carries its vocabulary as metadata. Hugging Face transformers already knows how to turn that into a
`tokenizers` tokenizer (``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)``), so we let it do the
conversion once and cache the result as a tokenizer.json (the conversion of a 262k-token Gemma vocabulary takes ~4 s;
loading the cached file takes ~1 s). At run time only the fast `tokenizers` library and jinja2 are used, so encoding is
Hugging Face's token for token, and chat templates render as transformers renders them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from .config import ModelError, cache_dir, release_freed_memory

# Gemma GGUFs converted without a template: the official Gemma 3 chat template (system folded into the first turn).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# ChatML, for vocabularies that have its markers but ship no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# texts of control tokens that end a turn in the chat formats we know (llama.cpp treats these as end-of-generation)
EOG_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "</s>",
             "<|end_of_text|>", "<eos>", "<|return|>")


def _render_template(template: str, messages: Sequence[dict], **kwargs) -> str:
    """Render a chat template the way transformers does (sandboxed jinja2, trim/lstrip blocks, tojson)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=list(messages), **kwargs)


class Tokenizer:
    """Encode / decode / chat template over a `tokenizers.Tokenizer`, plus the special ids generation needs."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as FastTokenizer

        self.folder = folder
        self.backend = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))
        tmpl_path = folder / "chat_template.jinja"
        if self.chat_template is None and tmpl_path.exists():
            self.chat_template = tmpl_path.read_text()
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self.backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        added = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        self.eog_ids: set[int] = {i for i in (self.eos_id,) if i is not None}
        for text in EOG_TEXTS:
            tid = self.backend.token_to_id(text)
            if tid is not None and text in added:
                self.eog_ids.add(tid)
        if self.chat_template is None:
            if self.backend.token_to_id("<start_of_turn>") is not None:
                self.chat_template = GEMMA_TEMPLATE
            elif self.backend.token_to_id("<|im_start|>") is not None:
                self.chat_template = CHATML_TEMPLATE

    @property
    def model_kind(self) -> str:
        """The tokenizer model's kind ("BPE", "Unigram", ...): vocabularies of different kinds never match."""
        return type(self.backend.model).__name__

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS where the tokenizer adds it (as Hugging Face's `tok(text)` does)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template."""
        if self.chat_template is None:
            raise ModelError("this model has no chat template: run without --chat, or give a model that ships one")
        return _render_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation: the template writes BOS itself, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def vocab_texts(self) -> list[str]:
        """Every token's text, by id (for comparing the vocabularies of a target and its draft)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        texts = [""] * self.vocab_size
        for text, i in vocab.items():
            if i < len(texts):
                texts[i] = text
        return texts


def _token_text(tok: str | dict | None) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class StreamDecoder:
    """Incremental detokenization: emits text only once it is complete (no half UTF-8 characters).

    Decodes a short window of tokens before the new ones so that tokenizers whose decoding depends on the previous
    token (sentencepiece's leading space) still give the same text as decoding everything at once.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens whose text was already emitted

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix:], self.skip)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


# the cached tokenizer.json's format (bumped when _compact_tokenizer_json changes what it writes)
TOKENIZER_CACHE_VERSION = 2


def _file_key(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{TOKENIZER_CACHE_VERSION}"
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def _compact_tokenizer_json(path: Path) -> None:
    """Rewrite a tokenizer.json so that `tokenizers` loads it with less memory and time: BPE merges as "a b" strings
    (the library's older merges format, still read; the pair form costs a list per merge while parsing) when no
    merged token contains a space, and no indentation. The tokenizer it describes is the same (to_str() equal,
    tests/test_tokenizer.py::test_compact_json_is_the_same_tokenizer). Gemma 3's 262k-token vocabulary: loaded
    in 0.94 s instead of 1.24 s within `specdec generate`, from_file alone peaks at 185 MB instead of 380
    (docs/results/tokenizer-convert-1206b.txt)."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    merges = model.get("merges")
    if model.get("type") == "BPE" and merges and all(
            isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(spec, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file (converted once, then cached) or of a Hugging Face folder."""
    path = Path(model_path)
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            raise ModelError(f"{path} has no tokenizer.json: copy the model's tokenizer files into the folder")
        return Tokenizer(path)
    folder = cache_dir() / "tokenizers" / _file_key(path)
    if not (folder / "tokenizer.json").exists():
        folder = _convert_gguf_tokenizer(path, folder)
    tok = Tokenizer(folder)
    from .light_tokenizer import write_table

    write_table(tok)  # once: what `specdec generate` decodes with, without this vocabulary (light_tokenizer.py)
    release_freed_memory()  # the transient JSON tree (config.release_freed_memory)
    return tok


def _convert_gguf_tokenizer(path: Path, folder: Path) -> Path:
    """Convert a GGUF vocabulary with transformers and save it as tokenizer.json (written atomically) -> the folder
    holding it (a temporary one when the cache cannot be written)."""
    import logging
    import shutil
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import PreTrainedTokenizerFast  # TokenizersBackend in transformers 5, the same class
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        # the tokenizer class itself, not AutoTokenizer: AutoTokenizer first builds the model's config from the file
        # (a second full parse of the vocabulary, 20 s of Gemma 3's 24 s, docs/results/tokenizer-convert-1206b.txt)
        # only to pick a class, and fails on architectures transformers cannot load (deepseek2, glm4moe); the
        # tokenizer built is the same (tests/test_tokenizer.py::test_conversion_equals_auto)
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds here; all mean "this vocabulary can't be converted"
        why = " ".join(str(e).split())[:200]
        raise ModelError(f"cannot read the tokenizer of {path} ({type(e).__name__}: {why}): give a GGUF that carries "
                         "its vocabulary, or a Hugging Face folder with its tokenizer.json") from e
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    except OSError as e:  # no writable cache: convert into a temporary folder, used this once
        print(f"specdec: cannot cache the tokenizer in {folder.parent} ({e.strerror or e}); converting it for this "
              "run only", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp())
        folder = tmp
    tok.save_pretrained(str(tmp))
    _compact_tokenizer_json(tmp / "tokenizer.json")
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.setdefault("bos_token", tok.bos_token)
    cfg.setdefault("eos_token", tok.eos_token)
    if tok.chat_template and not cfg.get("chat_template") and not (tmp / "chat_template.jinja").exists():
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=1))
    if tmp == folder:
        return folder
    try:
        tmp.rename(folder)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
