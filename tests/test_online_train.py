"""Online EAGLE-3 training (train/online.py): the stream of Magpie prompts, answers and training steps runs end to
end on the CPU with a tiny model, writes heads at the asked token counts, and `pack` binds them to the model."""

from __future__ import annotations

import gzip
import json
import random

import torch
from tiny_models import write_gguf

from specdec.loader import load
from specdec.train.data import SEED_TASKS
from specdec.train.online import batches, load_trunk, main
from specdec.weights.heads import load_heads, read_header


def test_batches_cover_every_sequence_once_within_the_token_budget():
    rng = random.Random(0)
    seqs = [[i] * rng.randint(1, 40) for i in range(200)]
    out = batches(seqs, 128, random.Random(1))
    assert sorted(s[0] for b in out for s in b) == list(range(200))
    assert all(len(b) == 1 or len(b) * max(map(len, b)) <= 128 for b in out)


def test_trunk_matches_specdec_forward(tmp_path):
    """The transformers Llama built from specdec's reading of the file gives specdec's own logits."""
    path = write_gguf("llama", tmp_path / "t.gguf", seed=4)
    hf, tok, _ = load_trunk(path, torch.device("cpu"), torch.float32)
    t = load(path, dtype="f32", quant="none", ctx=64)
    ids = tok.encode_chat([{"role": "user", "content": "Name three colours."}])
    logits, _ = t.model(torch.tensor([ids]), torch.arange(len(ids)), t.model.new_cache())
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(ref, logits, atol=2e-3, rtol=1e-3)


def test_online_training_end_to_end(tmp_path):
    path = write_gguf("llama", tmp_path / "t.gguf", seed=4)
    out = tmp_path / "out"
    assert main(["train", str(path), "-o", str(out), "--device", "cpu", "--minutes", "10", "--rounds", "3",
                 "--prompt-batch", "6", "--gen-batch", "32", "--max-new", "12", "--prompt-max", "16", "--temps", "0,1",
                 "--vocab", "512", "--vocab-tokens", "100", "--batch-tokens", "256", "--ffn", "32",
                 "--checkpoints", "200", "--seed-prompts", str(SEED_TASKS)]) == 0
    log = json.loads((out / "online-log.json").read_text())
    assert len(log["rounds"]) == 3  # --rounds, well inside --minutes
    rounds = [r for r in log["rounds"] if r.get("steps")]
    assert rounds and rounds[-1]["trained_tokens"] >= 200
    assert sum(log["rounds"][-1]["filters"].values()) + log["rounds"][-1]["kept_prompts"] >= 6  # every candidate
    assert [c["file"] for c in log["checkpoints"]] == ["heads-200.safetensors", "heads-final.safetensors"]
    with gzip.open(out / "magpie-prompts.jsonl.gz", "rt") as f:
        assert len(f.read().splitlines()) == log["rounds"][-1]["kept_prompts"]
    heads = tmp_path / "h.safetensors"
    assert main(["pack", str(out / "heads-final.safetensors"), "-m", str(path), "-o", str(heads)]) == 0
    header = read_header(heads)
    assert header["kind"] == "eagle3" and header["train"]["tokens"] == log["checkpoints"][-1]["tokens"]
    kind, mods, _ = load_heads(heads, load(path, ctx=256))
    assert kind == "eagle3" and len(mods) == 1


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == f"error: model not found: {tmp_path / 'missing.gguf'}"
    gemma = write_gguf("gemma3", tmp_path / "g.gguf", seed=1)
    assert main(["train", str(gemma), "-o", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "supports plain Llama trunks" in capsys.readouterr().err
    not_ckpt = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(not_ckpt))
    assert main(["pack", str(not_ckpt), "-m", str(gemma), "-o", str(tmp_path / "h.safetensors")]) == 2
    assert "not an online-training checkpoint" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["train", str(gemma), "-o", str(tmp_path / "o")]) == 2  # --device cuda by default
        assert "sees no CUDA device" in capsys.readouterr().err
