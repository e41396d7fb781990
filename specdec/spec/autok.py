"""Draft-length policies: a fixed K (llama.cpp's --draft-max N) and `--draft-max auto`.

auto keeps running estimates of (a) the acceptance probability at each draft position, conditional on the earlier
positions having been accepted, (b) the target's forward time for each number of tokens T it has verified, and
(c) the drafting time per token, and each step picks the K (0 = plain decoding) that maximizes the predicted tokens
per second of spec/costmodel.py. Estimates forget old evidence exponentially, so the policy follows a prompt whose
drafts go from useless (free text) to excellent (a quoted list) and back. While K = 0 it probes with K = 1 now and
then so the estimates can recover; a probe that fails doubles the wait before the next (exponential backoff, as in
TCP retransmission), since each probe costs a verify of 2 tokens plus the proposer catching up on what it skipped.

Proposers that can tell in advance how good their next draft will be (the n-gram proposer: the length of the
context suffix it matched) pass that as a draft class: acceptance is then estimated per class, each class's counts
shrunk toward the pooled estimate while it has few of its own, so a long match drafts long and a one-token match
drafts little or nothing.

Proposers whose drafts cost nothing (n-gram lookup: `costless = True`) give full-information feedback: each step the
generation loop hands the policy the proposer's whole candidate (`watch`), drafted or not, and then the tokens that
were actually generated (`emitted`); their agreement says how many tokens a draft of any length would have had
accepted. Without it the policy learns only about the K it drafted, so a class whose drafts are kept short never
shows that its longer drafts would pay (in a replay of Spec-Bench summarization / rag outputs, watching lifts
tokens per forward 1.89 -> 2.00 and 2.50 -> 2.73; in real runs on this noisy machine the difference per category
stayed within -6% .. +7%). It also needs no probes. Under sampling this is still the acceptance rate: a point-mass
draft token x is accepted with probability p(x), and the emitted token equals x with that same probability.
"""

from __future__ import annotations

from collections.abc import Callable

from .costmodel import best_k, interpolate


class FixedDraftLength:
    """Draft k = draft_max tokens each step (llama.cpp's --draft-max); drafts shorter than draft_min are dropped."""

    def __init__(self, draft_max: int, draft_min: int = 0):
        self.draft_max, self.draft_min = draft_max, draft_min

    def choose(self, draft_class: int | None = None) -> int:
        return self.draft_max

    def update(self, k: int, n_accepted: int, verify_s: float, draft_s: float, draft_class: int | None = None
               ) -> None:
        pass

    def emitted(self, tokens: list[int]) -> None:
        pass


class AutoDraftLength:
    """Choose each step's K to maximize expected tokens per second, from measured acceptance and costs."""

    def __init__(self, k_max: int = 8, draft_min: int = 0, prior_acceptance: float = 0.5, decay: float = 0.95,
                 probe_every: int = 16, probe_max: int = 256, prior_cost: float = 0.0):
        """prior_cost: the drafting cost per token, as a fraction of a one-token forward, assumed until measured."""
        self.draft_max, self.draft_min = k_max, draft_min
        self.decay, self.probe_every, self.prior = decay, probe_every, prior_acceptance
        self.probe_gap, self.probe_max = probe_every, probe_max  # plain steps before the next probe
        self.probing = False
        # acceptance per position: exponentially weighted counts of accepted / reached, pooled and per draft class
        self.acc = [0.0] * k_max
        self.seen = [0.0] * k_max
        self.by_class: dict[int, tuple[list[float], list[float]]] = {}
        self.verify_s: dict[int, float] = {}  # T -> EMA seconds of a target forward over T tokens
        self.draft_s_per_token: float | None = None
        self.prior_cost = prior_cost
        self.since_draft = 0
        self.predicted = 1.0  # the predicted speedup of the last choice
        self.watching: list[tuple] = []  # (candidate, draft class, tokens matched so far) awaiting emitted tokens
        self.watched = False  # full-information feedback: counts come from watch() / emitted(), not update()
        # the first step of a generation runs cold (the prefill's data in cache, not the weights): its forward took
        # 6.2 ms where the next took 3.9 (SmolLM2, docs/results/default-vs-plain.txt's step log) and, as one of the
        # few T = 1 samples while a source drafts every step, made v(2) / v(1) read 0.8: drafting looked free
        self.cold = True

    def acceptance(self, draft_class: int | None = None) -> list[float]:
        """Per-position acceptance estimates; a position never reached yet borrows the one before it (the prior for
        the first), so a run of full acceptances lets K grow. With a draft class: that class's counts plus two
        pseudo-observations of the pooled estimate."""
        out, prev = [], self.prior
        for a, s in zip(self.acc, self.seen, strict=True):
            prev = (a + prev) / (s + 1.0) if s > 0 else prev  # one pseudo-observation of the previous estimate
            out.append(prev)
        if draft_class is None or draft_class not in self.by_class:
            return out
        acc, seen = self.by_class[draft_class]
        return [(a + 2.0 * pooled) / (s + 2.0) for a, s, pooled in zip(acc, seen, out, strict=True)]

    def forward_s(self, t: int) -> float | None:
        """Seconds of a target forward over t tokens: measured, else interpolated (costmodel.interpolate)."""
        return interpolate(self.verify_s, t)

    def _base(self) -> float | None:
        """v(1), or v(2) when that measured less: a forward over more tokens never costs less, so v(1) then holds a
        slow outlier."""
        base, two = self.forward_s(1), self.verify_s.get(2)
        return two if base and two and two < base else base

    def verify_cost(self, t: int, base: float | None = None) -> float:
        """v(T) / v(1) (>= 1); before any measurement the prior 1 + 0.25 (T - 1) (MACHINE-FACTS: ~1.2-1.6x for
        T = 2-4 on a 2-core CPU). base: _base() when the caller has it already."""
        base = base or self._base()
        if not base:  # nothing measured yet (or a forward timed at 0 s: bench found one)
            return 1.0 + 0.25 * (t - 1)
        return max(1.0, (self.forward_s(t) or base) / base)

    def verify_table(self, t_max: int) -> list[float]:
        """[0, v(1)/v(1), ..., v(t_max)/v(1)]: verify_cost for every T at once (auto's sources share it each step;
        the base looked up once), made non-decreasing from the right: a forward over more tokens never costs less,
        and the noise of this machine only ever adds time, so a v(T) above a later v(T') is an outlier (one slow
        sample read v(2) = 7.1 ms next to v(3) = 5.0 ms and kept a lookup from drafting)."""
        base = self._base()
        table = [0.0] + [self.verify_cost(t, base) for t in range(1, t_max + 1)]
        for t in range(t_max - 1, 0, -1):
            table[t] = min(table[t], table[t + 1])
        return table

    def draft_cost(self) -> float:
        """Drafting cost per token / v(1): measured, else the prior."""
        base = self.forward_s(1)
        return self.draft_s_per_token / base if (self.draft_s_per_token is not None and base) else self.prior_cost

    def choose(self, draft_class: int | None = None, verify_cost: Callable[[int], float] | None = None,
               peers: int = 1) -> int:
        """This step's K; verify_cost: v(T)/v(1) when the caller has it at hand (spec/auto.py tabulates it once per
        step for all its sources); peers: the sequences decoding in this step, whose probes of the same source
        count alike (spec/auto.py). The predicted speedup of the choice is left in self.predicted."""
        vc = verify_cost or self.verify_table(self.draft_max + 1).__getitem__
        k, self.predicted = best_k(self.acceptance(draft_class), self.draft_cost(), vc, self.draft_max)
        self.probing = k == 0 and self.since_draft >= self.probe_gap * peers and not self.watched
        if self.probing:
            k = 1  # probe now and then, or the estimates could never recover
        return k

    def update(self, k: int, n_accepted: int, verify_s: float, draft_s: float, draft_class: int | None = None
               ) -> None:
        """One step: a draft of k tokens (0 = none verified), n_accepted of them accepted, the target forward over
        k + 1 tokens took verify_s seconds and drafting took draft_s; draft_class as choose() was given it."""
        t = k + 1
        old = self.verify_s.get(t)
        if not self.cold:
            self.verify_s[t] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        self.cold = False
        if k == 0:
            self.since_draft += 1
            return
        self.since_draft = 0
        per_token = draft_s / k
        self.draft_s_per_token = per_token if self.draft_s_per_token is None else (
            0.8 * self.draft_s_per_token + 0.2 * per_token)
        if not self.watched:
            self._count(k, n_accepted, draft_class)
        # backoff: a probe after which drafting still does not pay doubles the wait (one that merely had a token
        # accepted used to reset it: heads at ~40% acceptance, which lose on chat, were probed every 32 steps at
        # ~2 ms of catching up each); a draft chosen on its merits, or a probe that shows it pays, resets it
        if self.probing:
            table = self.verify_table(self.draft_max + 1)
            pays = best_k(self.acceptance(draft_class), self.draft_cost(), table.__getitem__, self.draft_max)[0] > 0
            self.probe_gap = self.probe_every if pays else min(2 * self.probe_gap, self.probe_max)
        else:
            self.probe_gap = self.probe_every

    def watch(self, candidate: list[int], draft_class: int | None = None) -> None:
        """A costless proposer's whole candidate at this step (up to draft_max tokens), drafted or not: it is scored
        against the tokens emitted from now on (see the module docstring)."""
        self.watched = True
        if candidate:
            self.watching.append((candidate[:self.draft_max], draft_class, 0))

    def emitted(self, tokens: list[int]) -> None:
        """Tokens just appended to the output: each watched candidate is compared with them in order, and counted
        once it disagrees or is matched whole."""
        for tok in tokens:
            still = []
            for cand, cls, matched in self.watching:
                if cand[matched] != tok:
                    self._count(matched + 1, matched, cls)
                elif matched + 1 == len(cand):
                    self._count(len(cand), len(cand), cls)
                else:
                    still.append((cand, cls, matched + 1))
            self.watching = still

    def _count(self, k: int, n_accepted: int, draft_class: int | None) -> None:
        """One observation: positions 1..k were reached by a draft of k tokens whose first n_accepted were accepted
        (so positions up to n_accepted + 1 count as reached)."""
        counts = [(self.acc, self.seen)]
        if draft_class is not None:
            counts.append(self.by_class.setdefault(draft_class, ([0.0] * self.draft_max, [0.0] * self.draft_max)))
        for acc, seen in counts:
            for i in range(min(k, n_accepted + 1)):  # positions reached: the accepted ones and the first rejected
                acc[i] = self.decay * acc[i] + (1.0 if i < n_accepted else 0.0)
                seen[i] = self.decay * seen[i] + 1.0
