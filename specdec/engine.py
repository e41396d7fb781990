"""The engine: many sequences, one target forward per step, every sequence's output exactly its solo output.

One step (`Engine.step`): each decoding sequence's proposer drafts (K from its own policy, K = 0 allowed); the
target runs ONE forward over every sequence's [pending token + draft] rows, each row at its own position in its own
cache slot; each sequence is verified (greedy / stochastic, chain / tree) against its rows, its cache commits
(rollback, or tree compaction), and its new tokens come back. Sequences join between steps (a new one prefills in
chunks of its own prompt, one chunk per step, so a long prompt does not stall the others for long) and leave when
they finish, freeing their slot (continuous batching, as in Orca, Yu et al. 2022, and vLLM).

Exactness: the matmul kernels compute every row the same way whatever the other rows are, and the attention kernel
computes each row over its own slots, so a row of a batched forward is bitwise the row of that sequence's solo
forward; a sequence's prefill chunks depend only on its prompt; sampling uses the sequence's own generator. So a
sequence's output is the same alone or in any batch, greedy or seeded (tested). Without the attention kernel (no C
compiler, GPU) each sequence's rows go through their own forward (same results, no batching gain).

Stop strings, streaming and text live around the step (generate.py), as in mlx-lm's generate_step /
stream_generate split.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .cache import ContextFull, KVCache
from .config import ModelError
from .models.transformer import Transformer
from .sampling import Draws, SamplingParams, next_token
from .spec.autok import AutoDraftLength, FixedDraftLength
from .spec.base import Draft, Proposer
from .spec.stats import Stats
from .spec.tree import depths
from .spec.verify import verify_chain, verify_tree

PREFILL_CHUNK = 512
_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generation: its prompt, settings, proposer and policy, and its state as the engine advances it.

    out: generated tokens so far; the last one is "pending" (sampled, not yet in the cache) while decoding.
    finish: None while running, else "stop" (end-of-sequence, or a stop string the caller found), "length"
    (max_tokens reached), "context" (the context window is full) or "cancelled"."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    ignore_eos: bool = False
    proposer: Proposer | None = None
    policy: FixedDraftLength | AutoDraftLength | None = None
    eog: frozenset[int] = frozenset()
    id: int = field(default_factory=lambda: next(_ids))
    out: list[int] = field(default_factory=list)
    finish: str | None = None
    stats: Stats = field(default_factory=Stats)
    cache: KVCache | None = None
    generator: Draws | None = None  # sampling's randomness, keyed by output position
    logprobs: int | None = None  # record each generated token's log-probability and this many top alternatives
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache so far
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)
    t_first: float = 0.0  # when the first token came out (decode time counts from here)

    @property
    def decoding(self) -> bool:
        return self.finish is None and self.prefilled == len(self.prompt)

    def context(self) -> list[int]:
        return self.prompt + self.out


@dataclass(eq=False)
class Prefix:
    """A prompt prefilled once (Engine.prefill_prefix): its cache slot, last logits [V] and hidden states [n, dim]."""

    prompt: list[int]
    cache: KVCache
    logits: torch.Tensor
    hidden: torch.Tensor


class Engine:
    """Advances sequences one step at a time over a shared cache pool (model.new_pool)."""

    def __init__(self, model: Transformer, max_batch: int = 1, max_len: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, prompt_cache: bool = False):
        """prompt_cache: a finished sequence's slot keeps its tokens' keys and values, and a new sequence whose
        prompt begins with them starts there (llama-server's cache_prompt, vLLM's prefix caching: a chat's next turn
        prefills only its new tokens). Exact: on the attention kernel every forward, prefill chunks included,
        computes each row as a decode step computes it, so a slot's entries are the same whichever forward wrote
        them, and a reused prefix gives bitwise the output of a fresh prefill (tested). Only where that holds: the
        whole stack in forward.c (Transformer.fast_layers: quantized Llama-family / Gemma 3 layers on CPU)."""
        self.model = model
        self.pool = model.new_pool(max_batch, max_len)
        self.prefill_chunk = prefill_chunk
        self.prompt_cache = prompt_cache and model.kernel and model.fast_layers() is not None
        self.batched = model.kernel  # one forward for all sequences needs the attention kernel
        self.active: list[Sequence] = []
        self.row_cost: dict[tuple[int, int], float] = {}  # (sequences, rows) of a step -> EMA seconds (attribute())

    @property
    def free_slots(self) -> int:
        return len(self.pool.free)

    def add(self, seq: Sequence, prefix: Prefix | None = None) -> Sequence:
        """Take a cache slot for a new sequence; it prefills in the next steps (or starts from `prefix`, a
        prefill_prefix() of exactly its prompt, at once: its first token is then already in seq.out)."""
        seq.params.validate()
        if not seq.prompt:
            raise ModelError("the prompt is empty: give some text with -p")
        if len(seq.prompt) >= self.pool.max_len:
            raise ModelError(f"the prompt has {len(seq.prompt)} tokens but the context is {self.pool.max_len}: "
                             "raise -c or shorten the prompt")
        if seq.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        reuse = self.prompt_cache and prefix is None
        if reuse and getattr(seq.proposer, "needs_prompt_hidden", False):
            # MTP modules read the target's hidden state at every prompt position, which a cached prefix lacks:
            # under --spec auto they sit this sequence out when at least half its prompt (and 64 tokens) is cached,
            # else (and with --spec mtp) the prompt is prefilled in full
            n = self.pool.match(seq.prompt)
            reuse = n >= max(64, len(seq.prompt) // 2) and hasattr(seq.proposer, "drop_hidden_sources")
            if reuse:
                seq.proposer.drop_hidden_sources()
                reuse = not seq.proposer.needs_prompt_hidden  # it had nothing else
        seq.cache = self.pool.acquire(tokens=seq.prompt if reuse else ())
        seq.generator = Draws(seq.params.seed, self.model.device) if not seq.params.greedy else None
        seq.policy = seq.policy or FixedDraftLength(0)
        seq.stats = Stats(prompt_tokens=len(seq.prompt))
        if reuse:  # the cached prefix, less the prompt's last token: its prefill gives the first token's logits
            seq.prefilled = seq.cache.length = seq.stats.cached_tokens = min(seq.cache.reused, len(seq.prompt) - 1)
        self.active.append(seq)
        if prefix is not None:
            if prefix.prompt != seq.prompt:
                raise ValueError("a prefix must be exactly the sequence's prompt")
            t0 = time.perf_counter()
            with torch.inference_mode():
                seq.cache.copy_from(prefix.cache, len(prefix.prompt))
                seq.prefilled = len(seq.prompt)
                seq.stats.prefill_s = time.perf_counter() - t0
                self._start(seq, prefix.logits, prefix.hidden)
        return seq

    def prefill_prefix(self, prompt: list[int]) -> Prefix:
        """Prefill a prompt once into a slot of its own, for many sequences to start from (several samples of one
        prompt): add(seq, prefix) copies its cache slots instead of computing them again. The copies are the
        values the sequence's own prefill would write (the same chunks), so its output does not change."""
        if not prompt or len(prompt) >= self.pool.max_len:
            raise ModelError(f"a prefix of {len(prompt)} tokens does not fit a context of {self.pool.max_len}")
        cache = self.pool.acquire()
        with torch.inference_mode():
            logits, hidden = self.model.prefill(prompt, cache, self.prefill_chunk)
        return Prefix(list(prompt), cache, logits, hidden)

    def release_prefix(self, prefix: Prefix) -> None:
        """Free a prefix's slot; with prompt caching its prompt stays there for a later prompt that begins with it."""
        self.pool.release(prefix.cache, prefix.prompt if self.prompt_cache else None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (the caller's reasons: a stop string, a cancelled request) and free its slot."""
        if seq.finish is None:
            seq.finish = reason
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        if seq.cache is not None:
            if seq.t_first:
                seq.stats.decode_s = time.perf_counter() - seq.t_first
            seq.stats.generated_tokens = len(seq.out)
            # its slots [0, length) hold context()[j] at slot j (rollback and tree compaction keep it so), unless a
            # forward failed on the way: what an error left is not kept
            kept = seq.context()[:seq.cache.length] if self.prompt_cache and seq.finish != "error" else None
            self.pool.release(seq.cache, kept)
            seq.cache = None
        if seq in self.active:
            self.active.remove(seq)

    def step(self, seqs: Seq[Sequence] | None = None) -> dict[int, list[int]]:
        """Advance `seqs` (default: every active sequence) by one step -> new tokens per sequence id (sequences that
        only prefilled a chunk get none; a finished sequence's list is its last tokens, its finish is set)."""
        seqs = list(self.active if seqs is None else seqs)
        new: dict[int, list[int]] = {}
        with torch.inference_mode():
            waiting = [s for s in seqs if s.finish is None and s.prefilled < len(s.prompt)]
            budget = self.prefill_chunk  # prompt tokens per step, oldest prompts first (at least one chunk)
            for s in waiting:
                if budget <= 0:
                    break
                budget -= min(self.prefill_chunk, len(s.prompt) - s.prefilled)
                tok = self._prefill_chunk(s)
                if tok is not None:
                    new[s.id] = [tok]
            decoding = [s for s in seqs if s.decoding and s.id not in new]
            if decoding:
                new.update(self._decode(decoding))
        return new

    # ---------------------------------------------------------------------------------------------------------------

    def _prefill_chunk(self, s: Sequence) -> int | None:
        """Prefill the next chunk of s's prompt; after the last one, the first token (returned) and the proposer's
        start."""
        t0 = time.perf_counter()
        part = s.prompt[s.prefilled:s.prefilled + self.prefill_chunk]
        m = self.model
        ids = torch.tensor([part], device=m.device)
        pos = torch.arange(s.prefilled, s.prefilled + len(part), device=m.device)
        logits, h = m(ids, pos, s.cache, last_only=True)
        s.prefilled += len(part)
        s.prompt_hidden.append(h[0])
        s.stats.prefill_s += time.perf_counter() - t0
        if s.prefilled < len(s.prompt):
            return None
        hidden = torch.cat(s.prompt_hidden)
        s.prompt_hidden = []
        return self._start(s, logits[0, -1], hidden)

    def _start(self, s: Sequence, logits: torch.Tensor, hidden: torch.Tensor) -> int:
        """The prompt is cached: the first token from its last logits [V], then the proposer's start."""
        token = next_token(logits, s.params, s.generator, s.prompt, len(s.prompt))
        s.out.append(token)
        if s.logprobs is not None:
            _record_logprobs(s, logits[None], [token])
        if self._check_finish(s, token) is None and s.proposer is not None:
            t = time.perf_counter()
            s.proposer.begin(s.context(), hidden)
            s.stats.draft_s += time.perf_counter() - t
        s.t_first = time.perf_counter()
        if s.finish is not None:
            self._retire(s)
        return token

    def _check_finish(self, s: Sequence, token: int) -> str | None:
        if token in s.eog and not s.ignore_eos:
            s.finish = "stop"
        elif len(s.out) >= s.max_tokens:
            s.finish = "length"
        return s.finish

    def _draft(self, s: Sequence, peers: int) -> tuple[Draft, int | None, float]:
        """s's draft for this step (K from its policy, never past its context or max_tokens; `peers` sequences decode
        in this step) -> (draft, draft class, drafting seconds)."""
        proposer, policy = s.proposer, s.policy
        if proposer is None:
            return Draft(), None, 0.0
        n = s.cache.length
        cap = min(s.cache.max_len - n - 1, s.max_tokens - len(s.out) - 1)
        if hasattr(proposer, "plan"):  # a proposer that picks its own source and length (spec/auto.py)
            t = time.perf_counter()
            draft, source = proposer.plan(cap, peers) if cap > 0 else (Draft(), None)
            return draft, source, time.perf_counter() - t
        kind = proposer.draft_class() if hasattr(proposer, "draft_class") else None
        k = min(policy.choose(kind), cap)
        # full-information feedback for policies that learn (spec/autok.py) from costless proposers
        watch = getattr(proposer, "costless", False) and isinstance(policy, AutoDraftLength)
        if k <= 0 and not watch:
            return Draft(), kind, 0.0
        t = time.perf_counter()
        if watch:  # the longest candidate, scored whole by the policy; the first k tokens are drafted
            full = proposer.propose(policy.draft_max)
            policy.watch(full.tokens, kind)
            draft = Draft(full.tokens[:max(k, 0)])
        else:
            draft = proposer.propose(k)
        if len(draft) < max(policy.draft_min, 1):
            draft = Draft()
        return draft, kind, time.perf_counter() - t

    def _decode(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        m = self.model
        items = []  # (seq, draft, class, draft seconds, positions)
        for s in seqs:
            n = s.cache.length  # == len(prompt) + len(out) - 1: the pending token is not cached yet
            if n + 1 > s.cache.max_len:
                s.finish = "context"
                self._retire(s)
                continue
            draft, kind, draft_s = self._draft(s, len(seqs))
            s.stats.draft_s += draft_s
            pos = [n] + ([n + 1 + i for i in range(len(draft))] if draft.parents is None
                         else [n + d for d in depths(draft.parents)])
            items.append((s, draft, kind, draft_s, pos))
        if not items:
            return {}
        t = time.perf_counter()
        if self.batched and len(items) > 1:
            logits, hidden = m.forward_batch([(s.cache, [s.out[-1]] + d.tokens, pos, d.parents)
                                              for s, d, _, _, pos in items])
            rows, at = [], 0
            for _, d, _, _, _ in items:
                rows.append((logits[at:at + 1 + len(d)], hidden[at:at + 1 + len(d)]))
                at += 1 + len(d)
        else:
            rows = []
            for s, d, _, _, pos in items:
                ids = torch.tensor([[s.out[-1]] + d.tokens], device=m.device)
                lg, h = m(ids, torch.tensor(pos, device=m.device), s.cache, parents=d.parents, exact=True)
                rows.append((lg[0], h[0]))
        forward_s = time.perf_counter() - t
        shares = attribute(forward_s, [len(d) for _, d, _, _, _ in items], self.row_cost)
        out: dict[int, list[int]] = {}
        for (s, draft, kind, draft_s, _), (logits, hidden), share in zip(items, rows, shares, strict=True):
            t = time.perf_counter()
            n = s.cache.length - 1 - len(draft)  # the pending token's slot
            context = s.context() if s.params.penalized else ()
            if draft.parents is None:  # a chain
                n_acc, token = verify_chain(logits, draft, s.params, s.generator and s.generator.shifted(len(s.out)),
                                            context, len(s.prompt))
                path = list(range(n_acc))
                s.cache.rollback(n + 1 + n_acc)
                depth = len(draft)
            else:  # a tree: keep the accepted path's slots
                path, token = verify_tree(logits, draft, s.params, s.generator and s.generator.shifted(len(s.out)),
                                          context, len(s.prompt))
                n_acc = len(path)
                s.cache.keep(n, [n] + [n + 1 + i for i in path])
                depth = max(depths(draft.parents))
            elapsed = share + time.perf_counter() - t  # its share of the forward (attribute()), then its verify
            s.stats.verify_s += elapsed
            planned = hasattr(s.proposer, "plan")
            if planned:
                s.proposer.feedback(depth, n_acc, elapsed, draft_s)
            else:
                s.policy.update(depth, n_acc, elapsed, draft_s, kind)
            new = [draft.tokens[i] for i in path] + [token]
            emitted = []
            for tok in new:  # EOS / max_tokens inside the accepted tokens end generation right there
                s.out.append(tok)
                emitted.append(tok)
                if self._check_finish(s, tok):
                    break
            if s.logprobs is not None:  # the target's own distributions, at the rows that produced the tokens
                _record_logprobs(s, logits[([0] + [1 + i for i in path])[:len(emitted)]], emitted)
            source = kind if planned else getattr(s.proposer, "name", None)
            s.stats.record(len(draft), n_acc, len(emitted), depth, source if len(draft) else None)
            (s.proposer if planned else s.policy).emitted(emitted)
            if s.finish is None and s.proposer is not None:
                t = time.perf_counter()
                rows = hidden[:n_acc + 1] if draft.parents is None else hidden[[0] + [1 + i for i in path]]
                s.proposer.accept(new[:-1], token, rows)
                s.stats.draft_s += time.perf_counter() - t
            if s.finish is not None:
                self._retire(s)
            out[s.id] = emitted
        return out

    def run(self, seqs: Seq[Sequence]) -> None:
        """Step until every one of `seqs` has finished (a convenience for callers without stop strings)."""
        while any(s.finish is None for s in seqs):
            self.step()


def attribute(forward_s: float, drafts: list[int], row_cost: dict[tuple[int, int], float]) -> list[float]:
    """Each sequence's share of a step's forward (forward_s seconds over one pending row per sequence plus `drafts[i]`
    draft rows each): an equal share of what the forward would have cost without drafts, F(n) for n sequences, plus the
    extra time (forward_s - F(n)) split over the draft rows. F comes from row_cost (seconds per (sequences, rows) of a
    step, kept here as an exponential average), which this call updates. (Keyed by rows alone, the steps of 4
    sequences with 4 draft rows each counted into F(8): after a continuous-batching run on Spec-Bench summarization
    F(8) read 14.8 ms against 12.2 for 8 draft-free rows; docs/results/batch-row-cost-1206i.txt.)

    The extra time is the drafts' marginal cost: a draft of K rows is worth its expected accepted tokens A when A / (its
    marginal cost) beats n / F(n), the batch's own rate, and that is what a sequence's draft-length policy concludes
    from these shares (its rate (1 + A) / (F(n)/n + marginal) against n / F(n) per sequence). Splitting forward_s by
    rows instead charges a draft the average cost of a row, which at batch 8 is several times the marginal one: 8
    single-token rows of SmolLM2 took 9.9 ms here and 16 rows 13.6 ms (docs/results/batch-rows-1204.txt), so a draft row
    at batch 8 looked 2.7x dearer than it is; charged at its marginal cost, `--spec auto` at batch 8 decoded Spec-Bench
    rag 1.07x faster (docs/results/batch-share-1204.txt). With one sequence the share is forward_s itself. Without a
    measured F (nothing draft-free seen yet) rows share forward_s equally."""
    n, rows = len(drafts), len(drafts) + sum(drafts)
    old = row_cost.get((n, rows))
    row_cost[n, rows] = forward_s if old is None else 0.8 * old + 0.2 * forward_s
    base = forward_s if rows == n else row_cost.get((n, n))
    if n == 1 or base is None:
        return [forward_s * (1 + k) / rows for k in drafts]
    base = min(base, forward_s)  # a forward with more rows never costs less: the excess is noise
    extra = forward_s - base
    return [base / n + (extra * k / (rows - n) if k else 0.0) for k in drafts]


def _record_logprobs(s: Sequence, logits: torch.Tensor, tokens: list[int]) -> None:
    """Log-probabilities of `tokens` under the model's distribution (log-softmax of the raw logits [n, V], before
    temperature and truncation, as vLLM's default and OpenAI report them), with the s.logprobs most likely
    alternatives each."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = s.logprobs
    top = torch.topk(lp, k, dim=-1) if k else None
    for r, tok in enumerate(tokens):
        alts = list(zip(top.indices[r].tolist(), top.values[r].tolist(), strict=True)) if top is not None else []
        s.token_logprobs.append((float(lp[r, tok]), alts))


def check_prompt(n_prompt: int, ctx: int) -> None:
    if n_prompt == 0:
        raise ModelError("the prompt is empty: give some text with -p")
    if n_prompt >= ctx:
        raise ModelError(f"the prompt has {n_prompt} tokens but the context is {ctx}: raise -c or shorten the prompt")


__all__ = ["ContextFull", "Engine", "Prefix", "Sequence", "check_prompt"]
