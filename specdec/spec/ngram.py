"""N-gram drafting: prompt lookup decoding (Saxena 2023; vLLM's `ngram` proposer, llama.cpp's lookup).

Find the most recent earlier occurrence of the context's last n tokens, for n from ngram_max down to ngram_min, and
propose the tokens that followed it. The context is the prompt plus everything generated so far, so the proposer
also copies from its own output (lists, repeated code, quoted text). No model, no cost: each n-gram's latest
continuation is kept in a dict, updated in O(ngram_max) per new token.

The shortest n-gram is one token by default (llama.cpp's lookup decoding looks up from 1 token too): where no
longer suffix matched, the last token's latest continuation still holds the text's next tokens often enough to pay,
and the draft-length policy keeps single-token matches in a class of their own (draft_class), so where they do not
pay they are not drafted. Minimum 1 against 2 on Spec-Bench, same prompts side by side, before single_max below
(docs/results/ngram-min-1208.txt): replays of the plain texts under the shipped policy -0.5% to +5.6% by category
and temperature; real greedy runs on 20 prompts a category, n-gram +0.4% to +4.3% in five categories and -3.5% on
translation, `--spec auto` +1.7% to +4.9% in five and -2.0% on mt_bench.
"""

from __future__ import annotations

from .base import Draft


class NgramProposer:
    name = "ngram"
    costless = True  # a draft is a dict lookup: the loop may ask for the longest one every step (spec/autok.py)
    # A single-token match drafts at most this many tokens: once its first token is accepted, the next step matches
    # two tokens and drafts the same continuation anyway, so a long single-token draft mostly adds rows that a step
    # later would verify for its own class (traced on translation, docs/results/tried-1208.txt). 2 against 8 tokens
    # (docs/results/ngram-min-1208.txt): replayed -0.3% to +3.4% by category, temperature and verify curve; real
    # runs on 20 prompts a category, n-gram -1.7% to +6.1% (+2.0% on average over six), auto -1.9% to +2.7% (+1.6%)
    single_max = 2

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"--ngram-min {ngram_min} / --ngram-max {ngram_max}: n-gram sizes need "
                             "1 <= --ngram-min <= --ngram-max")
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

    def _match(self) -> tuple[int, int]:
        """(n, start): the longest context suffix (n = ngram_max..ngram_min tokens) seen earlier, and where what
        followed its latest earlier occurrence starts; (0, 0) when none was."""
        for n in range(min(self.ngram_max, len(self.tokens)), self.ngram_min - 1, -1):
            start = self.index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return n, start
        return 0, 0

    def draft_class(self) -> int:
        """The length of the suffix the next draft would match: long matches are accepted far more often (on
        Spec-Bench summarization / rag with SmolLM2, ~90% per token from 5 tokens on, 30-50% for the first token
        of shorter ones), so draft-length policies keep their statistics per class (spec/autok.py)."""
        return self._match()[0]

    def propose(self, k: int) -> Draft:
        n, start = self._match()
        if n == 1:  # see single_max
            k = min(k, self.single_max)
        return Draft(self.tokens[start:start + k]) if n else Draft()

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        self._extend(accepted + [next_token])
