"""Token trees: tree attention equals plain decoding of each node's path, cache compaction keeps an accepted path
exactly, and tree verification (greedy and stochastic) is lossless."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import make_generator, sample
from specdec.spec.tree import depths, paths, tree_mask, verify_tree_greedy, verify_tree_stochastic

PARENTS = [-1, -1, 0, 0, 1, 2, 4, 6]  # 8 nodes, depth up to 5, branching at the root and at node 0
TOKENS = [330, 1420, 284, 6891, 30, 17, 2115, 905]


def test_shapes():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3, 3, 4]
    assert paths(PARENTS)[6] == [0, 2, 5, 7]  # rows of: root, node 1, node 4, node 6
    m = tree_mask(PARENTS)
    assert m.shape == (9, 9) and m[7].nonzero().flatten().tolist() == [0, 2, 5, 7]


def decode_path(model, prompt, tokens):
    """Plain decoding: prefill, then one token per forward; returns (last logits, cache)."""
    cache = model.new_cache()
    model.prefill(prompt, cache)
    for t in tokens:
        logits, _ = model(torch.tensor([[t]]), torch.tensor([cache.length]), cache)
    return logits[0, -1], cache


@pytest.mark.parametrize("exact,kernel", [(True, True), (True, False), (False, True)])
def test_tree_attention_equals_plain_decoding_of_each_path(smollm2_default, monkeypatch, exact, kernel):
    m, tok = smollm2_default.model, smollm2_default.tokenizer
    monkeypatch.setattr(m, "kernel", kernel and m.kernel)  # False: SDPA per node (AttentionPlan "paths")
    prompt = tok.encode_chat([{"role": "user", "content": "Name a fruit."}])
    root = 504
    n = len(prompt)
    with torch.inference_mode():
        cache = m.new_cache()
        m.prefill(prompt, cache)
        rows = torch.tensor([[root] + TOKENS])
        pos = torch.tensor([n] + [n + d for d in depths(PARENTS)])
        logits, _ = m(rows, pos, cache, parents=PARENTS, exact=exact)
        for i, path in enumerate(paths(PARENTS)):
            ref, ref_cache = decode_path(m, prompt, [([root] + TOKENS)[r] for r in path])
            if exact:
                assert torch.equal(logits[0, i + 1], ref), f"node {i}"
            else:  # bf16 rounding differences through 30 layers (one masked SDPA call vs the attention kernel, and
                # int8 activations in the matmul kernel): up to ~1.1 on logits reaching ~40; a wrong mask moves many
                torch.testing.assert_close(logits[0, i + 1], ref, atol=2.0, rtol=0)
                assert logits[0, i + 1].argmax() == ref.argmax()
        if exact:  # keep one path: the cache equals the plain-decoding cache of that path, bit for bit
            path = paths(PARENTS)[6]
            cache.keep(n, [n + r for r in path])
            _, ref_cache = decode_path(m, prompt, [([root] + TOKENS)[r] for r in path])
            assert cache.length == ref_cache.length
            assert torch.equal(cache.entries(0, cache.length), ref_cache.entries(0, cache.length))


def test_greedy_tree_verification():
    V = 10
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]  # node i carries token i + 1
    want = {0: 2, 2: 5, 5: 7, 7: 8, 8: 9}  # row -> the target's argmax there
    logits = torch.zeros(len(PARENTS) + 1, V)
    for r in range(len(PARENTS) + 1):
        logits[r, want.get(r, 0)] = 1.0
    # root wants 2 (node 1, row 2) -> wants 5 (node 4, row 5) -> wants 7 (node 6, row 7) -> wants 8 (node 7,
    # row 8, no children) -> next token 9
    assert verify_tree_greedy(logits, tokens, PARENTS) == ([1, 4, 6, 7], 9)
    logits[2] = 0
    logits[2, 3] = 1.0  # node 1 now wants 3, which is not among its children: stop there, recovered token 3
    assert verify_tree_greedy(logits, tokens, PARENTS) == ([1], 3)


def test_stochastic_tree_verification_is_lossless():
    """A deterministic top-2-per-node tree of depth 2 over a 10-token vocabulary; the first two output tokens must
    be distributed as p(a) p(b | a) (chi-square over 100 cells, 60k seeded trials)."""
    V, trials = 10, 60_000
    g0 = torch.Generator().manual_seed(5)
    P = torch.rand(V, V, generator=g0) ** 3
    P[:, 7] = 0
    P = P / P.sum(1, keepdim=True)
    Q = torch.rand(V, V, generator=g0)  # the "draft model" whose top-2 make the tree (q itself is not needed)
    start = 0
    top = Q.topk(2, dim=1).indices
    a, b = top[start].tolist()
    tokens = [a, b, *top[a].tolist(), *top[b].tolist()]
    parents = [-1, -1, 0, 0, 1, 1]
    rows = torch.stack([P[start], P[a], P[b], *(P[t] for t in tokens[2:])])
    g = make_generator(3)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        accepted, nxt = verify_tree_stochastic(rows, tokens, parents, g)
        out = [tokens[i] for i in accepted] + [nxt]
        if len(out) < 2:
            out.append(int(sample(P[out[0]], g)))
        counts[out[0], out[1]] += 1
    expected = P[start][:, None] * P * trials
    keep = expected > 5
    stat = (((counts - expected)[keep]) ** 2 / expected[keep]).sum().item()
    df = int(keep.sum()) - 1
    assert stat < df + 4.5 * (2 * df) ** 0.5, f"chi2 {stat:.1f}, df {df}"
    assert counts[:, 7].sum() == 0
