"""Draft-model proposer (Leviathan et al. 2023; llama.cpp's `-md`): a small model with the target's vocabulary
drafts k tokens autoregressively in its own KV cache, which rolls back on rejection like the target's.

Greedy targets get greedy drafts (q = None: point masses). Sampled targets get drafts sampled from the draft's
distribution q, processed with the same temperature / top-k / top-p / min-p, and q is handed to the verifier.
"""

from __future__ import annotations

import torch

from ..config import ModelError
from ..models.transformer import Transformer
from ..sampling import SamplingParams, probs_from_logits, sample
from ..tokenizer import Tokenizer
from .base import Draft

VOCAB_SIZE_SLACK = 128  # as llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: padded vocabularies differ by a few rows


def check_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    """Refuse a draft whose vocabulary differs from the target's (as llama.cpp's common_speculative_are_compatible:
    same tokenizer kind, same BOS/EOS, same text for every token id). Checked once per pair (~50 ms for 49152
    tokens; a batch builds one proposer per sequence)."""
    checked = draft.__dict__.setdefault("_vocab_checked", set())
    if id(target) in checked:
        return
    _compare_vocab(target, draft)
    checked.add(id(target))


def _compare_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    kinds = target.model_kind, draft.model_kind
    if kinds[0] != kinds[1]:
        raise ModelError(f"draft and target tokenizers differ ({kinds[1]} vs {kinds[0]}): use a draft of the same "
                         f"model family")
    if (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        raise ModelError(f"draft and target special tokens differ (BOS/EOS {draft.bos_id}/{draft.eos_id} vs "
                         f"{target.bos_id}/{target.eos_id}): use a draft of the same model family")
    if abs(target.vocab_size - draft.vocab_size) > VOCAB_SIZE_SLACK:
        raise ModelError(f"draft vocabulary has {draft.vocab_size} tokens, target {target.vocab_size}: use a draft "
                         f"of the same model family")
    t_texts, d_texts = target.vocab_texts(), draft.vocab_texts()
    for i in range(min(len(t_texts), len(d_texts))):
        if t_texts[i] != d_texts[i]:
            raise ModelError(f"draft and target vocabularies differ at token {i} ({d_texts[i]!r} vs {t_texts[i]!r}): "
                             f"use a draft of the same model family")


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: Transformer, params: SamplingParams, vocab_size: int, p_min: float = 0.0,
                 generator: torch.Generator | None = None):
        """vocab_size: the target's logit width (draft distributions are padded or cut to it)."""
        self.model, self.params, self.p_min = model, params, p_min
        self.vocab_size = vocab_size
        self.generator = generator
        self.cache = model.new_cache()
        self.pending: list[int] = []  # context tokens not yet in the draft's cache
        self.last: list[int] = []  # the latest draft, until accept() says how much of it was kept
        self._ctx = 0

    def begin(self, context: list[int], hidden=None) -> None:

        self.cache.rollback(0)
        if len(context) > 1:
            self.model.prefill(context[:-1], self.cache)
        self.pending = context[-1:]

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft distribution over the target's vocabulary: [V_draft] logits -> [V_target] probabilities."""
        V = self.vocab_size
        if logits.shape[-1] > V:
            logits = logits[..., :V]
        q = probs_from_logits(logits, self.params)
        if q.shape[-1] < V:
            q = torch.nn.functional.pad(q, (0, V - q.shape[-1]))
        return q

    def propose(self, k: int) -> Draft:
        m, cache = self.model, self.cache
        self._ctx = cache.length + len(self.pending)  # context length before this draft
        k = min(k, cache.max_len - self._ctx + 1)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        feed, self.pending = self.pending, []
        while len(tokens) < k:
            n = cache.length
            logits, _ = m(torch.tensor([feed], device=m.device), torch.arange(n, n + len(feed), device=m.device),
                          cache, last_only=True, exact=True)
            logits = logits[0, -1]
            if self.params.greedy:
                if self.p_min > 0 and tokens:  # llama.cpp's --draft-p-min: stop when the draft itself is unsure
                    if torch.softmax(logits, dim=-1).max() < self.p_min:
                        break
                tok = int(torch.argmax(logits[:self.vocab_size]))
            else:
                q = self._q(logits)
                if self.p_min > 0 and tokens and q.max() < self.p_min:
                    break
                tok = int(sample(q, self.generator))
                qs.append(q)
            tokens.append(tok)
            feed = [tok]
        # the cache now holds the context and tokens[:-1]; the last drafted token was never fed
        self.last = tokens
        return Draft(tokens, torch.stack(qs) if qs else None)

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        n_accepted = len(accepted)
        m = len(self.last)
        if m == 0:  # nothing was drafted this step
            self.pending.append(next_token)
            return
        keep = min(n_accepted, m - 1)  # accepted drafts that are already in the cache
        self.cache.rollback(self._ctx + keep)
        self.pending = self.last[keep:n_accepted] + [next_token]
        self.last = []
