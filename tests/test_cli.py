"""The command line: text streams to stdout, a summary goes to stderr, and every bad input is one line on stderr
with a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from specdec.cli import main


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_generate_streams_and_summarizes(tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("generate", "-p", "What is the capital of France?", "--chat", "-n", "24", "--temp", "0",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["text"].strip() and result["text"].strip() in r.stdout
    assert "tok/s" in r.stderr and "load" in r.stderr and "prompt" in r.stderr
    assert result["stats"]["generated_tokens"] <= 24


def test_demo_alternates_rounds_and_prints_medians():
    """`specdec demo` (make demo's main job): each prompt plain then speculative, --repeats rounds alternated, one
    table row per prompt with the medians, texts identical to plain decoding."""
    r = run_cli("demo", "-n", "12", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    assert "medians of 2 alternated rounds" in r.stdout.splitlines()[0]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert len(rows) == 2 and all(line.rstrip().endswith("| yes |") for line in rows), rows
    one = run_cli("demo", "-n", "12", "--repeats", "1")
    assert one.returncode == 0 and "one round" in one.stdout.splitlines()[0]


def test_truncated_gguf(tmp_path, smollm2_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm2_path.read_bytes()[:30_000_000])
    assert_one_line_error(run_cli("generate", "-m", str(bad), "-p", "hi"), "truncated")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("just some text\n")
    assert_one_line_error(run_cli("generate", "-m", str(bad), "-p", "hi"), "not a GGUF")


def test_missing_file():
    assert_one_line_error(run_cli("generate", "-m", "/nonexistent/model.gguf", "-p", "hi"), "not found")


def test_unknown_architecture_gguf(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(run_cli("generate", "-m", str(path), "-p", "hi"), "falcon", "supports")


def test_unknown_architecture_hf(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert_one_line_error(run_cli("generate", "-m", str(tmp_path), "-p", "hi"), "gpt2", "supports")


def test_prompt_longer_than_context():
    r = run_cli("generate", "-p", "hello " * 600, "-c", "256", "-n", "8")
    assert_one_line_error(r, "context", "-c")


@pytest.mark.parametrize("argv,words", [
    (["generate", "-p", "hi", "--temp", "-1"], ["--temp"]),
    (["generate", "-p", "hi", "--top-p", "0"], ["--top-p"]),
    (["generate", "-p", "hi", "--quant", "int3"], ["--quant"]),
    (["generate", "-p", "hi", "--dtype", "f8"], ["--dtype"]),
    (["generate"], ["prompt"]),
    (["generate", "-p", "hi", "--repeat-penalty", "0"], ["--repeat-penalty"]),
    (["generate", "-p", "hi", "--presence-penalty", "3"], ["--presence-penalty"]),
    (["generate", "-p", "hi", "-l", "12+x"], ["--logit-bias"]),
    (["generate", "-f", "/nonexistent/prompt.txt"], ["prompt file not found", "/nonexistent/prompt.txt"]),
    (["generate", "-f", "/"], ["cannot read the prompt file /"]),
    (["generate", "-p", "hi", "-f", "p.txt"], ["-p TEXT or -f FILE, not both"]),
    (["generate", "-p", "hi", "--draft-max", "17"], ["--draft-max must be auto or 0..16, not 17"]),
    (["generate", "-p", "hi", "-l", "49152+1"], ["token id 49152 is outside the vocabulary (0..49151)"]),
    (["generate", "-p", "hi", "--json", "/"], ["--json / is a folder"]),
    (["bench", "--json", "/"], ["--json / is a folder"]),
    (["roofline", "--png", "/"], ["--png / is a folder"]),
    (["generate", "-p", "hi", "-md", "/nonexistent/draft.gguf"], ["model not found: /nonexistent/draft.gguf"]),
    (["generate", "-p", "hi", "--temp", "inf"], ["--temp must be a finite number"]),
    (["generate", "-p", "hi", "--spec", "mtp", "-md", "d.gguf"], ["-md drafts with --spec draft", "or auto", "mtp"]),
    (["generate", "-p", "hi", "--spec", "ngram", "--tree", "2,2"], ["--tree shapes the MTP heads' drafts"]),
    (["generate", "-p", "hi", "--spec", "ngram", "--ngram-min", "5"], ["--ngram-min 5 / --ngram-max 4: n-gram sizes"]),
    (["generate", "-p", "hi", "-n", "2", "--device", "mps"], ["--device mps asked"]),
    (["train-mtp", "-o", "h.safetensors", "--lr", "-1"], ["--lr -1.0 is out of range"]),
    (["train-mtp", "-o", "h.safetensors", "--lr", "nan"], ["--lr nan is out of range"]),
    (["train-mtp", "-o", "h.safetensors", "--noise", "-1"], ["--noise -1.0 is out of range"]),
    (["train-mtp", "-o", "heads.txt"], ["give a FILE.safetensors"]),
    (["demo", "-n", "0"], ["-n must be >= 1"]),
    (["bench-serve", "--url", "http://127.0.0.1:9", "--extra", "{bad"], ["--extra is not JSON"]),
    (["bench-serve", "--url", "http://127.0.0.1:9", "--extra", "[1]"], ["--extra must be a JSON object"]),
    (["train-mtp", "-o", "h.safetensors", "--vocab", "99999"], ["--vocab 99999 is more than the model's 49152"]),
])
def test_bad_flags_in_process(capsys, argv, words):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    for w in words:
        assert w in err



def test_more_threads_than_cpus_is_said(capsys):
    """-t beyond the CPUs this process may use runs (llama.cpp's -t does too) but says why it will be slow (-t 1000
    decoded 0.3 tok/s without a word)."""
    import argparse

    import torch

    from specdec.cli import set_threads, usable_cpus

    before = torch.get_num_threads()
    try:
        set_threads(argparse.Namespace(threads=usable_cpus()))
        assert capsys.readouterr().err == ""
        set_threads(argparse.Namespace(threads=usable_cpus() + 1))
        assert "more threads than the" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_outputs_and_draft_files_are_checked_before_any_load(monkeypatch, capsys, tmp_path):
    """A --json that cannot be written and a draft file that is missing or broken are refused before the target
    loads (the results of a whole run were lost at its end; a missing draft was named after the target's load)."""
    import specdec.loader as loader

    loaded = []
    monkeypatch.setattr(loader, "load", lambda model, **kw: loaded.append(model))
    broken = tmp_path / "d.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))  # the magic, then a header that cannot be read
    for argv in (["--json", str(tmp_path)], ["-md", str(tmp_path / "none.gguf")], ["-md", str(broken)]):
        assert main(["generate", "-p", "hi", "-n", "4", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err), err
    assert "is a folder" in err[0] and "model not found" in err[1] and "d.gguf" in err[2], err
    assert loaded == []


def test_auto_takes_the_draft_model_as_a_source(monkeypatch, capsys, smollm2_path):
    """`--spec auto -md DRAFT` loads the draft model and hands it to auto as one more source (spec/__init__.py); the
    command line ignored it until 12-07 (only `--spec draft` loaded it). Greedy text equal to --spec none's."""
    import specdec.loader as loader

    loaded = []
    real = loader.load
    monkeypatch.setattr(loader, "load", lambda model, **kw: loaded.append(model) or real(model, **kw))
    texts = []
    for spec in (["--spec", "auto", "-md", str(smollm2_path)], ["--spec", "none"]):
        assert main(["generate", "-p", "Repeat exactly: the quick brown fox jumps over the lazy dog.", "-n", "16",
                     "--temp", "0", *spec]) == 0
        texts.append(capsys.readouterr().out)
    assert loaded == [None, str(smollm2_path), None] and texts[0] == texts[1]


def test_prompt_file_rows_are_checked_by_line(capsys, tmp_path):
    """-f FILE.jsonl: a row that is not a usable prompt names the file and line; an empty file is refused; a
    prompt longer than the context is named before anything decodes."""
    cases = {'{"prompt": "hi"}\n{"prompt": 5}\n': "p.JSONL:2: 'prompt' must be a non-empty string",
             '{"turns": []}\n': "p.JSONL:1: 'turns' must be a list whose first item is a non-empty string",
             '{"turns": "hello"}\n': "'turns' must be a list",
             '"just text"\n': "p.JSONL:1 has neither 'turns' (Spec-Bench) nor 'prompt'",
             "\n": "no prompts in",
             '{"prompt": "hi"}\n{"id": "big", "prompt": "' + "word " * 400 + '"}\n':
                 "prompt big has 40"}
    for text, words in cases.items():
        f = tmp_path / "p.JSONL"  # the suffix in any case
        f.write_text(text)
        assert main(["generate", "-f", str(f), "-n", "4", "-c", "256"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and words in err, (words, err)


def test_prompt_file_takes_the_system_message_and_writes_json(capsys, tmp_path):
    """-f FILE.jsonl with -sys (which turns --chat on) decodes each prompt as `-p` does with the same flags, and
    --json writes every output (both were silently ignored for prompt files)."""
    system = "Answer only in French."
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "q", "prompt": "Say hello to me."}) + "\n")
    out = tmp_path / "o.json"
    assert main(["generate", "-f", str(f), "-n", "10", "--temp", "0", "-sys", system, "--json", str(out)]) == 0
    batch = json.loads(out.read_text())["outputs"]
    assert len(batch) == 1 and batch[0]["id"] == "q" and len(batch[0]["tokens"]) == 10
    capsys.readouterr()
    single = {}
    for sys_flags in (["-sys", system], []):
        assert main(["generate", "-p", "Say hello to me.", "--chat", "-n", "10", "--temp", "0", *sys_flags]) == 0
        single[bool(sys_flags)] = capsys.readouterr().out.strip()
    assert batch[0]["text"].strip() == single[True] != single[False]


@pytest.mark.parametrize("argv,flag", [
    (["generate", "-p", "hi", "-c", "-5"], "-c/--ctx-size"),  # reached torch.arange: "upper bound and lower bound ..."
    (["generate", "-p", "hi", "-t", "0"], "-t/--threads"),  # reached torch.set_num_threads: a RuntimeError
    (["generate", "-p", "hi", "-c", "many"], "-c/--ctx-size"),
    (["bench", "--repeats", "0"], "--repeats"),  # an IndexError after the whole run
    (["bench", "--limit", "0"], "--limit"),
    (["demo", "--repeats", "0"], "--repeats"),
    (["train-mtp", "--epochs", "0", "-o", "x.safetensors"], "--epochs"),  # generated answers first, trained nothing
    (["train-mtp", "--samples", "0", "-o", "x.safetensors"], "--samples"),
    (["train-mtp", "--limit", "0", "-o", "x.safetensors"], "--limit"),  # 0 used to mean every prompt
])
def test_bad_counts_are_refused_by_the_parser(capsys, argv, flag):
    """Counts out of range stop at argument parsing, with argparse's one line naming the flag, before any load."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdec ") and f"argument {flag}: " in err[-1] and "Traceback" not in "\n".join(err)

def test_a_draft_of_another_vocabulary_is_refused_before_its_weights_load(monkeypatch, capsys, gemma_path):
    """-md with Gemma's vocabulary for the SmolLM2 target: one line, from the draft's tokenizer alone (loading its
    weights first took ~20 s of conversion before the same refusal)."""
    import specdec.loader as loader

    loaded = []
    real = loader.load
    monkeypatch.setattr(loader, "load", lambda model, **kw: loaded.append(model) or real(model, **kw))
    assert main(["generate", "-md", str(gemma_path), "-p", "hi", "-n", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "differ" in err[-1]
    assert loaded == [None]  # the target only


def test_decode_commands_defer_torch_meta_registrations():
    """generate / serve / demo import torch without running torch._meta_registrations (0.3 s): in a fresh process
    its stand-in is in place, real tensors compute, a meta-device fft (a Python-only shape function) is not
    registered yet; the first read from the module runs it and the fft works. Without defer_meta the real module
    is there from the start."""
    code = ("import argparse, sys; from specdec.cli import set_threads; "
            "set_threads(argparse.Namespace(threads=1), defer_meta=sys.argv[1] == '1'); import torch; "
            "m = sys.modules['torch._meta_registrations']; x = torch.arange(6.0).reshape(2, 3); "
            "print(type(m).__name__, float((x @ x.T).sum()), end=' ')\n"
            "def fft():\n"
            "    try: torch.fft.rfft(torch.empty(8, device='meta')); return 'fft'\n"
            "    except NotImplementedError: return 'no-fft'\n"
            "print(fft(), end=' '); import torch._decomp; f = m.meta_index_Tensor; "
            "print(type(sys.modules['torch._meta_registrations']).__name__, fft())")
    runs = {flag: subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, timeout=120,
                                 check=True).stdout.split() for flag in "10"}
    assert runs["1"] == ["_DeferredTorchModule", "83.0", "no-fft", "module", "fft"]
    assert runs["0"] == ["module", "83.0", "fft", "module", "fft"]


@pytest.mark.parametrize("spec, coupled", [(["--spec", "mtp"], True), (["-md", "default"], False)])
def test_sampled_drafting_runs_where_torch_meta_registrations_are_deferred(spec, coupled):
    """`generate` with sampled drafts from MTP heads or a draft model, in a fresh process (so the deferral of
    set_threads is in force): torch 2.13 refused to make their torch.Generator there until torch._prims.rng_prims had
    run, and every such run ended in "error: RuntimeError: torch.Generator() cannot be called before the opaque
    metaclass is set" (found 12-07: tests that run the CLI in this process, where torch is imported already, passed).
    The heads draft point masses, verified coupled to plain sampling: their seeded text is the --spec none run's; a
    draft model's drafts are sampled from its q (rejection sampling: the same distribution, not the same text)."""
    from specdec.paths import default_model_path

    spec = [str(default_model_path()) if x == "default" else x for x in spec]
    runs = [subprocess.run([sys.executable, "-m", "specdec", "generate", "-p", "Tell me a short story.", "-n", "12",
                            "--temp", "0.8", "-s", "3", "--chat", *s], capture_output=True, text=True, timeout=300)
            for s in (spec, ["--spec", "none"])]
    for r in runs:
        assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    assert runs[0].stdout.strip() and "drafted" in runs[0].stderr
    if coupled:
        assert runs[0].stdout == runs[1].stdout


def test_first_torch_import_pauses_the_collector_and_freezes():
    """set_threads imports torch with the cycle collector paused (a fresh process: in this one torch is imported
    already) and then freezes the objects it made: a collector left off, or nothing frozen, fails this."""
    code = ("import argparse, gc, sys; from specdec.cli import set_threads; "
            "assert 'torch' not in sys.modules and gc.get_freeze_count() == 0; "
            "seen = []; gc.callbacks.append(lambda phase, info: seen.append(info['generation'])); "
            "set_threads(argparse.Namespace(threads=1)); import torch; "
            "print(gc.isenabled(), gc.get_freeze_count() > 100_000, len(seen), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "0", "1"]  # enabled again, torch's objects frozen, no collection
