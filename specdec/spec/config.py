"""Speculation settings in one object: which proposer, draft lengths, and each proposer's knobs (llama.cpp's names)."""

from __future__ import annotations

from dataclasses import dataclass

from .autok import AutoDraftLength, FixedDraftLength

SPEC_KINDS = ("none", "auto", "draft", "ngram", "suffix", "mtp")


@dataclass(frozen=True)
class SpecConfig:
    """kind: auto (each step the best of suffix lookup, MTP heads and a draft model, spec/auto.py), none, draft (a
    draft model, -md), ngram (prompt lookup of the last 1-4 tokens), suffix (the longest earlier match, spec/suffix.py),
    mtp (MTP modules or heads);
    draft_max: "auto" (choose each step's K from measured acceptance and costs) or a fixed K; draft_min: drafts
    shorter than this are not verified; draft_p_min: a draft model stops when its top probability falls below
    this; ngram_min / ngram_max: n-gram sizes to look up; tree: MTP tree branching per depth (None = chains);
    heads: an MTP heads file (None: the model's own MTP modules, or heads shipped for it)."""

    kind: str = "none"
    draft_max: str = "auto"
    draft_min: int = 0
    draft_p_min: float = 0.8
    ngram_min: int = 1
    ngram_max: int = 4
    tree: tuple[int, ...] | None = None
    heads: str | None = None

    def validate(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise ValueError(f"unknown --spec '{self.kind}': use {', '.join(SPEC_KINDS)}")
        if self.draft_min < 0:
            raise ValueError("--draft-min must be >= 0")
        draft_length(self.draft_max, 0)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} / --ngram-max {self.ngram_max}: n-gram sizes need "
                             "1 <= --ngram-min <= --ngram-max")
        if self.tree is not None and (not self.tree or min(self.tree) < 1):
            raise ValueError("--tree branching factors must be >= 1")

    def policy(self) -> FixedDraftLength | AutoDraftLength:
        """A fresh draft-length policy (one per sequence: each learns its own acceptance)."""
        return draft_length(self.draft_max, self.draft_min)


MAX_DRAFT = 16  # tokens a draft may have (--draft-max, the server's speculative.n_max): a verification of 17 rows


def draft_length(value: str | int, draft_min: int) -> FixedDraftLength | AutoDraftLength:
    """A draft-length policy from a --draft-max value: "auto" or a number of tokens (at most MAX_DRAFT)."""
    if value == "auto":
        return AutoDraftLength(8, draft_min)
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--draft-max must be auto or a number, not '{value}'") from None
    if not 0 <= k <= MAX_DRAFT:
        raise ValueError(f"--draft-max must be auto or 0..{MAX_DRAFT}, not {k}")
    return FixedDraftLength(k, draft_min)


def parse_tree(value: str | None) -> tuple[int, ...] | None:
    """--tree 3,2,1 -> (3, 2, 1)."""
    if value is None:
        return None
    try:
        shape = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"--tree takes branching factors per depth like 3,2,1, not '{value}'") from None
    if not shape or min(shape) < 1:
        raise ValueError("--tree branching factors must be >= 1")
    return shape
