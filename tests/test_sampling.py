"""The fast sampler (sampling.process: top-k first, partial selection for top-p / min-p, candidates only) and the
sampling kernel (sample.c, what sampling.draw uses) give the distribution of Hugging Face's warper chain, on the
edge cases where a shortcut could go wrong; penalties and logit bias as HF / OpenAI define them; and speculative
sampling with penalties stays distributed as plain sampling (rejection sampling) or is the plain text (coupling).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec import kernels
from specdec.sampling import (
    Draws,
    SamplingParams,
    apply_penalties,
    draw,
    make_generator,
    next_token,
    probs_from_logits,
    process,
)
from specdec.spec.base import Draft
from specdec.spec.verify import verify_chain


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    out = logits.clone()
    for w in warpers:
        out = w(None, out)
    return out.softmax(-1)


def dense(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    d = process(logits, params)
    return torch.stack([d.dense(r) for r in range(len(d))])


def edge_cases() -> list[tuple[str, torch.Tensor, SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(3, 300, generator=g) * 3
    tie_k = rand.clone()
    tie_k[:, :5] = 9.0  # five tokens tied at the top: top-k 3 cuts through them (HF keeps all five)
    tie_p = torch.zeros(2, 50)
    tie_p[:, :4] = 2.0  # four equal tokens hold most of the mass: top-p 0.5 cuts between equal values
    one = torch.full((2, 100), -20.0)
    one[:, 17] = 30.0  # all mass on one token
    spread = torch.linspace(0, -30, 200).repeat(2, 1)
    return [
        ("tie at top-k", tie_k, SamplingParams(temperature=0.8, top_k=3)),
        ("tie at top-k, with top-p", tie_k, SamplingParams(temperature=0.8, top_k=3, top_p=0.9)),
        ("tie at top-p", tie_p, SamplingParams(temperature=1.0, top_p=0.5)),
        ("tie at top-p after top-k", tie_p, SamplingParams(temperature=1.0, top_k=10, top_p=0.5)),
        ("all mass on one", one, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)),
        ("all mass on one, top-p only", one, SamplingParams(temperature=0.8, top_p=0.95)),
        ("top-k above the vocabulary", rand, SamplingParams(temperature=0.9, top_k=1000)),
        ("top-k = vocabulary", rand, SamplingParams(temperature=0.9, top_k=300, top_p=0.9)),
        ("min-p leaves one", spread, SamplingParams(temperature=1.0, min_p=0.99)),
        ("min-p leaves one after top-k", spread, SamplingParams(temperature=1.0, top_k=40, min_p=0.99)),
        ("tiny temperature", rand, SamplingParams(temperature=1e-3, top_k=40, top_p=0.95, min_p=0.05)),
        ("huge temperature", rand, SamplingParams(temperature=100.0, top_k=40, top_p=0.95, min_p=0.05)),
        ("huge temperature, top-p only", rand, SamplingParams(temperature=100.0, top_p=0.95)),
        ("huge temperature, min-p only", rand, SamplingParams(temperature=100.0, min_p=0.5)),
        ("temperature only", rand, SamplingParams(temperature=0.7)),
        ("defaults", rand, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)),
        ("top-p needs more than the first partial selection", torch.randn(2, 5000, generator=g) * 0.1,
         SamplingParams(temperature=1.0, top_p=0.9)),
    ]


@pytest.mark.parametrize("name,logits,params", edge_cases(), ids=[c[0] for c in edge_cases()])
def test_fast_sampler_equals_transformers_warpers(name, logits, params):
    ref = probs_from_logits(logits, params)
    torch.testing.assert_close(dense(logits, params), ref, atol=2e-6, rtol=1e-5)
    if "tie at top-p" not in name:  # HF sorts ties in an unspecified order; specdec stably (see _ranked)
        torch.testing.assert_close(ref, hf_probs(logits, params), atol=2e-6, rtol=1e-5)


def random_params(g: torch.Generator) -> SamplingParams:
    return SamplingParams(temperature=float(torch.rand(1, generator=g)) * 2 + 0.05,
                          top_k=int(torch.randint(0, 60, (1,), generator=g)),
                          top_p=float(torch.rand(1, generator=g)) * 0.9 + 0.1 if torch.rand(1, generator=g) < 0.7
                          else 1.0,
                          min_p=float(torch.rand(1, generator=g)) * 0.3 if torch.rand(1, generator=g) < 0.5 else 0.0)


def test_fast_sampler_on_random_settings():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        logits = torch.randn(2, 400, generator=g) * float(torch.rand(1, generator=g) * 6)
        if torch.rand(1, generator=g) < 0.3:
            logits = logits.round()  # many ties
        params = random_params(g)
        torch.testing.assert_close(dense(logits, params), probs_from_logits(logits, params), atol=2e-6, rtol=1e-5)


needs_kernel = pytest.mark.skipif(kernels.sample_lib() is None, reason="no C compiler: no sampling kernel")


def kernel_dist(row: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """sample.c's kept candidates and probabilities as a dense row [V]; None on its dense path (no truncation)."""
    _, ids, probs = kernels.sample_row(row.contiguous(), params.top_k, params.temperature, params.top_p, params.min_p,
                                       0.5, want_candidates=True)
    if len(ids) == 0:
        return None
    ranked = [(-float(row[i]), -int(i)) for i in ids]
    assert ranked == sorted(ranked)  # value descending, ties by id descending: the dense reference's ranking
    out = torch.zeros(row.shape[0], dtype=torch.float64)
    out[ids] = probs
    return out


def inverse_cdf(p: torch.Tensor, order: torch.Tensor, u: float) -> tuple[int, float]:
    """The reference pick for u over p [V] walked in `order`, and how far u is from the nearest step edge."""
    cdf = p[order].double().cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    return int(order[min(i, len(order) - 1)]), float((cdf - u * cdf[-1]).abs().min())


@needs_kernel
@pytest.mark.parametrize("name,logits,params", edge_cases(), ids=[c[0] for c in edge_cases()])
def test_sampling_kernel_equals_the_reference(name, logits, params):
    """sample.c's kept candidates carry the dense reference's probabilities (ties, one-token mass, top-k past the
    vocabulary, min-p leaving one, tiny and huge temperatures, partial selections that must grow), and its pick for
    a uniform u is the reference's inverse CDF in the same order (away from rounding at a step's edge)."""
    ref = probs_from_logits(logits, params).double()
    for r in range(logits.shape[0]):
        row = logits[r].contiguous()
        got = kernel_dist(row, params)
        if got is None:  # the dense path: temperature only, the vocabulary walked in order
            assert params.top_k in (0,) or params.top_k >= row.shape[0]
            order = torch.arange(row.shape[0])
        else:
            torch.testing.assert_close(got, ref[r], atol=2e-6, rtol=1e-5)
            order = torch.tensor(sorted(range(row.shape[0]), key=lambda i: (-float(row[i]), -i)))
        for u in torch.rand(200, generator=torch.Generator().manual_seed(r), dtype=torch.float64).tolist():
            want, margin = inverse_cdf(ref[r], order, u)
            if margin > 1e-5:
                assert kernels.sample_row(row, params.top_k, params.temperature, params.top_p, params.min_p,
                                          u) == want, (name, u)


@needs_kernel
def test_sampling_kernel_on_random_settings():
    g = torch.Generator().manual_seed(6)
    for _ in range(300):
        V = int(torch.randint(2, 3000, (1,), generator=g))
        logits = torch.randn(V, generator=g) * float(torch.rand(1, generator=g) * 6)
        if torch.rand(1, generator=g) < 0.3:
            logits = logits.round()  # many ties
        if torch.rand(1, generator=g) < 0.2:
            logits[torch.randint(0, V, (V // 3,), generator=g)] = -math.inf  # banned tokens (logit bias -inf)
        params = random_params(g)
        got = kernel_dist(logits, params)
        if got is not None:
            torch.testing.assert_close(got, probs_from_logits(logits[None], params)[0].double(), atol=2e-6,
                                       rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("params", [SamplingParams(1.5, 0, 0.95), SamplingParams(2.0, 0, 1.0, 0.01),
                                    SamplingParams(1.0, 0, 0.999, 0.001)], ids=["top-p", "min-p", "both"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_sampling_kernel_on_large_nuclei(params, ties):
    """Flat rows of a real vocabulary's size at high temperature: thousands of survivors, past the size from which
    sample.c ranks the whole row (rank_all) instead of growing its heap; the same distribution as the reference."""
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        logits = torch.randn(49152, generator=g) * 1.5
        if ties:
            logits = (logits * 8).round() / 8  # runs of hundreds of equal values, some crossing the cut
        got = kernel_dist(logits, params)
        assert got is not None and int((got > 0).sum()) > 4096
        torch.testing.assert_close(got, probs_from_logits(logits[None], params)[0].double(), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("params", [SamplingParams(0.8, 40, 0.95, 0.05), SamplingParams(1.0, 0, 0.9),
                                    SamplingParams(1.0, 0, 1.0, 0.05)], ids=["defaults", "top-p", "min-p"])
def test_sampling_kernel_on_a_row_of_equal_logits(params):
    """Every token tied (a degenerate model): every one survives any cut, ranked by id. The ranking of a tie run
    was an insertion sort, 10 s a draw on 49152 tokens; a bound far above today's ~10 ms catches it coming back."""
    row = torch.zeros(49152)
    start = time.perf_counter()
    tok, ids, probs = kernels.sample_row(row, params.top_k, params.temperature, params.top_p, params.min_p, 0.25,
                                         want_candidates=True)
    assert time.perf_counter() - start < 2.0
    keep = 49152 if params.top_p >= 1.0 else math.ceil(49152 * params.top_p)  # top-p keeps the smallest prefix
    assert abs(len(ids) - keep) <= 1 and ids.tolist() == list(range(49151, 49151 - len(ids), -1))
    assert tok == int(ids[int(0.25 * len(ids))])


@pytest.mark.parametrize("kernel", [True, False], ids=["sample.c", "without the kernel"])
@pytest.mark.parametrize("params", [SamplingParams(0.9, 8, 0.9), SamplingParams(0.8, 40, 0.95, 0.05),
                                    SamplingParams(1.0), SamplingParams(0.7, 0, 0.8)],
                         ids=["top-k, top-p", "defaults", "temperature only", "top-p only"])
def test_draws_follow_the_distribution(params, kernel, monkeypatch):
    """draw() with each position's uniform (Draws.u, the coupling's randomness) samples p: chi-square over 20k
    positions, with the kernel and on the torch fallback; and it is a function of (logits, u): same u, same token."""
    if kernel and kernels.sample_lib() is None:
        pytest.skip("no C compiler: the sampling kernel is not built")
    if not kernel:
        monkeypatch.setattr(kernels, "sample_row", lambda *a, **k: None)
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 2
    p = probs_from_logits(logits[None], params)[0]
    n = 20_000
    d = Draws(11)
    got = torch.tensor([draw(logits, params, d.u(i)) for i in range(n)])
    freq = torch.bincount(got, minlength=1000).float()
    keep = p > 1e-4
    assert freq[p == 0].sum() == 0  # tokens the truncations removed never come out
    expected = p[keep] * n
    chi2 = float(((freq[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df) + 10, (chi2, df)
    assert draw(logits, params, d.u(5)) == int(got[5])


def test_samples_follow_the_distribution_and_the_seed():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9)
    d = process(logits, params)
    p = d.dense(0)
    g = make_generator(5)
    n = 40_000
    draws = torch.tensor([int(d.sample(g, 0)) for _ in range(n)])
    freq = torch.bincount(draws, minlength=1000).float()
    keep = p > 0
    assert freq[~keep].sum() == 0  # tokens the truncations removed never come out
    expected = p[keep] * n
    chi2 = float(((freq[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df) + 10, (chi2, df)
    a = [int(next_token(logits[0], params, make_generator(9))) for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same token


def test_penalties_match_their_definitions():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3)) * 2
    logits[:, 4] = -1.5  # a negative logit: the repetition penalty multiplies it
    ctx = [[1, 4, 4, 7], [2, 2, 2, 9, 1]]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.3, repeat_last_n=-1)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ctx[0]]), logits[:1].clone())
    torch.testing.assert_close(apply_penalties(logits[:1], p, ctx[:1]), ref)
    # window: only the last 2 tokens of the context count
    w = apply_penalties(logits[:1], SamplingParams(temperature=1.0, repetition_penalty=1.3, repeat_last_n=2), ctx[:1])
    assert torch.equal(w[0, 1], logits[0, 1]) and w[0, 7] == logits[0, 7] / 1.3 if logits[0, 7] > 0 else True
    # presence and frequency count generated tokens only (after n_prompt = 2)
    pf = apply_penalties(logits, SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25), ctx, 2)
    assert torch.isclose(pf[0, 4], logits[0, 4] - 0.5 - 0.25 * 1)  # one 4 after the prompt [1, 4]
    assert torch.isclose(pf[0, 7], logits[0, 7] - 0.75) and pf[0, 1] == logits[0, 1]  # the 1 is in the prompt
    assert torch.isclose(pf[1, 2], logits[1, 2] - 0.5 - 0.25 * 1)
    bias = apply_penalties(logits, SamplingParams(temperature=1.0, logit_bias=((3, 5.0), (6, -math.inf))), ctx)
    assert torch.isclose(bias[0, 3], logits[0, 3] + 5) and bias[1, 6] == -math.inf
    # and the fast path applies them: token 6 can never be drawn
    d = process(logits, SamplingParams(temperature=1.0, top_k=19, logit_bias=((6, -math.inf),)), ctx)
    assert float(d.prob_of(torch.tensor([6, 6]))[0]) == 0.0


# speculative sampling with penalties, end to end through verify_chain, on a toy model whose next-token logits
# depend on the last token: the first three output tokens must be distributed as plain sampling gives them
V, TRIALS = 6, 6_000  # the wrong-history control measured 1408 against a limit of 463 at 12k: ~3x margin at 6k
PEN = SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.8, repeat_last_n=-1, presence_penalty=0.4,
                     frequency_penalty=0.3, logit_bias=((2, 0.7),), seed=0)
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(4)) * 1.5
PROMPT = [0, 3]


def toy_logits(ctx: list[int]) -> torch.Tensor:
    return TABLE[ctx[-1]]


def plain_three(g: torch.Generator) -> tuple[int, ...]:
    ctx = list(PROMPT)
    for _ in range(3):
        ctx.append(next_token(toy_logits(ctx), PEN, g, ctx, len(PROMPT)))
    return tuple(ctx[len(PROMPT):])


def spec_three(g: torch.Generator, honest: bool = True) -> tuple[int, ...]:
    ctx = list(PROMPT)
    while len(ctx) < len(PROMPT) + 3:
        draft = Draft([(ctx[-1] + 1) % V, (ctx[-1] + 2) % V])  # point-mass guesses, often wrong
        rows = [ctx, ctx + draft.tokens[:1], ctx + draft.tokens]
        logits = torch.stack([toy_logits(r) for r in rows])
        if honest:
            n, nxt = verify_chain(logits, draft, PEN, g, ctx, len(PROMPT))
        else:  # a verifier that penalizes as if nothing had been generated yet
            n, nxt = verify_chain(logits, draft, PEN, g, PROMPT, len(PROMPT))
        ctx += draft.tokens[:n] + [nxt]
    return tuple(ctx[len(PROMPT):len(PROMPT) + 3])


def counts(fn, seed: int, **kw) -> torch.Tensor:
    g = make_generator(seed)
    c = torch.zeros(V, V, V)
    for _ in range(TRIALS):
        a, b, d = fn(g, **kw)
        c[a, b, d] += 1
    return c


def two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    keep = (a + b) > 10
    stat = float((((a - b) ** 2) / (a + b))[keep].sum())
    return stat, int(keep.sum()) - 1


def test_speculative_sampling_with_penalties_is_plain_sampling():
    plain = counts(plain_three, 1)
    spec = counts(spec_three, 2)
    stat, df = two_sample_chi2(plain, spec)
    limit = df + 4.5 * math.sqrt(2 * df)
    assert stat < limit, (stat, df)
    wrong = counts(spec_three, 3, honest=False)
    stat_wrong, df_wrong = two_sample_chi2(plain, wrong)
    assert stat_wrong > 3 * (df_wrong + 4.5 * math.sqrt(2 * df_wrong)), (stat_wrong, df_wrong)


def test_coupled_speculative_sampling_with_penalties_is_the_plain_text():
    """Under a sequence's Draws, point-mass drafts are verified by coupling: the output is the plain sampled text
    token for token, penalties and logit bias included, whatever was drafted; a verifier that penalizes with the
    wrong history writes another text."""
    def plain(d: Draws) -> tuple[int, ...]:
        ctx = list(PROMPT)
        for i in range(3):
            ctx.append(next_token(toy_logits(ctx), PEN, d.shifted(i), ctx, len(PROMPT)))
        return tuple(ctx[len(PROMPT):])

    def spec(d: Draws, honest: bool = True) -> tuple[int, ...]:
        ctx = list(PROMPT)
        while len(ctx) < len(PROMPT) + 3:
            draft = Draft([(ctx[-1] + 1) % V, (ctx[-1] + 2) % V])
            logits = torch.stack([toy_logits(r) for r in (ctx, ctx + draft.tokens[:1], ctx + draft.tokens)])
            n, nxt = verify_chain(logits, draft, PEN, d.shifted(len(ctx) - len(PROMPT)),
                                  ctx if honest else PROMPT, len(PROMPT))
            ctx += draft.tokens[:n] + [nxt]
        return tuple(ctx[len(PROMPT):len(PROMPT) + 3])

    seeds = range(400)
    assert all(spec(Draws(s)) == plain(Draws(s)) for s in seeds)
    assert sum(spec(Draws(s), honest=False) != plain(Draws(s)) for s in seeds) > 20
    assert len({plain(Draws(s)) for s in seeds}) > 50  # and the seeds do give different texts
