"""Speculative decoding: proposers (draft model, n-gram, MTP), the verifier, statistics."""

from __future__ import annotations

from ..config import ModelError
from ..sampling import SamplingParams, make_generator
from .base import Draft, Proposer

SPEC_KINDS = ("none", "draft", "ngram")


def build_proposer(kind: str, target, params: SamplingParams, draft=None, p_min: float = 0.0, ngram_min: int = 2,
                   ngram_max: int = 4) -> Proposer | None:
    """The proposer for --spec KIND. `target` / `draft` are loader.Loaded models (draft only for kind "draft")."""
    if kind == "none":
        return None
    if kind == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(ngram_min, ngram_max)
    if kind == "draft":
        from .draft_model import DraftModelProposer, check_vocab

        if draft is None:
            raise ModelError("--spec draft needs a draft model: give -md DRAFT")
        check_vocab(target.tokenizer, draft.tokenizer)
        seed = None if params.seed is None else params.seed + 1
        gen = make_generator(seed, draft.model.device) if not params.greedy else None
        return DraftModelProposer(draft.model, params, target.model.args.vocab_size, p_min, gen)
    raise ModelError(f"unknown --spec '{kind}': use {', '.join(SPEC_KINDS)}")


__all__ = ["Draft", "Proposer", "SPEC_KINDS", "build_proposer"]
