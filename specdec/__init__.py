"""specdec: fast local LLM inference through lossless speculative decoding."""

__version__ = "0.1.0"
