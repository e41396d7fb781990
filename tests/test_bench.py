"""`specdec bench` end to end on a tiny model (JSON, PNG, greedy-identity check), and its prompt loading."""

from __future__ import annotations

import json

import pytest
from tiny_models import write_gguf

from specdec.bench.prompts import load_prompts
from specdec.cli import main

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"


def test_bench_tiny_model_end_to_end(tmp_path, capsys):
    model = write_gguf("llama", tmp_path / "t.gguf", seed=1)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", "-m", str(model), "--mode", "plain,ngram,draft", "-md", str(model), "-n", "12",
               "--repeats", "1", "--draft-max", "auto,2", "--json", str(out), "--png", str(png), "--peer", "hf"])
    assert rc == 0
    report = json.loads(out.read_text())
    modes = {r["mode"] for r in report["rows"]}
    assert {"plain", "ngram (K auto)", "ngram (K 2)", "draft (K auto)", "draft (K 2)", "hf transformers"} <= modes
    assert report["mismatches"] == []  # every speculative output equals plain greedy output
    assert report["settings"]["n_predict"] == 12 and report["machine"]["torch"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "| all | plain |" in text and "identical to plain decoding" in text


def test_spec_bench_prompts():
    rows = load_prompts(SPEC_BENCH, "mt_bench,summarization", limit=3)
    assert [r.category for r in rows] == ["mt_bench"] * 3 + ["summarization"] * 3
    assert load_prompts(SPEC_BENCH)[0].category == "mt_bench"  # writing, roleplay, ... fold into mt_bench
    with pytest.raises(ValueError, match="no prompts of category"):
        load_prompts(SPEC_BENCH, "poetry")


def test_plain_prompt_format(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"prompt": "there", "category": "x"}\n')
    assert [(r.category, r.text) for r in load_prompts(f)] == [("default", "hi"), ("x", "there")]
    f.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_prompts(f)
