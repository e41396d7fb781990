"""The batched engine (specdec/engine.py): a sequence's output is the same alone or in any batch, for every
proposer, greedy and seeded; the cache pool reuses slots and keeps sequences apart; speculative sampling through the
whole step is distributed as plain sampling on the real model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import CHAT_PROMPTS, chat
from memo import Memo, MemoModule
from tiny_models import write_gguf

from specdec.api import LLM
from specdec.engine import Engine, Sequence
from specdec.loader import load
from specdec.sampling import SamplingParams, draw, process
from specdec.spec import SpecConfig, build_proposer, resolve_mtp
from specdec.spec import verify as verify_mod

GREEDY = SamplingParams()
PROMPTS = CHAT_PROMPTS + [
    "Repeat exactly, twice: the quick brown fox jumps over the lazy dog.",
    "Summarize in one line: Paris is the capital of France. Paris is known for the Eiffel Tower.",
    "Count from one to twelve in words.",
    "hi",
]
MAX = [24, 14, 30, 9, 26, 18, 21, 12]  # different lengths: sequences leave (and others join) mid-run


@pytest.fixture(scope="module")
def target(smollm2_default):
    return smollm2_default


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    path = write_gguf("llama", tmp_path_factory.mktemp("draft") / "tiny-draft.gguf", seed=11)
    return load(path, ctx=2048)


SPECS = {
    "none": SpecConfig(),
    "ngram": SpecConfig(kind="ngram", draft_max="4"),
    "ngram-auto": SpecConfig(kind="ngram"),
    "draft": SpecConfig(kind="draft", draft_max="3", draft_p_min=0.0),
    "mtp": SpecConfig(kind="mtp", draft_max="3"),
    "mtp-tree": SpecConfig(kind="mtp", draft_max="5", tree=(2, 2)),
    "suffix": SpecConfig(kind="suffix"),
    "auto": SpecConfig(kind="auto"),  # suffix lookup + the shipped MTP heads
    "auto-tree": SpecConfig(kind="auto", tree=(2, 2)),
    "auto-draft": SpecConfig(kind="auto", draft_p_min=0.0),  # suffix + MTP heads + a draft model
}


def run_batch(target, draft, spec: SpecConfig, batch: int, params: list[SamplingParams], draft_too: bool = False
              ) -> list[list[int]]:
    llm = LLM.of(target, draft if spec.kind == "draft" or draft_too else None, spec, max_batch=batch)
    outs = llm.generate([chat(target.tokenizer, p) for p in PROMPTS], params, max_tokens=MAX, ignore_eos=True,
                        progress=False)
    return [o.tokens for o in outs]


@pytest.fixture(scope="module")
def solo(target, tiny_draft):
    """Each prompt alone (batch 1), per proposer: the reference."""
    cache = {}

    def get(name: str, params: tuple[SamplingParams, ...]) -> list[list[int]]:
        key = (name, params)
        if key not in cache:
            cache[key] = run_batch(target, tiny_draft, SPECS[name], 1, list(params), name.endswith("draft"))
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("batch", [3, 8])
def test_greedy_output_does_not_depend_on_the_batch(target, tiny_draft, solo, name, batch, monkeypatch):
    params = (GREEDY,) * len(PROMPTS)
    ref = solo(name, params)
    assert ref == solo("none", params)  # every proposer's greedy output is plain greedy output
    sizes = []
    real = target.model.forward_batch
    monkeypatch.setattr(target.model, "forward_batch", lambda items: sizes.append(len(items)) or real(items))
    assert run_batch(target, tiny_draft, SPECS[name], batch, list(params), name.endswith("draft")) == ref
    assert max(sizes) == min(batch, len(PROMPTS)) and min(sizes) < max(sizes)  # batched, with joins and leaves


def test_seeded_sampling_does_not_depend_on_the_batch(target, tiny_draft, solo):
    params = tuple(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=100 + i)
                   for i in range(len(PROMPTS)))
    for name in ("none", "ngram", "mtp"):
        ref = solo(name, params)
        assert run_batch(target, tiny_draft, SPECS[name], 3, list(params)) == ref
        assert run_batch(target, tiny_draft, SPECS[name], 8, list(params)) == ref
    assert len({tuple(t) for t in solo("none", params)}) == len(PROMPTS)


SEEDED = tuple(SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=100 + i)
               for i in range(len(PROMPTS)))


@pytest.mark.parametrize("name", ["ngram-auto", "mtp-tree", "auto", "auto-draft"])
def test_seeded_speculative_sampling_is_the_plain_sampled_text(target, tiny_draft, solo, name):
    """Point-mass drafts (lookups, argmax drafts, deterministic trees) are verified by coupling with plain sampling
    (sampling.Draws): a seeded speculative run writes the plain seeded run's text, whatever each step drafted."""
    assert solo(name, SEEDED) == solo("none", SEEDED)
    if name == "auto":  # and in a batch, where each step's draft lengths differ again
        assert run_batch(target, tiny_draft, SPECS[name], 3, list(SEEDED)) == solo("none", SEEDED)


def test_sampled_chain_drafts_are_exact_but_not_the_plain_text(target, tiny_draft, solo):
    """The control: chains sampled from the heads' q are verified by rejection sampling, exact in distribution
    (the end-to-end tests) but another text than plain sampling's, so the identity above is not for free."""
    assert solo("mtp", SEEDED) != solo("none", SEEDED)


def test_cache_pool_reuses_slots_and_keeps_sequences_apart(target):
    m = target.model
    engine = Engine(m, max_batch=2)
    a = engine.add(Sequence(chat(target.tokenizer, PROMPTS[0]), GREEDY, 12, True))
    b = engine.add(Sequence(chat(target.tokenizer, PROMPTS[1]), GREEDY, 6, True))
    assert engine.free_slots == 0 and {a.cache.slot, b.cache.slot} == {0, 1}
    with pytest.raises(Exception, match="slots"):
        engine.add(Sequence([1, 2, 3], GREEDY, 4))
    slot_b = b.cache.slot
    engine.run([b])
    assert engine.free_slots == 1 and b.cache is None and a.finish is None
    c = engine.add(Sequence(chat(target.tokenizer, PROMPTS[2]), GREEDY, 8, True))
    assert c.cache.slot == slot_b  # the freed slot is taken again
    # rolling one sequence back leaves the other's cache untouched
    engine.run([a, c])
    ref = Engine(m, max_batch=1)
    alone = ref.add(Sequence(chat(target.tokenizer, PROMPTS[2]), GREEDY, 8, True))
    ref.run([alone])
    assert c.out == alone.out


def test_prefix_start_is_the_same_as_prefilling(target):
    engine = Engine(target.model, max_batch=3)
    ids = chat(target.tokenizer, PROMPTS[3])
    p = SamplingParams(temperature=0.8, seed=4)
    own = engine.add(Sequence(ids, p, 16, True))
    engine.run([own])
    pfx = engine.prefill_prefix(ids)
    forked = engine.add(Sequence(ids, p, 16, True), pfx)
    engine.release_prefix(pfx)
    engine.run([forked])
    assert forked.out == own.out


# --------------------------------------------------------------------------------------------------------------
# lossless sampling end to end: the first three generated tokens of a prompt, at temperature 1 (top-k 6), drawn
# SAMPLES times through the whole step with each proposer, against the exact plain distribution computed by the model

SAMPLES = 20_000  # per proposer; target (and draft model / MTP module) rows served by context (tests/memo.py)
P1 = SamplingParams(temperature=1.0, top_k=6)
REPEATED = "Say this three times: red green blue yellow. red green blue yellow. red green blue"


def exact_three(model, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) under plain sampling, by enumeration over the top-6 survivors; each distribution computed as
    decoding computes it (the prompt prefilled, then one decode step per token: the same bits)."""
    def dist(ctx: list[int]):
        cache = model.new_cache(len(ctx) + 1)
        logits, _ = model.prefill(prompt, cache)
        for i, t in enumerate(ctx[len(prompt):]):
            lg, _ = model(torch.tensor([[t]]), torch.tensor([len(prompt) + i]), cache, exact=True)
            logits = lg[0, -1]
        d = process(logits, P1)
        return [(int(i), float(p)) for i, p in zip(d.ids[0], d.probs[0], strict=True) if p > 0]

    out = {}
    with torch.inference_mode():
        for a, pa in dist(prompt):
            for b, pb in dist(prompt + [a]):
                for c, pc in dist(prompt + [a, b]):
                    out[(a, b, c)] = pa * pb * pc
    return out


def sample_three(target, spec: SpecConfig, draft=None, seed: int = 0, samples: int = SAMPLES, memo: bool = True
                 ) -> tuple[list[tuple[int, int, int]], int, int]:
    """The first three tokens of `samples` seeded runs of REPEATED through the engine, in seed order, and the
    drafted / accepted token totals. memo: the target's, draft model's and MTP module's rows served by context
    (tests/memo.py: the same rows, each computed once)."""
    prompt = target.tokenizer.encode(REPEATED)
    L = len(prompt) + 8
    model = Memo(target.model, L) if memo else target.model
    if memo and draft is not None:
        draft = replace(draft, model=Memo(draft.model, L))
    engine = Engine(model, max_batch=129, max_len=L)
    mtp = resolve_mtp(target) if spec.kind == "mtp" else None
    if memo and mtp is not None and mtp[0] != "parallel":  # sequential modules, EAGLE-3
        mtp = (mtp[0], [MemoModule(m, L) for m in mtp[1]], *mtp[2:])
    outs: list[tuple[int, int, int]] = []
    drafted = accepted = 0
    pfx = engine.prefill_prefix(prompt)
    while len(outs) < samples:
        seqs = []
        for j in range(min(128, samples - len(outs))):
            params = replace(P1, seed=seed * 1_000_003 + len(outs) + j)
            proposer = build_proposer(spec, target, params, draft, mtp)
            seqs.append(engine.add(Sequence(prompt, params, 3, True, proposer, spec.policy()), pfx))
        engine.run(seqs)
        outs += [tuple(s.out[:3]) for s in seqs]
        drafted += sum(s.stats.drafted for s in seqs)
        accepted += sum(s.stats.accepted for s in seqs)
    engine.release_prefix(pfx)
    return outs, drafted, accepted


def tally(outs: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], int]:
    counts: dict[tuple[int, int, int], int] = {}
    for o in outs:
        counts[o] = counts.get(o, 0) + 1
    return counts


def chi_square(counts: dict, exact: dict) -> tuple[float, int]:
    n = sum(counts.values())
    stat, cells, rest_e, rest_o = 0.0, 0, 0.0, 0
    for key, p in exact.items():
        e = p * n
        if e >= 5:
            stat += (counts.get(key, 0) - e) ** 2 / e
            cells += 1
        else:
            rest_e += e
            rest_o += counts.get(key, 0)
    outside = sum(v for k, v in counts.items() if k not in exact)  # outputs plain sampling can never give
    rest_o += outside
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    return stat, cells - 1


def limit(df: int) -> float:  # chi-square critical value at p ~ 1e-4 (Wilson-Hilferty)
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.fixture(scope="module")
def exact(target):
    return exact_three(target.model, target.tokenizer.encode(REPEATED))


class Scaled:
    """The default model with its logits times `factor`: as a draft model, a distribution q that overlaps the
    target's p without equalling it, so its drafts are both accepted and rejected (a random-weight draft's top 6
    tokens never meet the target's: every draft rejected)."""

    def __init__(self, model, factor: float):
        self.model, self.factor = model, factor

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.model(*args, **kwargs)
        return logits * self.factor, hidden

    def prefill(self, tokens: list[int], cache, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.model.prefill(tokens, cache, chunk)
        return logits * self.factor, hidden


@pytest.fixture(scope="module")
def scaled_draft(target):
    return replace(target, model=Scaled(target.model, 0.6))


E2E_SPECS = {"ngram": SpecConfig(kind="ngram", draft_max="3", ngram_min=1),
             "mtp": SpecConfig(kind="mtp", draft_max="2"),
             "draft": SpecConfig(kind="draft", draft_max="2", draft_p_min=0.0)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "mtp", "draft"])
def test_speculative_sampling_end_to_end_is_plain_sampling(target, scaled_draft, exact, name):
    outs, drafted, accepted = sample_three(target, E2E_SPECS[name], scaled_draft if name == "draft" else None, seed=1)
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    counts, n = tally(outs), len(outs)
    stat, df = chi_square(counts, exact)
    assert stat < limit(df), (stat, df)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    assert tv < 0.03 + 0.5 * math.sqrt(len(exact) / n)


@pytest.mark.slow
def test_memo_changes_nothing(target, scaled_draft):
    """The memoized forwards the end-to-end tests run on give the samples the real forwards give, seed by seed."""
    for name, spec in E2E_SPECS.items():
        draft = scaled_draft if name == "draft" else None
        real = sample_three(target, spec, draft, seed=1, samples=128, memo=False)
        assert sample_three(target, spec, draft, seed=1, samples=128) == real, name


@pytest.mark.slow
def test_a_wrong_residual_fails_the_end_to_end_test(target, exact, monkeypatch):
    """The same test with a coupled verifier that, on rejecting a point-mass draft, draws again from p itself with
    another uniform (not the plain draw, which excludes the rejected token): biased toward drafted tokens, it must
    fail."""
    real = verify_mod.verify_coupled

    def wrong(logits, draft, params, draws, history=None, n_prompt=0):
        n, tok = real(logits, draft, params, draws, history, n_prompt)
        if n < len(draft.tokens):  # a rejection happened: redraw at that row, the drafted token allowed
            return n, draw(logits[n], params, draws.u(1000 + n))
        return n, tok

    monkeypatch.setattr(verify_mod, "verify_coupled", wrong)
    outs, _, _ = sample_three(target, E2E_SPECS["ngram"], seed=2)
    stat, df = chi_square(tally(outs), exact)
    assert stat > 3 * limit(df), (stat, df)


def test_without_the_attention_kernel_each_sequence_runs_alone(target, monkeypatch):
    """No kernel (no C compiler, a GPU): every sequence gets its own exact forward (PyTorch SDPA over its own
    slot of the pool), with the same outputs as running it alone."""
    monkeypatch.setattr(target.model, "kernel", False)
    params = [GREEDY] * len(PROMPTS)
    for name in ("none", "ngram"):
        solo = run_batch(target, None, SPECS[name], 1, params)
        assert run_batch(target, None, SPECS[name], 3, params) == solo


def test_logprobs_of_accepted_drafts_are_the_targets(target):
    """A speculative run reports, for every token (drafted and accepted, or not), the target's own log-probability:
    bitwise those of plain decoding, and the log-softmax of the model's logits."""
    ids = chat(target.tokenizer, PROMPTS[4])
    runs = {}
    for name in ("none", "ngram"):
        engine = Engine(target.model, max_batch=1)
        spec = SPECS[name]
        seq = engine.add(Sequence(ids, GREEDY, 20, True, build_proposer(spec, target, GREEDY), spec.policy(),
                                  logprobs=3))
        engine.run([seq])
        runs[name] = seq
    plain, spec = runs["none"], runs["ngram"]
    assert spec.stats.accepted > 0 and spec.out == plain.out
    assert spec.token_logprobs == plain.token_logprobs
    lp, alts = plain.token_logprobs[0]
    with torch.inference_mode():
        logits, _ = target.model.prefill(ids, target.model.new_cache())
    ref = torch.log_softmax(logits.float(), -1)
    assert abs(lp - float(ref[plain.out[0]])) < 1e-6 and [t for t, _ in alts] == ref.topk(3).indices.tolist()


def test_a_batched_forward_charges_drafts_their_marginal_cost():
    """engine.attribute: alone, a sequence is charged the whole forward; in a batch, every sequence an equal share of
    the draft-free forward F(n) (measured at an earlier step) and the drafting ones the excess, split by draft rows;
    before F(n) is known, and under the old rule, rows share the forward equally."""
    from specdec.engine import attribute

    costs: dict[tuple[int, int], float] = {}
    assert attribute(0.005, [3], costs) == [0.005]  # one sequence: its rows are the forward
    assert attribute(0.016, [2, 0, 0, 0, 0, 0, 0, 0], costs) == pytest.approx([0.0048] + [0.0016] * 7)  # F(8) unknown
    assert attribute(0.008, [0] * 8, costs) == pytest.approx([0.001] * 8)  # a draft-free step measures F(8)
    assert costs[8, 8] == 0.008
    attribute(0.012, [1, 1, 1, 1], costs)  # 8 rows of 4 sequences (a wave's end): not the draft-free F(8)
    assert costs[8, 8] == 0.008
    shares = attribute(0.0108, [3, 0, 1, 0, 0, 0, 0, 0], costs)  # 12 rows: 2.8 ms over F(8)
    assert shares == pytest.approx([0.001 + 0.0021, 0.001, 0.001 + 0.0007] + [0.001] * 5)
    assert sum(shares) == pytest.approx(0.0108)
    # a drafting step measured faster than F(8) (noise): no negative marginal cost, the forward shared by sequence
    assert attribute(0.0072, [2] + [0] * 7, costs) == pytest.approx([0.0009] * 8)


def test_llm_generate_refuses_misuse_in_words(target):
    """specdec.LLM.generate's arguments are checked by type and count, naming the argument: a string of params or a
    prompt that is a number used to fail as "6 sampling settings / 1 limits for 1 prompts" or "object of type 'int'
    has no len()"."""
    llm = LLM.of(target, max_batch=2)
    cases = [(dict(prompts="hi"), TypeError, "give [text] for one"),
             (dict(prompts=[5]), TypeError, "prompts[0] must be a string or a list of token ids, not int"),
             (dict(prompts=["hi"], params="greedy"), TypeError, "params must be a SamplingParams"),
             (dict(prompts=["a", "b"], params=[SamplingParams()]), ValueError, "params has 1 entries for 2 prompts"),
             (dict(prompts=["a", "b"], max_tokens=[4]), ValueError, "max_tokens has 1 entries for 2 prompts")]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            llm.generate(progress=False, **kwargs)
    assert len(llm.generate([[1, 2, 3]], max_tokens=2, progress=False)[0].tokens) == 2  # token ids still work
