"""OpenAI request parsing and validation (chat completions, completions), and OpenAI's error bodies.

Every request body is checked here, field by field, before anything reaches the engine: a malformed or hostile
request becomes an `APIError` (a 4xx with OpenAI's body {"error": {"message", "type", "param", "code"}}), never a
500 (the official openai client retries 5xx). Unknown fields are ignored, as OpenAI-compatible servers do (clients
send many); known features this server does not implement (tools, response_format, best_of, ...) are refused with a
400 that names the field. Sampling defaults are llama-server's; llama-server's extensions `top_k`, `min_p`,
`repeat_penalty`, `repeat_last_n`, `ignore_eos` and the per-request `speculative` object are understood.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams
from ..spec.config import MAX_DRAFT, SPEC_KINDS

# llama-server's sampling defaults (common/common.h), used when a request does not say
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
            "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; chat front-ends send a few more)
MAX_STOP_CHARS = 256  # a stop string this long already holds back that much streamed text
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 1024
MAX_N = 16  # choices per request (n): each its own sequence in the engine, all admitted together
SPEC_N_MAX = MAX_DRAFT  # per-request speculative.n_max is clamped to [0, SPEC_N_MAX], n_min to [0, n_max]
# llama.cpp's --spec-type names, mapped onto specdec's proposers
SPEC_ALIASES = {"draft-simple": "draft", "draft-mtp": "mtp", "ngram-simple": "ngram", "ngram-map-k": "ngram",
                "ngram-map-k4v": "ngram", "ngram-mod": "ngram", "ngram-cache": "ngram"}
ROLES = ("system", "user", "assistant", "developer")


class APIError(Exception):
    """An error answered in OpenAI's shape: HTTP status, message, type, param and code."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
             500: "server_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # echoed input may hold surrogates
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.TYPES.get(self.status, "invalid_request_error"), self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class SpecRequest:
    """A request's `speculative` object (llama-server's extension), already clamped; None fields: the server's."""

    kind: str | None = None
    n_max: int | str | None = None
    n_min: int | None = None
    p_min: float | None = None


@dataclass
class GenRequest:
    """One validated generation request, in the engine's terms."""

    kind: str  # "chat" or "completion"
    model: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (0 = only the chosen token's), None = off
    ignore_eos: bool = False
    spec: SpecRequest = field(default_factory=SpecRequest)
    n: int = 1  # choices: sequences of the same prompt, choice i seeded with seed + i when a seed is given


@dataclass
class ModelContext:
    """What validation needs to know about the served model."""

    model_id: str
    names: frozenset[str]  # every name a request may use for it
    ctx: int  # context window per request (prompt + completion)
    vocab_size: int
    encode: Callable[[str], list[int]]  # completion prompts (BOS as the tokenizer adds it)
    encode_chat: Callable[[list[dict]], list[int]]
    spec_kinds: tuple[str, ...] = ("none", "ngram")  # proposers this server can build for a request
    max_token_chars: int = 0  # the longest token's text: a prompt of c characters has at least c / it tokens

    def refuse_hopeless(self, chars: int, name: str) -> None:
        """A 400 for a prompt whose characters alone make it longer than the context (each token covers at most
        max_token_chars of them; twice that, for normalizers that drop characters), before it is tokenized: an
        8 MB prompt took 7 s to tokenize, holding the interpreter's lock, while the server answered nothing else."""
        if self.max_token_chars and chars > 2 * self.ctx * self.max_token_chars:
            raise bad(f"This model's maximum context length is {self.ctx} tokens. However, your prompt has "
                      f"{chars} characters, at least {chars // self.max_token_chars} tokens: shorten it (or start "
                      "the server with a larger -c)", name, "context_length_exceeded")


# ----------------------------------------------------------------------------------------------------------------
# JSON bodies

def parse_json(raw: bytes, content_type: str | None) -> dict:
    """The request body as a JSON object: 415 for another content type, 400 for bytes that are not UTF-8 JSON."""
    if content_type:
        media = content_type.split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"unsupported content type '{media}': send application/json", None,
                           "unsupported_media_type")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})", None, "invalid_json") from None
    if not text.strip():
        raise bad("the request body is empty: send a JSON object", None, "invalid_json")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None,
                  "invalid_json") from None
    except (ValueError, RecursionError) as e:  # NaN / Infinity, a number too long, nesting too deep
        raise bad(f"the request body is not valid JSON: {str(e)[:100]}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {_type(body)}", None, "invalid_type")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _wrong(name: str, want: str, v: Any) -> APIError:
    return bad(f"'{name}' must be {want}, not {_type(v)}", name, "invalid_type")


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _wrong(name, "a boolean", v)
    return v


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None,
            shown: str | None = None) -> int | None:
    shown = shown or name
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            v = int(v)
        else:
            raise _wrong(shown, "an integer", v)
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad(f"'{shown}' must be {_range(lo, hi)}, not {v}", shown)
    return v


def get_float(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, shown: str | None = None) -> float:
    shown = shown or name
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _wrong(shown, "a number", v)
    v = float(v)
    if not math.isfinite(v) or (lo is not None and (v < lo or lo_open and v == lo)) or (hi is not None and v > hi):
        raise bad(f"'{shown}' must be {_range(lo, hi, lo_open)}, not {v:g}", shown)
    return v


def _range(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    return f"<= {_num(hi)}"


def _num(x: float) -> str:
    """A bound as people write it: integers whole (2147483647, not 2.14748e+09)."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _check_text(s: str, name: str) -> str:
    """Refuse strings that cannot be encoded (lone surrogates from JSON escapes like \\ud800)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{name}' holds a lone UTF-16 surrogate: it is not valid Unicode text", name) from None
    return s


# ----------------------------------------------------------------------------------------------------------------
# the two generation endpoints

def parse_chat(body: dict, m: ModelContext) -> GenRequest:
    """POST /v1/chat/completions -> GenRequest (the prompt rendered with the model's chat template)."""
    _refuse_unsupported(body, chat=True)
    model = _model(body, m)
    messages = _messages(body.get("messages"))
    m.refuse_hopeless(sum(len(x["content"]) for x in messages), "messages")
    try:
        prompt = m.encode_chat(messages)
    except Exception as e:  # a template's raise_exception (e.g. roles out of order) or a renderer error
        raise bad(f"the chat template cannot render these messages: {str(e)[:200]}", "messages") from None
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    limit = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    return _common(body, m, "chat", model, prompt, limit, (top or 0) if logprobs else None)


def parse_completion(body: dict, m: ModelContext) -> GenRequest:
    """POST /v1/completions -> GenRequest (prompt: text, or token ids)."""
    _refuse_unsupported(body, chat=False)
    model = _model(body, m)
    prompt = _prompt(body.get("prompt"), m)
    logprobs = get_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return _common(body, m, "completion", model, prompt, _max_tokens(body, "max_tokens"), logprobs)


def _common(body: dict, m: ModelContext, kind: str, model: str, prompt: list[int], max_tokens: int | None,
            logprobs: int | None) -> GenRequest:
    n = len(prompt)
    if n == 0:
        raise bad("the prompt is empty: give some text", "messages" if kind == "chat" else "prompt")
    if n >= m.ctx:
        raise bad(f"This model's maximum context length is {m.ctx} tokens. However, your prompt is {n} tokens, "
                  "which leaves no room for a completion: shorten it (or start the server with a larger -c)",
                  "messages" if kind == "chat" else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = m.ctx - n  # llama-server's n_predict = -1: until the context is full
    elif n + max_tokens > m.ctx:
        raise bad(f"This model's maximum context length is {m.ctx} tokens. However, you requested "
                  f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
                  "the prompt or the completion length", "max_tokens", "context_length_exceeded")
    stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _wrong("stream_options", "an object", opts)
    include_usage = stream and get_bool(opts or {}, "include_usage")
    return GenRequest(kind=kind, model=model, prompt=prompt, params=_sampling(body, m), max_tokens=max_tokens,
                      stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage, logprobs=logprobs,
                      ignore_eos=get_bool(body, "ignore_eos"), spec=_speculative(body, m),
                      n=get_int(body, "n", 1, 1, MAX_N))


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """A 400 naming each known OpenAI feature this server does not implement (when the request really uses it)."""
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad("'best_of' other than 1 is not supported", "best_of", "unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(f"'{name}' is not supported: this server does not implement tool calling", name,
                      "unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise bad(f"'{name}' is not supported: this server does not implement tool calling", name,
                      "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("'response_format' is not supported (structured output): send plain text requests",
                  "response_format", "unsupported_parameter")
    for name in ("json_schema", "grammar"):
        if body.get(name):
            raise bad(f"'{name}' is not supported (constrained generation)", name, "unsupported_parameter")
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise bad("'modalities' other than [\"text\"] are not supported: this server generates text only",
                  "modalities", "unsupported_parameter")
    if body.get("audio") is not None:
        raise bad("'audio' output is not supported", "audio", "unsupported_parameter")
    if not chat:
        if body.get("echo"):
            raise bad("'echo' is not supported", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise bad("'suffix' (insertion) is not supported", "suffix", "unsupported_parameter")


def _model(body: dict, m: ModelContext) -> str:
    name = body.get("model")
    if name is None or name == "":
        return m.model_id
    if not isinstance(name, str):
        raise _wrong("model", "a string", name)
    if name not in m.names:
        raise APIError(404, f"The model '{name[:200]}' does not exist: this server serves '{m.model_id}'", "model",
                       "model_not_found")
    return name


def _max_tokens(body: dict, name: str) -> int | None:
    return get_int(body, name, None, 1)


def _messages(messages: Any) -> list[dict]:
    if messages is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _wrong("messages", "an array of messages", messages)
    if not messages:
        raise bad("'messages' is empty: give at least one message", "messages", "empty_array")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _wrong(where, "an object with 'role' and 'content'", msg)
        role = msg.get("role")
        if role in ("tool", "function") or msg.get("tool_calls") or msg.get("function_call"):
            raise bad(f"{where}: tool messages and tool calls are not supported (no tool calling)", f"{where}.role",
                      "unsupported_parameter")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{where}.role must be one of system, user, assistant, developer, not "
                      f"{json.dumps(role)[:50] if isinstance(role, str) else _type(role)}", f"{where}.role")
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(content, f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's array of content parts (text parts only)."""
    if isinstance(content, str):
        return _check_text(content, where)
    if not isinstance(content, list):
        raise _wrong(where, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _wrong(at, "a content part object", part)
        kind = part.get("type")
        if kind != "text":
            if kind in ("image_url", "input_audio", "file", "image", "audio", "input_image"):
                raise bad(f"{at}: '{kind}' content is not supported: this model takes text only", f"{at}.type",
                          "unsupported_content_type")
            raise bad(f"{at}.type must be 'text', not {json.dumps(kind)[:50]}", f"{at}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise _wrong(f"{at}.text", "a string", text)
        texts.append(_check_text(text, f"{at}.text"))
    return "\n".join(texts)


def _prompt(prompt: Any, m: ModelContext) -> list[int]:
    """A completion prompt: a string, token ids, or a one-element array of either (several prompts: 400)."""
    if prompt is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise bad(f"'prompt' holds {len(prompt)} prompts: this server takes one prompt per request", "prompt",
                      "unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        m.refuse_hopeless(len(prompt), "prompt")
        return m.encode(_check_text(prompt, "prompt"))
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt", m.vocab_size)
    raise _wrong("prompt", "a string or an array of token ids", prompt)


def _token_ids(ids: list, name: str, vocab: int) -> list[int]:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(f"'{name}'[{i}] must be a token id (an integer), not {_type(t)}", name, "invalid_type")
        if not 0 <= t < vocab:
            raise bad(f"'{name}'[{i}] = {t} is not a token id of this model (0..{vocab - 1})", name)
    return list(ids)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _wrong("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP:
        raise bad(f"'stop' has {len(stop)} strings: at most {MAX_STOP} are allowed", "stop")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise _wrong(f"stop[{i}]", "a string", s)
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"stop[{i}] is {len(s)} characters long: at most {MAX_STOP_CHARS}", "stop")
        _check_text(s, f"stop[{i}]")
    return tuple(s for s in stop if s)


def _sampling(body: dict, m: ModelContext) -> SamplingParams:
    seed = get_int(body, "seed", None, -(2**63), 2**63 - 2)
    top_k = get_int(body, "top_k", DEFAULTS["top_k"], -1, 2**31 - 1)
    params = SamplingParams(
        temperature=get_float(body, "temperature", DEFAULTS["temperature"], 0.0, 100.0),
        top_k=max(top_k, 0),  # -1 (vLLM) and 0 (llama.cpp) both mean off
        top_p=get_float(body, "top_p", DEFAULTS["top_p"], 0.0, 1.0, lo_open=True),
        min_p=get_float(body, "min_p", DEFAULTS["min_p"], 0.0, 1.0),
        seed=None if seed is None or seed < 0 else seed,  # llama-server: -1 = random
        repetition_penalty=get_float(body, "repeat_penalty", DEFAULTS["repeat_penalty"], 0.0, 100.0, lo_open=True),
        repeat_last_n=get_int(body, "repeat_last_n", DEFAULTS["repeat_last_n"], -1, 2**31 - 1),
        presence_penalty=get_float(body, "presence_penalty", DEFAULTS["presence_penalty"], -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", DEFAULTS["frequency_penalty"], -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias"), m.vocab_size))
    try:
        params.validate()  # the engine's own check, so nothing that passed here fails at admission
    except ValueError as e:
        raise bad(str(e)) from None
    return params


def _logit_bias(bias: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _wrong("logit_bias", "an object mapping token ids to biases", bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' has {len(bias)} entries: at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = []
    for key, v in bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad(f"logit_bias key {json.dumps(key)[:40]} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab:
            raise bad(f"logit_bias key {tok} is not a token id of this model (0..{vocab - 1})", "logit_bias")
        b = get_float({"b": v}, "b", 0.0, -100.0, 100.0, shown=f"logit_bias[{key}]")
        out.append((tok, b))
    return tuple(out)


def _speculative(body: dict, m: ModelContext) -> SpecRequest:
    """llama-server's per-request speculative settings: {"speculative": {type, n_max, n_min, p_min}} or the flat
    "speculative.n_max" keys; n_max clamped to [0, SPEC_N_MAX], n_min to [0, n_max], p_min to [0, 1] (llama-server
    clamps these rather than refusing them)."""
    spec = body.get("speculative")
    if spec is None:
        spec = {k.split(".", 1)[1]: v for k, v in body.items() if k.startswith("speculative.")}
    elif not isinstance(spec, dict):
        raise _wrong("speculative", "an object", spec)
    kind = spec.get("type")
    if kind is not None:
        if not isinstance(kind, str):
            raise _wrong("speculative.type", "a string", kind)
        kind = SPEC_ALIASES.get(kind, kind)
        if kind not in SPEC_KINDS:
            raise bad(f"speculative.type '{kind[:40]}' is unknown: use {', '.join(SPEC_KINDS)}", "speculative.type")
        if kind not in m.spec_kinds:
            raise bad(f"speculative.type '{kind}' is not available on this server (available: "
                      f"{', '.join(m.spec_kinds)}; draft needs -md, mtp needs MTP heads)", "speculative.type")
    n_max = spec.get("n_max")
    if n_max != "auto":
        n_max = get_int(spec, "n_max", None, shown="speculative.n_max")
        n_max = None if n_max is None else min(max(n_max, 0), SPEC_N_MAX)
    n_min = get_int(spec, "n_min", None, shown="speculative.n_min")
    if n_min is not None:
        n_min = max(0, min(n_min, n_max if isinstance(n_max, int) else SPEC_N_MAX))
    p_min = spec.get("p_min")
    if p_min is not None:
        if isinstance(p_min, bool) or not isinstance(p_min, int | float) or not math.isfinite(p_min):
            raise _wrong("speculative.p_min", "a number", p_min)
        p_min = min(max(float(p_min), 0.0), 1.0)
    return SpecRequest(kind, n_max, n_min, p_min)


# ----------------------------------------------------------------------------------------------------------------
# /tokenize and /detokenize

def parse_tokenize(body: dict) -> tuple[str, bool, bool]:
    """(content, add_special, with_pieces) of a POST /tokenize body (llama-server's fields)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise _wrong("content", "a string", content)
    return _check_text(content, "content"), get_bool(body, "add_special"), get_bool(body, "with_pieces")


def parse_detokenize(body: dict, vocab: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _wrong("tokens", "an array of token ids", tokens)
    return _token_ids(tokens, "tokens", vocab)


__all__ = ["APIError", "DEFAULTS", "GenRequest", "ModelContext", "SpecRequest", "error_body", "parse_chat",
           "parse_completion", "parse_detokenize", "parse_json", "parse_tokenize"]
