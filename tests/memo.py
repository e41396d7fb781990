"""Memoized forwards for the statistical end-to-end tests (test_engine.py's lossless-sampling tests).

Those tests draw tens of thousands of seeded samples of a prompt's first generated tokens through the whole engine
step; almost every target forward row they compute has been computed before (the same few hundred contexts come
back thousands of times). A row of an exact forward depends only on its context (the tokens before it and its own:
the batch-invariance property that test_engine.py's identity tests check), so `Memo` wraps a model and serves each
row from a table keyed by its context, computing the rows it has not seen with the real model (one exact forward
from the prompt's own prefill, whose keys and values it keeps). Everything else (the engine, its cache pool,
proposers, verification, sampling) runs as it does without the wrapper; `test_memo_changes_nothing` checks that a
run through it gives the same samples as a run without it.

The engine's caches then hold no real keys or values, only which token each slot stands for: the wrapper writes
the token id into the first value elements of layer 0 (base-128 digits, exact in bf16), where the cache's own
operations (copy_from for a shared prefix, rollback, a tree's keep) carry it along with the slot.
"""

from __future__ import annotations

import torch

DIGITS = 3  # base-128 digits of a token id (ids < 2**21)


def write_marks(cache, start: int, tokens: list[int]) -> None:
    """Slots [start, start + len(tokens)) of `cache` stand for `tokens`."""
    digits = [[(t >> (7 * i)) & 127 for i in range(DIGITS)] for t in tokens]
    b = cache.base + start
    cache.kv[0, 0, b:b + len(tokens), 0, :DIGITS] = torch.tensor(digits, dtype=cache.kv.dtype)


def read_marks(cache, n: int) -> list[int]:
    """The tokens slots [0, n) of `cache` stand for."""
    rows = cache.kv[0, 0, cache.base:cache.base + n, 0, :DIGITS].tolist()
    return [sum(int(d) << (7 * i) for i, d in enumerate(r)) for r in rows]


def advance(cache, marks: list[int], positions: torch.Tensor) -> None:
    """What a forward does to its cache, without keys or values: the next slots stand for `marks` at `positions`."""
    start = cache.reserve(len(marks))
    write_marks(cache, start, marks)
    cache.pos[start:start + len(marks)] = positions
    cache.length = start + len(marks)


class Memo:
    """A Transformer whose forward rows come from a table keyed by context (see the module docstring).

    Misses are computed exactly: the prompt registered by prefill() (its keys and values kept in a slot of the
    wrapper's own pool) is copied into a scratch slot and the rest of the context runs as one exact forward, every
    row of which is remembered. `rows` / `computed` count the rows served / computed."""

    def __init__(self, model, max_len: int):
        self.model = model
        self.pool = model.new_pool(2, max_len)
        self.anchor = self.pool.acquire()  # the registered prompt's real keys and values
        self.anchor_tokens: list[int] = []
        self.scratch = self.pool.acquire()
        self.table: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows = self.computed = 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    # ---- the forwards the engine and the proposers call -----------------------------------------------------

    def prefill(self, tokens: list[int], cache, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """As Transformer.prefill. The first prompt prefilled becomes the anchor misses start from."""
        if not self.anchor_tokens:
            self.anchor.rollback(0)
            logits, hidden = self.model.prefill(tokens, self.anchor, chunk)
            self.anchor_tokens = list(tokens)
            self.prompt_rows = (logits, hidden)
        if list(tokens) == self.anchor_tokens and cache.length == 0:
            logits, hidden = self.prompt_rows
        else:  # another prompt: computed for real, served from the table if it is ever needed again
            ctx = read_marks(cache, cache.length) + list(tokens)
            rows = [self._row(tuple(ctx[:len(ctx) - len(tokens) + i + 1])) for i in range(len(tokens))]
            logits, hidden = rows[-1][0], torch.stack([h for _, h in rows])
        advance(cache, list(tokens), torch.arange(cache.length, cache.length + len(tokens)))
        return logits, hidden

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, parents: list[int] | None = None,
                 last_only: bool = False, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self._rows(cache, tokens[0].tolist(), positions, parents)
        return (logits[-1:] if last_only else logits)[None], hidden[None]

    def forward_batch(self, items) -> tuple[torch.Tensor, torch.Tensor]:
        out = [self._rows(cache, list(tokens), torch.tensor(pos), parents) for cache, tokens, pos, parents in items]
        return torch.cat([lg for lg, _ in out]), torch.cat([h for _, h in out])

    # ---------------------------------------------------------------------------------------------------------

    def _rows(self, cache, tokens: list[int], positions: torch.Tensor, parents: list[int] | None):
        """Each row's (logits [V], hidden [dim]) by its context: the cache's tokens, then its path among `tokens`
        (a chain, or a tree's root-to-node path)."""
        before = read_marks(cache, cache.length)
        paths: list[list[int]] = []
        for i, t in enumerate(tokens):
            paths.append([t] if i == 0 else (paths[parents[i - 1] + 1] if parents is not None else paths[-1]) + [t])
        rows = [self._row(tuple(before + p)) for p in paths]
        advance(cache, tokens, positions)
        return torch.stack([lg for lg, _ in rows]), torch.stack([h for _, h in rows])

    def _row(self, ctx: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows += 1
        if ctx not in self.table:
            a = self.anchor_tokens
            n = len(a) if len(ctx) > len(a) and list(ctx[:len(a)]) == a else 0
            if n:
                self.scratch.copy_from(self.anchor, n)
            else:
                self.scratch.rollback(0)
            rest = list(ctx[n:])
            logits, hidden = self.model(torch.tensor([rest]), torch.arange(n, len(ctx)), self.scratch, exact=True)
            for i in range(len(rest)):
                self.table.setdefault(ctx[:n + i + 1], (logits[0, i], hidden[0, i]))
            self.computed += len(rest)
        return self.table[ctx]


class MemoModule:
    """A drafting module (models/mtp.MTPModule, models/eagle3.Eagle3Module) whose rows come from a table, as Memo's.

    A module row depends on its inputs (the hidden row h it reads, its token, its position) and on the rows before
    it in its cache, so each row is named by an id for (the id before it, h's bytes, token, position), and a
    cache's slots carry their rows' ids. A row not computed yet is computed by running the module over its whole
    chain of rows in a scratch cache (rows of one input width in one exact call)."""

    def __init__(self, module, max_len: int):
        self.module = module
        self.scratch = module.new_cache(max_len)
        self.ids: dict[tuple, int] = {}
        self.inputs: list[tuple[int, torch.Tensor, int, int]] = []  # by id: (id before, h row, token, position)
        self.table: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (logits [V_draft], x [dim])
        self.rows = self.computed = 0

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    def __call__(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache, exact: bool = False,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        before = read_marks(cache, cache.length)
        prev, new = before[-1] if before else -1, []
        for i, t in enumerate(tokens[0].tolist()):
            row = h[0, i].contiguous()
            key = (prev, row.view(torch.uint8).numpy().tobytes(), t, int(positions[i]))
            if key not in self.ids:
                self.ids[key] = len(self.inputs)
                self.inputs.append((prev, row.clone(), t, int(positions[i])))
            prev = self.ids[key]
            new.append(prev)
        self.rows += len(new)
        for i in new:
            if i not in self.table:
                self._compute(i)
        advance(cache, new, positions)
        logits = torch.stack([self.table[i][0] for i in new])
        x = torch.stack([self.table[i][1] for i in new])
        return (logits[-1:] if last_only else logits)[None], x[None]

    def _compute(self, i: int) -> None:
        chain = []
        while i >= 0:
            chain.append(i)
            i = self.inputs[i][0]
        chain.reverse()
        self.scratch.rollback(0)
        a = 0
        while a < len(chain):  # runs of rows of one input width
            w = self.inputs[chain[a]][1].shape[-1]
            b = a
            while b < len(chain) and self.inputs[chain[b]][1].shape[-1] == w:
                b += 1
            rows = [self.inputs[j] for j in chain[a:b]]
            logits, x = self.module(torch.stack([r[1] for r in rows])[None], torch.tensor([[r[2] for r in rows]]),
                                    torch.tensor([r[3] for r in rows]), self.scratch)
            for k, j in enumerate(chain[a:b]):
                self.table.setdefault(j, (logits[0, k], x[0, k]))
            self.computed += b - a
            a = b
