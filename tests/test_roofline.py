"""The roofline tool and the models behind draft-length choice: byte / FLOP counts against hand-computed values, the
speedup model's identities, the automatic draft length on synthetic costs, and `specdec roofline` / the bench
figure end to end on a tiny model. No assertion is about time."""

from __future__ import annotations

import json

import pytest
from tiny_models import write_gguf

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
    assert {(p["proposer"], p["alpha"]) for p in r["predictions"]} == {(k, a) for k in ("ngram", "draft")
                                                                          for a in (0.5, 0.9)}
    assert r["draft_model"]["seconds_per_token"] > 0 and r["draft_model"]["c"] > 0
    assert all(p["c"] == 0.0 for p in r["predictions"] if p["proposer"] == "ngram")
    assert all(len(p["speedup"]) == 8 and 0 <= p["best_k"] <= 8 for p in r["predictions"])
    assert r["phases"]["prefill"]["intensity"] > r["phases"]["decode"]["intensity"]
    assert r["machine"]["torch"] and r["settings"]["context"] == 16
    assert "| T | ms per forward" in captured.out and "best K" in captured.out
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
