"""Token trees: shapes, positions, attention masks, and verification (greedy and lossless stochastic).

A tree draft holds N nodes; node i carries `tokens[i]` and has parent `parents[i]` (-1 = the root, i.e. the last
accepted token, which the target forward processes first). Nodes are ordered parents-first, so a node's depth is its
parent's depth + 1 and rows of the target forward are [root, node 0, ..., node N-1].

Verification walks down from the root (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024):
- greedy: follow the child whose token equals the target's argmax at the current node; stop when none does; the
  next token is the target's argmax at the last accepted node. The result is exactly what plain greedy decoding
  would produce, since the accepted path is a chain of the target's own choices.
- stochastic, with a deterministic tree (each node's children are distinct tokens chosen without sampling, e.g.
  top-k): each child is a point-mass proposal. Try the children in order, accepting child x with probability r(x),
  where r starts as the target's distribution p at the node; on rejection set r(x) = 0 and renormalize (the
  residual norm(max(0, r - delta_x))). If no child is accepted, draw the next token from r. Each trial is one
  step of Leviathan et al.'s speculative sampling with q = delta_x, so the output follows p exactly.
"""

from __future__ import annotations

import torch

from ..sampling import argmax, sample


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1)."""
    out: list[int] = []
    for p in parents:
        assert p < len(out), "nodes must come after their parents"
        out.append(1 if p < 0 else out[p] + 1)
    return out


def paths(parents: list[int]) -> list[list[int]]:
    """For each node, the rows of the target forward on its path: [0 (root), ..., 1 + node]."""
    out: list[list[int]] = []
    for p in parents:
        out.append(([0] if p < 0 else out[p]) + [len(out) + 1])
    return out


def tree_mask(parents: list[int], device=None) -> torch.Tensor:
    """[N+1, N+1] bool: row r may attend to row c iff c is r or an ancestor of r (row 0 = the root)."""
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[0, 0] = True
    for i, path in enumerate(paths(parents)):
        mask[i + 1, path] = True
    return mask


def children(parents: list[int]) -> dict[int, list[int]]:
    """node -> its children in order (key -1 = the root)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def verify_tree_greedy(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """logits [N+1, V] (row 0 = root) -> (accepted node indices along one path, next token)."""
    target = argmax(logits.float()).tolist()
    kids = children(parents)
    node, accepted = -1, []
    while True:
        want = target[node + 1]
        nxt = next((c for c in kids.get(node, []) if tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def verify_tree_stochastic(p, tokens: list[int], parents: list[int],
                           generator) -> tuple[list[int], int]:
    """p: the processed target distributions of the rows (sampling.Dist, or dense [N+1, V]; row 0 = root) ->
    (accepted path, next token).

    For deterministic trees (siblings are distinct point masses): recursive rejection sampling, see module doc.
    (Under a sequence's position-keyed Draws, verify.verify_tree walks the tree by coupling instead.)"""
    from ..sampling import Dist, Draws

    if isinstance(p, torch.Tensor):
        p = Dist(None, p, p.shape[-1])
    if isinstance(generator, Draws):
        generator = generator.at(0)
    kids = children(parents)
    node, accepted = -1, []
    while True:
        ids, probs = p.row(node + 1)
        r = probs.clone()
        moved = False
        for c in kids.get(node, []):
            x = tokens[c]
            rx = r[x] if ids is None else (r * (ids == x)).sum()
            if torch.rand((), generator=generator, device=r.device) < rx:
                accepted.append(c)
                node, moved = c, True
                break
            if ids is None:
                r[x] = 0.0
            else:
                r = r * (ids != x)
            total = r.sum()
            if total <= 0:  # the children covered all of p's mass, and all were rejected: impossible in exact math
                break
            r /= total
        if not moved:
            pick = int(sample(r, generator))
            return accepted, pick if ids is None else int(ids[pick])
