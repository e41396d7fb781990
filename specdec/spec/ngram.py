"""N-gram drafting: prompt lookup decoding (Saxena 2023; vLLM's `ngram` proposer, llama.cpp's lookup).

Find the most recent earlier occurrence of the context's last n tokens, for n from ngram_max down to ngram_min, and
propose the tokens that followed it. The context is the prompt plus everything generated so far, so the proposer
also copies from its own output (lists, repeated code, quoted text). No model, no cost: each n-gram's latest
continuation is kept in a dict, updated in O(ngram_max) per new token.
"""

from __future__ import annotations

from .base import Draft


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("n-gram sizes need 1 <= --ngram-min <= --ngram-max")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> start of what followed its latest occurrence

    def begin(self, context: list[int], hidden=None) -> None:
        self.tokens, self.index = [], {}
        self._extend(context)

    def _extend(self, new: list[int]) -> None:
        for tok in new:
            i = len(self.tokens)  # tok lands at i: it continues every n-gram ending at i - 1
            for n in range(self.ngram_min, self.ngram_max + 1):
                if i >= n:
                    self.index[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(tok)

    def propose(self, k: int) -> Draft:
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return Draft(self.tokens[start:start + k])
        return Draft()

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        self._extend(accepted + [next_token])
