"""`specdec bench` end to end on a tiny model (JSON, PNG, greedy-identity check), and its prompt loading."""

from __future__ import annotations

import json
import statistics

import pytest
from tiny_models import write_gguf

from specdec.bench.prompts import load_prompts
from specdec.cli import main

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"


def test_bench_tiny_model_end_to_end(tmp_path, capsys):
    model = write_gguf("llama", tmp_path / "t.gguf", seed=1)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", "-m", str(model), "--mode", "plain,ngram,draft", "-md", str(model), "-n", "12",
               "--repeats", "1", "--draft-max", "auto,2", "--json", str(out), "--png", str(png), "--peer", "hf",
               "--ignore-eos"])
    assert rc == 0
    report = json.loads(out.read_text())
    modes = {r["mode"] for r in report["rows"]}
    assert {"plain", "ngram (K auto)", "ngram (K 2)", "draft (K auto)", "draft (K 2)", "hf", "hf prompt-lookup",
            "hf assisted"} <= modes
    assert report["mismatches"] == []  # every speculative output equals plain greedy output
    assert report["settings"]["n_predict"] == 12 and report["machine"]["torch"] and report["settings"]["ignore_eos"]
    plain = next(r for r in report["rows"] if r["category"] == "all" and r["mode"] == "plain")
    assert plain["tokens"] == 11 * len(report["prompts"])  # past EOS: every run made all 12 tokens
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "| all | plain |" in text and "identical to plain decoding" in text


def test_spec_bench_prompts():
    rows = load_prompts(SPEC_BENCH, "mt_bench,summarization", limit=3)
    assert [r.category for r in rows] == ["mt_bench"] * 3 + ["summarization"] * 3
    assert len(load_prompts(SPEC_BENCH, "mt_bench", limit=100)) == 80  # a limit above the category's size keeps all
    eight = load_prompts(SPEC_BENCH, "mt_bench", limit=8)  # evenly spaced: one prompt of each MT-bench sub-task
    assert len({r.id for r in eight}) == 8 and [int(r.id) for r in eight] == [81 + 10 * i for i in range(8)]
    assert load_prompts(SPEC_BENCH)[0].category == "mt_bench"  # writing, roleplay, ... fold into mt_bench
    with pytest.raises(ValueError, match="no prompts of category"):
        load_prompts(SPEC_BENCH, "poetry")
    with pytest.raises(ValueError, match="no prompts of category writing: .*under mt_bench"):
        load_prompts(SPEC_BENCH, "summarization,writing")  # one unknown name among known ones is an error too


def test_plain_prompt_format(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"prompt": "there", "category": "x"}\n')
    assert [(r.category, r.text) for r in load_prompts(f)] == [("default", "hi"), ("x", "there")]
    f.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_prompts(f)


PERF = "llama_perf_context_print:"
FAKE_SIMPLE = f"""#!/bin/sh
echo "main: decoded 31 tokens in 0.40 s, speed: 77.50 t/s" >&2
echo "{PERF} prompt eval time =  20.00 ms /    12 tokens (    1.67 ms per token,   600.00 tokens per second)" >&2
echo "{PERF}        eval time = 300.00 ms /    31 runs   (    9.68 ms per token,   103.33 tokens per second)" >&2
"""
FAKE_LOOKUP = """#!/bin/sh
echo "encoded   12 tokens in    0.020 seconds, speed:  600.000 t/s" >&2
echo "decoded   32 tokens in    0.250 seconds, speed:  128.000 t/s" >&2
echo "n_draft   = 4" >&2
echo "n_drafted = 40" >&2
echo "n_accept  = 30" >&2
"""


def test_llama_cpp_peer_parses_its_tools(tmp_path):
    """The llama.cpp peer runs the tools of a build folder and reads their own timing lines (fake tools here:
    CI has no llama.cpp build)."""
    from specdec.bench.peers import LlamaCppPeer, parse_llama_output

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("llama-simple", FAKE_SIMPLE), ("llama-lookup", FAKE_LOOKUP)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    plain = LlamaCppPeer(tmp_path, "plain", model)
    seconds, tokens, counts = plain.run([1, 2], "hi", 32)
    assert tokens is None and abs(seconds - 0.3) < 1e-9  # the decode-only "eval time" line, 31 tokens
    (bin_dir / "llama-cli").write_text(FAKE_SIMPLE)  # preferred over llama-simple: it takes a thread count
    (bin_dir / "llama-cli").chmod(0o755)
    cli = LlamaCppPeer(tmp_path, "plain", model, threads=2)
    cmd = cli.command("hi", 32)
    assert cli.exe.name == "llama-cli" and cmd[cmd.index("-t") + 1] == "2" and "-no-cnv" in cmd
    assert abs(cli.run([1, 2], "hi", 32)[0] - 0.3) < 1e-9
    lookup = LlamaCppPeer(tmp_path, "lookup", model, draft_max=4)
    assert "--draft-max" in lookup.command("hi", 32)
    seconds, _, counts = lookup.run([1, 2], "hi", 32)
    assert counts == {"n_draft": 4, "n_drafted": 40, "n_accept": 30} and abs(seconds - 0.25 * 31 / 32) < 1e-9
    with pytest.raises(ValueError, match="not found"):
        LlamaCppPeer(tmp_path, "speculative", model, model)
    with pytest.raises(ValueError, match="no timing"):
        parse_llama_output("nothing here")


FAKE_LOOKUP_NEW = """#!/bin/sh
if [ "$1" = "-h" ]; then echo "--spec-draft-n-max N   number of tokens to draft"; exit 0; fi
echo "decoded   32 tokens in    0.250 seconds, speed:  128.000 t/s" >&2
"""
FAKE_SILENT = f"""#!/bin/sh
echo "{PERF}        eval time =   0.00 ms /     0 runs   (    0.00 ms per token,      0.00 tokens per second)" >&2
"""


def test_llama_cpp_peer_flags_of_new_builds_and_silent_runs(tmp_path):
    """Recent llama.cpp renamed --draft-max to --spec-draft-n-max (read from -h); a tool that decodes nothing
    (it stopped at once) gives no time instead of a division by zero."""
    from specdec.bench.peers import LlamaCppPeer

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("llama-lookup", FAKE_LOOKUP_NEW), ("llama-completion", FAKE_SILENT)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    lookup = LlamaCppPeer(tmp_path, "lookup", model, draft_max=3)
    cmd = lookup.command("hi", 32)
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "3" and "--draft-max" not in cmd and "--ignore-eos" in cmd
    assert LlamaCppPeer(tmp_path, "plain", model).run([1], "hi", 32)[0] == 0.0


class _SilentPeer:
    name, models = "silent peer", "target"

    def run(self, ids, text, n):
        return 0.0, None, {}


def test_bench_baseline_is_plain_whatever_the_order(tmp_path):
    """Speedups are against plain decoding even when another mode is listed first, a peer that decoded nothing
    gets no speed (not a ZeroDivisionError), and the counts and time shares come from the median repeat."""
    from specdec.bench.prompts import Prompt
    from specdec.bench.run import build_modes, run_bench
    from specdec.cli import build_parser
    from specdec.loader import load

    path = write_gguf("llama", tmp_path / "t.gguf", seed=2)
    target = load(path, ctx=256)
    args = build_parser().parse_args(["bench", "-m", str(path), "--mode", "ngram,plain"])
    modes = build_modes(["ngram", "plain"], target, args)
    assert [m.name for m in modes] == ["ngram", "plain"]
    prompts = [Prompt("x", "one two three one two three one two", "1"), Prompt("x", "a b c a b c a b", "2")]
    report = run_bench(target, modes, [_SilentPeer()], prompts, 10, 3, chat=False, ignore_eos=True,
                       peaks={"read_gb_s": 10.0, "matmul_flop_s": 1e11})
    rows = {(r["category"], r["mode"]): r for r in report["rows"]}
    assert rows[("all", "plain")]["speedup"] == 1.0
    ng = rows[("all", "ngram")]
    assert ng["speedup"] == ng["tok_s"] / rows[("all", "plain")]["tok_s"]
    assert rows[("all", "silent peer")]["tok_s"] is None and rows[("all", "silent peer")]["speedup"] is None
    assert 0 < rows[("all", "plain")]["bus"] and 0 < rows[("all", "plain")]["compute"] < 1
    assert 0 <= ng["draft_share"] < 1 and 0 < ng["verify_share"] <= 1


BATCHED_BENCH = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.352 |   363.46 |    0.801 |   159.80 |    1.153 |   222.00 |
|   128 |    128 |    4 |   1024 |    1.402 |   365.18 |    1.660 |   308.43 |    3.062 |   334.40 |
"""


def test_batched_bench_table_is_parsed():
    from specdec.bench.peers import parse_batched_bench

    rows = parse_batched_bench(BATCHED_BENCH)
    assert [(r["batch"], r["tg_tok_s"]) for r in rows] == [(1, 159.8), (4, 308.43)]
    with pytest.raises(ValueError, match="no table"):
        parse_batched_bench("nothing")


def test_bench_batch_sizes_end_to_end(tmp_path, capsys):
    """`bench --batch`: every prompt through the batched engine at each size; outputs identical to batch 1."""
    model = write_gguf("llama", tmp_path / "t.gguf", seed=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w} one two three one two three"}) + "\n"
                               for w in ("alpha", "beta", "gamma", "delta", "epsilon")))
    out = tmp_path / "b.json"
    rc = main(["bench", "-m", str(model), "--prompts", str(prompts), "--mode", "ngram", "-n", "10",
               "--batch", "2,4", "--no-chat", "--ignore-eos", "--repeats", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    got = [(r["mode"], r["batch"]) for r in report["rows"]]
    # plain runs first even when not asked: every speedup is against plain decoding at batch 1
    assert got == [(m, b) for m in ("plain", "ngram") for b in (1, 2, 4)] and report["mismatches"] == []
    plain1 = report["rows"][0]["aggregate_tok_s"]
    assert all(r["vs_plain_batch1"] == pytest.approx(r["aggregate_tok_s"] / plain1) for r in report["rows"])
    assert all(r["tokens"] == 50 for r in report["rows"])
    # the decode-only rate leaves the prefills' time out: above the whole-run rate, by exactly their share
    for r in report["rows"]:
        assert 0 < r["prefill_s"] < r["wall_s"] and r["decode_aggregate_tok_s"] > r["aggregate_tok_s"]
        assert r["decode_aggregate_tok_s"] == pytest.approx(r["tokens"] / (r["wall_s"] - r["prefill_s"]))
        # lockstep (llama-batched-bench's S_TG): each group prefilled first, then every token after the first
        # decoded; --repeats rounds, the median reported, and the ratio to batch 1 taken within each round
        runs = r["lockstep_runs"]
        assert len(runs) == 2 and all(x["tokens"] == 5 * 9 for x in runs)
        assert r["lockstep_tok_s"] == pytest.approx(statistics.median(45 / x["seconds"] for x in runs))
        one = next(q for q in report["rows"] if q["mode"] == r["mode"] and q["batch"] == 1)["lockstep_runs"]
        assert r["lockstep_vs_batch1"] == pytest.approx(statistics.median(
            one[i]["seconds"] / x["seconds"] for i, x in enumerate(runs)))
    assert "every batched output is identical" in capsys.readouterr().out
