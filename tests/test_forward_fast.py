"""kernels/forward.c runs a forward's decoder layers in one call: for Llama-family layers its logits and hidden states
are bitwise those of the layer-by-layer Python path, for decode steps, exact chains and trees, rows of several
sequences in one forward, and with the aux layers EAGLE-3 heads read; Gemma 3 and Qwen3 layers (q / k norms, sandwich
norms, GELU) agree with it up to float rounding, with verification rows bitwise the decode steps."""

from __future__ import annotations

import pytest
import torch
from conftest import chat

from specdec import kernels

pytestmark = pytest.mark.skipif(kernels.forward_lib() is None, reason="no forward kernel (no compiler or no VNNI)")


@pytest.fixture
def model(smollm2_default):
    m = smollm2_default.model
    assert m.fast_layers() is not None  # the default model is one it runs
    yield m
    m._fast = False  # recomputed on the next forward
    m.aux_layers = None


def both(m, run):
    """run(model) in C and in Python, on caches prefilled alike -> the two results."""
    out = []
    for fast in (True, False):
        m._fast = False
        if not fast:
            m._fast = None  # fast_layers() says no: the Python loop
        out.append(run(m))
    return out


def prefilled(m, prompt: list[int]):
    """A cache holding the prompt, prefilled on the kernel's exact plan in both paths (a forward's plan otherwise
    depends on whether the stack runs in C: Transformer._plan)."""
    cache = m.new_cache(256)
    m(torch.tensor([prompt]), torch.arange(len(prompt)), cache, exact=True)
    return cache


@pytest.mark.parametrize("T", [1, 5])
def test_chain_rows_are_bitwise_the_python_path(model, smollm2_default, T):
    prompt = chat(smollm2_default.tokenizer, "Name three rivers in Europe.")

    def run(m):
        cache = prefilled(m, prompt)
        n = len(prompt)
        return m(torch.tensor([list(range(100, 100 + T))]), torch.arange(n, n + T), cache, exact=True)

    (lf, hf), (ls, hs) = both(model, run)
    assert torch.equal(lf, ls) and torch.equal(hf, hs)


def test_tree_rows_are_bitwise_the_python_path(model, smollm2_default):
    prompt = chat(smollm2_default.tokenizer, "What is a prime number?")
    parents = [-1, -1, 0, 0, 2]  # two roots' children and a path of depth 3

    def run(m):
        cache = prefilled(m, prompt)
        n = len(prompt)
        depth = [0, 1, 1, 2, 2, 3]
        return m(torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([n + d for d in depth]), cache, parents=parents,
                 exact=True)

    (lf, hf), (ls, hs) = both(model, run)
    assert torch.equal(lf, ls) and torch.equal(hf, hs)


@pytest.mark.parametrize("aux", [(2, 15, 27), (15, 2, 2)])  # EAGLE-3's default; unsorted and repeated (tiny models)
def test_rows_of_several_sequences_and_aux_layers_are_bitwise_the_python_path(model, smollm2_default, aux):
    tok = smollm2_default.tokenizer
    prompts = [chat(tok, "Say hello."), chat(tok, "Count to five, please, slowly and clearly.")]
    model.aux_layers = aux  # EAGLE-3's feature layers: the forward keeps their inputs

    def run(m):
        pool = m.new_pool(2, 256)
        caches = [pool.acquire(256) for _ in range(2)]
        for c, p in zip(caches, prompts, strict=True):
            m(torch.tensor([p]), torch.arange(len(p)), c, exact=True)  # alike in both paths (see prefilled)
        items = [(caches[0], [11], [len(prompts[0])], None),
                 (caches[1], [12, 13, 14], [len(prompts[1]) + i for i in range(3)], None)]
        return m.forward_batch(items)

    (lf, hf), (ls, hs) = both(model, run)
    assert hf.shape[-1] == 4 * model.args.dim
    assert torch.equal(lf, ls) and torch.equal(hf, hs)


def test_sliding_window_layers_are_bitwise_the_python_path(tmp_path):
    """A Mistral-style model with an 8-token sliding window (a Hugging Face folder, int4), 20 tokens cached: the
    sliding layers' spans and tables in forward.c are the Python path's."""
    from tiny_models import write_hf

    from specdec.loader import load

    m = load(write_hf("mistral", tmp_path / "m", seed=3, sliding_window=8), ctx=64, quant="int4").model
    assert m.args.sliding_window == 8 and all(layer.sliding for layer in m.layers) and m.fast_layers() is not None

    def run(model):
        cache = prefilled(model, list(range(3, 23)))
        return model(torch.tensor([[30, 31, 32, 33]]), torch.arange(20, 24), cache, exact=True)

    (lf, hf), (ls, hs) = both(m, run)
    assert torch.equal(lf, ls) and torch.equal(hf, hs)



@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_gemma3_and_qk_norm_layers_run_in_c(tmp_path, arch):
    """Gemma 3 (q / k norms, norms after attention and FFN, GELU, sliding and global layers) and Qwen3 (q / k norms)
    run in forward.c too: there verification rows are bitwise the decode steps, and the logits are the Python path's
    up to float rounding (the C norms and GELU round differently from the PyTorch ops, so not bitwise)."""
    from tiny_models import write_hf

    from specdec.loader import load

    m = load(write_hf(arch, tmp_path / "m", seed=3), ctx=64, quant="int4", dtype="f32").model
    assert m.fast_layers() is not None
    tokens = [30, 31, 32, 33]

    def run(model):
        cache = prefilled(model, list(range(3, 23)))
        chain, _ = model(torch.tensor([tokens]), torch.arange(20, 24), cache, exact=True)
        cache.rollback(20)
        steps = [model(torch.tensor([[t]]), torch.tensor([20 + i]), cache, exact=True)[0] for i, t in enumerate(tokens)]
        return chain, steps

    (chain_c, steps_c), (chain_py, steps_py) = both(m, run)
    for chain, steps in ((chain_c, steps_c), (chain_py, steps_py)):
        for i, step in enumerate(steps):
            assert torch.equal(chain[0, i], step[0, 0]), i
    # f32 activations: the two paths differ by float rounding only (measured ~3e-7 of the largest logit; in bf16 the
    # roundings move logits by ~1-4%, as they do between any two orders of the same sums)
    assert (chain_c - chain_py).abs().max() <= 1e-5 * chain_py.abs().max()
    assert not torch.equal(chain_c, chain_py)  # the C path ran (its roundings differ)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_elementwise_steps_shared_among_threads_keep_rows_bitwise(tmp_path, arch):
    """forward.c shares its elementwise steps (Gemma's GELU, in place row after row; the q / k head norms; the
    norms after attention and FFN) among the threads from PAR_MIN elements on: 12 rows of the tiny models' FFN (128)
    cross it. Each of the 12 verification rows must still be bitwise its decode step (a row overwritten before it
    was read, or an element computed differently on another thread, would show here)."""
    from tiny_models import write_hf

    from specdec.loader import load

    m = load(write_hf(arch, tmp_path / "m", seed=3), ctx=64, quant="int4", dtype="f32").model
    assert m.fast_layers() is not None
    tokens = list(range(30, 42))
    cache = prefilled(m, list(range(3, 23)))
    chain, _ = m(torch.tensor([tokens]), torch.arange(20, 32), cache, exact=True)
    cache.rollback(20)
    for i, t in enumerate(tokens):
        step, _ = m(torch.tensor([[t]]), torch.tensor([20 + i]), cache, exact=True)
        assert torch.equal(chain[0, i], step[0, 0]), i
