"""`--spec auto`: one drafter that picks its source every step (the default when no draft model is given).

Sources: suffix-automaton lookup over the prompt and the output (spec/suffix.py: costless), the model's MTP modules
or the heads shipped for it, and a draft model when one is given. Each source has its own draft-length policy
(spec/autok.py: acceptance per position and per the source's own draft class, e.g. the match length of a lookup;
its drafting cost per token), all sharing one measured verify cost curve v(T). Every step, each source's best K and
its predicted speedup E(K) / (K c + v(K + 1)) (Leviathan et al. 2023, with measured per-position acceptance) are
compared, and the best source drafts, or none (K = 0) when plain decoding is predicted fastest.

A costless source is asked for its whole candidate every step and scored against what is then generated
(full-information feedback), so its estimates stay current whether or not it drafts. A costly source (MTP heads, a
draft model) is not run while it loses: its state catches up lazily when it is next chosen, and it is probed now and
then (with exponential backoff) so that its estimates can recover. Verification never asks which source drafted.

While nothing pays (QUIET_AFTER steps in a row without a draft), the sources are consulted only every
CONSULT_EVERY-th step; the lookups are handed the tokens of the steps in between in one batch when next consulted
(extending a suffix automaton by many tokens at once is the same automaton), so a losing step costs the loop little:
the bookkeeping of every source every step was ~80 us of a ~3.3 ms SmolLM2 step on chat, where nothing pays
(docs/results/default-vs-plain.txt).

What one generation learned (acceptance per source and class, drafting costs per token) is where the next
generation of the same model in this process starts (`learned`: the server's requests, a benchmark's runs, a
batch file), instead of the priors: a fresh policy drafts on a prior acceptance of 0.5 until evidence says
otherwise, which on free text costs the first tokens of every request. It is also kept on disk at exit (`memory`:
the model file and heads' identity; $SPECDEC_CACHE/auto/), so the next `specdec generate` of the same model
starts there too: with the priors, the CLI on chat prompts ran at 0.96x plain decoding where the same generations in
one process ran at 1.00x (docs/results/default-vs-plain.txt). The verify cost curve is always measured afresh.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import weakref
from pathlib import Path

from .autok import AutoDraftLength
from .base import Draft, Proposer
from .costmodel import speedup

# model -> {source names -> the policies of the latest generation that began}; weak: a freed model takes its state
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
QUIET_AFTER, CONSULT_EVERY = 16, 4  # steps in a row with no draft before the sources rest; then consulted 1 step in 4
COSTLY_PROBE_MAX = 256  # the longest probe gap of a costly source (heads, a draft model): after 3 lost probes
RETIRE_FOR = 8  # of that many processes whose memory says the heads lose, one loads them (and probes them) again
# file on disk -> the policies to write there at exit (the latest generation's of that model, sources and regime)
_ON_DISK: dict[Path, dict] = {}
_KEPT = ("acc", "seen", "by_class", "draft_s_per_token", "probe_gap")  # what a policy carries to the next process


def memory_file(identity: str, sources, regime: str) -> Path | None:
    """Where auto's learned policies for this model identity, source names and regime live on disk (None when
    SPECDEC_AUTO_MEMORY=0)."""
    from ..config import cache_dir

    if os.environ.get("SPECDEC_AUTO_MEMORY", "1") == "0":
        return None
    key = hashlib.sha256(json.dumps([identity, list(sources), regime]).encode()).hexdigest()[:20]
    return cache_dir() / "auto" / f"{key}.json"


def _read(path: Path, policies: dict) -> bool:
    """Fill `policies` from the file (same source names, same draft lengths); False (nothing changed) when the file
    is missing, unreadable or of another shape."""
    def floats(xs, n: int) -> list[float]:
        if len(xs) != n:
            raise ValueError("another draft length")
        return [float(x) for x in xs]

    try:
        saved = json.loads(path.read_text())["policies"]
        parsed = {}
        for name, pol in policies.items():
            st, k = saved[name], len(pol.acc)
            cost = st["draft_s_per_token"]
            parsed[name] = (floats(st["acc"], k), floats(st["seen"], k),
                            {int(c): (floats(a, k), floats(s, k)) for c, (a, s) in st["by_class"].items()},
                            None if cost is None else float(cost), int(st["probe_gap"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    for name, pol in policies.items():
        pol.acc, pol.seen, pol.by_class, pol.draft_s_per_token, pol.probe_gap = parsed[name]
    return True


def heads_retired(identity: str | None, sources, regime: str) -> bool:
    """Whether a new process should leave the MTP heads unloaded (no features in the target's forward, no probes):
    auto's memory for these sources (names, "mtp" among them) and regime says the heads lost their last probes (the
    probe gap at its cap). A source that keeps losing then costs nothing, loading included; one process in
    RETIRE_FOR loads them again so that they can show they pay (the count is kept in the same file)."""
    path = memory_file(identity, sources, regime) if identity else None
    if path is None:
        return False
    try:
        state = json.loads(path.read_text())
        if int(state["policies"]["mtp"]["probe_gap"]) < COSTLY_PROBE_MAX:
            return False
        skipped = (int(state.get("skipped", 0)) + 1) % RETIRE_FOR
        state["skipped"] = skipped
        _write(path, state)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return skipped != 0


@atexit.register
def write_memory() -> None:
    """Write every model's latest learned policies (atomically; a cache that cannot be written is skipped)."""
    for path, policies in list(_ON_DISK.items()):
        state = {name: {k: getattr(pol, k) for k in _KEPT} for name, pol in policies.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, {"version": 1, "policies": state})
        except OSError:
            pass


def _write(path: Path, state: dict) -> None:
    """A memory file replaced atomically (a process killed mid-write leaves the old one)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


class AutoProposer:
    """Chooses, each step, the source and draft length with the most expected tokens per second."""

    name = "auto"

    def __init__(self, sources: dict[str, Proposer], k_max: int = 8, draft_min: int = 0, learned=None,
                 regime: str = "", memory: str | None = None):
        """learned: an object (the target model) under which what this generation learns is kept for the next
        generation with the same sources and regime (e.g. greedy, or a sampling temperature: acceptance differs);
        memory: the identity of the model's files, under which it is also kept on disk for the next process."""
        if not sources:
            raise ValueError("--spec auto needs at least one source")
        self.sources = sources
        # a costly source starts pessimistic (it must show it pays: probes find out) so that a model whose heads lose
        # does not pay for them while its policy learns; a costless one learns every step from watching anyway. A
        # costly source's draft step is assumed to cost 0.3 of a target forward until measured (EAGLE-3 heads on
        # SmolLM2: 0.8 ms a token against a 2.7 ms forward, docs/results/default-vs-plain.txt's step log), so that
        # a short generation does not pay for its first drafts on the prior alone
        self.policies = {name: AutoDraftLength(k_max, draft_min) if getattr(src, "costless", False) else
                         AutoDraftLength(k_max, draft_min, prior_acceptance=0.3, probe_every=32, prior_cost=0.3,
                                         probe_max=COSTLY_PROBE_MAX)
                         for name, src in sources.items()}
        shared: dict[int, float] = {}
        for pol in self.policies.values():  # one measured v(T) for all sources: the same target forward
            pol.verify_s = shared
        self.chosen: tuple[str, int | None] | None = None
        self.learned, self.regime = learned, regime
        self.memory = memory_file(memory, sources, regime) if memory else None
        self._table: list | None = None  # [measured T count, steps since tabulated, v(T) / v(1) table]
        self.quiet = 0  # steps in a row on which nothing was drafted
        self.resting = False  # this step the sources were not consulted
        self.backlog: list[int] = []  # tokens the costless sources have not been given yet (resting steps)

    @property
    def needs_prompt_hidden(self) -> bool:
        """Whether a source's begin() takes the target's hidden state at every prompt position (MTP modules)."""
        return any(getattr(src, "needs_prompt_hidden", False) for src in self.sources.values())

    def drop_hidden_sources(self) -> None:
        """Leave out the sources that need the prompt's hidden states (before begin(): a sequence that starts from a
        cached prefix, engine.Engine's prompt cache, has none for it)."""
        keep = [name for name, src in self.sources.items() if not getattr(src, "needs_prompt_hidden", False)]
        if keep:
            self.sources = {name: self.sources[name] for name in keep}
            self.policies = {name: self.policies[name] for name in keep}

    def _inherit(self) -> None:
        """Start from the policies of the latest generation of the same model and sources (a deep copy: the shared
        verify curve stays shared), with nothing of its pending bookkeeping; then become the latest."""
        if self.learned is None:
            return
        key = (*self.sources, self.regime)
        store = _LEARNED.setdefault(self.learned, {})
        last = store.get(key)
        if last is None and self.memory is not None and _read(self.memory, self.policies):  # an earlier process's
            last = self.policies
            self._reset_bookkeeping()
        elif last is not None and last is not self.policies:
            self.policies = copy.deepcopy(last)
            self._reset_bookkeeping()
        store[key] = self.policies
        if self.memory is not None:
            _ON_DISK[self.memory] = self.policies

    def _reset_bookkeeping(self) -> None:
        """Inherited policies keep what they learned, not the last generation's pending state or verify costs."""
        shared: dict[int, float] = {}
        for pol in self.policies.values():
            pol.watching, pol.since_draft, pol.probing, pol.cold = [], 0, False, True
            # costs are measured afresh: v(T) depends on the context length, and an entry for a T that is no
            # longer drafted would never be corrected (a long prompt's v(8) kept a short one from drafting)
            pol.verify_s = shared
        self._table = None

    def begin(self, context: list[int], hidden=None) -> None:
        self._inherit()
        self.quiet, self.resting, self.backlog = 0, False, []
        for src in self.sources.values():
            src.begin(context, hidden)

    def accept(self, accepted: list[int], next_token: int, hidden=None) -> None:
        if self.resting:  # the lookups get these tokens when they are next consulted
            self.backlog += accepted + [next_token]
        for src in self.sources.values():  # every source follows the text; the costly ones only bookkeep here
            if not (self.resting and getattr(src, "costless", False)):
                src.accept(accepted, next_token, hidden)

    def _catch_up(self) -> None:
        """Hand the costless sources the tokens of the steps they rested through."""
        if self.backlog:
            for src in self.sources.values():
                if getattr(src, "costless", False):
                    src.accept(self.backlog[:-1], self.backlog[-1])
            self.backlog = []

    def _verify_table(self) -> list[float]:
        """v(T) / v(1) for every T, shared by the sources (one curve: the same target forward). Tabulated again when
        a T is measured for the first time and every 8th step: the EMA moves little in between, and tabulating took
        ~20 us of a ~3.3 ms SmolLM2 step (docs/results/default-vs-plain.txt)."""
        first = next(iter(self.policies.values()))
        key = len(first.verify_s)
        if self._table is None or key != self._table[0] or self._table[1] >= 8:
            self._table = [key, 0, first.verify_table(first.draft_max + 1)]
        self._table[1] += 1
        return self._table[2]

    def plan(self, cap: int, peers: int = 1) -> tuple[Draft, str | None]:
        """This step's draft (at most `cap` tokens) and the name of the source that made it (None: no draft).

        peers: the sequences decoding in this step (engine.Engine). A batch of them probes a losing costly source as
        often as one sequence would, each sequence `peers` times less often: a probe runs the heads (their catch-up
        and a draft) and adds a verify row, and the sequences of a batch would each find out the same thing. Fresh
        `--spec auto` (no memory) at batch 8 on Spec-Bench summarization probed the shipped heads 10-12 times in 128
        steps (docs/results/batch-probes-1206g.txt)."""
        self.resting = self.quiet >= QUIET_AFTER and self.quiet % CONSULT_EVERY != 0
        if self.resting:
            self.quiet += 1
            self.chosen = None
            return Draft(), None
        self._catch_up()
        best: tuple[float, str | None, int, int | None, Draft | None] = (0.0, None, 0, None, None)
        probe = None
        vc = self._verify_table().__getitem__
        for name, src in self.sources.items():
            pol = self.policies[name]
            cls = src.draft_class() if hasattr(src, "draft_class") else None
            candidate = None
            if getattr(src, "costless", False):
                candidate = src.propose(pol.draft_max)
                if not candidate.tokens:  # no match: nothing to draft or to learn from this step
                    continue
                pol.watch(candidate.tokens, cls)
            elif pol.predicted < 1.0 and pol.since_draft % 8 and pol.since_draft < pol.probe_gap * peers:
                continue  # switched off and not due to probe: its estimate is rechecked every 8th step
            k = pol.choose(cls, vc, peers)
            if k <= 0:
                continue
            if pol.probing:
                probe = probe or (name, min(k, cap), cls, candidate)
                continue
            s = pol.predicted
            if k > cap:  # the end of the sequence or the context is nearer than the best K
                k = cap
                s = speedup(pol.acceptance(cls)[:k], pol.draft_cost(), vc)
            if s > best[0]:
                best = (s, name, k, cls, candidate)
        _, name, k, cls, candidate = best
        if name is None and probe is not None:  # nothing pays: let a source that has been idle show itself
            name, k, cls, candidate = probe
        if name is None:
            self.quiet += 1
            self.chosen = None
            return Draft(), None
        self.quiet = 0
        self.chosen = (name, cls)
        if candidate is not None:
            return Draft(candidate.tokens[:k]), name
        return self.sources[name].propose(k), name

    def feedback(self, depth: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        """The step's outcome: the chosen source's policy learns from it, the others count an idle step."""
        chosen = self.chosen[0] if self.chosen else None
        for name, pol in self.policies.items():
            if name == chosen:
                pol.update(depth, n_accepted, verify_s, draft_s, self.chosen[1])
            elif chosen is None and name == next(iter(self.policies)):
                pol.update(0, 0, verify_s, 0.0)  # a plain step: the shared v(1) (and this one's idle count)
            else:
                pol.since_draft += 1

    def emitted(self, tokens: list[int]) -> None:
        for pol in self.policies.values():
            if pol.watching:  # candidates of earlier steps still being scored
                pol.emitted(tokens)
