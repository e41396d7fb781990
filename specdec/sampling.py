"""Sampling as pure functions on logits, with an explicit torch.Generator.

The processed distribution p (temperature, then top-k, top-p, min-p, in Hugging Face's warper order) is what plain
sampling draws from and what the speculative verifier compares drafts against, so speculative sampling is plain
sampling in distribution. Greedy decoding (temperature 0) is argmax and never builds p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("--temp must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("--top-p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("--min-p must be in [0, 1]")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> processed probabilities p [..., V] (float32, rows sum to 1).

    temperature -> top-k (keep the k largest) -> top-p (keep the smallest prefix of the sorted distribution whose
    mass reaches top_p, always at least one token) -> min-p (drop tokens below min_p x the top probability)."""
    logits = logits.float() / max(params.temperature, 1e-5)
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1:] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from probs [..., V] -> [...] (long).

    Exponential race (as gpt-fast's multinomial_sample_one_no_sync): argmax(p / E) with E ~ Exp(1) i.i.d. picks
    token x with probability p(x), with no host synchronisation and reproducibly for a seeded generator."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / e, dim=-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from the last position's logits [V]: argmax when greedy, else a draw from p."""
    if params.greedy:
        return int(torch.argmax(logits, dim=-1))
    return int(sample(probs_from_logits(logits, params), generator))
