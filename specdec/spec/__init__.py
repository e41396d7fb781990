"""Speculative decoding: proposers (draft model, n-gram, MTP), the verifier, statistics."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ModelError
from ..sampling import SamplingParams, make_generator
from .base import Draft, Proposer
from .config import SPEC_KINDS, SpecConfig


def resolve_mtp(target, heads: str | None = None, kind: str | None = None):
    """(kind, drafter, vocab_map, source) of the MTP drafter for `target`: a heads file if given, else the model's
    own MTP modules, else heads shipped with specdec for exactly these weights (of `kind` sequential / parallel
    when given); None when there is nothing."""
    from ..weights.heads import find_heads, load_heads

    if heads:
        kind, drafter, vocab_map = load_heads(heads, target)
        return kind, drafter, vocab_map, str(heads)
    if getattr(target, "mtp", None) and kind in (None, "sequential"):
        return "sequential", target.mtp, None, "native"
    path = find_heads(target, kind)
    if path is not None:
        kind, drafter, vocab_map = load_heads(path, target)
        return kind, drafter, vocab_map, shipped_source(path)
    return None


def shipped_source(path: Path) -> str:
    """The source resolve_mtp() names shipped heads by (part of auto's memory key, _identity): the file's name and
    a digest of its safetensors header, which holds the training summary (each run's losses) and the tensors'
    offsets. Heads retrained and shipped under the same name are other heads, and start with no memory of the old
    ones' losses. The header is a few KB (read at each call: a process resolves its heads once or twice)."""
    import hashlib
    import struct

    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            digest = hashlib.sha256(f.read(min(n, 1 << 24))).hexdigest()[:16]
    except (OSError, struct.error):
        digest = "unreadable"
    return f"shipped {path.name} {digest}"


AUTO_LOOKUPS = ("suffix", "ngram")  # the sources --spec auto always has, first (auto's memory is keyed by the names)


def auto_mtp(target, params: SamplingParams, heads: str | None = None):
    """resolve_mtp() for `--spec auto` in a process that generates with `params` (the CLI): () without loading them
    when the model's shipped heads lost their last probes in this sampling regime (auto.heads_retired)."""
    from ..weights.heads import find_heads
    from .auto import heads_retired

    if not heads and not getattr(target, "mtp", None):
        path = find_heads(target)
        if path is not None and heads_retired(_identity(target, (None, None, None, shipped_source(path)), None),
                                              (*AUTO_LOOKUPS, "mtp"), regime(params)):
            return ()
    return resolve_mtp(target, heads) or ()


def regime(params: SamplingParams) -> str:
    """The sampling regime auto keeps what it learned under (acceptance differs with the temperature)."""
    return "greedy" if params.greedy else f"temp {params.temperature:g}"


def _identity(target, mtp, draft) -> str | None:
    """What auto's on-disk memory is keyed by: the target's file (path, sizes and modification times, as the layout
    cache first compares them: a folder's files each), the heads' source and the draft model's; None for a model
    loaded from no file."""
    from ..weights.layout import cheap_identity

    parts = []
    for m in (target, draft):
        path = getattr(m, "path", None)
        if m is not None and path is None:
            return None
        if path is not None:
            try:
                parts.append([str(Path(path).resolve()), cheap_identity(Path(path))])
            except OSError:
                return None
    return json.dumps([parts, mtp[3] if mtp else None]) if parts else None


def build_proposer(spec: SpecConfig, target, params: SamplingParams, draft=None, mtp=None, index=None
                   ) -> Proposer | None:
    """The proposer spec.kind asks for (one per sequence: proposers keep per-sequence state). `target` / `draft` are
    loader.Loaded models (draft only for kind "draft"); mtp: resolve_mtp()'s result (kind "mtp"; resolved from
    spec.heads when None); index: a server's spec.suffix.SuffixIndex of earlier responses (a source of "auto")."""
    if spec.kind == "none":
        return None
    seed = None if params.seed is None else params.seed + 1
    if spec.kind == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.kind == "suffix":
        from .suffix import SuffixProposer

        return SuffixProposer()
    if spec.kind == "auto":
        from .auto import AutoProposer
        from .ngram import NgramProposer
        from .suffix import SuffixProposer

        # both lookups: the suffix automaton finds the longest match, the n-gram table the most recent one
        sources: dict = dict(zip(AUTO_LOOKUPS, (SuffixProposer(), NgramProposer(spec.ngram_min, spec.ngram_max)),
                                 strict=True))
        if index is not None:
            from .suffix import GlobalSuffixProposer

            sources["global"] = GlobalSuffixProposer(index)
        mtp = mtp if mtp is not None else resolve_mtp(target, spec.heads)
        # the model sources draft their argmax even when the target samples: point masses, which verification
        # couples with plain sampling (sampling.Draws), so a seeded run's text is the plain run's whatever each
        # step drafted
        argmax_drafts = SamplingParams(temperature=0.0)
        if mtp:
            sources["mtp"] = build_proposer(SpecConfig(kind="mtp", tree=spec.tree), target, argmax_drafts, mtp=mtp)
        if draft is not None:
            sources["draft"] = build_proposer(SpecConfig(kind="draft", draft_p_min=spec.draft_p_min), target,
                                              argmax_drafts, draft)
        k_max = 8 if spec.draft_max == "auto" else int(spec.draft_max)
        return AutoProposer(sources, k_max, spec.draft_min, learned=getattr(target, "model", target),
                            regime=regime(params),
                            memory=_identity(target, mtp, draft))
    if spec.kind == "draft":
        from .draft_model import DraftModelProposer, check_vocab

        if draft is None:
            raise ModelError("--spec draft needs a draft model: give -md DRAFT")
        check_vocab(target.tokenizer, draft.tokenizer)
        gen = make_generator(seed, draft.model.device) if not params.greedy else None
        return DraftModelProposer(draft.model, params, target.model.args.vocab_size, spec.draft_p_min, gen)
    if spec.kind == "mtp":
        from .mtp import ParallelMTP, SequentialMTP

        mtp = mtp or resolve_mtp(target, spec.heads)
        if mtp is None:
            raise ModelError("this model has no MTP modules and specdec ships no heads for it: train some with "
                             "`specdec train-mtp -m MODEL -o heads.safetensors` and pass --heads")
        heads_kind, drafter, vocab_map = mtp[:3]
        gen = make_generator(seed, target.model.device) if not params.greedy else None
        cls = ParallelMTP if heads_kind == "parallel" else SequentialMTP  # EAGLE-3: one module, recursed
        return cls(drafter, params, target.model.args.vocab_size, list(spec.tree) if spec.tree else None, gen,
                   vocab_map)
    raise ModelError(f"unknown --spec '{spec.kind}': use {', '.join(SPEC_KINDS)}")


__all__ = ["Draft", "Proposer", "SPEC_KINDS", "SpecConfig", "auto_mtp", "build_proposer", "resolve_mtp"]
