"""Decoding: greedy output equals transformers' greedy generate; the KV cache (prefill, decode, rollback) equals
full forwards; sampling processes and draws from the same distribution as transformers' warpers."""

from __future__ import annotations

import pytest
import torch
from conftest import CHAT_PROMPTS
from conftest import chat as chat_ids
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.generate import generate
from specdec.sampling import SamplingParams, make_generator, probs_from_logits, sample

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_equals_transformers_generate(smollm2_f32, hf_smollm2, prompt):
    tok = smollm2_f32.tokenizer
    ids = chat_ids(tok, prompt)
    ours = generate(smollm2_f32.model, tok, ids, GREEDY, max_tokens=64, ignore_eos=True).tokens
    with torch.no_grad():
        ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


def test_prefill_decode_equals_full_forward(smollm2_f32):
    m = smollm2_f32.model
    ids = chat_ids(smollm2_f32.tokenizer, "Tell me about the Moon and the tides it causes.")
    with torch.inference_mode():
        full, _ = m(torch.tensor([ids]), torch.arange(len(ids)), m.new_cache())
        cache = m.new_cache()
        n = len(ids) - 6
        last, _ = m.prefill(ids[:n], cache, chunk=7)  # several chunks
        steps = [last]
        for i in range(n, len(ids)):
            lg, _ = m(torch.tensor([[ids[i]]]), torch.tensor([i]), cache)
            steps.append(lg[0, -1])
    torch.testing.assert_close(torch.stack(steps[:-1]), full[0, n - 1:-1], atol=2e-3, rtol=0)
    torch.testing.assert_close(steps[-1], full[0, -1], atol=2e-3, rtol=0)


def test_rollback_then_regenerate_equals_never_going_ahead(smollm2_default):
    """Write 5 speculative tokens, roll back 3 of them, continue differently: the logits equal those of a cache that
    never saw the rolled-back tokens (bitwise: rollback only moves the offset, the same kernels run). The forwards
    are exact, as verification's are (a forward that is not exact attends through SDPA with a mask over all T new
    slots, whose sums depend on T)."""
    m = smollm2_default.model
    ids = chat_ids(smollm2_default.tokenizer, "Count to ten.")
    n = len(ids)
    with torch.inference_mode():
        a = m.new_cache()
        m.prefill(ids, a)
        m(torch.tensor([[11, 12, 13, 14, 15]]), torch.arange(n, n + 5), a, exact=True)
        a.rollback(n + 2)
        la, _ = m(torch.tensor([[21, 22, 23]]), torch.arange(n + 2, n + 5), a, exact=True)
        b = m.new_cache()
        m.prefill(ids, b)
        m(torch.tensor([[11, 12]]), torch.arange(n, n + 2), b, exact=True)
        lb, _ = m(torch.tensor([[21, 22, 23]]), torch.arange(n + 2, n + 5), b, exact=True)
    assert torch.equal(la, lb)
    assert torch.equal(a.entries(0, n + 5), b.entries(0, n + 5))


def test_keys_are_kept_once(smollm2_default):
    """Where the attention kernel runs, a cache holds each key once (in the kernel's tiles) and each value once: the
    bytes of llama.cpp's K and V caches at the same dtype, not a second copy of the keys."""
    m = smollm2_default.model
    a = m.args
    cache = m.new_cache(256)
    assert cache.kt is not None and cache.kv.shape[-2] == a.n_kv_heads  # values only
    per_slot = a.n_layers * 2 * a.n_kv_heads * m.layers[0].head_dim * cache.kv.element_size()
    assert cache.nbytes == 256 * per_slot


def test_values_are_stored_head_by_head(smollm2_default):
    """The kernel's value cache is [Hkv, S, D] per layer: one KV head's values are one stream (consecutive slots D
    elements apart), which the attention kernel reads as such; the slot-major view the cache's copies use shows the
    same values."""
    m = smollm2_default.model
    a = m.args
    ids = chat_ids(smollm2_default.tokenizer, "Hello there")
    with torch.inference_mode():
        cache = m.new_cache(256)
        m.prefill(ids, cache)
    D = m.layers[0].head_dim
    for i in (0, a.n_layers - 1):
        values = cache.layer(i).kv
        assert values.is_contiguous() and values.shape == (1, a.n_kv_heads, cache.kt.shape[2] * 32, D)
        assert values.stride(2) == D  # slot s + 1 of a head right after slot s
        slots = cache.entries(0, len(ids))[i, :, a.n_kv_heads:]  # [n, Hkv, D], slot by slot
        assert torch.equal(values[0, :, :len(ids)].transpose(0, 1), slots)
        assert values[0, :, :len(ids)].abs().sum() > 0


def test_keep_compacts_tree_slots(smollm2_default):
    """cache.keep(start, slots): the kept slots' keys/values move into place as if only they had been written."""
    m = smollm2_default.model
    ids = chat_ids(smollm2_default.tokenizer, "Hello")
    n = len(ids)
    with torch.inference_mode():
        a = m.new_cache()
        m.prefill(ids, a)
        m(torch.tensor([[11, 12, 13, 14]]), torch.arange(n, n + 4), a)
        a.keep(n, [n + 1, n + 3])  # keep tokens 12 and 14 (their K/V were computed at positions n+1, n+3)
        assert a.length == n + 2
        assert a.pos[n:n + 2].tolist() == [n + 1, n + 3]
        b = m.new_cache()
        m.prefill(ids, b)
        m(torch.tensor([[11, 12, 13, 14]]), torch.arange(n, n + 4), b)
    assert torch.equal(a.entries(n, n + 2), torch.cat([b.entries(n + 1, n + 2), b.entries(n + 3, n + 4)], dim=1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=20),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
])
def test_processing_equals_transformers_warpers(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    ref = logits.clone()
    for w in warpers:
        ref = w(None, ref)
    torch.testing.assert_close(probs_from_logits(logits, params), ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_sample_follows_distribution_and_seed():
    p = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    g = make_generator(1)
    draws = sample(p.expand(200_000, 5), g)
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert (freq - p).abs().max() < 0.005
    assert freq[4] == 0
    assert torch.equal(sample(p.expand(100, 5), make_generator(7)), sample(p.expand(100, 5), make_generator(7)))


def test_seeded_sampling_is_reproducible(smollm2_default):
    m, tok = smollm2_default.model, smollm2_default.tokenizer
    ids = chat_ids(tok, "Write a haiku about rain.")
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=123)
    a = generate(m, tok, ids, params, max_tokens=30)
    b = generate(m, tok, ids, params, max_tokens=30)
    c = generate(m, tok, ids, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=124), max_tokens=30)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_string_eos_and_max_tokens(smollm2_default):
    m, tok = smollm2_default.model, smollm2_default.tokenizer
    ids = chat_ids(tok, "Count from 1 to 20, separated by commas.")
    full = generate(m, tok, ids, GREEDY, max_tokens=60)
    assert full.finish_reason in ("stop", "length")
    streamed = []
    cut = generate(m, tok, ids, GREEDY, max_tokens=60, stop=["5"], on_text=streamed.append)
    assert cut.finish_reason == "stop" and "5" not in cut.text and full.text.startswith(cut.text)
    assert "".join(streamed) == cut.text
    short = generate(m, tok, ids, GREEDY, max_tokens=7)
    assert short.finish_reason == "length" and len(short.tokens) == 7 and short.tokens == full.tokens[:7]
    eos = generate(m, tok, chat_ids(tok, "What is 2+2? Answer with a number only."), GREEDY, max_tokens=50)
    assert eos.finish_reason == "stop" and eos.tokens[-1] in tok.eog_ids and "<|im_end|>" not in eos.text


def test_context_window_end(smollm2_path):
    from specdec.loader import load

    small = load(smollm2_path, ctx=64)
    ids = chat_ids(small.tokenizer, "Write a long story.")
    r = generate(small.model, small.tokenizer, ids, GREEDY, max_tokens=500, ignore_eos=True)
    assert r.finish_reason == "context" and len(ids) + len(r.tokens) == 64 + 1
