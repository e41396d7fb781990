"""Sampling as pure functions on logits, with an explicit torch.Generator.

The processed distribution p (penalties and logit bias, then temperature, top-k, top-p, min-p, in Hugging Face's
warper order) is what plain sampling draws from and what the speculative verifier compares drafts against, so
speculative sampling is plain sampling in distribution. Greedy decoding (temperature 0) is argmax and never builds p.

Fast path (`process`): p is computed only on the tokens that can survive the truncations. With top-k, `torch.topk`
first and everything else on the k survivors: exactly HF's distribution, since tokens outside the top k get
probability 0 anyway (a tie at the k-th value, where HF keeps every tied token, falls back to the full computation).
Without top-k, top-p and min-p take a partial selection: the top m tokens (m = 64, doubled while needed) hold every
survivor once their mass reaches top_p (top-p) and their smallest probability is below min_p x the largest (min-p),
with the normalizer taken over the whole vocabulary. The result is a `Dist`: candidate ids and their probabilities
per row, sampled with the exponential race (gpt-fast's multinomial_sample_one_no_sync) over the candidates only.
`probs_from_logits` is the dense reference, kept for tests and for draft distributions q.

A sequence's own tokens (plain decoding, and coupled verification of point-mass drafts) are drawn by `draw`: one
row, one uniform per position (Draws.u), inverse CDF over the ranked candidates, in sample.c when it is built (the
same truncations in C, ~20 us a token for the CLI defaults; the Python path above costs ~120 us, ~300 us right
after a forward, when its code and data are out of cache: docs/results/sampling-speed.txt).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import kernels

PARTIAL_START = 64  # candidates first tried by the partial selection (top-p / min-p without top-k)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    # penalties (each off by default): repetition as in CTRL / HF (logit / r if > 0 else logit * r) over the last
    # repeat_last_n tokens of the context (llama.cpp's window; -1 = all of it); presence and frequency as OpenAI
    # and vLLM define them, over the generated tokens (logit -= presence [count > 0] + frequency * count)
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's logit_bias

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    def validate(self) -> None:
        if not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError("--temp must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("--top-p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("--min-p must be in [0, 1]")
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise ValueError("--repeat-penalty must be > 0 (1 = off)")
        if self.repeat_last_n < -1:
            raise ValueError("--repeat-last-n must be >= -1 (-1 = the whole context, 0 = off)")
        for name, v in (("presence", self.presence_penalty), ("frequency", self.frequency_penalty)):
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"--{name}-penalty must be in [-2, 2]")
        for tok, bias in self.logit_bias:
            if tok < 0 or not math.isfinite(bias) and bias != -math.inf:
                raise ValueError(f"logit bias {tok}:{bias}: give a token id >= 0 and a finite bias (or -inf)")


class Draws:
    """A sequence's randomness keyed by output position: the token at position `offset + j` is drawn with its own
    uniform u(j), a hash of (seed, position). Plain decoding samples position i with `draw(.., u(i))`; verification
    of a point-mass draft (n-gram / suffix lookup, argmax drafts) takes the very sample plain decoding would take at
    each row's position and accepts the drafted token iff they agree (spec/verify.py). The output is then the plain
    sampled text itself, token for token, whatever was drafted and however many forwards it took: drafter-invariant
    speculative decoding (Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
    Speculative Decoding"), with the acceptance probability of rejection sampling for point masses, p(x)."""

    def __init__(self, seed: int | None, device: torch.device | str = "cpu", offset: int = 0):
        import random

        self.seed = seed if seed is not None else random.SystemRandom().getrandbits(62)
        self.device, self.offset = device, offset

    def _key(self, j: int) -> int:
        i = self.offset + j
        key = (self.seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
        key ^= key >> 31  # splitmix64's finalizer: neighbouring positions get unrelated seeds
        return (key * 0x94D049BB133111EB) & (2 ** 64 - 1)

    def u(self, j: int) -> float:
        """The uniform in [0, 1) of position offset + j: the key's top 53 bits after one more mixing round."""
        key = self._key(j)
        key ^= key >> 29
        key = (key * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
        return ((key ^ (key >> 32)) >> 11) * 2.0 ** -53

    def at(self, j: int) -> torch.Generator:
        """A torch generator of position offset + j (a fresh one each call: drawing from it twice repeats the draw),
        for draws that need more than one uniform (rejection sampling of drafts with a distribution q)."""
        return generator(self.device).manual_seed(self._key(j) >> 1)

    def shifted(self, n: int) -> Draws:
        return Draws(self.seed, self.device, self.offset + n)


def generator(device: torch.device | str = "cpu") -> torch.Generator:
    """torch.Generator(device), with the module that defines the generator's class imported first: `specdec
    generate / serve / demo` import torch with its meta registrations deferred (cli.set_threads), and torch 2.13 then
    refuses to make a generator until torch._prims.rng_prims has run (sampled drafting with MTP heads or a draft
    model failed on every run that way). Imported here, where a generator is first needed, it costs those commands
    nothing when they never sample a draft (~0.1 s when they do)."""
    import torch._prims.rng_prims  # noqa: F401

    return torch.Generator(device=device)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = generator(device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: Sequence[Sequence[int]],
                    n_prompt: int = 0) -> torch.Tensor:
    """Penalized logits [R, V] (a copy): row r after the context history[r], whose first n_prompt tokens are the
    prompt (presence and frequency count only the tokens after it). In numpy on the touched ids only (a token
    count over the whole vocabulary per row cost ~0.3 ms a token here)."""
    out = logits.detach().float().cpu().clone()
    rows = out.numpy()
    V = rows.shape[-1]
    for r, ctx in enumerate(history):
        row = rows[r]
        if params.repetition_penalty != 1.0 and params.repeat_last_n != 0:
            window = ctx if params.repeat_last_n < 0 else ctx[-params.repeat_last_n:]
            ids = np.fromiter((t for t in set(window) if 0 <= t < V), dtype=np.int64)
            if ids.size:
                x = row[ids]
                rp = np.float32(params.repetition_penalty)
                row[ids] = np.where(x > 0, x / rp, x * rp)
        if (params.presence_penalty or params.frequency_penalty) and len(ctx) > n_prompt:
            ids, counts = np.unique(np.asarray(ctx[n_prompt:], dtype=np.int64), return_counts=True)
            keep = (ids >= 0) & (ids < V)
            ids, counts = ids[keep], counts[keep].astype(np.float32)
            row[ids] -= np.float32(params.frequency_penalty) * counts + np.float32(params.presence_penalty)
    if params.logit_bias:
        for t, b in params.logit_bias:
            if t < V:
                rows[:, t] += np.float32(b)
    return out.to(logits.device)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> processed probabilities p [..., V] (float32, rows sum to 1): the dense reference.

    temperature -> top-k (keep the k largest, ties at the k-th value included) -> top-p (keep the smallest prefix
    of the sorted distribution whose mass reaches top_p, always at least one token) -> min-p (drop tokens below
    min_p x the top probability). Penalties are applied before (apply_penalties)."""
    logits = logits.float() / max(params.temperature, 1e-5)
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False, stable=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1:] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits.softmax(dim=-1)


class Dist:
    """Processed distributions of R rows on their candidates: ids [R, m] (token ids, or None: all V tokens in
    order) and probs [R, m] (float32, rows sum to 1; 0 for candidates the truncations removed)."""

    def __init__(self, ids: torch.Tensor | None, probs: torch.Tensor, vocab: int):
        self.ids, self.probs, self.vocab = ids, probs, vocab

    def __len__(self) -> int:
        return self.probs.shape[0]

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """p_r(tokens[r]) for rows r = 0 .. len(tokens) - 1 -> [len(tokens)]."""
        n = tokens.shape[0]
        if self.ids is None:
            return self.probs[:n].gather(1, tokens[:, None]).squeeze(1)
        hit = self.ids[:n] == tokens[:, None]
        return (self.probs[:n] * hit).sum(1)

    def dense(self, row: int) -> torch.Tensor:
        """Row `row` over the whole vocabulary [V]."""
        if self.ids is None:
            return self.probs[row]
        out = torch.zeros(self.vocab, dtype=self.probs.dtype, device=self.probs.device)
        return out.index_put_((self.ids[row],), self.probs[row], accumulate=True)

    def row(self, r: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        return (None if self.ids is None else self.ids[r]), self.probs[r]

    def sample(self, generator: torch.Generator, row: int | None = None) -> torch.Tensor:
        """One token per row (or for one row), drawn from p: the exponential race over the candidates."""
        probs = self.probs if row is None else self.probs[row:row + 1]
        pick = sample(probs, generator)  # [R] index into the candidates
        if self.ids is None:
            out = pick
        else:
            ids = self.ids if row is None else self.ids[row:row + 1]
            out = ids.gather(1, pick[:, None]).squeeze(1)
        return out if row is None else out[0]

    def sample_at(self, u: float, row: int) -> int:
        """Row `row`'s token by inverse CDF with the uniform u: the first candidate (in this Dist's order) whose
        running probability exceeds u (sample.c's rule, here for rows its kernel does not take)."""
        probs = self.probs[row].double()
        cdf = probs.cumsum(0)
        i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
        i = min(i, probs.shape[0] - 1)
        while probs[i] <= 0 and i > 0:  # never a zero-probability candidate (u at the very end of the sum)
            i -= 1
        return i if self.ids is None else int(self.ids[row, i])


def _truncate_sorted(v: np.ndarray, lse: np.ndarray | None, params: SamplingParams) -> np.ndarray:
    """Candidates' scaled logits v [R, m] (float64), sorted descending per row -> their processed probabilities.

    lse: the full vocabulary's logsumexp of the scaled logits [R, 1] when the candidates are a partial selection
    without top-k (so top-p measures mass against the whole vocabulary); None when they are the top-k survivors
    (top-p then renormalizes over them, as HF's TopPLogitsWarper after TopKLogitsWarper does). numpy: on a few
    dozen values per row its calls cost ~1 us where torch's cost ~5."""
    keep = np.ones(v.shape, dtype=bool)
    with np.errstate(invalid="ignore", over="ignore"):
        if params.top_p < 1.0:
            p = np.exp(v - lse) if lse is not None else _softmax(v)
            # HF drops a token when the ascending cumulative mass up to it (itself and everything ranked below) is
            # <= 1 - top_p; summed here from the lowest candidate up as HF sums it, the mass left out of a partial
            # selection first; the top one always stays
            below = np.clip(1.0 - p.sum(axis=-1, keepdims=True), 0.0, None) if lse is not None else 0.0
            keep &= (np.cumsum(p[:, ::-1], axis=-1)[:, ::-1] + below) > (1.0 - params.top_p)
            keep[:, 0] = True
        if params.min_p > 0.0:
            probs = _softmax(np.where(keep, v, -np.inf))
            keep &= probs >= params.min_p * probs[:, :1]
        return _softmax(np.where(keep, v, -np.inf))


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v[:, :1])  # rows sorted descending: the first is the max
    return e / e.sum(axis=-1, keepdims=True)


def process(logits: torch.Tensor, params: SamplingParams, history: Sequence[Sequence[int]] | None = None,
            n_prompt: int = 0) -> Dist:
    """logits [R, V] -> the processed distribution p of each row, on as few candidates as the settings allow.

    history[r]: the context before row r (prompt then generated tokens, the first n_prompt being the prompt), for
    the penalties; None when they are off. Same distribution as probs_from_logits (to float rounding)."""
    logits = logits.float()
    if logits.dim() == 1:
        logits = logits[None]
    R, V = logits.shape
    if params.penalized:
        logits = apply_penalties(logits, params, history or [[]] * R, n_prompt)
    t = max(params.temperature, 1e-5)
    if 0 < params.top_k < V:
        v, ids = _ranked(*_top_closed(logits, t, params.top_k))
        return _dist(ids, _truncate_sorted(v, None, params), V)
    scaled = logits / t
    if params.top_p >= 1.0 and params.min_p <= 0.0:
        return Dist(None, scaled.softmax(dim=-1), V)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    m = PARTIAL_START
    while m < V:
        v, ids = _top_closed(scaled, 1.0, m)
        # the survivors of top-p and of min-p are both top prefixes of the ranking: the top m hold all of them once
        # either prefix ends inside it (top-p: their mass reaches top_p; min-p: the m-th is below min_p x the top)
        enough = torch.zeros(R, dtype=torch.bool)
        if params.top_p < 1.0:
            enough |= (v - lse).exp().sum(dim=-1) >= params.top_p
        if params.min_p > 0.0:
            last = v.masked_fill(v == float("-inf"), float("inf")).amin(dim=-1)
            enough |= (last - v[:, 0]) < math.log(params.min_p)
        if bool(enough.all()):
            v, ids = _ranked(v, ids)
            return _dist(ids, _truncate_sorted(v, lse.double().numpy(), params), V)
        m *= 4
    return Dist(None, probs_from_logits(logits, params), V)


TIE_SLACK = 16  # candidates taken past the k-th, so a run of values tied with it (bf16 logits) is usually inside


def _top_closed(logits: torch.Tensor, t: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of logits / t per row and every value tied with the k-th (as HF's top-k keeps them): (values
    [R, n], ids [R, n]), n >= k, values below a row's k-th set to -inf."""
    V = logits.shape[-1]
    n = min(k + TIE_SLACK, V)
    vals, ids = kernels.topk(logits, n)
    v = vals / t
    kth = v[:, k - 1:k]
    if n < V and bool((v[:, -1:] >= kth).any()):  # a tie runs past the slack: take all of it
        n = int(((logits / t) >= kth).sum(dim=-1).max())
        vals, ids = kernels.topk(logits, n)
        v = vals / t
    return v.masked_fill(v < kth, float("-inf")), ids


def _ranked(vals: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Candidates [R, m] in the ranking the dense reference uses: value descending, equal values by id descending
    (the reverse of a stable ascending sort), so a top-p cut through tied values removes the same tokens ->
    float64 values and ids, as numpy arrays."""
    v, i = vals.double().numpy(), ids.numpy()
    order = np.lexsort((-i, -v), axis=-1)
    return np.take_along_axis(v, order, -1), np.take_along_axis(i, order, -1)


def _dist(ids: np.ndarray, probs: np.ndarray, vocab: int) -> Dist:
    return Dist(torch.from_numpy(np.ascontiguousarray(ids)), torch.from_numpy(probs.astype(np.float32)), vocab)


RACE_MAX = 1024  # widest rows sampled by the exponential race; wider ones by inverse CDF


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from probs [..., V] -> [...] (long), reproducibly for a seeded generator.

    Up to RACE_MAX candidates: the exponential race (as gpt-fast's multinomial_sample_one_no_sync), argmax(p / E)
    with E ~ Exp(1) i.i.d. picks x with probability p(x). Wider rows (a whole vocabulary: temperature alone) by
    inverse CDF, one uniform per row against the float64 running sum: drawing 49152 exponentials costs ~0.75 ms on
    this CPU, the running sum ~0.04 ms."""
    if probs.shape[-1] <= RACE_MAX:
        e = torch.empty_like(probs).exponential_(1.0, generator=generator)
        return argmax(probs / e)
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(dim=-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]
    # never a zero-probability token (u can land exactly on a flat step of the sum only if it has p = 0)
    bad = flat.gather(1, pick[:, None])[:, 0] <= 0
    if bool(bad.any()):
        pick[bad] = argmax(flat[bad])
    return pick.reshape(probs.shape[:-1])


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dimension; on CPU through numpy, ~20x faster for a vocabulary-wide row (3 vs
    61 us for 49152 floats here). Ties: the first index, as torch.argmax."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() >= 1:
        return torch.as_tensor(np.asarray(x.detach().contiguous().numpy().argmax(axis=-1)), dtype=torch.long)
    return torch.argmax(x, dim=-1)


def draw(logits: torch.Tensor, params: SamplingParams, u: float, history: Sequence[int] | None = None,
         n_prompt: int = 0) -> int:
    """One token from p for one row of logits [V] with the uniform u, by inverse CDF over p's ranked candidates:
    the one definition of a sampled token that plain decoding and coupled verification share (Draws). Penalties
    (history: the row's context) first, then sample.c's sampler (specdec_sample: top-k on k + slack values, the
    rest on the survivors, no sort of the vocabulary: ~33 us for the CLI defaults on 49152 tokens in a slow stretch
    of the 12-03 host, docs/results/sampler-ab.txt); without the kernel, process() and the same inverse CDF on its
    Dist."""
    x = logits.float()
    if params.penalized:
        x = apply_penalties(x[None], params, [history or []], n_prompt)[0]
    x = x.contiguous()
    tok = kernels.sample_row(x, params.top_k, params.temperature, params.top_p, params.min_p, u)
    return tok if tok is not None else process(x, params).sample_at(u, 0)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | Draws | None,
               history: Sequence[int] | None = None, n_prompt: int = 0) -> int:
    """The next token from the last position's logits [V]: argmax when greedy, else a draw from p (with a Draws,
    the draw of its first position)."""
    if params.greedy and not params.penalized:
        return int(argmax(logits.float()))
    if params.greedy:
        return int(argmax(apply_penalties(logits.float()[None], params, [history or []], n_prompt)[0]))
    if isinstance(generator, Draws):
        return draw(logits, params, generator.u(0), history, n_prompt)
    return int(process(logits, params, [history or []], n_prompt).sample(generator)[0])
