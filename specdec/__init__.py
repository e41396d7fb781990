"""specdec: fast local LLM inference through lossless speculative decoding.

    from specdec import LLM, SamplingParams, SpecConfig
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpecConfig"]


def __getattr__(name: str):
    # imported on first use, so `import specdec.cli` stays light until it has set up the environment torch reads
    if name == "LLM":
        from .api import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    if name == "SpecConfig":
        from .spec import SpecConfig

        return SpecConfig
    raise AttributeError(name)
