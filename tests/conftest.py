"""Shared fixtures: the real models (loaded once per session) and their Hugging Face transformers references."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


def _isolated_cache() -> None:
    """Tests write layout-cache entries and converted tokenizers for hundreds of temporary files: keep them out of
    the user's cache. The compiled kernels, the assembled Gemma file and the real models' tokenizers are linked in
    from it (compiling or converting them again would cost a minute)."""
    import tempfile

    real = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
    tmp = Path(tempfile.mkdtemp(prefix="specdec-test-cache-"))
    real.mkdir(parents=True, exist_ok=True)
    (real / "models").mkdir(exist_ok=True)
    (real / "tokenizers").mkdir(exist_ok=True)
    (tmp / "models").symlink_to(real / "models")
    (tmp / "tokenizers").mkdir()
    for entry in (real / "tokenizers").iterdir():
        (tmp / "tokenizers" / entry.name).symlink_to(entry)
    for so in real.glob("*.so"):
        (tmp / so.name).symlink_to(so)
    os.environ["SPECDEC_CACHE"] = str(tmp)
    os.environ["SPECDEC_TEST_SESSION_CACHE"] = str(tmp)  # tiny_models.share_default_tokenizer
    import atexit
    import shutil

    atexit.register(shutil.rmtree, tmp, ignore_errors=True)


_isolated_cache()
# one torch (and OpenMP) thread per pytest-xdist worker, so that workers do not spin on each other's cores; two
# threads in a single process (tests that check threading set their own counts)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "List three uses of a paperclip.",
    "Explain why the sky is blue to a five-year-old.",
]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from specdec.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from specdec.loader import gemma3_270m_path

    return gemma3_270m_path()


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_path):
    """The default model with exactly dequantized weights (f32), the configuration compared with transformers."""
    from specdec.loader import load

    return load(smollm2_path, dtype="f32", quant="none", ctx=2048)


@pytest.fixture(scope="session")
def smollm2_default(smollm2_path):
    """The default model as `specdec generate` runs it (auto dtype and quantization)."""
    from specdec.loader import load

    return load(smollm2_path, ctx=2048)


def hf_gguf_model(path: Path, **kwargs):
    """transformers' own model from a GGUF file (its dequantization and name mapping: the independent reference).
    Its loader parses the file twice (config, then tensors); the parse is shared here: of Gemma-3-270M's 262k-token
    vocabulary it took ~20 s each time."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    real, readers = gguf.GGUFReader, {}

    def shared(file, *args, **kw):
        key = (str(file), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real(file, *args, **kw)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    **kwargs).eval()
    finally:
        gguf.GGUFReader = real


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    return hf_gguf_model(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def chat(tok, text: str) -> list[int]:
    """Token ids of a one-turn chat prompt."""
    return tok.encode_chat([{"role": "user", "content": text}])


@pytest.fixture(scope="session")
def plain_greedy(smollm2_default):
    """plain_greedy(prompt, n) -> the default model's plain greedy output (ignoring EOS), computed once per prompt."""
    from specdec.generate import generate
    from specdec.sampling import SamplingParams

    done: dict[tuple[str, int], list[int]] = {}

    def get(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in done:
            tok = smollm2_default.tokenizer
            done[(prompt, n)] = generate(smollm2_default.model, tok, chat(tok, prompt), SamplingParams(),
                                         max_tokens=n, ignore_eos=True).tokens
        return done[(prompt, n)]

    return get
