"""The roofline tool and the models behind draft-length choice: byte / FLOP counts against hand-computed values, the
speedup model's identities, the automatic draft length on synthetic costs, and `specdec roofline` / the bench
figure end to end on a tiny model. No assertion is about time."""

from __future__ import annotations

import json

import pytest
from tiny_models import write_gguf

from specdec import kernels
from specdec.bench.roofline import forward_counts, kv_bytes_per_token, measure_bandwidth, measure_matmul, verify_curve
from specdec.config import ModelArgs
from specdec.spec.autok import AutoDraftLength
from specdec.spec.costmodel import best_k, expected_tokens, expected_tokens_iid, speedup

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# a small config: dim 8, 2 layers, 2 query heads and 1 kv head of 4, ffn 16, vocab 100
SMALL = ModelArgs(arch="llama", vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=16)


def test_kv_bytes_per_token_by_hand():
    # 2 layers x (K and V) x 1 kv head x 4 dims x 2 bytes (bf16)
    assert kv_bytes_per_token(SMALL, 2) == 32


def test_forward_counts_by_hand():
    # matmul weights per layer: q 8x8 = 64, k 8x4 = 32, v 8x4 = 32, o 8x8 = 64, gate/up/down 3 x 8x16 = 384 -> 576;
    # 2 layers -> 1152; output head 100 x 8 = 800; total 1952
    # t = 3 after 5 cached: matmuls 2 x 1952 x 3 = 11712; attention 2 layers x 2 x 2 x 3 x (5 + 3) x 2 heads x 4 = 1536
    n = forward_counts(SMALL, weight_bytes=1000, kv_bytes_per_token=32, t=3, context=5)
    assert n["flops"] == 11712 + 1536 == 13248
    # bytes: weights 1000 + KV read 32 x (5 + 3) = 256 + KV written 32 x 3 = 96
    assert n["bytes"] == 1000 + 256 + 96 == 1352
    assert n["intensity"] == pytest.approx(13248 / 1352)
    # decode, empty cache: 2 x 1952 + 2 x 2 x 2 x 1 x 1 x 2 x 4 = 3904 + 64 flops; 1000 + 32 + 32 bytes
    d = forward_counts(SMALL, weight_bytes=1000, kv_bytes_per_token=32, t=1, context=0)
    assert (d["flops"], d["bytes"]) == (3968, 1064)
    # the weights are read once whatever t: bytes grow only by the KV of the extra tokens
    assert forward_counts(SMALL, 1000, 32, 9, 5)["bytes"] - n["bytes"] == 32 * 6 + 32 * 6


def test_forward_counts_real_shapes():
    # SmolLM2-135M shapes: its published 134,515,008 parameters less the 61 norm vectors of 576 (tied head counted
    # once, as the output head)
    smol = ModelArgs(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                     ffn_dim=1536)
    n = forward_counts(smol, weight_bytes=0, kv_bytes_per_token=0, t=1, context=0)
    assert n["flops"] - n["attention_flops"] == 2 * (134_515_008 - 61 * 576)


def test_measure_peaks_small():
    bw = measure_bandwidth("cpu", nbytes=4 * 2**20, repeats=2)
    assert all(bw[k] > 0 for k in ("copy", "triad", "read"))
    assert bw["array_bytes"] == 4 * 2**20
    assert measure_bandwidth("cpu", nbytes=2**20, repeats=1, kinds=("read",)).keys() >= {"read"}
    assert measure_matmul(n=64, repeats=2) > 0


def test_matmul_peak_is_the_faster_dtype(monkeypatch):
    """A model in bf16 on a CPU whose bf16 GEMM is slow (no bf16 units) is measured against the f32 GEMM, and the
    slow dtype only probed at a small size; where bf16 is fast, its full-size rate counts."""
    import torch

    from specdec.bench import roofline

    calls = []
    rates = {torch.bfloat16: 3e8, torch.float32: 9e10}
    monkeypatch.setattr(roofline, "measure_matmul", lambda dt, dev, n, reps: calls.append((dt, n)) or rates[dt])
    assert roofline.matmul_peak(torch.bfloat16) == 9e10
    assert calls == [(torch.float32, 2048), (torch.bfloat16, 256)]  # the slow dtype never at full size
    assert roofline.matmul_peak(torch.float32) == 9e10
    rates[torch.bfloat16] = 2e12  # a CPU with AMX / AVX-512 BF16
    calls.clear()
    assert roofline.matmul_peak(torch.bfloat16) == 2e12 and (torch.bfloat16, 2048) in calls


def test_verify_curve_interpolates():
    v = verify_curve({1: 0.010, 2: 0.012, 4: 0.020})
    assert v(1) == 1.0 and v(2) == pytest.approx(1.2) and v(3) == pytest.approx(1.6)
    assert v(6) == pytest.approx(2.8)  # last slope (0.004 s per token) extrapolated


# ---------------------------------------------------------------------------------------------------------------
# the speedup model


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_expected_tokens_iid_matches_product_form(a, k):
    assert expected_tokens([a] * k) == pytest.approx(expected_tokens_iid(a, k))


def test_speedup_with_free_verification_is_expected_tokens():
    for acc in ([0.9, 0.8], [0.5] * 4, [1.0] * 3):
        assert speedup(acc, 0.0, lambda t: 1.0) == pytest.approx(expected_tokens(acc))


def test_best_k_zero_when_speculation_loses():
    # drafting costs half a forward and verification scales linearly: every K loses to plain decoding
    k, s = best_k([0.7] * 8, 0.5, lambda t: float(t), 8)
    assert (k, s) == (0, 1.0)


def test_best_k_large_when_everything_is_accepted_and_verification_is_flat():
    k, s = best_k([0.999] * 8, 0.0, lambda t: 1.0, 8)
    assert k == 8 and s > 8


# ---------------------------------------------------------------------------------------------------------------
# AutoDraftLength on synthetic steps


def simulate(policy: AutoDraftLength, steps: int, accept_all: bool, verify_s, draft_s_per_token: float) -> list[int]:
    """Drive the policy as generate() does: choose k, verify k drafts, report what happened."""
    ks = []
    for _ in range(steps):
        k = policy.choose()
        ks.append(k)
        policy.update(k, k if accept_all else 0, verify_s(k + 1), draft_s_per_token * k)
    return ks


def test_auto_k_settles_on_plain_when_every_draft_is_rejected_and_probes():
    policy = AutoDraftLength(k_max=8, probe_every=16, probe_max=64)
    ks = simulate(policy, 400, accept_all=False, verify_s=lambda t: 0.010 * (1 + 0.1 * (t - 1)),
                  draft_s_per_token=0.0)
    tail = ks[100:]
    assert sum(k == 0 for k in tail) >= 0.95 * len(tail)
    # now and then it drafts again (k = 1), once, then goes back to plain; each failed probe doubles the wait
    probes = [i for i, k in enumerate(ks) if k > 0 and i >= 20]
    assert len(probes) >= 4 and all(ks[i] == 1 for i in probes)
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] in ([32, 64, 64], [16, 32, 64]) and set(gaps[3:]) <= {64}
    assert all(k == 0 for k in ks[probes[-1] - 64:probes[-1]])


def test_auto_k_probe_backoff_resets_when_a_probe_is_accepted():
    policy = AutoDraftLength(k_max=8, probe_every=16, probe_max=256)
    simulate(policy, 300, accept_all=False, verify_s=lambda t: 0.010 * (1 + 0.1 * (t - 1)), draft_s_per_token=0.0)
    assert policy.probe_gap > 16
    policy.since_draft = policy.probe_gap
    assert policy.choose() == 1 and policy.probing
    policy.update(1, 1, 0.011, 0.0)
    assert policy.probe_gap == 16


def test_auto_k_settles_on_plain_when_drafts_are_expensive():
    policy = AutoDraftLength(k_max=8, probe_every=16)
    # every draft accepted and verification flat, but each drafted token costs two target forwards
    ks = simulate(policy, 200, accept_all=True, verify_s=lambda t: 0.010, draft_s_per_token=0.020)
    assert sum(k == 0 for k in ks[100:]) >= 0.9 * 100


def test_auto_k_grows_when_everything_is_accepted_and_verification_is_cheap():
    policy = AutoDraftLength(k_max=8, probe_every=16)
    ks = simulate(policy, 200, accept_all=True, verify_s=lambda t: 0.010 * (1 + 0.02 * (t - 1)),
                  draft_s_per_token=0.0)
    assert min(ks[100:]) >= 6


def test_auto_k_per_draft_class():
    """Long n-gram matches (class 8) always accepted, one-token matches (class 1) never: each class gets its own K."""
    policy = AutoDraftLength(k_max=8, probe_every=16)
    verify = lambda t: 0.010 * (1 + 0.1 * (t - 1))  # noqa: E731
    for step in range(300):
        cls = 8 if step % 2 else 1
        k = policy.choose(cls)
        policy.update(k, k if cls == 8 else 0, verify(k + 1), 0.0, cls)
    assert policy.choose(8) >= 6
    assert policy.choose(1) == 0 or policy.probing
    assert policy.acceptance(1)[0] < 0.3 < 0.9 < policy.acceptance(8)[0]
    # a class never seen borrows the pooled estimate
    assert policy.acceptance(5) == policy.acceptance()



def test_auto_k_watch_scores_whole_candidates_against_emitted_tokens():
    """Full-information feedback: a watched candidate is counted once it disagrees with the emitted tokens (or
    matches whole), however many of its tokens were drafted."""
    policy = AutoDraftLength(k_max=8)
    policy.watch([1, 2, 3, 4], 5)
    policy.emitted([1, 2])
    assert 5 not in policy.by_class  # still agreeing: not counted yet
    policy.watch([3, 9], 5)  # the next step's candidate: scored from the next emitted token on
    policy.emitted([7])  # ends both: [1, 2, 3, 4] after 2 matched tokens, [3, 9] at its first
    acc, seen = policy.by_class[5]
    assert acc[:4] == pytest.approx([0.95, 1.0, 0.0, 0.0]) and seen[:4] == pytest.approx([1.95, 1.0, 1.0, 0.0])
    policy.watch([4, 4], 6)
    policy.emitted([4, 4, 4])  # matched whole
    assert policy.by_class[6] == ([1.0, 1.0] + [0.0] * 6, [1.0, 1.0] + [0.0] * 6)
    assert policy.watching == []
    # update() no longer counts what watch() does, and a watching policy never needs to probe
    policy.update(2, 2, 0.01, 0.0, 6)
    assert policy.by_class[6][1][0] == 1.0
    policy.since_draft = 10 ** 6
    policy.choose(6)
    assert not policy.probing


def test_auto_k_learns_long_drafts_from_watched_candidates_without_drafting():
    """A class whose candidates are always right is learned from watching alone, while nothing is drafted; without
    watching the policy knows nothing of it."""
    verify = lambda t: 0.010 * (1 + 0.1 * (t - 1))  # noqa: E731
    watching, blind = AutoDraftLength(k_max=8, prior_acceptance=0.1), AutoDraftLength(k_max=8, prior_acceptance=0.1)
    truth = list(range(1000))
    for step in range(100):
        for policy in (watching, blind):
            if policy is watching:
                policy.watch(truth[step:step + 8], 3)
            policy.update(0, 0, verify(1), 0.0, 3)  # plain decoding: one token emitted per step
            policy.emitted([truth[step]])
    assert watching.choose(3) == 8
    assert blind.choose(3) <= 1  # plain decoding, or a probe

# ---------------------------------------------------------------------------------------------------------------
# end to end


def test_roofline_command_quick(tmp_path, capsys):
    from specdec.cli import main

    model = write_gguf("llama", tmp_path / "t.gguf")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["roofline", "-m", str(model), "-md", str(model), "--quick", "--context", "16", "--alpha", "0.5,0.9",
               "-t", "2", "--json", str(out_json), "--png", str(out_png)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    r = json.loads(out_json.read_text())
    assert [row["t"] for row in r["forward"]] == [1, 2, 4]
    assert r["forward"][0]["ratio"] == 1.0 and all(row["seconds"] > 0 for row in r["forward"])
    assert r["peaks"]["ridge_flop_per_byte"] > 0 and r["peaks"]["bandwidth_gb_s"]["read"] > 0
    # the read measured "at the weights' size" says how many bytes it read: the weights', at most the arrays'
    wset = r["peaks"]["read_bytes_at_weight_size"]
    assert wset == min(r["model"]["weight_bytes"], 8 * 2**20) and f"read over {wset / 1e6:.0f} MB" in captured.out
    assert "--quick: arrays this small" in captured.out
    assert {(p["proposer"], p["alpha"]) for p in r["predictions"]} == {(k, a) for k in ("ngram", "draft")
                                                                          for a in (0.5, 0.9)}
    assert r["draft_model"]["seconds_per_token"] > 0 and r["draft_model"]["c"] > 0
    assert all(p["c"] == 0.0 for p in r["predictions"] if p["proposer"] == "ngram")
    assert all(len(p["speedup"]) == 8 and 0 <= p["best_k"] <= 8 for p in r["predictions"])
    assert r["phases"]["prefill"]["intensity"] > r["phases"]["decode"]["intensity"]
    assert r["machine"]["torch"] and r["settings"]["context"] == 16
    assert "moe" not in r  # a dense model's report has no MoE part
    assert "| T | ms per forward" in captured.out and "best K" in captured.out
    ins = r["peaks"]["instructions"]
    if kernels.matmul_isa() is None:
        assert ins is None
    else:  # the instruction peaks, in the report and its text
        assert ins["isa"] == kernels.matmul_isa() and ins["int_gop_s"] > 0 and ins["fma_gflop_s"] > 0
        assert f"{ins['int_instruction']} {ins['int_gop_s']:.0f} GOP/s" in captured.out
    data = out_png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000


def test_roofline_refuses_a_context_past_the_window(tmp_path, capsys):
    from specdec.cli import main

    model = write_gguf("llama", tmp_path / "t.gguf")  # max_position_embeddings 256
    assert main(["roofline", "-m", str(model), "--quick", "--context", "300"]) == 1
    assert "--context" in capsys.readouterr().err
    assert main(["roofline", "-m", str(model), "--quick", "--alpha", "1.5"]) == 1


def test_plot_bench_writes_png(tmp_path):
    from specdec.bench.plots import plot_bench

    def row(cat, mode, tok_s, speedup, acc):
        return {"category": cat, "mode": mode, "models": "target", "tok_s": tok_s, "speedup": speedup,
                "mean_accepted": 1.0 + sum(acc), "acceptance": sum(acc) / len(acc) if acc else None,
                "acceptance_per_position": acc, "gb_s": 1.0, "tokens": 100, "decode_s": 1.0}

    rows = []
    for cat in ("coding", "writing", "all"):
        rows += [row(cat, "ngram", 120.0, 1.2, [0.8, 0.6, 0.5]), row(cat, "plain", 100.0, 1.0, []),
                 row(cat, "draft", 90.0, 0.9, [0.7, 0.5, 0.4, 0.3])]
    report = {"rows": rows, "machine": {"cpu": "test cpu", "threads": 2}, "mismatches": [],
              "settings": {"model": "/x/model.gguf", "quant": "auto", "dtype": "bfloat16", "n_predict": 64}}
    path = tmp_path / "bench.png"
    plot_bench(report, path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000


# ---------------------------------------------------------------------------------------------------------------
# mixture of experts: the distinct experts a verification reads


@pytest.mark.parametrize("E,k", [(8, 2), (64, 6), (128, 8)])
def test_expected_distinct_experts_matches_monte_carlo(E, k):
    """E (1 - (1 - k/E)^T) against uniform independent routing simulated: each token a random k-subset of E."""
    import torch

    from specdec.bench.roofline import expected_distinct_experts

    g = torch.Generator().manual_seed(E * 100 + k)
    trials = 4000
    for t in (1, 2, 3, 5, 9, 32):
        picks = torch.rand(trials, t, E, generator=g).argsort(dim=-1)[..., :k]  # [trials, t, k], k distinct each
        touched = torch.zeros(trials, E, dtype=torch.bool).scatter_(1, picks.reshape(trials, -1), True)
        simulated = touched.sum(dim=1).double()
        # 4000 trials: the mean is within ~5 standard errors, well under 1.5% of E
        assert expected_distinct_experts(E, k, t) == pytest.approx(simulated.mean().item(),
                                                                   abs=5 * simulated.std().item() / trials**0.5 + 1e-9)
    assert expected_distinct_experts(E, k, 1) == pytest.approx(k)
    assert expected_distinct_experts(E, k, 10**6) == pytest.approx(E)


@pytest.fixture(scope="module")
def tiny_moe_models(tmp_path_factory):
    import torch
    from tiny_moe import write_moe_hf

    from specdec.models.transformer import Transformer
    from specdec.weights import read_model

    out = {}
    for arch in ("qwen3_moe", "deepseek_v2"):  # qwen3_moe: layer 1 dense (mlp_only_layers); deepseek_v2: MLA,
        folder, _, _ = write_moe_hf(arch, tmp_path_factory.mktemp(arch) / arch, seed=3)  # 2 shared, first dense
        lm = read_model(folder)
        out[arch] = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_moe_weight_bytes_grow_with_the_expert_union(tiny_moe_models, arch):
    from specdec.bench.roofline import expected_distinct_experts, moe_layout, moe_weight_bytes

    m = tiny_moe_models[arch]
    a = m.args
    layout = moe_layout(m)
    moe_layers = [layer for layer in m.layers if layer.moe is not None]
    assert layout["moe_layers"] == len(moe_layers) == sum(a.moe_layers) == 2
    # one expert: gate|up [2 x 32, 64] and down [64, 32] in f32
    assert layout["expert_bytes"] == [3 * 32 * 64 * 4] * 2
    # everything the model holds = the fixed part + all E experts of every MoE layer (+ the embedding lookup table
    # when untied, which a forward reads only T rows of and is not counted)
    held = sum(t.numel() * t.element_size() for layer in m.layers for t in layer.tensors())
    held += sum(t.numel() * t.element_size() for t in m.output.tensors() + [m.output_norm])
    assert layout["all_bytes"] == held
    assert moe_weight_bytes(layout, m.weight_bytes, 1) == m.weight_bytes == layout["active_bytes"]
    eb = sum(layout["expert_bytes"])
    for t in (2, 3, 5, 9, 64):
        want = m.weight_bytes + eb * (expected_distinct_experts(a.n_experts, a.n_experts_used, t) - a.n_experts_used)
        assert moe_weight_bytes(layout, m.weight_bytes, t) == round(want)
    assert moe_weight_bytes(layout, m.weight_bytes, 10**4) == layout["all_bytes"]  # every expert, eventually
    # measured routing: k distinct experts at T = 1, between k and min(E, T k) at T = 3, bytes to match
    distinct = {1: [a.n_experts_used] * 2, 3: [5, 6]}
    assert moe_weight_bytes(layout, m.weight_bytes, 1, distinct[1]) == m.weight_bytes
    assert moe_weight_bytes(layout, m.weight_bytes, 3, distinct[3]) == (layout["fixed_bytes"]
                                                                        + 5 * eb // 2 + 6 * eb // 2)


def test_measured_distinct_experts(tiny_moe_models):
    from specdec.bench.roofline import measured_distinct_experts

    m = tiny_moe_models["qwen3_moe"]
    k, E = m.args.n_experts_used, m.args.n_experts
    got = measured_distinct_experts(m, 4, [1, 3, 8])
    assert got[1] == [k, k]
    assert all(k <= d <= min(E, 3 * k) for d in got[3]) and all(k <= d <= E for d in got[8])


def test_matmul_params_moe_and_mla_by_hand():
    from specdec.bench.roofline import matmul_params

    # qwen3-moe-like: 2 layers, the first dense; dim 8, 2 heads of 4 (+ 1 kv head), 4 experts of 6, 2 used
    moe = ModelArgs(arch="qwen3_moe", vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
                    ffn_dim=16, n_experts=4, n_experts_used=2, moe_ffn_dim=6, moe_layers=[False, True])
    attn = 64 + 32 + 32 + 64
    # dense layer 192 + 384; MoE layer 192 + router 4 x 8 + 2 experts x 3 x 8 x 6; head 800
    assert matmul_params(moe) == (attn + 384) + (attn + 32 + 2 * 144) + 800
    # MLA (no q low-rank) with 1 shared expert: q 8 x 2 x (3 + 2), kv_a 8 x (4 + 2), W_UK / W_UV 2 x (3 + 5) x 4,
    # o 2 x 5 x 8
    mla = ModelArgs(arch="deepseek_v2", vocab_size=100, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=5,
                    ffn_dim=16, n_experts=4, n_experts_used=2, moe_ffn_dim=6, n_shared_experts=1, attention="mla",
                    kv_lora_rank=4, qk_nope_dim=3, qk_rope_dim=2, v_head_dim=5)
    assert matmul_params(mla) == (80 + 48 + 64 + 80) + 32 + 3 * 144 + 800
    assert kv_bytes_per_token(mla, 2) == 1 * (4 + 2) * 2  # one latent vector per layer, not K and V


def test_dense_roofline_counts_unchanged():
    from specdec.bench.roofline import moe_weight_bytes

    assert moe_weight_bytes(None, 1234, 1) == moe_weight_bytes(None, 1234, 9) == 1234
    assert forward_counts(SMALL, 1000, 32, 3, 5)["bytes"] == 1352  # as test_forward_counts_by_hand


def test_roofline_command_moe_quick(tmp_path, capsys):
    from tiny_moe import write_moe_hf

    from specdec.cli import main

    folder, _, _ = write_moe_hf("qwen3_moe", tmp_path / "moe", seed=2, tokenizer=True)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["roofline", "-m", str(folder), "--quick", "--context", "8", "-t", "1", "--json", str(out_json),
               "--png", str(out_png)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    r = json.loads(out_json.read_text())
    moe = r["moe"]
    assert (moe["n_experts"], moe["k"], moe["moe_layers"]) == (8, 2, 2)
    curve = {c["t"]: c for c in moe["curve"]}
    assert list(curve) == [1, 2, 4]
    assert curve[1]["measured_ratio"] == curve[1]["moe_calibrated_ratio"] == curve[1]["dense_roofline_ratio"] == 1.0
    assert curve[1]["weight_bytes"] == r["model"]["weight_bytes"] and curve[1]["measured_distinct"] == 2
    # the union of experts grows with T, so verifying costs more than on a dense model of the same active size
    assert curve[4]["weight_bytes"] > curve[2]["weight_bytes"] > curve[1]["weight_bytes"]
    assert curve[4]["moe_calibrated_ratio"] > curve[4]["dense_calibrated_ratio"]
    assert curve[4]["moe_roofline_ratio"] >= curve[4]["dense_roofline_ratio"]
    assert [row["bytes"] for row in r["forward"]] == sorted(row["bytes"] for row in r["forward"])
    assert "mixture of experts: 2 of 3 layers" in captured.out and "| T | experts/layer expected" in captured.out
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_overhead_prediction_by_hand():
    """The overhead model: v1 beyond bytes(1) / bw is fixed, bytes stream at bw, extra FLOPs at the peak; 1 at T = 1,
    and more bytes cost less than under the calibrated model when v1 reads slower than bw."""
    from specdec.bench.roofline import predicted_ratios

    nbytes = {1: 100.0, 4: 250.0}
    flops = {1: 10.0, 4: 40.0}
    bw, peak, v1 = 10.0, 100.0, 15.0  # v1 = 10 s of bytes at bw + 5 s fixed
    roof, cal, over = predicted_ratios(nbytes.get, flops.get, 4, bw, peak, v1)
    assert roof == 25.0 / 10.0 and cal == 2.5 + 0.3 / 15.0
    assert over == (5.0 + 25.0 + 0.3) / 15.0 and over < cal
    assert predicted_ratios(nbytes.get, flops.get, 1, bw, peak, v1)[2] == 1.0
    assert predicted_ratios(nbytes.get, flops.get, 4, bw, peak, 8.0)[2] == (25.0 + 0.3) / 8.0  # no negative fixed


@pytest.mark.skipif(kernels.matmul_lib() is None,
                    reason="no matmul kernel on this CPU: no linear runs in it")
def test_kernel_rate_of_a_quantized_model_only(tmp_path):
    """measure_kernel_rate times one of the model's own quantized FFN linears (a MoE layer's first expert) on 8 rows
    against 1; a model whose linears are not quantized has no such kernel (None: the matmul peak is used)."""
    import torch
    from tiny_moe import write_moe_hf

    from specdec.bench.roofline import measure_kernel_rate
    from specdec.models.transformer import Transformer
    from specdec.weights import read_model

    folder, _, _ = write_moe_hf("qwen3_moe", tmp_path / "m", seed=3, hidden_size=1024,
                                moe_intermediate_size=1024)  # an expert of 2 x 2 MB: the kernel, not the call
    lm = read_model(folder)
    assert measure_kernel_rate(Transformer(lm.args, lm.weights, torch.float32, "none", max_len=16)) is None
    quantized = Transformer(lm.args, lm.weights, torch.float32, "int8", max_len=16)
    assert quantized.layers[-1].moe.experts[0][0].native
    rate = measure_kernel_rate(quantized)
    assert rate is not None and 1e8 < rate < 1e14  # FLOP/s: a real timing, not a placeholder


@pytest.mark.skipif(kernels.matmul_isa() is None, reason="the quantized matmul kernel is not built on this CPU")
def test_instruction_peaks_count_every_thread(monkeypatch):
    """specdec_peak's multiply-adds per second: with twice the rounds the same rate (it is a rate, not a count), and
    the named instructions those of the path the kernel runs."""
    dll = kernels.matmul_lib()
    a = dll.specdec_peak(0, 100_000)
    b = dll.specdec_peak(0, 200_000)
    assert a > 1e8 and b > 1e8 and 0.25 < a / b < 4  # MAC/s: a real timing of the same work per second
    assert dll.specdec_peak(1, 100_000) > 1e8
    p = kernels.instruction_peaks(seconds=0.005, repeats=1)
    assert p["isa"] == kernels.matmul_isa()
    assert p["int_instruction"].startswith("VPDPBUSD" if p["isa"] == "AVX-512 VNNI" else "VPMADDUBSW")
    assert p["int_macs_s"] > 0 and p["fma_macs_s"] > 0
