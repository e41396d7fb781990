"""The stochastic verifier reproduces the target distribution exactly (Leviathan et al. 2023, Theorem 1).

A toy "language model" over V = 10 tokens: p(. | previous token) and q(. | previous token) are hand-made tables with
the hard cases (q = 0 where p > 0, p = 0 where q > 0, q = None point-mass drafts, q = p). Each trial drafts two tokens
from q, verifies them against p, and continues by plain sampling when fewer than two tokens came out. The joint
distribution of the first two output tokens must be p(a) p(b | a): a chi-square test over 100 cells on 120k seeded
trials. A verifier with a wrong residual (sampling from p instead of norm(max(0, p - q)) after a rejection) must fail
the same test, which shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import make_generator, sample
from specdec.spec.base import Draft
from specdec.spec.verify import verify_greedy, verify_stochastic

V = 10
TRIALS = 120_000
START = 0


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, V, generator=g) ** 3
    q = torch.rand(V, V, generator=g) ** 3
    p[:, 7] = 0.0  # the target never says 7; the draft often does
    q[:, 2] = 0.0  # the draft never says 2; the target does
    q[:, 7] += 0.3
    q[3] = p[3]  # after token 3 the draft is exact
    return p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True)


def wrong_residual(p, draft, generator):
    """Resamples from p on rejection (ignoring q): biased toward tokens the draft over-proposes."""
    k = len(draft.tokens)
    for i, x in enumerate(draft.tokens):
        qx = draft.q[i, x] if draft.q is not None else 1.0
        if torch.rand((), generator=generator) * qx >= p[i, x]:
            return i, int(sample(p[i], generator))
    return k, int(sample(p[k], generator))


def run(p: torch.Tensor, q: torch.Tensor | None, verify=verify_stochastic, seed: int = 0) -> torch.Tensor:
    """Counts [V, V] of the first two output tokens over TRIALS runs."""
    g = make_generator(seed)
    counts = torch.zeros(V, V)
    guess = p.argsort(dim=1)[:, -2]  # point-mass drafts: the target's second choice (often wrong, never absurd)
    for _ in range(TRIALS):
        if q is None:
            x1 = int(guess[START])
            x2 = int(guess[x1])
            draft = Draft([x1, x2])
        else:
            x1 = int(sample(q[START], g))
            x2 = int(sample(q[x1], g))
            draft = Draft([x1, x2], torch.stack([q[START], q[x1]]))
        n, nxt = verify(torch.stack([p[START], p[x1], p[x2]]), draft, g)
        out = draft.tokens[:n] + [nxt]
        if len(out) < 2:
            out.append(int(sample(p[out[0]], g)))
        counts[out[0], out[1]] += 1
    return counts


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    expected = (p[START][:, None] * p) * counts.sum()
    keep = expected > 5  # cells with tiny expectation are pooled into one
    stat = (((counts - expected)[keep]) ** 2 / expected[keep]).sum().item()
    rest_e, rest_o = expected[~keep].sum().item(), counts[~keep].sum().item()
    cells = int(keep.sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    return stat, cells - 1


def critical(df: int) -> float:
    """Chi-square critical value at p ~ 1e-4 (Wilson-Hilferty approximation)."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("case", ["q", "q=None", "q=p"])
def test_joint_distribution_of_two_positions(case):
    p, q = tables(1)
    if case == "q=p":
        q = p.clone()
    counts = run(p, None if case == "q=None" else q)
    stat, df = chi_square(counts, p)
    assert stat < critical(df), f"chi2 {stat:.1f} > {critical(df):.1f} (df {df})"
    assert counts[:, 7].sum() == 0 and counts[7].sum() == 0  # p(7) = 0 is never output
    tv = 0.5 * (counts / counts.sum() - p[START][:, None] * p).abs().sum().item()
    assert tv < 0.015


def test_wrong_residual_fails_the_same_test():
    p, q = tables(1)
    stat, df = chi_square(run(p, q, verify=wrong_residual), p)
    assert stat > 10 * critical(df)


def test_greedy_verification():
    logits = torch.full((4, V), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 8] = 2.0  # argmax 3, 5, 1, 8
    assert verify_greedy(logits, Draft([3, 5, 1])) == (3, 8)  # all accepted, bonus 8
    assert verify_greedy(logits, Draft([3, 6, 1])) == (1, 5)  # rejected at 2nd, recovered 5
    assert verify_greedy(logits[:1], Draft([])) == (0, 3)  # no draft: plain greedy
