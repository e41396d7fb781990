"""The proposer interface: anything that guesses the target's next tokens.

A proposer drafts a chain (or a tree) of tokens and, when it samples them, their draft probabilities q. The verifier
(spec/verify.py) checks drafts against the target's distributions p without ever asking which proposer made them,
as llama.cpp's common_speculative_state and vLLM's rejection sampler (draft_probs=None for n-gram) do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Draft:
    """Drafted tokens after the last accepted token.

    tokens: [k] token ids. For a chain, token i follows token i-1 (token 0 follows the last accepted token).
    q: [k, V] the draft distribution each token was sampled from, or None when every drafted token is a point
       mass (n-gram lookup, greedy drafting): the verifier then treats q(x) = 1 for the drafted x.
    parents: for a tree, the index of each node's parent in `tokens` (-1 = the last accepted token); None = chain.
    """

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    """begin(context) once after prefill; then per step propose(k) and, after verification, accept().

    A proposer may also have draft_class() -> int: before propose(), a label of how good the next draft is likely
    to be (the n-gram proposer: its match length), which `--draft-max auto` keeps acceptance statistics apart by.
    One whose drafts cost nothing sets `costless = True`: the loop then asks it for the longest draft every step and
    lets the draft-length policy score all of it against what is generated (full-information feedback)."""

    name: str

    def begin(self, context: list[int], hidden: torch.Tensor | None = None) -> None:
        """The whole context so far: prompt tokens followed by the first generated token; hidden [len - 1, dim]
        the target's final hidden states at the prompt's positions (for proposers that draft from them)."""

    def propose(self, k: int) -> Draft:
        """Up to k tokens that follow the current context."""

    def accept(self, accepted: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        """These drafted tokens were accepted (a prefix of a chain, or one root-to-node path of a tree), and
        `next_token` (recovered or bonus) follows them.

        hidden: the target's final hidden states [1 + len(accepted), dim] at the positions that produced the
        accepted tokens and next_token (the previous pending token, then each accepted draft token), for proposers
        that draft from the target's hidden state (MTP)."""
