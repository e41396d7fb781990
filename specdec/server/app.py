"""The HTTP API (FastAPI): OpenAI's chat completions and completions, streaming and not, and llama-server's
side endpoints.

POST /v1/chat/completions, /v1/completions (also without /v1), GET /v1/models, GET /health (503 while the model
loads, 200 after), GET /metrics (Prometheus text), POST /tokenize, POST /detokenize, GET /props (defaults, slots,
model, chat template), GET /slots. Streams are server-sent events (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`)
shaped as OpenAI's chunks: one id per response, the role first, finish_reason last, then an optional usage chunk;
an error after the stream started goes out as `data: {"error": ...}` before [DONE]. Every refusal is OpenAI's error
body with a 4xx (503 with Retry-After while loading or when the queue is full); with --api-key every endpoint but
/health and /v1/models wants `Authorization: Bearer KEY`.

The model loads in a background thread once the HTTP server is up (create_app's `load`), so /health answers 503
until it is ready; generation runs on the scheduler's engine thread, and the event loop only parses, tokenizes (in
a worker thread) and streams.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import secrets
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .scheduler import Backend, Job, Scheduler, Update
from .schemas import (
    DEFAULTS,
    SPEC_N_MAX,
    APIError,
    GenRequest,
    ModelContext,
    error_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)

MAX_BODY = 8 * 2**20  # bytes; a larger body is refused (413) before it is read whole
FINGERPRINT = "specdec"
PUBLIC = ("/health", "/v1/health", "/v1/models", "/models")  # no API key needed (as llama-server)


@dataclass
class ServerConfig:
    """The server's knobs (llama-server's names): slots, queue bound, API key; threads for the engine thread
    (default: the creating thread's torch thread count)."""

    parallel: int = 4
    max_queue: int | None = None  # default 4 x parallel
    api_key: str | None = None
    threads: int | None = None
    prompt_cache: bool = True  # llama-server's cache_prompt: a request whose prompt begins with a finished one's text


class State:
    """Loading status, then the backend, its scheduler and what validation needs."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics()
        self.backend: Backend | None = None
        self.scheduler: Scheduler | None = None
        self.mctx: ModelContext | None = None
        self.error: str | None = None
        self.created = int(time.time())

    def ready(self) -> Scheduler:
        if self.scheduler is None:
            if self.error:
                raise APIError(503, f"the model failed to load: {self.error}", None, "load_failed")
            raise APIError(503, "Loading model", None, "loading", {"Retry-After": "1"})
        return self.scheduler


def create_app(load: Callable[[], Backend], config: ServerConfig | None = None,
               on_ready: Callable[[Backend], None] | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app. `load()` builds the Backend (loads the models); it runs in a background thread started with
    the app, so the server answers /health (503) while it loads."""
    config = config or ServerConfig()
    threads = config.threads or torch.get_num_threads()
    state = State(config)

    def load_in_background() -> None:
        torch.set_num_threads(threads)
        try:
            backend = load()
            sched = Scheduler(backend, config.parallel, config.max_queue, state.metrics, threads, config.prompt_cache)
            state.mctx = model_context(backend, sched.ctx)
            state.backend = backend
            sched.start()
            state.scheduler = sched
        except BaseException as e:  # noqa: B036 - reported, and the server keeps answering 503
            state.error = str(e) or type(e).__name__
            if on_error is not None:
                on_error(e)
            else:
                traceback.print_exc(file=sys.stderr)
            return
        if on_ready is not None:
            on_ready(backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=load_in_background, name="specdec-load", daemon=True)
        loader.start()
        yield
        if state.scheduler is not None:
            await run_in_threadpool(state.scheduler.stop)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    _install_error_handlers(app, state)

    def auth(request: Request) -> None:
        key = config.api_key
        if not key or request.url.path in PUBLIC or request.url.path.startswith(("/v1/models/", "/models/")):
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), key.encode()):
            state.metrics.rejected.labels(status="401").inc()
            what = "Invalid API key" if token else "Malformed Authorization header" if given else "Missing API key"
            raise APIError(401, f"{what}: send 'Authorization: Bearer KEY'", None, "invalid_api_key")

    # --- generation -------------------------------------------------------------------------------------------------

    async def generation(request: Request, parse) -> Response:
        auth(request)
        sched = state.ready()
        body = await read_body(request)
        req: GenRequest = await run_in_threadpool(parse, body, state.mctx)
        jobs = sched.submit([choice_request(req, i) for i in range(req.n)], asyncio.get_running_loop())
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        fmt = Formatter(state.backend.target.tokenizer, req, rid)
        if req.stream:
            return StreamingResponse(stream(jobs, fmt), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(request, jobs, fmt)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, parse_chat)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, parse_completion)

    # --- side endpoints ----------------------------------------------------------------------------------------------

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        state.ready()
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        sched = state.ready()
        b = state.backend
        meta = {"n_ctx": sched.ctx, "n_vocab": state.mctx.vocab_size, "speculative": b.spec.kind,
                "speculative_types": list(b.spec_kinds), "path": str(b.target.path)}
        return {"id": b.model_id, "object": "model", "created": state.created, "owned_by": "specdec", "meta": meta}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request) -> Response:
        auth(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    @app.get("/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        """One model (the openai client's models.retrieve), by any name a request may use for it."""
        auth(request)
        card = model_card()
        if model not in state.mctx.names:
            raise APIError(404, f"The model '{model[:100]}' does not exist: this server serves '{card['id']}'",
                           "model", "model_not_found")
        return JSONResponse(card)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        auth(request)
        if state.scheduler is not None:
            state.metrics.waiting.set(state.scheduler.queue_length)
        data, ctype = state.metrics.render()
        return Response(data, media_type=ctype)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        auth(request)
        state.ready()
        content, add_special, with_pieces = parse_tokenize(await read_body(request))
        tok = state.backend.target.tokenizer
        ids = await run_in_threadpool(tok.encode, content, add_special)
        if with_pieces:
            return JSONResponse({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
        return JSONResponse({"tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        auth(request)
        state.ready()
        ids = parse_detokenize(await read_body(request), state.mctx.vocab_size)
        text = await run_in_threadpool(state.backend.target.tokenizer.decode, ids)
        return JSONResponse({"content": text})

    @app.get("/props")
    async def props(request: Request) -> Response:
        auth(request)
        sched = state.ready()
        b, tok = state.backend, state.backend.target.tokenizer
        spec = b.spec
        busy = len(list(sched.running))
        params = {**DEFAULTS, "seed": -1, "n_predict": -1, "max_tokens": -1, "stop": [],
                  "ignore_eos": False, "n_probs": 0, "speculative.type": spec.kind,
                  "speculative.n_max": spec.draft_max, "speculative.n_min": spec.draft_min,
                  "speculative.p_min": spec.draft_p_min, "speculative.n_max_limit": SPEC_N_MAX}
        return JSONResponse({
            "default_generation_settings": {"n_ctx": sched.ctx, "speculative": spec.kind != "none",
                                            "params": params},
            "total_slots": sched.parallel, "slots_idle": sched.parallel - busy, "slots_processing": busy,
            "max_queue": sched.max_queue, "queue_length": sched.queue_length,
            "model": b.model_id, "model_path": str(b.target.path),
            "model_draft_path": str(b.draft.path) if b.draft is not None else None,
            "speculative_types": list(b.spec_kinds),
            "mtp": b.mtp[3] if b.mtp else None,
            "chat_template": tok.chat_template or "", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "modalities": {"vision": False, "audio": False}, "build_info": _version(), "is_sleeping": False})

    @app.get("/slots")
    async def slots(request: Request) -> Response:
        auth(request)
        sched = state.ready()
        by_slot = {j.seq.cache.slot: j for j in list(sched.running) if j.seq is not None and j.seq.cache}
        out = []
        for i in range(sched.parallel):
            j = by_slot.get(i)
            out.append({"id": i, "n_ctx": sched.ctx, "is_processing": j is not None,
                        "id_task": j.id if j else -1, "n_prompt_tokens": len(j.req.prompt) if j else 0,
                        "n_decoded": len(j.seq.out) if j else 0, "speculative": j.spec_kind if j else None})
        return JSONResponse(out)

    return app


def model_context(backend: Backend, ctx: int) -> ModelContext:
    tok = backend.target.tokenizer
    vocab = min(tok.vocab_size, backend.target.model.args.vocab_size)
    return ModelContext(model_id=backend.model_id, names=frozenset(backend.names | {backend.model_id}), ctx=ctx,
                        vocab_size=vocab, encode=tok.encode, encode_chat=tok.encode_chat,
                        spec_kinds=backend.spec_kinds, max_token_chars=max(map(len, tok.vocab_texts())))


async def read_body(request: Request) -> dict:
    """The JSON object of a request, at most MAX_BODY bytes (413 beyond)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise APIError(413, f"the request body is {int(length)} bytes: at most {MAX_BODY}", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is more than {MAX_BODY} bytes", None, "body_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks), request.headers.get("content-type"))


def choice_request(req: GenRequest, i: int) -> GenRequest:
    """Choice i of a request with n choices: its own sequence, seeded with seed + i when a seed is given (so each
    choice is the n = 1 request with that seed)."""
    seed = req.params.seed
    return req if i == 0 else replace(req, params=replace(req.params, seed=None if seed is None else
                                                          (seed + i) % 2**63))


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, Update]]:
    """(choice index, update) of every job as they come, until each job's last update."""
    queue: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        async for u in job.updates():
            queue.put_nowait((i, u))

    tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        for _ in jobs:
            while True:
                i, u = await queue.get()
                yield i, u
                if u.finish is not None or u.error is not None:
                    break
    finally:
        for t in tasks:
            t.cancel()


async def stream(jobs: list[Job], fmt: Formatter) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response (n choices: each chunk names its choice's index). Closing it (the
    client went away) cancels the request."""
    try:
        for i in range(len(jobs)):
            yield fmt.event(fmt.start(i))
        async for i, u in merged(jobs):
            if u.error is not None:
                kind, code = ("unavailable_error", "shutting_down") if u.status == 503 else ("server_error",
                                                                                          "internal_error")
                yield fmt.event(error_body(u.error, kind, None, code))
                break
            if u.finish == "abort":
                return
            if u.text or u.logprobs:
                yield fmt.event(fmt.delta(u.text, u.logprobs, i))
            if u.finish is not None:
                yield fmt.event(fmt.final(u.finish, jobs[i], i))
        else:
            if fmt.req.include_usage:
                yield fmt.event(fmt.usage_chunk(jobs))
        yield b"data: [DONE]\n\n"
    finally:
        for j in jobs:
            j.cancel()


async def complete(request: Request, jobs: list[Job], fmt: Formatter) -> Response:
    """A non-streamed response; a client that disconnects while waiting cancels the request."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for j in jobs:
                    j.cancel()
                return

    watcher = asyncio.create_task(watch())
    texts: list[list[str]] = [[] for _ in jobs]
    logprobs: list[list] = [[] for _ in jobs]
    finish: list[str | None] = [None] * len(jobs)
    try:
        async for i, u in merged(jobs):
            if u.error is not None:
                raise APIError(u.status, u.error, None, "shutting_down" if u.status == 503 else "internal_error")
            texts[i].append(u.text)
            logprobs[i].extend(u.logprobs)
            finish[i] = u.finish
    finally:
        watcher.cancel()
        for j in jobs:
            j.cancel()
    if "abort" in finish:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(fmt.whole(["".join(t) for t in texts], logprobs, finish, jobs))


class Formatter:
    """OpenAI's response and chunk objects for one request (chat.completion / text_completion)."""

    def __init__(self, tokenizer, req: GenRequest, rid: str):
        self.tok, self.req, self.id = tokenizer, req, rid
        self.chat = req.kind == "chat"
        self.created = int(time.time())
        self.offset: dict[int, int] = {}  # completions' logprobs text_offset, per choice
        self.piece = functools.lru_cache(maxsize=4096)(lambda t: self.tok.decode([t]))

    @staticmethod
    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                "system_fingerprint": FINGERPRINT}
        if chunk and self.req.include_usage:
            head["usage"] = None  # as OpenAI: null on every chunk but the last
        return head

    def _choice(self, i: int, text: str, logprobs, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or logprobs
                                                                         else {})
            return {"index": i, "delta": delta, "logprobs": self._chat_logprobs(logprobs), "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": self._completion_logprobs(logprobs, i),
                "finish_reason": finish}

    def start(self, i: int = 0) -> dict:
        """A choice's first chunk: the assistant role (chat) or an empty text (completions)."""
        return {**self._head(True), "choices": [self._choice(i, "", [], None, role=self.chat)]}

    def delta(self, text: str, logprobs, i: int = 0) -> dict:
        return {**self._head(True), "choices": [self._choice(i, text, logprobs, None)]}

    def final(self, finish: str, job: Job, i: int = 0) -> dict:
        return {**self._head(True), "choices": [self._choice(i, "", [], finish)], "timings": job.timings}

    def usage_chunk(self, jobs: list[Job]) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(jobs)}

    def whole(self, texts: list[str], logprobs: list, finish: list, jobs: list[Job]) -> dict:
        """The response object; timings (llama-server's, one object) are the first choice's."""
        choices = []
        for i, (text, lps, reason) in enumerate(zip(texts, logprobs, finish, strict=True)):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": self._chat_logprobs(lps), "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": self._completion_logprobs(lps, i),
                                "finish_reason": reason})
        return {**self._head(False), "choices": choices, "usage": usage(jobs), "timings": jobs[0].timings}

    def _entry(self, t: int, lp: float) -> dict:
        s = self.piece(t)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    def _chat_logprobs(self, entries) -> dict | None:
        if self.req.logprobs is None:
            return None
        return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in alts]}
                            for t, lp, alts in entries], "refusal": None}

    def _completion_logprobs(self, entries, i: int) -> dict | None:
        if self.req.logprobs is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        offset = self.offset.get(i, 0)
        for t, lp, alts in entries:
            s = self.piece(t)
            tokens.append(s)
            lps.append(_finite(lp))
            tops.append({self.piece(a): _finite(alp) for a, alp in alts})
            offsets.append(offset)
            offset += len(s)
        self.offset[i] = offset
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(jobs: list[Job]) -> dict:
    """OpenAI's usage of a request's choices: the prompt counted once, every choice's completion tokens."""
    first = jobs[0].usage
    completion = sum(j.usage["completion_tokens"] for j in jobs)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


def _finite(x: float) -> float:
    return x if x > -9999.0 else -9999.0  # OpenAI's floor; JSON has no -Infinity


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"specdec {version('specdec')}"
    except Exception:
        return "specdec"


def _install_error_handlers(app: FastAPI, state: State) -> None:
    """Every error in OpenAI's shape: APIError as given, FastAPI's validation errors as 400, routing errors (404,
    405) with their status, anything unexpected as a 500 whose message says what failed."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        if e.status < 500 and e.status != 401:
            state.metrics.rejected.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        state.metrics.rejected.labels(status="400").inc()
        return JSONResponse(error_body(f"invalid request: {first.get('msg', 'malformed body')}", param=param,
                                       code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code, str(e.status_code))  # as strings
        return JSONResponse(error_body(message, kind, None, code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)
