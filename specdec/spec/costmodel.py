"""The speculative-decoding speedup model (Leviathan et al. 2023, section 3.4), with measured costs.

With per-position acceptance probabilities a_1..a_K (a_i = P(draft token i accepted | tokens 1..i-1 accepted)), one
verification yields E = 1 + a_1 + a_1 a_2 + ... + a_1...a_K tokens, the bonus / recovered token included. For an
i.i.d. acceptance rate a this is (1 - a^(K+1)) / (1 - a). A step costs K drafting steps plus one target forward over
K+1 tokens, so the speedup over plain decoding (one forward of 1 token per token) is

    speedup(K) = E(K) / (K c + v(K+1)),   c = draft cost per token, v(T) = target forward over T tokens,

both relative to v(1). On a bandwidth-starved GPU v(T) ~ 1 for small T; on a small CPU it is not (MACHINE-FACTS:
v(4) ~ 1.6), which is why the best K here is small and sometimes 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def expected_tokens(acceptance: Sequence[float]) -> float:
    """E[tokens per verification] for per-position conditional acceptance probabilities (bonus token included)."""
    total, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        total += run
    return total


def expected_tokens_iid(a: float, k: int) -> float:
    """(1 - a^(K+1)) / (1 - a): the closed form for an i.i.d. acceptance rate a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup(acceptance: Sequence[float], draft_cost: float, verify_cost: Callable[[int], float]) -> float:
    """Predicted speedup of drafting K = len(acceptance) tokens per step; costs relative to one decode forward."""
    k = len(acceptance)
    return expected_tokens(acceptance) / (k * draft_cost + verify_cost(k + 1))


def best_k(acceptance: Sequence[float], draft_cost: float, verify_cost: Callable[[int], float],
           k_max: int) -> tuple[int, float]:
    """The K in [0, k_max] with the highest predicted speedup (K = 0 is plain decoding, speedup 1 / v(1))."""
    best = (0, 1.0 / verify_cost(1))
    e, run = 1.0, 1.0  # E(K) built up one position at a time (called every step: no O(K^2) re-summing)
    for k in range(1, min(k_max, len(acceptance)) + 1):
        run *= acceptance[k - 1]
        e += run
        s = e / (k * draft_cost + verify_cost(k + 1))
        if s > best[1]:
            best = (k, s)
    return best


def interpolate(costs: dict[int, float], t: int, prior_slope: float = 0.25) -> float | None:
    """Seconds of a target forward over t tokens from the measured seconds per T (`costs`): linear between the two
    nearest measured T, extrapolated with the slope of the nearest segment outside them (never decreasing with T
    beyond the largest); with one measured T, a prior slope of `prior_slope` of it per extra token; None when
    nothing was measured. Used by `--draft-max auto` (spec/autok.py) and `specdec roofline` alike."""
    if not costs:
        return None
    if t in costs:
        return costs[t]
    ts = sorted(costs)
    if len(ts) == 1:
        return costs[ts[0]] * (1.0 + prior_slope * (t - ts[0]))
    lo = max((x for x in ts if x < t), default=None)
    hi = min((x for x in ts if x > t), default=None)
    if lo is None:
        lo, hi = ts[0], ts[1]
    elif hi is None:
        lo, hi = ts[-2], ts[-1]
    slope = (costs[hi] - costs[lo]) / (hi - lo)
    if t > ts[-1]:
        slope = max(slope, 0.0)
    return max(costs[lo] + slope * (t - lo), 1e-9)
