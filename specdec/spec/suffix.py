"""Suffix-automaton drafting: the longest earlier match of the text's end, in O(1) amortized per token.

The n-gram proposer (spec/ngram.py) looks up the last 1-4 tokens. A suffix automaton (Blumer et al. 1985, "The
smallest automaton recognizing the subwords of a text") over the prompt and everything generated finds the LONGEST
suffix of the text that occurred before, however long, and where; the tokens that followed that occurrence are the
draft (SAM-Decoding, Hu et al., ACL 2025; SuffixDecoding, Oliaro et al. 2024, uses suffix trees for the same).
Long matches are far more reliable than short ones, so the match length is the draft class the draft-length policy
keeps acceptance statistics by (spec/autok.py).

The automaton is built online (one state per token plus clones, amortized O(1) per token). A matcher follows the
text's end through it: before token t is added, (state, length) is the longest suffix of the text so far that
also occurs ending one token earlier or more; extending it by t follows t's transition, or suffix links when there
is none (the matching-statistics walk). Each state keeps the end position of its strings' first occurrence, so the
continuation of the match is text[first + 1:].

A server also keeps one global automaton over its earlier responses (SuffixIndex: SuffixDecoding's global tree),
bounded in tokens, that every request's text is matched against as a second lookup source: answers to similar
requests repeat each other (templates, code, boilerplate) where a request's own prompt does not.
"""

from __future__ import annotations

from collections import deque

from .base import Draft


class SuffixAutomaton:
    """Online suffix automaton over a token sequence, with the longest-earlier-match matcher."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]  # transitions per state
        self.link: list[int] = [-1]  # suffix links
        self.len: list[int] = [0]  # longest string of each state
        self.first: list[int] = [-1]  # end position of the first occurrence of each state's strings
        self.last = 0  # the state of the whole text
        self.tokens: list[int] = []
        self.state, self.length = 0, 0  # the match: longest suffix of the text occurring earlier, and its length

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self._match(t)
            self._add(t)

    def _match(self, t: int) -> None:
        """Extend the match by t, against the automaton of the text before t (so matches end earlier than t)."""
        self.state, self.length = self.walk(self.state, self.length, t)

    def walk(self, v: int, n: int, t: int) -> tuple[int, int]:
        """The matching-statistics step: (state, length) of a matched string, extended by token t -> the longest
        suffix of (string + t) that occurs in this automaton's text."""
        while v and n <= self.len[self.link[v]]:  # a state split since: its shorter strings moved to the clone
            v = self.link[v]
        while v and t not in self.next[v]:
            v = self.link[v]
            n = self.len[v]
        if t in self.next[v]:
            return self.next[v][t], n + 1
        return 0, 0

    def _add(self, t: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = self._new(self.len[self.last] + 1, pos)
        p = self.last
        while p != -1 and t not in self.next[p]:
            self.next[p][t] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][t]
            if self.len[p] + 1 == self.len[q]:
                self.link[cur] = q
            else:
                clone = self._new(self.len[p] + 1, self.first[q])
                self.next[clone] = dict(self.next[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(t) == q:
                    self.next[p][t] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def _new(self, length: int, first: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.len.append(length)
        self.first.append(first)
        return len(self.len) - 1

    def match(self) -> tuple[int, int]:
        """(length, start): the longest suffix of the text that occurred earlier, and where the tokens that followed
        its first occurrence start; (0, 0) when the last token never occurred before."""
        v, n = self.state, self.length
        if n == 0:
            return 0, 0
        return n, self.first[v] + 1

    def continuation(self, k: int) -> list[int]:
        """Up to k tokens that followed the match's first occurrence. When they run into the text's end (periodic
        text: the match overlaps itself), the copy goes on from its own start as an LZ77 copy does: the text from
        `start` on equals the text's last `len - start` tokens, so it continues the same way."""
        n, start = self.match()
        if not n:
            return []
        out = self.tokens[start:start + k]
        period = len(self.tokens) - start
        while len(out) < k:
            out.append(out[len(out) - period])
        return out


def match_class(n: int) -> int:
    """Draft classes by match length: 0-4 one each, then 5-7, 8-15, 16+ (acceptance stops changing much)."""
    return n if n <= 4 else 5 if n < 8 else 8 if n < 16 else 16


class SuffixProposer:
    """Drafts the continuation of the longest earlier match (prompt and output alike). Costless: the generation
    loop may ask for the longest candidate every step and score it against what is generated (spec/autok.py)."""

    name = "suffix"
    costless = True

    def __init__(self, min_match: int = 2):
        self.min_match = min_match
        self.sam = SuffixAutomaton()

    def begin(self, context: list[int], hidden=None) -> None:
        self.sam = SuffixAutomaton()
        self.sam.extend(context)

    def draft_class(self) -> int:
        n, _ = self.sam.match()
        return match_class(n if n >= self.min_match else 0)

    def propose(self, k: int) -> Draft:
        n, _ = self.sam.match()
        return Draft(self.sam.continuation(k)) if n >= self.min_match else Draft()

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        self.sam.extend(accepted + [next_token])


class SuffixIndex:
    """A global suffix automaton over earlier responses (one per server), bounded: past max_tokens it is rebuilt
    over the most recent responses filling half of the bound. Responses are separated by distinct negative tokens,
    so no match spans two of them and a continuation stops at its response's end."""

    def __init__(self, max_tokens: int = 1 << 16, min_response: int = 8):
        self.max_tokens, self.min_response = max_tokens, min_response
        self.sam = SuffixAutomaton()
        self.responses: deque[list[int]] = deque()
        self.generation = 0  # bumped by every rebuild: matchers holding states of an older automaton restart
        self._sep = -1

    def __len__(self) -> int:
        return len(self.sam.tokens)

    def add(self, tokens: list[int]) -> None:
        """Index a finished response (its last max_tokens / 2 tokens; short ones are not worth indexing)."""
        tokens = list(tokens[-(self.max_tokens // 2):])
        if len(tokens) < self.min_response:
            return
        if len(self.sam.tokens) + len(tokens) + 1 > self.max_tokens:
            keep, n = [], len(tokens) + 1
            for r in reversed(self.responses):
                if n + len(r) + 1 > self.max_tokens // 2:
                    break
                keep.append(r)
                n += len(r) + 1
            self.responses = deque(reversed(keep))
            self.sam, self._sep = SuffixAutomaton(), -1
            self.generation += 1
            for r in self.responses:
                self._append(r)
        self.responses.append(tokens)
        self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        for t in tokens + [self._sep]:
            self.sam._add(t)  # no self-matching: the index is only matched against
        self._sep -= 1


class IndexMatcher:
    """One sequence's match against a SuffixIndex: the longest suffix of the sequence's text found in the index."""

    TAIL = 64  # tokens of the text kept to re-match after a rebuild

    def __init__(self, index: SuffixIndex):
        self.index = index
        self.state, self.length, self.generation = 0, 0, index.generation
        self.tail: list[int] = []

    def feed(self, tokens: list[int]) -> None:
        if self.generation != self.index.generation:  # the automaton was rebuilt: its old states mean nothing
            self.state, self.length, self.generation = 0, 0, self.index.generation
            tokens = self.tail + tokens
        sam = self.index.sam
        for t in tokens:
            self.state, self.length = sam.walk(self.state, self.length, t)
        self.tail = (self.tail + tokens)[-self.TAIL:]

    def match_length(self) -> int:
        return self.length if self.generation == self.index.generation else 0

    def continuation(self, k: int) -> list[int]:
        """Up to k tokens that followed the match's first occurrence in the index, within its response."""
        if not self.match_length():
            return []
        sam = self.index.sam
        start = sam.first[self.state] + 1
        out = []
        for t in sam.tokens[start:start + k]:
            if t < 0:
                break
            out.append(t)
        return out


class GlobalSuffixProposer:
    """Drafts from a server's SuffixIndex of earlier responses (costless, like SuffixProposer); a source of
    `--spec auto` in the server, with its own acceptance per match length."""

    name = "global"
    costless = True

    def __init__(self, index: SuffixIndex, min_match: int = 4):
        self.index, self.min_match = index, min_match
        self.matcher = IndexMatcher(index)

    def begin(self, context: list[int], hidden=None) -> None:
        self.matcher = IndexMatcher(self.index)
        self.matcher.feed(context[-IndexMatcher.TAIL:])

    def draft_class(self) -> int:
        n = self.matcher.match_length()
        return match_class(n if n >= self.min_match else 0)

    def propose(self, k: int) -> Draft:
        if self.matcher.match_length() < self.min_match:
            return Draft()
        return Draft(self.matcher.continuation(k))

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        self.matcher.feed(accepted + [next_token])
