"""The attention kernel (specdec/kernels/attention.c): batch-invariant, so a verification row is bitwise the decode
step of that token; close to PyTorch's SDPA; and a machine without it falls back to SDPA with one clear line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels

pytestmark = pytest.mark.skipif(kernels.attention_lib() is None, reason="no C compiler: the kernel is not built")


def make(H: int, Hkv: int, D: int, S: int, dtype: torch.dtype, seed: int = 0):
    """kv [1, S, 2 Hkv, D] (keys then values, for the references) and the keys in their tiles."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(1, S, 2 * Hkv, D, generator=g).to(dtype)
    kt = kernels.key_tiles(1, Hkv, D, S, dtype)[0]
    kernels.store_keys(kv[:, :, :Hkv], kt, 0)
    return kv, kt


def values(kv, kt, Hkv):
    """kv's values as the kernel's cache holds them: head by head, [1, Hkv, S, D], S the slots of the tiles."""
    v = torch.zeros(1, Hkv, kt.shape[1] * kernels.TILE, kv.shape[-1], dtype=kv.dtype)
    v[:, :, :kv.shape[1]] = kv[:, :, Hkv:].transpose(1, 2)
    return v


def run(qkv, kv, kt, H, Hkv, start, tails, window=None, scale=0.125):
    """The kernel over kv's values (the kernel's cache holds only values) and the key tiles kt."""
    spans, tail = kernels.row_spans([(0, start, [int(x) for x in t]) for t in tails], window)
    return kernels.attend(qkv, values(kv, kt, Hkv), kt, H, Hkv, spans, tail, scale)


def sdpa(qkv, kv, H, Hkv, slots, scale=0.125):
    """Reference: row r's queries over exactly the slots given, f32."""
    outs = []
    for r, sl in enumerate(slots):
        q = qkv[:, r:r + 1, :H].transpose(1, 2).float()
        k = kv[:, sl, :Hkv].transpose(1, 2).float()
        v = kv[:, sl, Hkv:].transpose(1, 2).float()
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2))
    return torch.cat(outs, 1).reshape(1, len(slots), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 1, 256), (8, 2, 128), (6, 6, 32), (4, 2, 16), (10, 2, 64)])
def test_chain_rows_equal_decode_steps_bitwise(dtype, H, Hkv, D):
    S = 300
    kv, kt = make(H, Hkv, D, S, dtype)
    ids = torch.arange(S)
    for start, T in [(0, 1), (5, 4), (31, 2), (32, 3), (95, 8), (200, 5), (250, 8), (290, 3)]:  # 256+: halves
        qkv = torch.randn(1, T, H + 2 * Hkv, D).to(dtype)
        batched = run(qkv, kv, kt, H, Hkv, start, [ids[start:start + i + 1] for i in range(T)])
        for i in range(T):  # the decode step of token i: everything before it is a consecutive run
            alone = run(qkv[:, i:i + 1].contiguous(), kv, kt, H, Hkv, start + i, [ids[start + i:start + i + 1]])
            assert torch.equal(batched[:, i], alone[:, 0]), (start, T, i)
        ref = sdpa(qkv, kv, H, Hkv, [ids[:start + i + 1] for i in range(T)])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(batched.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 2, 16), (8, 2, 128)])
def test_rope_store_is_apply_rope_then_the_cache_writes(dtype, H, Hkv, D):
    """rope_store() does in one call what the PyTorch path does: RoPE on the query and key heads, the values into
    the cache at slots start.., the keys into their tiles (their only copy); each row alone (batch-invariant)."""
    from specdec.models.transformer import Rope, apply_rope, rope_inv_freq

    S, start, T = 100, 61, 5
    rope = Rope(rope_inv_freq(D, 10000.0, None), S, torch.float32, "cpu")
    pos = torch.arange(start, start + T)
    qkv = torch.randn(1, T, H + 2 * Hkv, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    kv, kt = make(H, Hkv, D, S, dtype)
    vals = values(kv, kt, Hkv)
    vals2, kt2 = vals.clone(), kt.clone()
    ref = apply_rope(qkv.float(), *rope.tables(pos, H + Hkv, Hkv)).to(dtype)
    vals2[:, :, start:start + T] = ref[:, :, H + Hkv:].transpose(1, 2)
    kernels.store_keys(ref[:, :, H:H + Hkv], kt2, start)
    got = qkv.clone()
    kernels.rope_store(got, vals, kt, *rope.rows(pos), torch.arange(start, start + T), H, Hkv)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the same f32 result, or the next value
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(vals.float(), vals2.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kt.float(), kt2.float(), atol=tol, rtol=tol)
    assert torch.equal(vals[:, :, start:start + T], got[:, :, H + Hkv:].transpose(1, 2))
    assert torch.equal(vals[:, :, :start], vals2[:, :, :start])
    assert torch.equal(vals[:, :, start + T:], vals2[:, :, start + T:])
    # the tiles hold exactly the rotated keys at slots start.., and the other slots' keys unchanged
    assert torch.equal(kernels.tile_keys(kt, start, start + T), got[0, :, H:H + Hkv].transpose(0, 1))
    assert torch.equal(kernels.tile_keys(kt, 0, start), kv[0, :start, :Hkv].transpose(0, 1))
    for i in range(T):  # a row alone is bitwise the same row of the batch
        one = qkv[:, i:i + 1].clone()
        kernels.rope_store(one, vals.clone(), kt.clone(), *rope.rows(pos[i:i + 1]), torch.tensor([start + i]), H,
                           Hkv)
        assert torch.equal(one[0, 0], got[0, i])


@pytest.mark.parametrize("window", [None, 40, 3])
def test_tree_paths_equal_decoding_the_path_laid_out(window):
    """A tree node's row over the prefix plus its path's scattered slots equals decoding that node after the path was
    compacted into consecutive slots (what KVCache.keep does on acceptance), sliding window or not."""
    H, Hkv, D, S, start = 9, 3, 64, 400, 300  # 300 + path: a row split in halves
    kv, kt = make(H, Hkv, D, S, torch.bfloat16)
    path = [0, 2, 5, 7]  # rows of the tree, the root first
    qkv = torch.randn(1, 1, H + 2 * Hkv, D).bfloat16()  # the query of node 7 (the path's last row)
    tree = run(qkv, kv, kt, H, Hkv, start, [start + torch.tensor(path)], window)
    lay_kv, lay_kt = kv.clone(), kt.clone()  # compact the path's slots to start, start + 1, ...
    lay_kv[:, start:start + 4] = kv[:, [start + r for r in path]]
    kernels.store_keys(lay_kv[:, start:start + 4, :Hkv], lay_kt, start)
    last = start + len(path) - 1
    alone = run(qkv, lay_kv, lay_kt, H, Hkv, last, [torch.tensor([last])], window)
    assert torch.equal(tree, alone)
    first = max(0, last + 1 - window) if window else 0
    ref = sdpa(qkv, lay_kv, H, Hkv, [torch.arange(first, last + 1)])
    torch.testing.assert_close(tree.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,window", [(300, None), (300, 40), (300, 3), (20, None), (20, 8)])
def test_tree_rows_in_one_call_equal_decoding_each_path(dtype, start, window):
    """Every node of a tree in one call (rows sharing each key tile and value row, their tails scattered), as
    Transformer._plan lays them out: each row is bitwise the decode step of its node after its path was compacted."""
    from specdec.spec.tree import paths

    H, Hkv, D, S = 9, 3, 64, 400
    kv, kt = make(H, Hkv, D, S, dtype)
    parents = [-1, -1, 0, 0, 1, 2, 2, 4, 5, 7]  # depth up to 5, branches at several levels
    rows = [[0]] + paths(parents)
    qkv = torch.randn(1, len(rows), H + 2 * Hkv, D).to(dtype)
    tree = run(qkv, kv, kt, H, Hkv, start, [start + torch.tensor(p) for p in rows], window)
    for i, path in enumerate(rows):
        lay_kv, lay_kt = kv.clone(), kt.clone()
        lay_kv[:, start:start + len(path)] = kv[:, [start + r for r in path]]
        kernels.store_keys(lay_kv[:, start:start + len(path), :Hkv], lay_kt, start)
        last = start + len(path) - 1
        alone = run(qkv[:, i:i + 1].contiguous(), lay_kv, lay_kt, H, Hkv, last, [torch.tensor([last])], window)
        assert torch.equal(tree[:, i], alone[:, 0]), (i, path)


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 1, 256), (6, 6, 32)])
def test_many_chain_rows_with_a_window_equal_decode_steps(H, Hkv, D):
    """Up to 13 rows (more pairs than one block of shared loads holds), each over a window that starts at its own
    slot, some rows split in halves and some not (around 256 keys): bitwise the decode steps."""
    S = 300
    kv, kt = make(H, Hkv, D, S, torch.bfloat16)
    ids = torch.arange(S)
    for start, T, window in [(40, 13, 16), (245, 13, 300), (250, 9, 258), (100, 7, 33)]:
        qkv = torch.randn(1, T, H + 2 * Hkv, D).bfloat16()
        batched = run(qkv, kv, kt, H, Hkv, start, [ids[start:start + i + 1] for i in range(T)], window)
        for i in range(T):
            alone = run(qkv[:, i:i + 1].contiguous(), kv, kt, H, Hkv, start + i, [ids[start + i:start + i + 1]],
                        window)
            assert torch.equal(batched[:, i], alone[:, 0]), (start, T, window, i)
        first = [max(0, start + i + 1 - window) for i in range(T)]
        ref = sdpa(qkv, kv, H, Hkv, [ids[first[i]:start + i + 1] for i in range(T)])
        torch.testing.assert_close(batched.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 1, 5, 64])
def test_row_spans_of_chain_ranges_equal_the_slot_lists(window):
    """Chains give row_spans ranges (their tails built whole in numpy when there are many); the result is the
    element-by-element one of the same slots as lists, alone and next to a tree's paths in one batch."""
    from specdec.models.transformer import Transformer

    class Cache:
        def __init__(self, base: int):
            self.base = base

    # 40 + 4 rows: 830 tail slots, past the 256 under which row_spans converts them one by one
    chains = Transformer.row_tails(Cache(1000), 37, 40, None) + Transformer.row_tails(Cache(0), 0, 4, None)
    tree = Transformer.row_tails(Cache(5000), 12, 5, [-1, 0, 0, 1, 3])
    assert all(isinstance(t, range) for _, _, t in chains)
    for rows in (chains, chains[-4:], chains + tree, tree + chains):
        spans, tails = kernels.row_spans(rows, window)
        ref_spans, ref_tails = kernels.row_spans([(b, s, [int(x) for x in t]) for b, s, t in rows], window)
        assert torch.equal(spans, ref_spans) and torch.equal(tails, ref_tails)
        assert tails.dtype == torch.int64 and tails.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,D,Dv", [(16, 576, 512), (4, 48, 32), (3, 80, 64), (5, 32, 16)])
def test_latent_rows_equal_decode_steps_and_sdpa(dtype, H, D, Dv):
    """Multi-head latent attention (attend_latent): H query heads over one latent vector a slot, its first Dv elements
    the value; a chain's rows, a tree's scattered tails and the rows of two sequences in one call are each bitwise the
    row alone, and close to SDPA over the same slots (DeepSeek-V3's 576 / 512 among the sizes)."""
    S = 600
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(1, S, 1, D, generator=g).to(dtype)
    kt = kernels.key_tiles(1, 1, D, S, dtype)[0]
    kernels.store_keys(kv, kt, 0)
    scale = D ** -0.5

    def latent(q, rows):
        spans, tail = kernels.row_spans([(base, start, [int(x) for x in t]) for base, start, t in rows], None)
        return kernels.attend_latent(q, kv, kt, Dv, spans, tail, scale)

    def ref(q, slots):
        k = kv[:, slots].transpose(1, 2).float()  # [1, 1, n, D]
        return F.scaled_dot_product_attention(q.transpose(1, 2).float(), k, k, scale=scale, enable_gqa=True
                                              )[..., :Dv].transpose(1, 2)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for start, T in [(0, 1), (5, 4), (40, 13), (250, 9), (290, 3)]:  # 256+ keys: rows in halves
        q = torch.randn(1, T, H, D, generator=g).to(dtype)
        batched = latent(q, [(0, start, range(start, start + i + 1)) for i in range(T)])
        assert batched.shape == (1, T, H, Dv)
        for i in range(T):
            alone = latent(q[:, i:i + 1].contiguous(), [(0, start + i, [start + i])])
            assert torch.equal(batched[:, i], alone[:, 0]), (start, T, i)
            torch.testing.assert_close(batched[:, i:i + 1].float(), ref(q[:, i:i + 1], list(range(start + i + 1))),
                                       atol=tol, rtol=tol)
    q = torch.randn(1, 4, H, D, generator=g).to(dtype)  # a tree path's tail, then a second sequence from slot 320
    rows = [(0, 100, [100, 103, 105]), (0, 100, [100, 104]), (320, 50, [370]), (320, 50, [370, 371])]
    both = latent(q, rows)
    for i, row in enumerate(rows):
        assert torch.equal(both[:, i], latent(q[:, i:i + 1].contiguous(), [row])[:, 0]), i
        slots = list(range(row[0], row[0] + row[1])) + list(row[2])
        torch.testing.assert_close(both[:, i:i + 1].float(), ref(q[:, i:i + 1], slots), atol=tol, rtol=tol)


def test_models_use_the_kernel_only_where_it_applies():
    cpu = torch.device("cpu")
    assert kernels.kernel_supports(torch.bfloat16, cpu, 64) and kernels.kernel_supports(torch.float32, cpu, 256)
    assert not kernels.kernel_supports(torch.float16, cpu, 64)  # f16: SDPA
    assert not kernels.kernel_supports(torch.bfloat16, cpu, 48)  # a head size it is not built for
    assert kernels.kernel_supports(torch.bfloat16, cpu, 576, 512)  # MLA: DeepSeek-V3's latent and rope key
    assert kernels.kernel_supports(torch.float32, cpu, 48, 32)
    assert not kernels.kernel_supports(torch.bfloat16, cpu, 72, 48)  # MLA values: 16, 32 or a multiple of 64 wide
    assert not kernels.kernel_supports(torch.bfloat16, torch.device("meta"), 64)  # not the CPU


def test_threads_change_nothing():
    H, Hkv, D, S = 9, 3, 64, 400
    kv, kt = make(H, Hkv, D, S, torch.bfloat16)
    qkv = torch.randn(1, 4, H + 2 * Hkv, D).bfloat16()
    tails = [torch.arange(390, 391 + i) for i in range(4)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(qkv, kv, kt, H, Hkv, 390, tails)
        torch.set_num_threads(2)
        two = run(qkv, kv, kt, H, Hkv, 390, tails)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_without_a_compiler_attention_falls_back_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    kernels.attention_lib.cache_clear()
    try:
        assert kernels.attention_lib() is None
        assert not kernels.kernel_supports(torch.bfloat16, torch.device("cpu"), 64)
        err = capsys.readouterr().err.strip().splitlines()  # "compiling ...", then why it failed and what to do
        assert len(err) == 2 and "could not compile the attention kernel" in err[1] and "install gcc" in err[1]
    finally:
        kernels.attention_lib.cache_clear()
    monkeypatch.undo()
    assert kernels.attention_lib() is not None


def test_a_new_kernel_build_removes_the_builds_no_one_loaded_for_a_month(tmp_path, monkeypatch):
    """Compiling a kernel (here the sampler, the quickest) removes that kernel's other builds whose last load is
    older than BUILDS_KEPT_DAYS, keeps a recently loaded one and other kernels' builds; loading an existing build
    marks it used (its mtime), so a build in use is never the one removed."""
    import os
    import time

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    month = (kernels.BUILDS_KEPT_DAYS + 1) * 86400
    stale, recent, other = (tmp_path / f"{n}.so" for n in ("sample-00000000stale000", "sample-0000000recent00",
                                                           "matmul-00000000stale000"))
    for f, age in ((stale, month), (recent, 86400), (other, month)):
        f.write_bytes(b"\0")
        os.utime(f, (time.time() - age, time.time() - age))
    assert kernels._build("sample", "none") is not None
    built = [f for f in tmp_path.glob("sample-*.so") if f not in (stale, recent)]
    assert not stale.exists() and recent.exists() and other.exists() and len(built) == 1
    os.utime(built[0], (time.time() - month, time.time() - month))
    assert kernels._build("sample", "none") is not None  # loaded from the cache: marked used, not rebuilt
    assert time.time() - built[0].stat().st_mtime < 3600 and len(list(tmp_path.glob("sample-*.so"))) == 2


@pytest.mark.skipif(not kernels.attention_weights_bf16(), reason="bf16 weights need AVX-512 BF16")
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("n", [41, 42, 300])
def test_bf16_cache_weighs_values_by_bf16_rounded_weights(D, n):
    """With AVX-512 BF16, a bf16 cache's output is sum_j bf16(p_j) v_j / sum_j p_j (FlashAttention-2's P V, two
    keys an instruction). Two keys of scores 0 and 3/512 (p = 0.99416 and 1; 0.99416 rounds to 0.99609) and values
    +1 / -1 in column 0: their difference over the sum is -0.00196 with rounded weights, -0.00293 with f32 ones.
    The other keys' scores are -60 (weights below bf16's smallest normal: 0)."""
    H, Hkv = 1, 1
    kv = torch.zeros(1, n, 2 * Hkv, D)
    kv[0, :, 0, 0] = -60.0
    kv[0, n - 2, 0, 0], kv[0, n - 1, 0, 0] = 0.0, 3 / 512
    kv[0, :, 1, 1] = 0.5
    kv[0, n - 2, 1, 0], kv[0, n - 1, 1, 0] = 1.0, -1.0
    kv = kv.bfloat16()
    kt = kernels.key_tiles(1, Hkv, D, n, torch.bfloat16)[0]
    kernels.store_keys(kv[:, :, :Hkv], kt, 0)
    qkv = torch.zeros(1, 1, H + 2 * Hkv, D, dtype=torch.bfloat16)
    qkv[0, 0, 0, 0] = 1.0
    out = run(qkv, kv, kt, H, Hkv, n - 1, [torch.tensor([n - 1])], scale=1.0)[0, 0].float()
    p0 = torch.tensor(-3 / 512).exp()
    rounded, exact = (p0.bfloat16().float() - 1) / (p0 + 1), (p0 - 1) / (p0 + 1)
    assert abs(float(out[0]) - float(rounded)) < 0.01 * abs(float(rounded)), (float(out[0]), float(rounded))
    assert abs(float(out[0]) - float(exact)) > 0.2 * abs(float(exact))
    torch.testing.assert_close(out[1], torch.tensor(0.5), atol=4e-3, rtol=0)  # the other keys: weights 0 or 1


@pytest.mark.parametrize("start,ntail", [(10, 293), (11, 290), (0, 261), (7, 40)])
def test_long_scattered_tails_equal_their_compacted_decode_step(start, ntail):
    """A row whose keys are a short run and then many scattered slots (halves that hold only tail slots, starting at
    an odd or even key) equals the decode step of the same keys compacted into consecutive slots, bitwise: the
    outputs pair keys by their place in that decode step's run, not by their slots."""
    H, Hkv, D, S = 9, 3, 64, 700
    kv, kt = make(H, Hkv, D, S, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    tail = (start + 1 + torch.randperm(S - start - 1, generator=g)[:ntail]).tolist()
    qkv = torch.randn(1, 1, H + 2 * Hkv, D, generator=g).bfloat16()
    scattered = run(qkv, kv, kt, H, Hkv, start, [torch.tensor(tail)])
    lay_kv, lay_kt = kv.clone(), kt.clone()
    lay_kv[:, start:start + ntail] = kv[:, tail]
    kernels.store_keys(lay_kv[:, start:start + ntail, :Hkv], lay_kt, start)
    last = start + ntail - 1
    alone = run(qkv, lay_kv, lay_kt, H, Hkv, last, [torch.tensor([last])])
    assert torch.equal(scattered, alone)
    ref = sdpa(qkv, kv, H, Hkv, [torch.tensor(list(range(start)) + tail)])
    torch.testing.assert_close(scattered.float(), ref, atol=2e-2, rtol=2e-2)
