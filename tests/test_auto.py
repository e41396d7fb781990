"""Suffix-automaton lookup (spec/suffix.py) against brute force, and the `--spec auto` chooser (spec/auto.py) on
synthetic sources: K = 0 when nothing is accepted, the longest draft when everything is, and a losing costly source
is not run (but probed now and then)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.spec.auto import AutoProposer
from specdec.spec.base import Draft
from specdec.spec.suffix import GlobalSuffixProposer, IndexMatcher, SuffixAutomaton, SuffixIndex, SuffixProposer


def brute(tokens: list[int]) -> tuple[int, int]:
    """(L, first end + 1): the longest suffix of `tokens` that occurs in tokens[:-1], and where its first
    occurrence ends + 1 (the continuation's start); (0, 0) when none."""
    m = len(tokens)
    for L in range(m - 1, 0, -1):
        suffix = tokens[m - L:]
        for e in range(L - 1, m - 1):  # occurrences ending at e <= m - 2
            if tokens[e - L + 1:e + 1] == suffix:
                return L, e + 1
    return 0, 0


@pytest.mark.parametrize("seed,alphabet,n", [(0, 2, 300), (1, 3, 300), (2, 8, 300), (3, 50, 200)])
def test_longest_match_equals_brute_force(seed, alphabet, n):
    rng = random.Random(seed)
    tokens = [rng.randrange(alphabet) for _ in range(n)]
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.extend([t])
        assert sam.match() == brute(tokens[:i + 1]), i


@pytest.mark.parametrize("pattern", [[5], [1, 2], [1, 2, 3, 1, 2], [7, 7, 8]])
def test_repeated_patterns_and_continuations(pattern):
    """The worst cases for suffix structures (periodic text): matches as long as the text allows, continuations that
    run into the text's own end, and a change of pattern midway."""
    tokens = pattern * 40 + [9, 9] + pattern * 10
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.extend([t])
        n, start = sam.match()
        assert (n, start) == brute(tokens[:i + 1])
        seen, k = tokens[:i + 1], 6
        # the continuation of the match, copied on past the text's end as LZ77 copies (the match repeats itself)
        want = []
        for j in range(k if n else 0):
            src = start + j
            want.append(seen[src] if src < len(seen) else want[src - len(seen)])
        assert sam.continuation(k) == want


def test_suffix_proposer_drafts_the_continuation():
    p = SuffixProposer()
    text = [10, 11, 12, 13, 14, 15, 99, 10, 11, 12]
    p.begin(text)
    assert p.propose(3).tokens == [13, 14, 15] and p.draft_class() == 3
    p.accept([13], 14)
    assert p.propose(2).tokens == [15, 99] and p.draft_class() == 5


def brute_index(responses: list[list[int]], text: list[int]) -> tuple[int, list[int]]:
    """(L, continuation): the longest suffix of `text` occurring inside one response, and what followed its first
    occurrence (responses in order) up to that response's end."""
    for L in range(len(text), 0, -1):
        suffix = text[len(text) - L:]
        for r in responses:
            for e in range(L, len(r) + 1):
                if r[e - L:e] == suffix:
                    return L, r[e:]
    return 0, []


@pytest.mark.parametrize("seed,alphabet", [(0, 2), (1, 4), (2, 30)])
def test_global_index_matches_brute_force(seed, alphabet):
    """A sequence's match against the server's index of earlier responses: the longest suffix of its text found
    within one response (never across two), and that response's continuation, token by token."""
    rng = random.Random(seed)
    index = SuffixIndex(min_response=1)
    responses = [[rng.randrange(alphabet) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    for r in responses:
        index.add(r)
    text = [rng.randrange(alphabet) for _ in range(80)]
    m = IndexMatcher(index)
    for i, t in enumerate(text):
        m.feed([t])
        n, cont = brute_index(responses, text[:i + 1])
        assert m.match_length() == n, i
        assert m.continuation(8) == cont[:8], i


def test_global_index_is_bounded_and_keeps_the_latest():
    """Past its bound the index rebuilds over the most recent responses; a live matcher re-matches its tail."""
    rng = random.Random(5)
    index = SuffixIndex(max_tokens=400, min_response=1)
    m = IndexMatcher(index)
    for i in range(60):
        r = [rng.randrange(1000) for _ in range(30)]
        index.add(r)
        assert len(index) <= 400
        m.feed(r[:10])  # the start of the newest response: the matcher finds it and drafts its next tokens
        assert m.match_length() >= 10 and m.continuation(5) == r[10:15], i
    assert index.generation > 0 and len(index.responses) <= 400 // 31
    index.add([1, 2])  # shorter than min_response: ignored by default
    assert SuffixIndex().add([1, 2]) is None and len(SuffixIndex()) == 0


def test_global_proposer_needs_a_long_enough_match():
    index = SuffixIndex()
    index.add(list(range(100, 140)))
    p = GlobalSuffixProposer(index, min_match=4)
    p.begin([1, 2, 100, 101, 102])
    assert p.propose(4).tokens == [] and p.draft_class() == 0  # 3 tokens matched: below min_match
    p.accept([], 103)
    assert p.propose(4).tokens == [104, 105, 106, 107] and p.draft_class() == 4


class Fake:
    """A synthetic source: drafts `tokens` (costless, or not), counts how often it is run."""

    def __init__(self, name: str, costless: bool, tokens: list[int]):
        self.name, self.costless, self.tokens = name, costless, tokens
        self.calls = 0

    def begin(self, context, hidden=None):
        pass

    def propose(self, k: int) -> Draft:
        self.calls += 1
        return Draft(self.tokens[:k])

    def accept(self, accepted, next_token, hidden=None):
        self.fed = getattr(self, "fed", []) + accepted + [next_token]


def run(proposer: AutoProposer, steps: int, truth, emitted: list[int] | None = None) -> list[int]:
    """Drive the chooser as the engine does: truth(draft) -> the tokens the target emits this step (the accepted
    prefix of the draft, then its own next token); a forward over T tokens costs 10 ms + 1 ms per extra token.
    emitted: collects the emitted tokens."""
    lengths = []
    for _ in range(steps):
        draft, _ = proposer.plan(8)
        out = truth(draft.tokens)
        n = len(out) - 1
        proposer.feedback(len(draft), n, 0.010 + 0.001 * len(draft), 0.0)
        proposer.emitted(out)
        proposer.accept(out[:-1], out[-1])
        if emitted is not None:
            emitted += out
        lengths.append(len(draft))
    return lengths


def wrong(draft: list[int]) -> list[int]:
    return [-1]  # the target never says what was drafted


def test_chooser_drafts_nothing_when_nothing_is_accepted():
    src = Fake("suffix", True, [1, 2, 3, 4, 5, 6, 7, 8])
    auto = AutoProposer({"suffix": src})
    lengths = run(auto, 120, wrong)
    assert sum(lengths[-60:]) == 0  # learned: plain decoding is fastest


def test_chooser_drafts_long_when_everything_is_accepted():
    text = list(range(100, 109))
    src = Fake("suffix", True, text)
    auto = AutoProposer({"suffix": src})
    lengths = run(auto, 60, lambda d: text[:len(d) + 1])  # every drafted token is the target's own
    assert min(lengths[-20:]) == 8


def test_a_losing_costly_source_is_not_run():
    good = Fake("suffix", True, [1, 2, 3, 4, 5, 6, 7, 8])
    heads = Fake("mtp", False, [7, 7, 7, 7])
    auto = AutoProposer({"suffix": good, "mtp": heads})

    def truth(draft):  # the suffix source is always right, the heads always wrong
        return [1, 2, 3, 4, 5, 6, 7, 8, 9][:len(draft) + 1] if draft[:1] == [1] or not draft else [-1]

    run(auto, 40, truth)
    before = heads.calls
    run(auto, 400, truth)
    assert heads.calls - before <= 2  # the winner drafts every step: the loser is never even probed

    heads2 = Fake("mtp", False, [7, 7, 7, 7])
    auto2 = AutoProposer({"suffix": Fake("suffix", True, [5] * 8), "mtp": heads2})
    run(auto2, 40, wrong)  # nothing wins: plain decoding, with the heads probed now and then
    before = heads2.calls
    lengths = run(auto2, 400, wrong)
    assert 1 <= heads2.calls - before <= 8 and sum(lengths) <= 8  # exponential backoff: 16, 32, 64, ... steps apart


def test_a_slow_first_step_does_not_make_drafting_look_free():
    """The first forward of a generation runs cold and is not timed; a v(1) above a measured v(2) (an outlier
    among the few plain steps while a source drafts every step) is replaced by v(2), so v(T) / v(1) >= 1."""
    from specdec.spec.autok import AutoDraftLength

    pol = AutoDraftLength(4)
    pol.update(0, 0, 0.020, 0.0)  # cold: 20 ms, ignored
    assert pol.forward_s(1) is None
    pol.update(0, 0, 0.004, 0.0)
    pol.update(1, 0, 0.0046, 0.0)
    assert pol.forward_s(1) == pytest.approx(0.004) and pol.verify_cost(2) == pytest.approx(1.15)
    slow = AutoDraftLength(4)
    slow.cold = False
    slow.update(0, 0, 0.006, 0.0)  # a slow plain step, then drafted steps at T = 2, 3
    slow.update(1, 0, 0.0045, 0.0)
    slow.update(2, 0, 0.0050, 0.0)
    assert slow.verify_cost(2) == 1.0 and slow.verify_cost(3) == pytest.approx(0.0050 / 0.0045)



def test_a_slow_outlier_at_one_length_does_not_stop_drafting():
    """The verify table is non-decreasing from the right: one slow sample of v(2) (7.1 ms between v(1) = 4.6 and
    v(3) = 5.0, as a noisy host measured) reads as v(3), so a lookup accepted 35% of the time still drafts; taken
    as measured, v(2) / v(1) = 1.54 would make K = 0 look best."""
    from specdec.spec.autok import AutoDraftLength

    pol = AutoDraftLength(4, prior_acceptance=0.35)
    pol.cold = False
    pol.verify_s.update({1: 0.0046, 2: 0.0071, 3: 0.0050, 4: 0.0054})
    table = pol.verify_table(5)
    assert table[2] == table[3] == pytest.approx(0.0050 / 0.0046) and table[1] == 1.0
    assert all(a <= b for a, b in zip(table[1:], table[2:], strict=False))
    assert pol.choose() >= 1
    assert pol.verify_cost(2) == pytest.approx(0.0071 / 0.0046)  # the raw curve: K = 0 would have won

def test_a_probe_that_shows_a_loss_backs_off_even_with_tokens_accepted():
    """Heads that have 40% of their first tokens accepted but cost half a forward per token lose: each probe that
    leaves them losing doubles the wait, accepted token or not (one accepted token used to reset it to 32 steps)."""
    heads = Fake("mtp", False, [7, 7, 7, 7])
    auto = AutoProposer({"mtp": heads})
    drafts = 0

    def drive(steps: int) -> None:
        nonlocal drafts
        for _ in range(steps):
            draft, _ = auto.plan(8)
            drafts += bool(draft.tokens)
            hit = bool(draft.tokens) and drafts % 5 < 2  # 40% of first tokens accepted
            out = [7, -1] if hit else [-1]
            auto.feedback(len(draft), len(out) - 1, 0.010 + 0.001 * len(draft), 0.005 * len(draft))
            auto.emitted(out)

    drive(60)
    before = heads.calls
    drive(600)
    assert heads.calls - before <= 6  # gaps 32, 64, 128, 256, 256: not one probe every 32 steps (~19)



@pytest.mark.parametrize("peers", [1, 8])
def test_a_batch_probes_a_losing_costly_source_as_one_sequence_would(peers):
    """Each of `peers` sequences decoding together probes the heads `peers` times less often than one alone."""
    probes = []
    for _ in range(peers):
        heads = Fake("mtp", False, [7, 7, 7, 7])
        auto = AutoProposer({"mtp": heads})
        for _ in range(200):
            draft, _ = auto.plan(8, peers)
            auto.feedback(len(draft), 0, 0.010 + 0.005 * len(draft), 0.005 * len(draft))
            auto.emitted([-1])
        probes.append(heads.calls)
    if peers == 1:
        assert probes[0] >= 2  # first at 32 steps, then backing off
    else:
        assert sum(probes) == 0  # not before 8 x 32 steps


def test_sources_rest_while_nothing_pays_and_catch_up_on_the_text():
    """After QUIET_AFTER steps without a draft the lookups are consulted one step in CONSULT_EVERY; when consulted
    they have been given every token in between (in one batch); a source that starts paying drafts again, and is
    then consulted every step."""
    from specdec.spec.auto import CONSULT_EVERY, QUIET_AFTER

    src = Fake("suffix", True, [1, 2, 3, 4, 5, 6, 7, 8])
    auto = AutoProposer({"suffix": src})
    out: list[int] = []
    counter = iter(range(100, 10**6))
    run(auto, 120, lambda d: [next(counter)], out)  # never right: plain decoding wins
    before = src.calls
    run(auto, 200, lambda d: [next(counter)], out)
    assert 200 // CONSULT_EVERY - 2 <= src.calls - before <= 200 // CONSULT_EVERY + 2
    assert src.fed + auto.backlog == out  # every token reached the source or waits for its next consultation
    calls = src.calls
    while src.calls == calls:  # up to the next consulted step
        run(auto, 1, lambda d: [next(counter)], out)
    assert src.fed == out  # in one batch, in order
    assert QUIET_AFTER > CONSULT_EVERY
    # now every first token is right: learned from the consulted steps only (a class-less source: its one pooled
    # estimate was driven to ~0), it drafts again within a few dozen steps
    lengths = run(auto, 60, lambda d: [1, 2, 3, 4, 5, 6, 7, 8, 9][:len(d) + 1])
    assert any(lengths[:50])
    calls = src.calls
    run(auto, 10, lambda d: [1, 2, 3, 4, 5, 6, 7, 8, 9][:len(d) + 1])
    assert src.calls - calls == 10 and auto.quiet == 0  # consulted every step while it pays


def test_what_auto_learned_is_where_the_next_process_starts(monkeypatch, tmp_path):
    """At exit the latest policies of a model are written under $SPECDEC_CACHE/auto; a later process (no policies in
    memory) with the same model identity, sources and regime starts from them, so heads that lost are not drafted
    on the priors again; another identity, another regime or a corrupt file start from the priors."""
    import specdec.spec.auto as auto_mod

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(auto_mod, "_ON_DISK", {})

    class Model:  # the in-memory key (a target model)
        pass

    def fresh(memory="model-a", regime="temp 0.8"):
        monkeypatch.setattr(auto_mod, "_LEARNED", auto_mod.weakref.WeakKeyDictionary())  # a new process
        heads = Fake("mtp", False, [7, 7, 7, 7])
        auto = AutoProposer({"suffix": Fake("suffix", True, [5] * 8), "mtp": heads}, learned=Model(),
                            regime=regime, memory=memory)
        auto.begin([1, 2, 3])
        return auto, heads

    first, _ = fresh()
    prior = first.policies["mtp"].acceptance()
    run(first, 300, wrong)  # the heads are probed and lose; the lookup never matches
    learned = first.policies["mtp"].acceptance()
    assert learned[0] < prior[0]
    auto_mod.write_memory()
    files = list((tmp_path / "auto").glob("*.json"))
    assert len(files) == 1
    again, heads = fresh()
    assert again.policies["mtp"].acceptance() == learned and again.policies["mtp"].probe_gap > 32
    assert again.policies["mtp"].verify_s == {}  # costs are measured afresh
    run(again, 64, wrong)
    assert heads.calls == 0  # not probed on the priors within its first 64 steps
    assert fresh(memory="model-b")[0].policies["mtp"].acceptance() == prior
    assert fresh(regime="greedy")[0].policies["mtp"].acceptance() == prior
    files[0].write_text('{"version": 1, "policies": {"mtp": {"acc": [1]}}}')
    assert fresh()[0].policies["mtp"].acceptance() == prior
    monkeypatch.setenv("SPECDEC_AUTO_MEMORY", "0")
    assert auto_mod.memory_file("model-a", ["suffix"], "greedy") is None


def test_memory_identity_follows_the_model_file(tmp_path):
    """The identity is the target file's path, size and modification time (and the heads' source): a rewritten file
    is another model."""
    import os
    from types import SimpleNamespace

    from specdec.spec import _identity

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    target = SimpleNamespace(path=f)
    a = _identity(target, None, None)
    assert a == _identity(SimpleNamespace(path=f), None, None)
    assert a != _identity(target, ("eagle3", None, None, "shipped h.safetensors"), None)
    os.utime(f, ns=(1, 1))
    assert _identity(target, None, None) != a
    assert _identity(SimpleNamespace(path=None), None, None) is None


def test_memory_identity_tells_retrained_heads_apart(tmp_path):
    """Shipped heads are named in auto's memory key by file name and header digest: heads retrained and shipped
    under the same name (another training summary in the header) are another source; the same file is the same."""
    from safetensors.torch import save_file

    from specdec.spec import shipped_source

    f = tmp_path / "h.safetensors"
    save_file({"w": torch.zeros(4)}, str(f), metadata={"specdec": '{"train": {"loss": 1.0}}'})
    first = shipped_source(f)
    assert first == shipped_source(f) and first.startswith("shipped h.safetensors ")
    save_file({"w": torch.zeros(4)}, str(f), metadata={"specdec": '{"train": {"loss": 0.5}}'})
    assert shipped_source(f) != first
    assert shipped_source(tmp_path / "gone.safetensors") == "shipped gone.safetensors unreadable"


def test_heads_that_keep_losing_are_not_loaded(smollm2_default, monkeypatch, tmp_path):
    """When auto's memory says the shipped heads lost their last probes in this regime (probe gap at its cap), a
    new `specdec generate` leaves them unloaded (no features in the forward, no probes) in 7 processes of 8 and
    loads them in the 8th, so that they can show they pay; heads whose probes pay now and then, another regime
    (no memory) and heads asked for by name are loaded."""
    import json

    import specdec.spec.auto as auto_mod
    from specdec.sampling import SamplingParams
    from specdec.spec import _identity, auto_mtp, regime, resolve_mtp, shipped_source
    from specdec.weights.heads import find_heads

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    target = smollm2_default
    path = find_heads(target)
    assert path is not None
    params = SamplingParams(temperature=0.8)
    ident = _identity(target, (None, None, None, shipped_source(path)), None)
    assert ident == _identity(target, resolve_mtp(target), None)  # the key the auto proposer writes its memory under
    memory = auto_mod.memory_file(ident, ("suffix", "ngram", "mtp"), regime(params))
    memory.parent.mkdir(parents=True)

    def remember(gap: int) -> None:
        memory.write_text(json.dumps({"version": 1, "policies": {"mtp": {"probe_gap": gap}}}))

    assert auto_mtp(target, params)  # no memory yet
    remember(auto_mod.COSTLY_PROBE_MAX)
    loaded = [bool(auto_mtp(target, params)) for _ in range(2 * auto_mod.RETIRE_FOR)]
    assert loaded == ([False] * (auto_mod.RETIRE_FOR - 1) + [True]) * 2
    assert auto_mtp(target, SamplingParams(temperature=0.0))  # greedy: nothing remembered
    assert auto_mtp(target, params, heads=str(path))
    remember(64)
    assert auto_mtp(target, params)
