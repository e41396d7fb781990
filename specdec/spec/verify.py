"""Verification of drafted tokens against the target's distributions: greedy and stochastic (rejection sampling).

It knows nothing of proposers: a Draft is tokens plus, optionally, the draft distributions q they were sampled from.
Letters follow the papers: p = target distribution, q = draft distribution, x = drafted token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling import Dist, Draws, SamplingParams, apply_penalties, argmax, draw, process, sample
from .base import Draft


def verify_greedy(logits: torch.Tensor, draft: Draft) -> tuple[int, int]:
    """logits [k+1, V] -> (n_accepted, next_token).

    Accept drafted tokens while each equals the target's argmax; the next token is the target's argmax after the
    last accepted one (the recovered token on a mismatch, the bonus token when all k are accepted)."""
    target = argmax(logits.float()).tolist()  # [k+1]
    n = 0
    while n < len(draft.tokens) and draft.tokens[n] == target[n]:
        n += 1
    return n, target[n]


def verify_stochastic(p: Dist | torch.Tensor, draft: Draft, generator: torch.Generator | Draws
                      ) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
    Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

    p: the target's processed distributions at the k+1 positions (a Dist, or dense [k+1, V]); draft.q [k, V] or
    None (point masses). Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the
    recovered token from norm(max(0, p_i - q_i)); when all k are accepted draw the bonus token from p_k. The output
    is then distributed exactly as p. With q = None, q_i is the point mass on x_i: accept with probability
    p_i(x_i), and on rejection draw from p_i with x_i removed. Only the drafted tokens' probabilities are looked
    up row by row; a residual is built only at the first rejected row. A sequence's Draws give the generator of
    its first position (point-mass drafts under Draws are verified by coupling instead: verify_coupled)."""
    if isinstance(p, torch.Tensor):
        p = Dist(None, p, p.shape[-1])
    k = len(draft.tokens)
    if isinstance(generator, Draws):
        generator = generator.at(0)
    if k == 0:
        return 0, int(p.sample(generator, 0))
    x = torch.tensor(draft.tokens, device=p.probs.device)
    px = p.prob_of(x)  # [k] p_i(x_i)
    qx = draft.q[:k].gather(1, x[:, None]).squeeze(1) if draft.q is not None else torch.ones_like(px)  # [k]
    u = torch.rand(k, generator=generator, device=p.probs.device)
    # accept iff u < p/q, written without division (q(x) = 0 cannot happen for a token drawn from q)
    rejected = (u * qx >= px).tolist()
    for i in range(k):
        if rejected[i]:
            if draft.q is not None:
                dense = p.dense(i)
                residual = (dense - draft.q[i]).clamp_(min=0.0)
                ids = None
            else:  # p_i without x_i, on p's own candidates
                ids, probs = p.row(i)
                residual = probs * (ids != draft.tokens[i]) if ids is not None else probs.clone()
                if ids is None:
                    residual[draft.tokens[i]] = 0.0
                dense = probs
            total = residual.sum()
            # p == q (up to rounding) leaves no residual mass; then rejection had probability ~0 and p is the answer
            dist = residual / total if total > 0 else dense
            pick = int(sample(dist, generator))
            return i, int(ids[pick]) if ids is not None else pick
    return k, int(p.sample(generator, k))


def verify_coupled(logits: torch.Tensor, draft: Draft, params: SamplingParams, draws: Draws,
                   history: Sequence[Sequence[int]] | None = None, n_prompt: int = 0) -> tuple[int, int]:
    """Point-mass drafts under position-keyed Draws: the acceptance law of verify_stochastic (x_i accepted with
    probability p_i(x_i), the recovered token from p_i without x_i) realized by coupling: row i draws the very token
    plain decoding draws at its position (sampling.draw with Draws.u(i)) and x_i is accepted iff it is that token,
    so the output is the plain sampled text itself (drafter-invariant, see Draws). Rows after the first rejection
    are never processed."""
    k = len(draft.tokens)
    for i in range(k + 1):
        y = draw(logits[i], params, draws.u(i), history[i] if history else None, n_prompt)
        if i == k or y != draft.tokens[i]:
            return i, y
    raise AssertionError("unreachable")


def target_dist(logits: torch.Tensor, params: SamplingParams, history: Sequence[Sequence[int]] | None = None,
                n_prompt: int = 0) -> Dist:
    """The processed target distribution of every verified row; history[r]: row r's context (for penalties)."""
    return process(logits, params, history if params.penalized else None, n_prompt)


def verify_chain(logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | Draws | None,
                 context: Sequence[int] = (), n_prompt: int = 0) -> tuple[int, int]:
    """logits [k+1, V] for [last accepted token, x_1 .. x_k] -> (n_accepted, next_token), greedy or stochastic.

    context: every token before row 0's prediction (prompt, then the generated tokens incl. the pending one), for
    penalties: row i sees it followed by x_1 .. x_i, as plain decoding would after accepting them."""
    history = [list(context) + draft.tokens[:i] for i in range(len(draft) + 1)] if params.penalized else None
    if params.greedy:
        if params.penalized:
            logits = apply_penalties(logits.float(), params, history, n_prompt)
        return verify_greedy(logits, draft)
    if isinstance(generator, Draws) and draft.q is None:
        return verify_coupled(logits, draft, params, generator, history, n_prompt)
    return verify_stochastic(target_dist(logits, params, history, n_prompt), draft, generator)


def verify_tree(logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | Draws | None,
                context: Sequence[int] = (), n_prompt: int = 0) -> tuple[list[int], int]:
    """logits [N+1, V] for [root, nodes...] of a tree draft -> (accepted node indices along one path, next token)."""
    from .tree import children, paths, verify_tree_greedy, verify_tree_stochastic

    history = None
    if params.penalized:  # each node's row follows its own root-to-node path
        history = [list(context)] + [list(context) + [draft.tokens[r - 1] for r in path[1:]]
                                     for path in paths(draft.parents)]
    if params.greedy:
        if params.penalized:
            logits = apply_penalties(logits.float(), params, history, n_prompt)
        return verify_tree_greedy(logits, draft.tokens, draft.parents)
    if draft.q is not None:
        raise ValueError("stochastic verification of sampled trees is not supported: draft deterministic trees")
    if isinstance(generator, Draws):  # coupled, as verify_coupled: each row on the path draws plain decoding's token
        kids = children(draft.parents)
        node, accepted = -1, []
        while True:
            y = draw(logits[node + 1], params, generator.u(len(accepted)), history[node + 1] if history else None,
                     n_prompt)
            nxt = next((c for c in kids.get(node, []) if draft.tokens[c] == y), None)
            if nxt is None:
                return accepted, y
            accepted.append(nxt)
            node = nxt
    return verify_tree_stochastic(target_dist(logits, params, history, n_prompt), draft.tokens, draft.parents,
                                  generator)
