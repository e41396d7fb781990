"""Generation: prefill, then [propose -> one target forward -> verify -> roll back -> accept] until done.

Plain autoregressive decoding is the same loop with an empty draft: one target forward over the pending token,
then a sample from its distribution. So the speculative path and the baseline share every line but the proposer.

Invariant of the loop: every emitted token except the last one (the "pending" token) is in the target's KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .config import ModelError
from .models.transformer import Transformer
from .sampling import SamplingParams, make_generator, next_token
from .spec.autok import AutoDraftLength, FixedDraftLength
from .spec.base import Draft, Proposer
from .spec.stats import Stats
from .spec.tree import depths
from .spec.verify import verify_chain, verify_tree
from .tokenizer import StreamDecoder, Tokenizer

PREFILL_CHUNK = 512


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length" (-n reached), "context" (context window full)
    stats: Stats = field(default_factory=Stats)


def prefill(model: Transformer, tokens: Sequence[int], cache: KVCache, chunk: int = PREFILL_CHUNK,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt through the model in chunks -> (logits of the last position [V], hidden [n, dim])."""
    hiddens = []
    logits = None
    for s in range(0, len(tokens), chunk):
        part = tokens[s:s + chunk]
        ids = torch.tensor([part], device=model.device)
        pos = torch.arange(cache.length, cache.length + len(part), device=model.device)
        logits, h = model(ids, pos, cache, last_only=True)
        hiddens.append(h[0])
    return logits[0, -1], torch.cat(hiddens)


def check_prompt(n_prompt: int, ctx: int) -> None:
    if n_prompt == 0:
        raise ModelError("the prompt is empty: give some text with -p")
    if n_prompt >= ctx:
        raise ModelError(f"the prompt has {n_prompt} tokens but the context is {ctx}: raise -c or shorten the prompt")


class TextStream:
    """Streams text, holding back what could still become a stop string, and finds stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], on_text: Callable[[str], None] | None):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.on_text = on_text
        self.text = ""
        self.sent = 0

    def push(self, tokens: list[int]) -> bool:
        """Add tokens; True when a stop string appeared (the text is cut before it)."""
        self.text += self.decoder.push(tokens)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self._emit(len(self.text))
                return True
        self._emit(len(self.text) - self.hold)
        return False

    def finish(self) -> None:
        self.text += self.decoder.flush()
        self._emit(len(self.text))

    def _emit(self, upto: int) -> None:
        if upto > self.sent:
            if self.on_text:
                self.on_text(self.text[self.sent:upto])
            self.sent = upto


def generate(model: Transformer, tokenizer: Tokenizer, prompt: Sequence[int], params: SamplingParams,
             max_tokens: int = 256, stop: Sequence[str] = (), proposer: Proposer | None = None,
             draft_length: FixedDraftLength | AutoDraftLength | None = None,
             on_text: Callable[[str], None] | None = None,
             ignore_eos: bool = False, cache: KVCache | None = None) -> Result:
    """Generate up to max_tokens after `prompt`, streaming text to on_text; speculative when a proposer is given."""
    params.validate()
    cache = cache or model.new_cache()
    cache.rollback(0)
    check_prompt(len(prompt), cache.max_len)
    gen = make_generator(params.seed, model.device) if not params.greedy else None
    stats = Stats(prompt_tokens=len(prompt))
    stream = TextStream(tokenizer, stop, on_text)
    eog = set() if ignore_eos else tokenizer.eog_ids
    draft_length = draft_length or FixedDraftLength(0)
    context = lambda: list(prompt) + out if params.penalized else ()  # noqa: E731  (penalties read the context)
    # full-information feedback for draft-length policies that learn (spec/autok.py) from costless proposers
    watch = getattr(proposer, "costless", False) and isinstance(draft_length, AutoDraftLength)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, prompt_hidden = prefill(model, prompt, cache)
        token = next_token(logits, params, gen, list(prompt), len(prompt))
        stats.prefill_s = time.perf_counter() - t0
        out = [token]
        finish = _finish(token, out, eog, max_tokens)
        if stream.push([t for t in out if t not in eog]):
            finish = "stop"
        if proposer is not None and finish is None:
            t = time.perf_counter()
            proposer.begin(list(prompt) + out, prompt_hidden)
            stats.draft_s += time.perf_counter() - t
        t_decode = time.perf_counter()
        while finish is None:
            n = cache.length  # == len(prompt) + len(out) - 1: the pending token `token` is not cached yet
            if n + 1 > cache.max_len:
                finish = "context"
                break
            # never draft past the context window or past max_tokens
            kind = proposer.draft_class() if hasattr(proposer, "draft_class") else None
            k = min(draft_length.choose(kind), cache.max_len - n - 1, max_tokens - len(out) - 1) if proposer else 0
            draft = Draft()
            draft_s = 0.0
            if k > 0 or watch:
                t = time.perf_counter()
                if watch:  # the longest candidate, scored whole by the policy; the first k tokens are drafted
                    full = proposer.propose(draft_length.draft_max)
                    draft_length.watch(full.tokens, kind)
                    draft = Draft(full.tokens[:k])
                else:
                    draft = proposer.propose(k)
                draft_s = time.perf_counter() - t
                stats.draft_s += draft_s
                if len(draft) < max(draft_length.draft_min, 1):
                    draft = Draft()
            t = time.perf_counter()
            ids = torch.tensor([[token] + draft.tokens], device=model.device)
            if draft.parents is None:  # a chain
                logits, hidden = model(ids, torch.arange(n, n + 1 + len(draft), device=model.device), cache,
                                       exact=True)
                n_acc, token = verify_chain(logits[0], draft, params, gen, context(), len(prompt))
                path = list(range(n_acc))
                cache.rollback(n + 1 + n_acc)
                depth = len(draft)
            else:  # a tree: rows at depth-based positions, then keep the accepted path's slots
                d = depths(draft.parents)
                pos = torch.tensor([n] + [n + x for x in d], device=model.device)
                logits, hidden = model(ids, pos, cache, parents=draft.parents, exact=True)
                path, token = verify_tree(logits[0], draft, params, gen, context(), len(prompt))
                n_acc = len(path)
                cache.keep(n, [n] + [n + 1 + i for i in path])
                depth = max(d)
            elapsed = time.perf_counter() - t
            stats.verify_s += elapsed
            draft_length.update(depth, n_acc, elapsed, draft_s, kind)
            accepted_rows = [0] + [1 + i for i in path]
            new = [draft.tokens[i] for i in path] + [token]
            emitted = 0
            for tok in new:  # EOS / -n inside the accepted tokens end generation right there
                out.append(tok)
                emitted += 1
                finish = _finish(tok, out, eog, max_tokens)
                if finish:
                    break
            stats.record(len(draft), n_acc, emitted, depth)
            draft_length.emitted(new[:emitted])
            if stream.push([t for t in new[:emitted] if t not in eog]):
                finish = "stop"
            if proposer is not None and finish is None:
                t = time.perf_counter()
                proposer.accept(new[:-1], token, hidden[0, accepted_rows])
                stats.draft_s += time.perf_counter() - t
        stats.decode_s = time.perf_counter() - t_decode
    stream.finish()
    stats.generated_tokens = len(out)
    return Result(out, stream.text, finish, stats)


def _finish(token: int, out: list[int], eog: set[int], max_tokens: int) -> str | None:
    if token in eog:
        return "stop"
    if len(out) >= max_tokens:
        return "length"
    return None
