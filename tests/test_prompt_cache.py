"""Prompt caching (Engine(prompt_cache=True), the server's default): a finished sequence's slot keeps its tokens'
keys and values, a new prompt that begins with them prefills only the rest, and the output is bitwise what a fresh
prefill gives (the engine's exact prefill), tokens and log-probabilities alike."""

from __future__ import annotations

import pytest
import torch
from conftest import chat

from specdec.cache import KVPool, common_prefix
from specdec.engine import Engine, Sequence
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig, build_proposer, resolve_mtp

GREEDY = SamplingParams()
TURN1 = "Name three rivers in Europe and say one thing about each."
TURN2 = "Now the same for Africa, in one line each."


@pytest.fixture(scope="module")
def target(smollm2_default):
    return smollm2_default


def run(engine: Engine, prompt: list[int], n: int = 24, proposer=None, params: SamplingParams = GREEDY,
        spec: SpecConfig | None = None) -> Sequence:
    seq = engine.add(Sequence(list(prompt), params, n, True, proposer, spec.policy() if spec else None))
    seq.logprobs = 2
    engine.run([seq])
    return seq


def second_turn(target, first: Sequence, turn2: str = TURN2) -> list[int]:
    """The next chat turn's prompt: the conversation so far (the first answer as generated), then a new question."""
    tok = target.tokenizer
    answer = tok.decode(first.out)
    return tok.encode_chat([{"role": "user", "content": TURN1}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": turn2}])


def test_a_next_turn_prefills_only_its_new_tokens_and_gives_the_fresh_output(target):
    engine = Engine(target.model, max_batch=2, prompt_cache=True)
    first = run(engine, chat(target.tokenizer, TURN1))
    prompt2 = second_turn(target, first)
    kept = first.context()[:len(first.prompt) + len(first.out) - 1]  # the last token was never cached
    expected = common_prefix(kept, prompt2)
    assert expected > len(first.prompt)  # the turn shares the first prompt and (the start of) its answer
    again = run(engine, prompt2)
    assert again.stats.cached_tokens == expected
    fresh = run(Engine(target.model, max_batch=2, prompt_cache=True), prompt2)
    assert fresh.stats.cached_tokens == 0
    assert again.out == fresh.out and again.token_logprobs == fresh.token_logprobs  # bitwise: logprobs too


def test_an_unrelated_prompt_leaves_a_kept_slot_alone(target):
    engine = Engine(target.model, max_batch=2, prompt_cache=True)
    first = run(engine, chat(target.tokenizer, TURN1))
    other = run(engine, chat(target.tokenizer, "Count from one to ten."), n=8)
    # the chat template's system prompt is shared: copied from the first sequence's slot into the other one
    assert 0 < other.stats.cached_tokens < len(other.prompt)
    assert other.out == run(Engine(target.model, max_batch=1, prompt_cache=True), other.prompt, n=8).out
    assert len(engine.pool.kept) == 2  # both slots keep their sequences
    again = run(engine, second_turn(target, first), n=6)
    assert again.stats.cached_tokens > len(first.prompt)


def test_a_prompt_equal_to_a_kept_one_still_prefills_its_last_token(target):
    engine = Engine(target.model, max_batch=1, prompt_cache=True)
    prompt = chat(target.tokenizer, TURN1)
    first = run(engine, prompt, n=6)
    again = run(engine, prompt, n=6)
    assert again.stats.cached_tokens == len(prompt) - 1 and again.out == first.out
    assert again.token_logprobs == first.token_logprobs


def test_speculation_and_seeded_sampling_over_a_cached_prefix(target):
    """A lookup drafter over a reused prefix sees the whole prompt; seeded sampling gives the fresh text. (The second
    turn asks for the answer again, so the drafter finds it in the prompt: with another question, whether anything
    was drafted depended on the sampled words, and a change of the kernels' rounding left this seed with none.)"""
    params = SamplingParams(temperature=0.8, top_k=40, seed=7)
    spec = SpecConfig(kind="ngram", draft_max="4")
    engine = Engine(target.model, max_batch=2, prompt_cache=True)
    first = run(engine, chat(target.tokenizer, TURN1), params=params)
    prompt2 = second_turn(target, first, "Repeat your answer word for word.")
    proposer = build_proposer(spec, target, params)
    again = run(engine, prompt2, proposer=proposer, params=params, spec=spec)
    assert proposer.tokens[:len(prompt2)] == prompt2  # the cached prefix included
    assert again.stats.drafts > 0 and again.stats.accepted > 0
    fresh = run(Engine(target.model, max_batch=2, prompt_cache=True), prompt2, params=params)
    assert again.stats.cached_tokens > len(first.prompt) and again.out == fresh.out


def test_mtp_heads_take_no_cached_prefix(target):
    """MTP modules read the target's hidden state at every prompt position, which a cached prefix does not have:
    their sequences prefill the whole prompt."""
    mtp = resolve_mtp(target)
    if not mtp:
        pytest.skip("no MTP heads for this model")
    spec = SpecConfig(kind="mtp", draft_max="3")
    engine = Engine(target.model, max_batch=2, prompt_cache=True)
    first = run(engine, chat(target.tokenizer, TURN1))
    prompt2 = second_turn(target, first)
    again = run(engine, prompt2, proposer=build_proposer(spec, target, GREEDY, None, mtp), spec=spec)
    assert again.stats.cached_tokens == 0
    assert again.out == run(Engine(target.model, max_batch=2, prompt_cache=True), prompt2).out


def test_pool_picks_the_longest_kept_prefix_and_forgets_on_reuse():
    pool = KVPool(1, 1, 16, 64, 3, torch.float32)
    a, b = pool.acquire(), pool.acquire()
    a.length, b.length = 5, 4
    pool.release(a, [1, 2, 3, 4, 5])
    pool.release(b, [1, 2, 9, 9])
    d = pool.acquire(tokens=[5, 5])  # shares nothing: the slot that keeps nothing
    assert d.slot not in (a.slot, b.slot) and d.reused == 0 and len(pool.kept) == 2
    c = pool.acquire(tokens=[1, 2, 3, 4, 5, 6])  # all of a's entries: a's slot itself, which forgets them
    assert (c.slot, c.reused) == (a.slot, 5) and a.slot not in pool.kept
    e = pool.acquire()  # only b's slot is left
    assert e.slot == b.slot and not pool.kept
    d.length = 1
    pool.release(d, [7])
    pool.release(e)
    f = pool.acquire()  # nothing asked: a slot that keeps nothing before the one released longest ago
    assert f.slot == e.slot and d.slot in pool.kept


def test_pool_copies_a_shared_prefix_out_of_a_longer_kept_entry():
    pool = KVPool(1, 1, 16, 64, 2, torch.float32)
    a = pool.acquire()
    a.kv[:, :, a.base:a.base + 5] = torch.arange(5.0)[None, None, :, None, None]  # entries to recognize
    a.length = 5
    pool.release(a, [1, 2, 3, 4, 5])
    b = pool.acquire(tokens=[1, 2, 3, 8])
    assert b.slot != a.slot and b.reused == 3 and pool.kept == {a.slot: [1, 2, 3, 4, 5]}
    assert torch.equal(b.kv[:, :, b.base:b.base + 3], a.kv[:, :, a.base:a.base + 3])


def test_auto_leaves_its_mtp_heads_out_of_a_sequence_that_starts_from_a_cached_prefix(target):
    """--spec auto with the shipped heads: a next turn whose prompt is mostly cached drafts from the lookups alone
    (the heads would need the hidden states of the cached positions), with the fresh output."""
    mtp = resolve_mtp(target)
    if not mtp:
        pytest.skip("no MTP heads for this model")
    spec = SpecConfig(kind="auto")
    engine = Engine(target.model, max_batch=2, prompt_cache=True)
    first = run(engine, chat(target.tokenizer, TURN1), proposer=build_proposer(spec, target, GREEDY, None, mtp),
                spec=spec)
    prompt2 = second_turn(target, first)
    proposer = build_proposer(spec, target, GREEDY, None, mtp)
    assert proposer.needs_prompt_hidden
    again = run(engine, prompt2, proposer=proposer, spec=spec)
    assert again.stats.cached_tokens >= len(prompt2) // 2 and not proposer.needs_prompt_hidden
    assert "mtp" not in again.stats.by_source
    assert again.out == run(Engine(target.model, max_batch=2, prompt_cache=True), prompt2).out
