"""Verification of drafted tokens against the target's distributions: greedy and stochastic (rejection sampling).

It knows nothing of proposers: a Draft is tokens plus, optionally, the draft distributions q they were sampled from.
Letters follow the papers: p = target distribution, q = draft distribution, x = drafted token.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, probs_from_logits, sample
from .base import Draft


def verify_greedy(logits: torch.Tensor, draft: Draft) -> tuple[int, int]:
    """logits [k+1, V] -> (n_accepted, next_token).

    Accept drafted tokens while each equals the target's argmax; the next token is the target's argmax after the
    last accepted one (the recovered token on a mismatch, the bonus token when all k are accepted)."""
    target = torch.argmax(logits, dim=-1).tolist()  # [k+1]
    n = 0
    while n < len(draft.tokens) and draft.tokens[n] == target[n]:
        n += 1
    return n, target[n]


def verify_stochastic(p: torch.Tensor, draft: Draft, generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
    Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

    p [k+1, V]: the target's processed distributions at the k+1 positions; draft.q [k, V] or None (point masses).
    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the recovered token from
    norm(max(0, p_i - q_i)); when all k are accepted draw the bonus token from p_k. The output is then distributed
    exactly as p. With q = None, q_i is the point mass on x_i: accept with probability p_i(x_i), and on rejection
    draw from p_i with x_i removed."""
    k = len(draft.tokens)
    if k == 0:
        return 0, int(sample(p[0], generator))
    x = torch.tensor(draft.tokens, device=p.device)
    px = p[:k].gather(1, x[:, None]).squeeze(1)  # [k] p_i(x_i)
    qx = draft.q[:k].gather(1, x[:, None]).squeeze(1) if draft.q is not None else torch.ones_like(px)  # [k]
    u = torch.rand(k, generator=generator, device=p.device)
    # accept iff u < p/q, written without division (q(x) = 0 cannot happen for a token drawn from q)
    rejected = (u * qx >= px).tolist()
    for i in range(k):
        if rejected[i]:
            if draft.q is not None:
                residual = (p[i] - draft.q[i]).clamp_(min=0.0)
            else:
                residual = p[i].clone()
                residual[draft.tokens[i]] = 0.0
            total = residual.sum()
            # p == q (up to rounding) leaves no residual mass; then rejection had probability ~0 and p is the answer
            dist = residual / total if total > 0 else p[i]
            return i, int(sample(dist, generator))
    return k, int(sample(p[k], generator))


def verify_chain(logits: torch.Tensor, draft: Draft, params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[int, int]:
    """logits [k+1, V] for [last accepted token, x_1 .. x_k] -> (n_accepted, next_token), greedy or stochastic."""
    if params.greedy:
        return verify_greedy(logits, draft)
    return verify_stochastic(probs_from_logits(logits, params), draft, generator)


def verify_tree(logits: torch.Tensor, draft: Draft, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """logits [N+1, V] for [root, nodes...] of a tree draft -> (accepted node indices along one path, next token)."""
    from .tree import verify_tree_greedy, verify_tree_stochastic

    if params.greedy:
        return verify_tree_greedy(logits, draft.tokens, draft.parents)
    if draft.q is not None:
        raise ValueError("stochastic verification of sampled trees is not supported: draft deterministic trees")
    return verify_tree_stochastic(probs_from_logits(logits, params), draft.tokens, draft.parents, generator)
