"""Speculative decoding statistics, counted as vLLM counts them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, keys and values found in the cache (Engine prompt_cache): not prefilled
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time after the first token
    draft_s: float = 0.0  # time in proposer.propose / accept
    verify_s: float = 0.0  # time in target forwards + verification during decode
    forwards: int = 0  # target forwards during decode
    decode_tokens: int = 0  # tokens emitted by those forwards (accepted drafts + one recovered/bonus each)
    drafts: int = 0  # drafts verified (non-empty)
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # drafted tokens accepted
    drafted_at: list[int] = field(default_factory=list)  # drafts that reached position i
    accepted_at: list[int] = field(default_factory=list)  # drafts whose token at position i was accepted
    # per drafting source (--spec auto mixes them): name -> [drafts, drafted tokens, accepted tokens, tokens emitted]
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def record(self, k: int, n_accepted: int, emitted: int, depth: int | None = None, source: str | None = None
               ) -> None:
        """One target forward that verified a draft of k tokens (a chain, or a tree of k nodes and `depth` levels)
        made by `source`, accepted n_accepted and emitted `emitted` tokens."""
        self.forwards += 1
        self.decode_tokens += emitted
        if k == 0:
            return
        if source is not None:
            row = self.by_source.setdefault(source, [0, 0, 0, 0])
            for i, v in enumerate((1, k, n_accepted, emitted)):
                row[i] += v
        self.drafts += 1
        self.drafted += k
        self.accepted += n_accepted
        depth = k if depth is None else depth
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward, the bonus / recovered token included (plain decoding = 1.00)."""
        return self.decode_tokens / self.forwards if self.forwards else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def decode_tok_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 and self.generated_tokens > 1 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 acceptance_per_position=self.acceptance_per_position, decode_tok_s=self.decode_tok_s,
                 prefill_tok_s=self.prefill_tok_s)
        return d

    def merge(self, other: Stats) -> None:
        """Add another run's counts (for totals over many prompts)."""
        for name in ("prompt_tokens", "cached_tokens", "generated_tokens", "prefill_s", "decode_s", "draft_s",
                     "verify_s", "forwards", "decode_tokens", "drafts", "drafted", "accepted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, row in other.by_source.items():
            mine = self.by_source.setdefault(name, [0, 0, 0, 0])
            for i, v in enumerate(row):
                mine[i] += v
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
