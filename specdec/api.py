"""Offline batched generation from Python, as vLLM's `LLM.generate`:

    from specdec import LLM, SamplingParams
    llm = LLM("model.gguf", max_batch=8)                     # or a loaded model: LLM.of(loaded)
    outs = llm.generate(["Why is the sky blue?", "Name three rivers."], SamplingParams(temperature=0.8, seed=1))
    print(outs[0].text)

Prompts are decoded together (continuous batching over engine.Engine: a finished prompt's slot takes the next
one at the next step), outputs come back in prompt order, and each output is exactly what the prompt gives alone
(greedy, or sampled with its seed).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from .engine import Engine
from .engine import Sequence as Seq
from .generate import TextStream
from .sampling import SamplingParams
from .spec import SpecConfig, build_proposer
from .spec.stats import Stats


@dataclass
class Output:
    prompt: str | list[int]
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)


class LLM:
    """A target model (and optional draft model) with a speculation setting, generating many prompts at once."""

    def __init__(self, model=None, *, draft=None, spec: SpecConfig | None = None, max_batch: int = 8,
                 dtype: str = "auto", quant: str = "auto", device: str = "auto", ctx: int | None = None,
                 prompt_cache: bool = False):
        """prompt_cache: a prompt that begins with an earlier one's text (and answer) reuses its keys and values
        (engine.Engine's prompt_cache; exact), e.g. a long shared system prompt or a conversation's next turn."""
        from .loader import load

        target = load(model, dtype=dtype, quant=quant, device=device, ctx=ctx)
        draft_model = load(draft, dtype=dtype, quant=quant, device=device, ctx=ctx) if draft else None
        self._init(target, draft_model, spec, max_batch, prompt_cache=prompt_cache)

    @classmethod
    def of(cls, target, draft=None, spec: SpecConfig | None = None, max_batch: int = 8, mtp=None,
           prompt_cache: bool = False) -> LLM:
        """Around models already loaded (loader.Loaded)."""
        self = cls.__new__(cls)
        self._init(target, draft, spec, max_batch, mtp, prompt_cache)
        return self

    def _init(self, target, draft, spec: SpecConfig | None, max_batch: int, mtp=None, prompt_cache: bool = False
              ) -> None:
        from .spec import resolve_mtp

        self.target, self.draft = target, draft
        self.spec = spec or SpecConfig(kind="draft" if draft is not None else "none")
        self.spec.validate()
        # MTP heads are resolved (read, quantized) once and shared: each sequence gets its own drafting state
        self.mtp = mtp or ((resolve_mtp(target, self.spec.heads) or ()) if self.spec.kind in ("mtp", "auto") else None)
        self.engine = Engine(target.model, max_batch=max_batch, prompt_cache=prompt_cache)
        self.eog = frozenset(target.tokenizer.eog_ids)  # end-of-generation tokens, for every sequence

    def sequence(self, ids: list[int], params: SamplingParams, max_tokens: int, ignore_eos: bool = False) -> Seq:
        """An engine Sequence for prompt token ids, with its own proposer and draft-length policy (not yet added)."""
        proposer = build_proposer(self.spec, self.target, params, self.draft, self.mtp)
        return Seq(ids, params, max_tokens, ignore_eos, proposer, self.spec.policy(), self.eog)

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams] = (),
                 max_tokens: int | Sequence[int] = 256, chat: bool = False, stop: Sequence[str] = (),
                 ignore_eos: bool = False, progress: bool = True, on_output=None) -> list[Output]:
        """Generate for every prompt (text, or token ids), `max_batch` at a time -> outputs in prompt order.
        params: one SamplingParams for all, or one per prompt (default: greedy); max_tokens likewise.
        on_output(index, Output): called as each prompt finishes."""
        from tqdm import tqdm

        tok = self.target.tokenizer
        if isinstance(prompts, str):
            raise TypeError("prompts is a list of prompts: give [text] for one")
        for i, p in enumerate(prompts):  # a string, or token ids
            if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
                raise TypeError(f"prompts[{i}] must be a string or a list of token ids, not {type(p).__name__}")
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not params:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(params, str) or not all(isinstance(x, SamplingParams) for x in params):
            raise TypeError("params must be a SamplingParams, or a list of them (one per prompt)")
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        for name, given in (("params", params), ("max_tokens", limits)):
            if len(given) != len(prompts):
                raise ValueError(f"{name} has {len(given)} entries for {len(prompts)} prompts: give one for all, or "
                                 "one per prompt")
        ids = [p if not isinstance(p, str) else (tok.encode_chat([{"role": "user", "content": p}]) if chat
                                                   else tok.encode(p)) for p in prompts]
        outputs: list[Output | None] = [None] * len(prompts)
        queue = list(range(len(prompts)))
        running: dict[int, tuple[int, Seq, TextStream]] = {}
        with tqdm(total=len(prompts), desc="generating", unit="prompt", file=sys.stderr,
                  disable=not progress or not sys.stderr.isatty()) as bar:
            while queue or running:
                while queue and self.engine.free_slots:  # continuous batching: join at the next step
                    i = queue.pop(0)
                    seq = self.engine.add(self.sequence(ids[i], params[i], limits[i], ignore_eos))
                    running[seq.id] = (i, seq, TextStream(tok, stop, None))
                new = self.engine.step([s for _, s, _ in running.values()])
                for sid, (i, seq, stream) in list(running.items()):
                    toks = new.get(sid, [])
                    if stream.push([t for t in toks if t not in self.eog or ignore_eos]):
                        self.engine.finish(seq, "stop")
                    if seq.finish is not None:
                        stream.finish()
                        outputs[i] = Output(prompts[i], stream.text, seq.out, seq.finish, seq.stats)
                        del running[sid]
                        bar.update(1)
                        if on_output is not None:
                            on_output(i, outputs[i])
        return outputs
