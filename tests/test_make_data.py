"""`specdec make-data` (Magpie-style data): the user-turn prefix, each filter on strings, seeded determinism, resume
equals an uninterrupted run, the meta check, read_data, and the command end to end on a tiny random model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tiny_models import write_hf

from specdec.cli import main
from specdec.tokenizer import CHATML_TEMPLATE, GEMMA_TEMPLATE
from specdec.train.data import (
    LOW_YIELD_AFTER,
    SPEC_BENCH,
    DataConfig,
    FilterConfig,
    Filters,
    derive_seed,
    is_english,
    is_looping,
    low_yield_warning,
    make_data,
    meta_path,
    prefix_tokens,
    read_data,
    seed_prompts,
    user_turn_prefix,
)

HAWAII = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
          "must-see attractions.")
EMAIL = ("Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' you "
         "prepared. Ask specifically about the data analysis, presentation style, and the clarity of conclusions "
         "drawn. Keep the email short and to the point.")
GOOD = ["What are the main differences between a crocodile and an alligator?",
        "Can you help me write a cover letter for a job as a junior data analyst?",
        "How do I make a simple tomato sauce from scratch?",
        "Write a Python function that checks whether a string is a palindrome.",
        "I have a meeting with my landlord tomorrow about the broken heater. What should I say to him?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama as a Hugging Face folder with the default model's (already converted) tokenizer files:
    loads in a fraction of a second, where a new GGUF's vocabulary takes seconds to convert."""
    import shutil

    from specdec.loader import default_model_path, load
    from specdec.tokenizer import load_tokenizer

    folder = write_hf("llama", tmp_path_factory.mktemp("make-data") / "tiny", seed=5, tokenizer=False)
    for f in load_tokenizer(default_model_path()).folder.iterdir():
        shutil.copyfile(f, folder / f.name)
    return load(folder, ctx=256)


@pytest.fixture
def seeds(tmp_path):
    path = tmp_path / "seeds.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Name three colours.", "Say hello.")) + "\n")
    return str(path)


def config(seeds, **kw) -> DataConfig:
    """Small and fast: a random model writes junk, so only the empty and Spec-Bench filters are on."""
    base = dict(n_prompts=4, temps=(0.0, 1.0), max_new=5, prompt_max=6, seed_prompts=seeds, batch=4,
                filters=FilterConfig(quality=False))
    return DataConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------------------------------
# prompts: the user-turn prefix


def test_user_turn_prefix_chatml_and_gemma(tiny):
    assert user_turn_prefix(CHATML_TEMPLATE) == "<|im_start|>user\n"
    assert user_turn_prefix(GEMMA_TEMPLATE, bos_token="<bos>") == "<bos><start_of_turn>user\n"
    tok = tiny.tokenizer  # SmolLM2's own template: its default system turn, then the user turn's start
    assert tok.decode(prefix_tokens(tok)) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                              "trained by Hugging Face<|im_end|>\n<|im_start|>user\n")


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(0, 0, 1) == derive_seed(0, 0, 1)
    assert len({derive_seed(s, k, j) for s in range(3) for k in range(2) for j in range(50)}) == 300
    assert all(0 <= derive_seed(1, j) < 2 ** 63 for j in range(20))


# ---------------------------------------------------------------------------------------------------------------
# filters


def test_good_prompts_pass_every_filter():
    f = Filters(FilterConfig(), [HAWAII, EMAIL])
    assert [f.reason(p) for p in GOOD] == [None] * len(GOOD)
    assert all(f.check(p) for p in GOOD) and sum(f.counts.values()) == 0


@pytest.mark.parametrize("text,finished,why", [
    ("", True, "empty"),
    ("  \n\t ", True, "empty"),
    ("What is the best way to learn", False, "unfinished"),
    ("Hi there", True, "length"),
    ("Tell me why " + "and how " * 150, True, "length"),
    ("Tell me a story about a dog. " * 6, True, "loop"),
    ("Write a list of:\nthe red apple tree\nthe red apple tree\nthe red apple tree", True, "loop"),
    ("Why do people say no no no no no to it?", True, "loop"),
    ("Écrivez un poème sur les chats et la pluie.", True, "language"),
    ("请写一首关于春天的短诗，描述花开的景象。", True, "language"),
    ("Obs Habit pope elevating fingert bulge thrill rover", True, "language"),
    (HAWAII, True, "spec_bench"),
    ("Compose an engaging travel blog post about a recent trip to Japan, highlighting cultural experiences and "
     "must-see sights.", True, "spec_bench"),
    ("Please draft a professional email seeking your manager's feedback on the 'Quarterly Financial Report' you "
     "prepared.", True, "spec_bench"),
])
def test_each_filter_drops_what_it_claims(text, finished, why):
    f = Filters(FilterConfig(), [HAWAII, EMAIL])
    assert f.reason(text, finished) == why
    assert not f.check(text, finished)
    assert f.counts[why] == 1 and sum(f.counts.values()) == 1


def test_near_duplicates_are_dropped_distinct_prompts_kept():
    f = Filters(FilterConfig())
    assert f.check("Write a short poem about the ocean at night and the stars above it.")
    assert not f.check("Write a short poem about the ocean at night and the stars above.")
    assert f.counts["duplicate"] == 1
    assert f.check("Write a short poem about the mountains in winter and the snow on the trees.")


def test_the_real_spec_bench_questions_are_dropped():
    if not SPEC_BENCH.exists():
        pytest.skip("no Spec-Bench file")
    from specdec.train.data import spec_bench_turns

    turns = spec_bench_turns()
    f = Filters(FilterConfig(quality=False), turns)
    assert all(f.reason(t) == "spec_bench" for t in turns[::7])
    assert f.reason(GOOD[2]) is None


def test_no_filter_keeps_junk_but_never_spec_bench():
    f = Filters(FilterConfig(quality=False), [HAWAII])
    assert f.check("Obs Habit pope elevating")
    assert f.check("Obs Habit pope elevating")  # no dedup either
    assert not f.check(HAWAII) and not f.check("") and f.counts["spec_bench"] == f.counts["empty"] == 1


def test_filter_thresholds_are_configurable():
    loop = "Tell me a story about a dog. " * 6
    assert is_looping(loop) and not is_looping(loop, max_repeat=1.0, max_line_repeats=10, max_run=10)
    french = "Écrivez un poème sur les chats."
    assert not is_english(french) and is_english(french, min_ascii=0.5, min_stopwords=0)
    assert Filters(FilterConfig(min_words=1)).reason("Hi there") is None


def test_seed_prompts_refuse_spec_bench(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [HAWAII]}) + "\n")
    with pytest.raises(ValueError, match="Spec-Bench"):
        seed_prompts(bad)
    with pytest.raises(ValueError, match="not found"):
        seed_prompts(tmp_path / "missing.jsonl")
    assert seed_prompts(None) == []


# ---------------------------------------------------------------------------------------------------------------
# the pipeline on a tiny random model


def run(tiny, out, cfg) -> tuple[bytes, dict, dict]:
    summary = make_data(tiny, out, cfg)
    return out.read_bytes(), json.loads(meta_path(out).read_text()), summary


def test_seeded_runs_are_deterministic(tiny, seeds, tmp_path):
    a, meta, s = run(tiny, tmp_path / "a.jsonl", config(seeds))
    b, _, _ = run(tiny, tmp_path / "b.jsonl", config(seeds))
    c, _, _ = run(tiny, tmp_path / "c.jsonl", config(seeds, seed=1))
    assert a == b and a != c
    rows = [json.loads(x) for x in a.splitlines()]
    assert [r["source"] for r in rows] == ["seed", "seed"] + ["magpie"] * 4
    assert [r["id"] for r in rows] == list(range(6)) and s["magpie"] == 4 and s["answers"] == 12
    tok = tiny.tokenizer
    for r in rows:
        assert r["prompt_tokens"] == tok.encode_chat([{"role": "user", "content": r["prompt"]}])
        assert [x["temperature"] for x in r["answers"]] == [0.0, 1.0]
        assert all(1 <= len(x["tokens"]) <= 5 and isinstance(x["text"], str) for x in r["answers"])
        assert len({x["seed"] for x in r["answers"]}) == 2
    assert meta["progress"]["lines"] == 6 and meta["base"]["file"] == "tiny"


def test_resume_equals_an_uninterrupted_run(tiny, seeds, tmp_path):
    fresh, fresh_meta, _ = run(tiny, tmp_path / "fresh.jsonl", config(seeds, n_prompts=8))
    out = tmp_path / "part.jsonl"
    four, _, _ = run(tiny, out, config(seeds, n_prompts=4))
    state4 = meta_path(out).read_bytes()
    assert fresh.startswith(four) and len(four.splitlines()) == 6
    again, meta, s = run(tiny, out, config(seeds, n_prompts=8, batch=3))  # continued, another batch size
    assert again == fresh and meta == fresh_meta and s["magpie"] == 8 and s["answers"] == 8
    # an interrupted run: a truncated last line, or a line written after the meta's last state, is redone
    lines = fresh.splitlines(keepends=True)
    for extra in (lines[6][:30], lines[6]):
        out.write_bytes(four + extra)
        meta_path(out).write_bytes(state4)
        assert run(tiny, out, config(seeds, n_prompts=8))[0] == fresh


def test_strict_filters_count_every_dropped_candidate(tiny, seeds, tmp_path):
    out = tmp_path / "strict.jsonl"
    data, meta, s = run(tiny, out, config(seeds, n_prompts=2, max_tries=3, filters=FilterConfig()))
    assert s["magpie"] == 0 and s["candidates"] == 6 and sum(s["dropped"].values()) == 6  # junk: all dropped
    assert meta["progress"]["counts"] == s["dropped"] and len(data.splitlines()) == 2  # the seed prompts only


def test_low_yield_is_said_once_with_what_to_do(tiny, seeds, tmp_path, capsys):
    """A model whose Magpie candidates nearly all fail the filters gets one line saying so early (after
    LOW_YIELD_AFTER candidates), naming the filter and pointing to --seed-prompts; a working run gets none."""
    assert low_yield_warning({"unfinished": 60, "loop": 2}, LOW_YIELD_AFTER - 1, 0) is None  # too early to judge
    assert low_yield_warning({"unfinished": 50}, 64, 4) is None  # 6% kept
    note = low_yield_warning({"unfinished": 61, "loop": 2}, 64, 1)
    assert "1 of 64" in note and "'unfinished'" in note and "--prompt-max" in note and "--seed-prompts" in note
    assert "--prompt-max" not in low_yield_warning({"loop": 64}, 64, 0)
    run(tiny, tmp_path / "strict.jsonl", config(seeds, n_prompts=4, max_tries=20, filters=FilterConfig()))
    err = capsys.readouterr().err
    assert err.count("Magpie candidates kept so far") == 1 and "0 of 64" in err  # junk from a random model
    run(tiny, tmp_path / "open.jsonl", config(seeds, n_prompts=80, max_tries=1))
    assert "kept so far" not in capsys.readouterr().err


def test_other_settings_or_model_are_refused(tiny, seeds, tmp_path):
    out = tmp_path / "m.jsonl"
    cfg = config(seeds, n_prompts=1)
    run(tiny, out, cfg)
    with pytest.raises(ValueError, match="other settings"):
        make_data(tiny, out, replace(cfg, temps=(0.0,)))
    with pytest.raises(ValueError, match="other settings"):
        make_data(tiny, out, replace(cfg, filters=FilterConfig()))
    meta = json.loads(meta_path(out).read_text())
    meta["base"]["sha256"] = "0" * 64
    meta_path(out).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="another model"):
        make_data(tiny, out, cfg)
    meta_path(out).unlink()
    with pytest.raises(ValueError, match="without"):
        make_data(tiny, out, cfg)


def test_a_corrupt_counted_line_is_named(tiny, seeds, tmp_path):
    """A line inside the part the meta file counts that is not JSON (an edited or damaged file) is refused with the
    file and line (it said only "Unterminated string starting at ...")."""
    out = tmp_path / "c.jsonl"
    cfg = config(seeds, n_prompts=2)
    run(tiny, out, cfg)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(lines[0] + lines[1][:20] + b"\n" + b"".join(lines[2:]))
    with pytest.raises(ValueError, match=r"c\.jsonl:2 is not a make-data line"):
        make_data(tiny, out, cfg)


def test_read_data_gives_prompt_plus_answer_per_answer(tiny, seeds, tmp_path):
    out = tmp_path / "r.jsonl"
    run(tiny, out, config(seeds, n_prompts=1))
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    want = [r["prompt_tokens"] + a["tokens"] for r in rows for a in r["answers"]]
    assert read_data(out) == want and len(want) == 6
    with open(out, "a") as f:
        f.write('{"id": 3, "source": "mag')  # an interrupted write
    assert read_data(out) == want


def test_read_data_refuses_what_is_not_this_models_data(tiny, seeds, tmp_path):
    from specdec.weights.heads import base_fingerprint

    out = tmp_path / "m.jsonl"
    run(tiny, out, config(seeds, n_prompts=1))
    base = base_fingerprint(tiny)
    want = read_data(out)
    assert read_data(out, base) == want
    with pytest.raises(ValueError, match="outside .* vocabulary of 2"):  # ids past another model's vocabulary
        read_data(out, {**base, "vocab_size": 2})
    meta = json.loads(meta_path(out).read_text())
    meta["base"]["sha256"] = "0" * 64
    meta_path(out).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="answers of another model"):
        read_data(out, base)
    assert read_data(out) == want  # without a model to check against, the meta file is not read
    meta_path(out).write_text("{")
    with pytest.raises(ValueError, match="not a make-data meta file"):
        read_data(out, base)
    lines = out.read_text().splitlines()
    for bad, what in (('{"answers": []}', "KeyError"), ("garbage", "JSONDecodeError"),
                      ('{"prompt_tokens": [1], "answers": [{"tokens": ["a"]}]}', "ValueError: token ids must be")):
        out.write_text("\n".join(lines + [bad]) + "\n")
        with pytest.raises(ValueError, match=rf"line {len(lines) + 1} is not a make-data line \({what}"):
            read_data(out)
    out.write_text("garbage")  # no newline: an interrupted first write
    with pytest.raises(ValueError, match="no complete make-data line"):
        read_data(out)


def test_cli_end_to_end(tiny, seeds, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    argv = ["make-data", "-m", str(tiny.path), "-o", str(out), "--n-prompts", "2", "--temps", "0,0.7", "--max-new",
            "4", "--prompt-max", "6", "--seed-prompts", "none", "--batch", "4", "--no-filter", "-s", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 Magpie of 2 candidates" in err and "tok/s" in err and "duplicate 0" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r.keys() == {"id", "source", "prompt", "prompt_tokens", "answers"} for r in rows)
    assert all(a.keys() == {"temperature", "seed", "tokens", "text"} for r in rows for a in r["answers"])
    meta = json.loads(meta_path(out).read_text())
    assert meta["settings"]["temps"] == [0.0, 0.7] and meta["settings"]["seed"] == 3
    assert meta["progress"]["counts"]["empty"] == 0
    assert main(argv[:-2] + ["-s", "4"]) == 1  # the same file with another seed is refused, in one line
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["make-data", "-o", str(out), "--temps", "hot"]) == 1
    assert "--temps" in capsys.readouterr().err
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"turns": [HAWAII]}) + "\n")
    assert main(argv[:-2] + ["--seed-prompts", str(bad)]) == 1
    assert "Spec-Bench" in capsys.readouterr().err
