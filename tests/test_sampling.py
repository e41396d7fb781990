"""The fast sampler (sampling.process: top-k first, partial selection for top-p / min-p, candidates only) gives the
distribution of Hugging Face's warper chain, on the edge cases where a shortcut could go wrong; penalties and
logit bias as HF / OpenAI define them; and speculative sampling with penalties stays distributed as plain sampling.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.sampling import SamplingParams, apply_penalties, make_generator, next_token, probs_from_logits, process
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


def test_fast_sampler_on_random_settings():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        logits = torch.randn(2, 400, generator=g) * float(torch.rand(1, generator=g) * 6)
        if torch.rand(1, generator=g) < 0.3:
            logits = logits.round()  # many ties
        params = SamplingParams(temperature=float(torch.rand(1, generator=g)) * 2 + 0.05,
                                top_k=int(torch.randint(0, 60, (1,), generator=g)),
                                top_p=float(torch.rand(1, generator=g)) * 0.9 + 0.1 if torch.rand(1, generator=g) < 0.7
                                else 1.0,
                                min_p=float(torch.rand(1, generator=g)) * 0.3 if torch.rand(1, generator=g) < 0.5
                                else 0.0)
        torch.testing.assert_close(dense(logits, params), probs_from_logits(logits, params), atol=2e-6, rtol=1e-5)


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
V, TRIALS = 6, 12_000
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
