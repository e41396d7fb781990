"""`specdec generate` without loading the `tokenizers` vocabulary in its own process: the prompt is encoded by a helper
process while this one imports torch and maps the weights, and the output is decoded from a table of token texts.

Building a `tokenizers.Tokenizer` from Gemma 3's 262k-token tokenizer.json takes ~0.8 s and keeps ~92 MB, holding
the GIL throughout (a thread cannot overlap it with torch's import), and `generate` needs it for one encode (the
prompt) and for decoding. So a generate run starts a helper process first (PromptEncoder: it builds the same
Tokenizer, renders the chat template and encodes, exactly as in-process, then exits) and goes on importing torch and
mapping the weights on the other core; decoding reads a table of every token's text (written beside the cached
tokenizer.json on the first full load) and runs the vocabulary's own decoder chain (VocabDecoder: GPT-2 byte-level,
or SentencePiece's Replace / ByteFallback / Fuse), which tests compare with `tokenizers` on every token and on
random sequences. Anything else (a later encode, the backend) loads the full tokenizer on first use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .config import ModelError, release_freed_memory
from .tokenizer import Tokenizer, _file_key, cache_dir

TABLE_VERSION = 1
TABLE = f"decode-table-v{TABLE_VERSION}.json"  # a new version writes a new file beside the old one
SIMPLE_DECODERS = ("Replace", "ByteFallback", "Fuse")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (Radford et al. 2019; `tokenizers`' ByteLevel decoder inverts it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def decoder_chain(spec: dict | None) -> list[dict] | None:
    """The decoder steps VocabDecoder runs for a tokenizer.json "decoder" entry, or None when it has one it does not
    know (then the full tokenizer decodes)."""
    if not spec:
        return None
    steps = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        return steps
    for s in steps:
        if s.get("type") not in SIMPLE_DECODERS or (s["type"] == "Replace" and "String" not in s.get("pattern", {})):
            return None
    return steps


class VocabDecoder:
    """ids -> text from the tokens' texts, as `tokenizers`' decode: added tokens and the model's tokens alike go
    through the decoder chain, special ones dropped when asked."""

    def __init__(self, tokens: Sequence[str], special: set[int], chain: list[dict]):
        self.tokens, self.special, self.chain = tokens, special, chain
        self.byte_level = _byte_level_chars() if chain[0]["type"] == "ByteLevel" else None
        self.token_bytes: dict[int, bytes] = {}  # byte-level: each token's bytes, made at its first use

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        n = len(self.tokens)
        ids = [i for i in ids if 0 <= i < n and not (skip_special_tokens and i in self.special)]
        if self.byte_level is not None:  # the stream decoder asks twice a step: bytes made once per token
            return b"".join(self.token_bytes.get(i) or self._bytes(i) for i in ids).decode("utf-8", "replace")
        toks = [self.tokens[i] for i in ids]
        for step in self.chain:
            toks = getattr(self, "_" + step["type"].lower())(toks, step)
        return "".join(toks)

    def _bytes(self, i: int) -> bytes:
        t = self.tokens[i]
        try:
            b = bytes(self.byte_level[c] for c in t)
        except KeyError:  # a token outside the alphabet (an added one) stands for its own UTF-8
            b = t.encode()
        self.token_bytes[i] = b
        return b

    @staticmethod
    def _replace(toks: list[str], step: dict) -> list[str]:
        return [t.replace(step["pattern"]["String"], step["content"]) for t in toks]

    @staticmethod
    def _bytefallback(toks: list[str], step: dict) -> list[str]:
        """Runs of <0xHH> tokens become their UTF-8 text, or one U+FFFD per byte when they are not valid UTF-8."""
        out: list[str] = []
        run = bytearray()
        for t in [*toks, None]:
            if t is not None and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                try:
                    run.append(int(t[3:5], 16))
                    continue
                except ValueError:
                    pass
            if run:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.extend("\ufffd" * len(run))
                run.clear()
            if t is not None:
                out.append(t)
        return out

    @staticmethod
    def _fuse(toks: list[str], step: dict) -> list[str]:
        return ["".join(toks)]


def write_table(tok: Tokenizer) -> None:
    """Write the decode table beside a cached tokenizer.json (once; nothing when its decoder is not one
    VocabDecoder knows, or the folder cannot be written)."""
    path = tok.folder / TABLE
    try:
        spec = json.loads(tok.backend.decoder.__getstate__()) if tok.backend.decoder is not None else None
    except (AttributeError, TypeError, ValueError):  # a decoder this `tokenizers` does not serialize so
        return
    if path.exists() or decoder_chain(spec) is None:
        return
    tokens = tok.vocab_texts()
    special = sorted(i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special)
    table = {"version": TABLE_VERSION, "tokens": tokens, "special": special, "decoder": spec,
             "bos_token": tok.bos_token, "eos_token": tok.eos_token, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
             "eog_ids": sorted(tok.eog_ids), "chat_template": tok.chat_template, "model_kind": tok.model_kind}
    try:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass


class LightTokenizer(Tokenizer):
    """A Tokenizer whose decode needs no `tokenizers` vocabulary (VocabDecoder); encoding and the backend load the
    full tokenizer on first use."""

    def __init__(self, folder: Path, table: dict):
        self.folder = folder
        self.chat_template = table["chat_template"]
        self.bos_token, self.eos_token = table["bos_token"], table["eos_token"]
        self.bos_id, self.eos_id = table["bos_id"], table["eos_id"]
        self.eog_ids = set(table["eog_ids"])
        self.vocab_size = len(table["tokens"])
        self.kind = table["model_kind"]
        self.decoder = VocabDecoder(table["tokens"], set(table["special"]), decoder_chain(table["decoder"]))
        self._full: Tokenizer | None = None
        self.load_s = 0.0  # seconds to read the table (cached())

    @classmethod
    def cached(cls, model_path: Path) -> LightTokenizer | None:
        """The light tokenizer of a GGUF file whose tokenizer was converted and its decode table written, else None."""
        t0 = time.perf_counter()
        if model_path.is_dir() or not model_path.is_file():
            return None
        folder = cache_dir() / "tokenizers" / _file_key(model_path)
        try:
            table = json.loads((folder / TABLE).read_text(encoding="utf-8"))
            if table.get("version") != TABLE_VERSION or decoder_chain(table.get("decoder")) is None:
                raise ValueError("not a decode table of this version")
            light = cls(folder, table)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError):
            # a damaged table: the full tokenizer this time, and removed so that its next load writes it anew
            (folder / TABLE).unlink(missing_ok=True)
            return None
        light.load_s = time.perf_counter() - t0
        return light

    @property
    def model_kind(self) -> str:
        return self.kind

    @property
    def backend(self):
        if self._full is None:
            self._full = Tokenizer(self.folder)
        return self._full.backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decoder.decode(ids, skip_special_tokens)

    def vocab_texts(self) -> list[str]:
        return list(self.decoder.tokens)


class PromptEncoder:
    """One prompt's token ids, encoded by a helper process (`python -m specdec.light_tokenizer FOLDER`) that builds the
    full Tokenizer of FOLDER: started before torch is imported, it runs on the other core while this process loads."""

    def __init__(self, folder: Path, text: str, messages: list[dict] | None):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])  # this checkout's specdec, whatever sys.path found it by
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        request = json.dumps({"messages": messages} if messages is not None else {"text": text})
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "specdec.light_tokenizer", str(folder)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, encoding="utf-8")
        except OSError:
            self.proc = None
            return
        # the request goes now, so the helper encodes and exits (its ~190 MB freed) as soon as its tokenizer is
        # built, while this process is still importing torch; a thread writes it, as a long prompt fills the pipe
        threading.Thread(target=self._send, args=(request,), daemon=True).start()

    def _send(self, request: str) -> None:
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.close()
        except (OSError, ValueError):  # the helper died: ids() says so
            pass

    def ids(self) -> list[int] | None:
        """The ids; None when the helper failed (the caller encodes in-process). A template error is raised."""
        if self.proc is None:
            return None
        try:
            out = self.proc.stdout.read()
            self.proc.wait(timeout=60)
            reply = json.loads(out)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            return None
        if "error" in reply:
            raise ModelError(reply["error"])
        return reply.get("ids")


def _encode_worker(folder: str) -> int:
    """The helper's work: build the tokenizer first (the slow part, while the caller loads), then read the request
    from stdin and write {"ids": [...]} or {"error": "..."} to stdout."""
    tok = Tokenizer(Path(folder))
    request = json.loads(sys.stdin.read())
    try:
        ids = tok.encode_chat(request["messages"]) if "messages" in request else tok.encode(request["text"])
        reply: dict = {"ids": ids}
    except ModelError as e:
        reply = {"error": str(e)}
    del tok
    release_freed_memory()  # a reply longer than the pipe holds waits for the caller: not with the vocabulary
    sys.stdout.write(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(_encode_worker(sys.argv[1]))
