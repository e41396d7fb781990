"""The server's engine loop: one background thread runs engine.Engine.step for every active request (continuous
batching, Orca / vLLM style), requests joining and leaving between steps.

Each iteration: drop cancelled requests (their slot and proposer state, draft-model cache included, are freed before
the next step), admit waiting requests into free slots (each with its own proposer and draft-length policy), run one
step, and hand every request its new text (incremental detokenization and stop strings by generate.TextStream) and
logprobs through its asyncio queue (loop.call_soon_threadsafe). The Engine is not thread-safe: only this thread
touches it. The admission queue is bounded (--max-queue): a request that finds it full is refused with 503 and
Retry-After instead of waiting without limit.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from ..engine import Engine, Sequence
from ..generate import TextStream
from ..spec import SpecConfig, build_proposer
from ..spec.suffix import SuffixIndex
from .metrics import Counted, Metrics
from .schemas import APIError, GenRequest, SpecRequest

FINISH = {"stop": "stop", "length": "length", "context": "length"}  # engine reason -> OpenAI finish_reason
_job_ids = itertools.count()


@dataclass
class Backend:
    """What the server serves: the target (loader.Loaded), an optional draft model, the server's speculation
    setting and the MTP drafter resolved once at start-up (spec.resolve_mtp; None when the model has none)."""

    target: object
    draft: object | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    mtp: tuple | None = None
    model_id: str = "model"
    names: frozenset[str] = frozenset()
    # earlier responses, a lookup source of --spec auto requests (spec/suffix.py); None: not kept
    index: SuffixIndex | None = field(default_factory=SuffixIndex)

    @property
    def spec_kinds(self) -> tuple[str, ...]:
        """Proposers a request may ask for (llama-server's per-request speculative.type)."""
        return ("none", "auto", "ngram", "suffix") + (("draft",) if self.draft is not None else ()) + (
            ("mtp",) if self.mtp else ())


@dataclass
class Update:
    """What one engine step produced for a request: new text and, when asked, the target's logprobs of the new
    tokens [(token, logprob, [(alternative, logprob), ...])]; the last update has finish (or error) set."""

    text: str = ""
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish: str | None = None  # "stop" / "length"; "abort" when the request was cancelled
    error: str | None = None
    status: int = 500  # the HTTP status of an error (503: the server is shutting down)


class Job:
    """One request between its HTTP handler (asyncio) and the engine loop (its thread)."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop, scheduler: Scheduler):
        self.id = next(_job_ids)
        self.req, self.loop, self.scheduler = req, loop, scheduler
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.seq: Sequence | None = None
        self.stream: TextStream | None = None
        self.pieces: list[str] = []
        self.spec_kind = "none"
        self.cancelled = False
        self.done = False
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.counted = Counted()
        self.siblings: list[Job] = [self]  # the choices of one request (n), admitted together

    def cancel(self) -> None:
        """The client went away (or the handler ended): free the slot at the next step. Called on the event loop;
        also ends this request's own update stream at once."""
        if self.done or self.cancelled:
            return
        self.cancelled = True
        self.queue.put_nowait(Update(finish="abort"))
        self.scheduler.wake()

    async def updates(self) -> AsyncIterator[Update]:
        """Updates until the last one (finish or error)."""
        while True:
            u = await self.queue.get()
            yield u
            if u.finish is not None or u.error is not None:
                return

    def _send(self, update: Update) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed (shutdown)
            self.cancelled = True


class Scheduler:
    """Slots = Engine(model, max_batch=parallel), a bounded admission queue, and the loop thread."""

    def __init__(self, backend: Backend, parallel: int = 4, max_queue: int | None = None,
                 metrics: Metrics | None = None, threads: int | None = None, prompt_cache: bool = True):
        if parallel < 1:
            raise ValueError("--parallel must be >= 1")
        self.backend = backend
        self.parallel = parallel
        self.max_queue = 4 * parallel if max_queue is None else max_queue
        if self.max_queue < 1:
            raise ValueError("--max-queue must be >= 1")
        self.metrics = metrics or Metrics()
        self.metrics.slots.set(parallel)
        self.threads = threads or torch.get_num_threads()
        tok = backend.target.tokenizer
        self.tokenizer = tok
        self.eog = frozenset(tok.eog_ids)
        # prompt caching: a request that continues a finished one's conversation prefills only its new tokens
        self.engine = Engine(backend.target.model, max_batch=parallel, prompt_cache=prompt_cache)
        self.ctx = self.engine.pool.max_len
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []  # read by /props and /slots (a copy is taken there); written by the loop
        self._busy = 0  # slots taken, as the loop last counted them (admissions count at once)
        self._stopping = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # --- the event loop's side ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown_soon(self) -> None:
        """Stop after the current step: every request still waiting or running ends with a 503 error (so streams
        close at once instead of holding a graceful shutdown open)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stop(self) -> None:
        self.shutdown_soon()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, reqs: list[GenRequest], loop: asyncio.AbstractEventLoop) -> list[Job]:
        """Queue a request's choices (one sequence each) together; 503 (with Retry-After) when they do not all fit
        beside the requests already waiting (--max-queue beyond the free slots)."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", None, "shutting_down", {"Retry-After": "5"})
            if len(reqs) > self.max_queue + self.parallel:  # never fits: a 400, not "busy"
                raise APIError(400, f"'n' = {len(reqs)} is more than this server holds at once ({self.parallel} "
                               f"slots and a queue of {self.max_queue}): ask for fewer choices", "n")
            if len(self._waiting) + len(reqs) > self.max_queue + max(0, self.parallel - self._busy):
                self.metrics.rejected.labels(status="503").inc()
                raise APIError(503, f"the server is busy: {len(self._waiting)} requests are already waiting for "
                               f"its {self.parallel} slots (--max-queue {self.max_queue}); retry later", None,
                               "queue_full", {"Retry-After": "1"})
            jobs = [Job(req, loop, self) for req in reqs]
            for j in jobs:
                j.siblings = jobs
            self._waiting.extend(jobs)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return jobs

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    # --- the loop thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread: set it for this one
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self.running:
                    self._cond.wait()
                if self._stopping:
                    break
            for j in [j for j in self.running if j.cancelled]:
                self._cancel(j)
            with self._cond:
                dropped = [j for j in self._waiting if j.cancelled]
                for j in dropped:
                    self._waiting.remove(j)
                admit = []
                while self._waiting and len(admit) < self.engine.free_slots:
                    admit.append(self._waiting.popleft())
                self._busy = len(self.running) + len(admit)
                self.metrics.waiting.set(len(self._waiting))
            for j in dropped:
                self._close(j, "abort")
            started: set[int] = set()
            for j in admit:
                if j.id not in started:
                    group = [s for s in admit if s.siblings is j.siblings]
                    started.update(s.id for s in group)
                    self._admit_group(group)
            if self.running:
                self._step()
            with self._cond:
                self._busy = len(self.running)
            self.metrics.running.set(len(self.running))
        self._shutdown()

    def _spec_for(self, r: SpecRequest) -> SpecConfig:
        """The server's speculation setting with a request's overrides (schemas already clamped them)."""
        base = self.backend.spec
        kind = r.kind or base.kind
        changes: dict = {"kind": kind}
        if r.n_max is not None:
            changes["draft_max"] = str(r.n_max)
        if r.n_min is not None:
            changes["draft_min"] = r.n_min
        if r.p_min is not None:
            changes["draft_p_min"] = r.p_min
        if kind != "mtp":
            changes["tree"] = None
        return dataclasses.replace(base, **changes)

    def _admit_group(self, jobs: list[Job]) -> None:
        """Admit a request's choices: with n > 1 (and a slot to spare) the prompt is prefilled once, in a slot of its
        own, and each choice starts from a copy of it (Engine.prefill_prefix: the same keys and values)."""
        if len(jobs) == 1 or self.engine.free_slots <= len(jobs):
            for j in jobs:
                self._admit(j)
            return
        try:
            prefix = self.engine.prefill_prefix(list(jobs[0].req.prompt))
        except Exception as e:
            for j in jobs:
                self._fail(j, f"could not start the request: {type(e).__name__}: {e}")
            return
        try:
            for j in jobs:
                self._admit(j, prefix)
        finally:
            self.engine.release_prefix(prefix)

    def _admit(self, job: Job, prefix=None) -> None:
        req, b = job.req, self.backend
        try:
            spec = self._spec_for(req.spec)
            proposer = build_proposer(spec, b.target, req.params, b.draft, b.mtp, b.index)
            seq = Sequence(list(req.prompt), req.params, req.max_tokens, req.ignore_eos, proposer, spec.policy(),
                           self.eog, logprobs=req.logprobs)
            self.engine.add(seq, prefix)
        except Exception as e:  # requests were validated: this is a server-side failure, said in one line
            self._fail(job, f"could not start the request: {type(e).__name__}: {e}")
            return
        job.seq, job.spec_kind = seq, spec.kind
        job.stream = TextStream(self.tokenizer, req.stop, job.pieces.append)
        self.running.append(job)
        self.metrics.prompt_tokens.inc(len(req.prompt))
        if self.engine.prompt_cache:
            self.metrics.prefix_queries.inc(len(req.prompt))
            self.metrics.prefix_hits.inc(seq.stats.cached_tokens)
        if seq.out:  # started from a prefix: its first token is already there
            self._deliver(job, list(seq.out))

    def _step(self) -> None:
        try:
            new = self.engine.step([j.seq for j in self.running])
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            for j in list(self.running):
                self.engine.finish(j.seq, "error")
                self.running.remove(j)
                self._fail(j, f"the engine failed: {type(e).__name__}: {e}")
            return
        self.steps += 1
        for j in list(self.running):
            self._deliver(j, new.get(j.seq.id, []))

    def _deliver(self, job: Job, tokens: list[int]) -> None:
        """Hand a request the text and logprobs of its new tokens; finish it when the engine or a stop string did."""
        seq, req = job.seq, job.req
        now = time.perf_counter()
        if tokens and job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.observe(now - job.arrived)
        visible = tokens if req.ignore_eos else [t for t in tokens if t not in self.eog]
        job.pieces.clear()
        stopped = job.stream.push(visible) if visible else False
        reason = None
        if stopped:
            if seq.finish is None:
                self.engine.finish(seq, "stop")
            reason = "stop"
        elif seq.finish is not None:
            job.stream.finish()
            reason = FINISH.get(seq.finish, "stop")
        lps = []
        if req.logprobs is not None and tokens:
            n = len(seq.out)
            entries = seq.token_logprobs[n - len(tokens):n]
            lps = [(t, lp, alts) for t, (lp, alts) in zip(tokens, entries, strict=False)
                   if req.ignore_eos or t not in self.eog]
        self.metrics.advance(job.counted, len(seq.out), seq.stats)
        if reason is None:
            if job.pieces or lps:
                job._send(Update("".join(job.pieces), lps))
            return
        self.running.remove(job)
        self._result(job)
        if self.backend.index is not None and reason != "abort":
            self.backend.index.add(seq.out)
        job.done = True
        seq.proposer = None  # drop the draft state now (a draft model's cache) rather than at collection
        self.metrics.requests.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(now - job.arrived)
        job._send(Update("".join(job.pieces), lps, finish=reason))

    def _result(self, job: Job) -> None:
        """usage and llama-server's timings object."""
        s, n = job.seq.stats, len(job.seq.out)
        job.usage = {"prompt_tokens": len(job.req.prompt), "completion_tokens": n,
                     "total_tokens": len(job.req.prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}  # as OpenAI reports prompt caching
        decode_ms = s.decode_s * 1e3
        prefilled = s.prompt_tokens - s.cached_tokens
        job.timings = {
            "cache_n": s.cached_tokens, "prompt_n": prefilled, "prompt_ms": s.prefill_s * 1e3,
            "prompt_per_token_ms": s.prefill_s * 1e3 / max(prefilled, 1), "prompt_per_second": s.prefill_tok_s,
            "predicted_n": n, "predicted_ms": decode_ms, "predicted_per_token_ms": decode_ms / max(n - 1, 1),
            "predicted_per_second": s.decode_tok_s, "draft_n": s.drafted, "draft_n_accepted": s.accepted,
            "speculative": job.spec_kind,
            # --spec auto: what each source drafted (suffix: the request's own text, global: earlier responses)
            "draft_sources": {name: {"drafts": d, "draft_n": k, "draft_n_accepted": a}
                              for name, (d, k, a, _) in s.by_source.items()}}

    def _cancel(self, job: Job) -> None:
        self.engine.finish(job.seq, "cancelled")
        self.running.remove(job)
        self.metrics.advance(job.counted, len(job.seq.out), job.seq.stats)
        job.seq.proposer = None
        self._close(job, "abort")

    def _close(self, job: Job, reason: str) -> None:
        job.done = True
        self.metrics.requests.labels(finished_reason=reason).inc()

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        if status == 500:
            print(f"specdec serve: request {job.id}: {message}", file=sys.stderr)
        self._close(job, "error")
        job._send(Update(error=message, status=status))

    def _shutdown(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for j in waiting + list(self.running):
            if j.seq is not None:
                self.engine.finish(j.seq, "cancelled")
            self._fail(j, "the server is shutting down", 503)
        self.running.clear()
