"""Multi-token-prediction proposers: the target drafts its own next tokens from its hidden state.

Sequential modules (DeepSeek-V3, GLM-4.5, MiMo, or trained by `specdec train-mtp --kind sequential`): module d at
position p reads h^{d-1}_p (the trunk's hidden state for d = 1) and the token t_{p+d}, and predicts t_{p+d+1}. Each
module keeps a KV cache over the real (accepted) positions it can already compute; a draft then runs module j at the
last position (and the few before it whose inputs are drafted tokens), in temporary cache slots that are dropped
after verification. Past the trained depth the last module is reused recursively at advancing positions, fed its
own output as the previous hidden state (as vLLM and EAGLE do).

Parallel heads (Medusa-1, Cai et al. 2024): head k maps the trunk's last hidden state to a distribution over the
token k steps ahead; no cache, no dependence between heads, the cheapest to run.

Drafts are chains (greedy argmax, or sampled from the head's processed distribution q when the target samples) or
deterministic trees (`tree=[b1, b2, ...]`: the top-b_j tokens at depth j under each node), verified in one target
forward with tree attention (spec/tree.py).
"""

from __future__ import annotations

import torch

from ..cache import lazy_zeros
from ..sampling import SamplingParams, probs_from_logits, sample
from .base import Draft


class _Head:
    """Maps a drafting module's logits (possibly over a reduced vocabulary) to target token ids."""

    def __init__(self, vocab_size: int, vocab_map: torch.Tensor | None):
        self.vocab_size = vocab_size
        self.vocab_map = vocab_map  # [V_draft] target ids of the draft vocabulary (EAGLE-3's d2t), or None

    def top(self, logits: torch.Tensor, k: int) -> list[int]:
        ids = torch.topk(logits, k).indices
        return (self.vocab_map[ids] if self.vocab_map is not None else ids).tolist()

    def q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The draft distribution over the target vocabulary (0 outside a reduced draft vocabulary)."""
        p = probs_from_logits(logits, params)
        if self.vocab_map is None:
            return p[:self.vocab_size]
        q = torch.zeros(self.vocab_size, dtype=p.dtype, device=p.device)
        q[self.vocab_map] = p
        return q


class _MTPBase:
    name = "mtp"

    def _advance(self) -> None:
        """Bring drafting state up to date with the accepted context (sequential modules' caches)."""

    def __init__(self, params: SamplingParams, vocab_size: int, tree: list[int] | None,
                 generator: torch.Generator | None, vocab_map: torch.Tensor | None):
        self.params, self.tree, self.generator = params, tree, generator
        self.head = _Head(vocab_size, vocab_map)
        self.ctx: list[int] = []

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One chain token from draft logits: argmax (greedy target), else a sample from q with q returned."""
        if self.params.greedy:
            return self.head.top(logits, 1)[0], None
        q = self.head.q(logits, self.params)
        return int(sample(q, self.generator)), q

    def propose(self, k: int) -> Draft:
        self._advance()
        if self.tree:
            tokens, parents = self._tree(k)
            return Draft(tokens, None, parents)
        tokens, qs = self._chain(k)
        return Draft(tokens, torch.stack(qs) if qs and qs[0] is not None else None)

    def _tree(self, k: int) -> tuple[list[int], list[int]]:
        """Deterministic top-b tree, breadth first, at most k nodes and len(self.tree) levels."""
        tokens: list[int] = []
        parents: list[int] = []
        frontier: list[tuple[int, list[int]]] = [(-1, [])]  # (node index, tokens on its path)
        for width in self.tree:
            nxt = []
            for node, path in frontier:
                if len(tokens) >= k:
                    break
                for tok in self.head.top(self._logits_after(path), width):
                    if len(tokens) >= k:
                        break
                    tokens.append(tok)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, path + [tok]))
            frontier = nxt
        return tokens, parents


# The most positions the modules catch up on at once. They run lazily, when next asked to draft; after the prompt or
# text generated while `--spec auto` rested them, the backlog can be a thousand positions, and running an EAGLE-3
# layer over those took ~50 ms a probe (SmolLM2, 1000-token prompts), which cost fresh `--spec auto` at batch 8 a
# fifth of its speed. Only the last CATCH_UP are run (the earlier ones stay out of the modules' caches; their
# attention sees the rest): heads alone on Spec-Bench summarization / rag 0.83 / 0.80x plain -> 0.93 / 0.91x with
# 256 and 0.95 / 0.95x with 64, first-draft acceptance unchanged or higher; fresh auto at batch 8 304 -> 350 tok/s
# with 128 (docs/results/catch-up-1206g.txt).
CATCH_UP = 128


class SequentialMTP(_MTPBase):
    """Drafts with sequential MTP modules (models/mtp.MTPModule), depth 1 first."""

    needs_prompt_hidden = True  # begin() takes the target's hidden state at every prompt position

    def __init__(self, modules: list, params: SamplingParams, vocab_size: int, tree: list[int] | None = None,
                 generator: torch.Generator | None = None, vocab_map: torch.Tensor | None = None):
        super().__init__(params, vocab_size, tree, generator, vocab_map)
        self.modules = modules
        m0 = modules[0]
        dim = m0.args.dim
        self.caches = [mod.new_cache() for mod in modules]
        # H[0]: the trunk's hidden states by position; H[d]: module d's outputs at real positions
        # allocated lazily (memory taken as positions are written): a server or a batch makes one per sequence
        widths = [getattr(m0, "in_dim", dim)] + [dim] * len(modules)  # EAGLE-3 reads the trunk's aux features
        self.H = [lazy_zeros((m0.max_len + 1, w), m0.dtype, m0.device) for w in widths]
        self.n = [0] * (len(modules) + 1)  # positions available in H[d] (and in module d's cache, for d >= 1)
        self.slots = [0] * (len(modules) + 1)  # module d's cache slots: n[d] less the positions a catch-up skipped
        self.pending: list[torch.Tensor] = []  # trunk hidden rows accepted since the modules last ran
        self.first: torch.Tensor | None = None  # module 1's logits at the last position: the first draft token

    def begin(self, context: list[int], hidden: torch.Tensor | None = None) -> None:
        self.ctx = list(context)
        for c in self.caches:
            c.rollback(0)
        self.n = [0] * len(self.n)
        self.slots = [0] * len(self.n)
        self.pending = []
        self._add_hidden(hidden)

    def _add_hidden(self, hidden: torch.Tensor) -> None:
        # the trunk's hidden output ends with its final hidden state; EAGLE-3's aux features come before it when
        # such heads are loaded on the model, and only EAGLE-3 modules read them. Kept as given until the modules
        # next run (_flush): a step that drafts nothing copies nothing
        self.pending.append(hidden[:, -self.H[0].shape[1]:])

    def _flush(self) -> None:
        """Write the hidden states accepted since the modules last ran into H[0]."""
        if self.pending:
            rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
            n = self.n[0]
            self.H[0][n:n + rows.shape[0]] = rows.to(self.H[0].dtype)
            self.n[0] = n + rows.shape[0]
            self.pending = []

    def _advance(self) -> None:
        """Run every module over the positions whose inputs are now all real (accepted tokens, target hidden)."""
        self._flush()
        C = len(self.ctx)
        first = 0  # the first position the module before has just computed
        for d, mod in enumerate(self.modules, start=1):
            lo, hi = self.n[d], min(self.n[d - 1], C - d)
            if hi <= lo:
                continue
            if hi - lo > CATCH_UP:  # a long backlog (the prompt, or text generated while the heads rested)
                lo = max(hi - CATCH_UP, first)
            first = lo
            dev = mod.device
            toks = torch.tensor([self.ctx[lo + d:hi + d]], device=dev)
            logits, h = mod(self.H[d - 1][lo:hi][None], toks, torch.arange(lo, hi, device=dev), self.caches[d - 1],
                            last_only=True)
            self.H[d][lo:hi] = h[0]
            self.n[d] = hi
            self.slots[d] += hi - lo
            if d == 1 and hi == C - 1:
                self.first = logits[0, -1]

    def _rollback(self) -> None:
        for d, c in enumerate(self.caches, start=1):
            c.rollback(self.slots[d])

    def _steps(self, path: list[int], k: int, pick) -> list[torch.Tensor]:
        """Draft logits for k steps after the context, feeding `path` tokens (then `pick`'s choices) as drafts.

        Returns the logits of each step; `pick(logits) -> token` chooses the token fed to the next step when the
        path has run out. Leaves the module caches at their real lengths."""
        C, m = len(self.ctx), len(self.modules)
        ext = self.ctx + list(path)
        temp: dict[tuple[int, int], torch.Tensor] = {}

        def h_at(d: int, p: int) -> torch.Tensor:
            return temp[(d, p)] if (d, p) in temp else self.H[d][p]

        out = [self.first]
        try:
            for j in range(2, k + 1):
                if len(ext) < C + j - 1:
                    ext.append(pick(out[-1]))
                if j <= m:  # module j at the last position, and the positions before it that need drafted tokens
                    mod, d = self.modules[j - 1], j
                    ps = list(range(self.n[d], C - 1))
                else:  # past the trained depth: the last module again, one position further each step
                    mod, d = self.modules[-1], m
                    ps = [C - 2 + j - m]
                p0 = ps[0]
                h_in = torch.stack([h_at(d - 1 if j <= m else m, p if j <= m else p - 1) for p in ps])[None]
                toks = torch.tensor([[ext[p + d] for p in ps]], device=mod.device)
                logits, h = mod(h_in, toks, torch.arange(p0, p0 + len(ps), device=mod.device), self.caches[d - 1],
                                last_only=True)
                for i, p in enumerate(ps):
                    temp[(d, p)] = h[0, i]
                out.append(logits[0, -1])
        finally:
            self._rollback()
        return out

    def _chain(self, k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens: list[int] = []
        qs: list[torch.Tensor | None] = []

        def pick(logits: torch.Tensor) -> int:
            tok, q = self._pick(logits)
            tokens.append(tok)
            qs.append(q)
            return tok

        last = self._steps([], k, pick)[-1]
        pick(last)
        return tokens, qs

    def _logits_after(self, path: list[int]) -> torch.Tensor:
        return self._steps(path, len(path) + 1, lambda _: 0)[-1]

    def accept(self, accepted: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        # lazy: the modules catch up in the next propose(), so steps that draft nothing (--draft-max auto chose
        # plain decoding) cost nothing here
        self.ctx += accepted + [next_token]
        self._add_hidden(hidden)


class ParallelMTP(_MTPBase):
    """Drafts with Medusa-style parallel heads: head k on the last hidden state predicts the token k steps after
    the pending one. A tree takes the top-b_j tokens of head j under every node (Medusa's Cartesian tree)."""

    def __init__(self, heads, params: SamplingParams, vocab_size: int, tree: list[int] | None = None,
                 generator: torch.Generator | None = None, vocab_map: torch.Tensor | None = None):
        super().__init__(params, vocab_size, tree[:len(heads)] if tree else None, generator, vocab_map)
        self.heads = heads
        self.dim = heads.weights[0][0].shape[1]
        self.h: torch.Tensor | None = None
        self.logits: list[torch.Tensor] | None = None

    def begin(self, context: list[int], hidden: torch.Tensor | None = None) -> None:
        self.ctx = list(context)
        self.h, self.logits = hidden[-1, -self.dim:], None  # the final hidden state (see SequentialMTP)

    def accept(self, accepted: list[int], next_token: int, hidden: torch.Tensor | None = None) -> None:
        self.ctx += accepted + [next_token]
        self.h, self.logits = hidden[-1, -self.dim:], None  # the final hidden state (see SequentialMTP)

    def _all(self) -> list[torch.Tensor]:
        if self.logits is None:
            self.logits = self.heads(self.h[None])
            self.logits = [x[0] for x in self.logits]
        return self.logits

    def _chain(self, k: int) -> tuple[list[int], list[torch.Tensor | None]]:
        picks = [self._pick(x) for x in self._all()[:k]]
        return [t for t, _ in picks], [q for _, q in picks]

    def _logits_after(self, path: list[int]) -> torch.Tensor:
        return self._all()[len(path)]
