"""Generation of one or many prompts: thin loops over engine.Engine.step, with stop strings and streaming around it.

Plain autoregressive decoding is the same step with an empty draft: one target forward over the pending token,
then a sample from its distribution. So the speculative path and the baseline share every line but the proposer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .engine import Engine
from .engine import Sequence as Seq
from .models.transformer import Transformer
from .sampling import SamplingParams
from .spec.autok import AutoDraftLength, FixedDraftLength
from .spec.base import Proposer
from .spec.stats import Stats
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length" (-n reached), "context" (context window full)
    stats: Stats = field(default_factory=Stats)


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
             on_text: Callable[[str], None] | None = None, ignore_eos: bool = False,
             engine: Engine | None = None) -> Result:
    """Generate up to max_tokens after `prompt`, streaming text to on_text; speculative when a proposer is given."""
    engine = engine or Engine(model, max_batch=1)
    seq = engine.add(Seq(list(prompt), params, max_tokens, ignore_eos, proposer, draft_length,
                         frozenset(tokenizer.eog_ids)))
    stream = TextStream(tokenizer, stop, on_text)
    try:
        while seq.finish is None:
            new = engine.step([seq]).get(seq.id, [])
            if stream.push([t for t in new if t not in tokenizer.eog_ids or ignore_eos]):
                engine.finish(seq, "stop")
    finally:
        if seq.finish is None:  # an exception (interrupt) mid-run: give the slot back
            engine.finish(seq, "cancelled")
    stream.finish()
    return Result(seq.out, stream.text, seq.finish, seq.stats)
