"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, for every proposer and
draft length, on the real default model; caches roll back exactly; EOS / stop strings / -n inside an accepted draft
end generation exactly where plain decoding does."""

from __future__ import annotations

import pytest
import torch
from conftest import CHAT_PROMPTS, chat
from tiny_models import write_gguf

from specdec.config import ModelError
from specdec.engine import Engine, Sequence
from specdec.generate import generate
from specdec.loader import load
from specdec.sampling import SamplingParams
from specdec.spec import SpecConfig, build_proposer
from specdec.spec.autok import FixedDraftLength
from specdec.spec.base import Draft
from specdec.spec.ngram import NgramProposer

GREEDY = SamplingParams(temperature=0.0)
N = 40
PROMPTS = CHAT_PROMPTS[:2] + ["Repeat exactly, twice: the quick brown fox jumps over the lazy dog."]


class RandomProposer:
    """Adversarial: drafts uniformly random tokens (almost all rejected)."""

    name = "random"

    def __init__(self, vocab: int, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def begin(self, context, hidden=None):
        pass

    def propose(self, k):
        return Draft(torch.randint(0, self.vocab, (k,), generator=self.g).tolist())

    def accept(self, accepted, next_token, hidden=None):
        pass


class OracleProposer:
    """Drafts the known continuation (then junk), so whole drafts are accepted."""

    name = "oracle"

    def __init__(self, continuation: list[int], junk: int = 7):
        self.cont, self.junk = continuation, junk
        self.pos = 0

    def begin(self, context, hidden=None):
        self.pos = 1  # the first generated token came from the prefill

    def propose(self, k):
        return Draft((self.cont[self.pos:self.pos + k] + [self.junk] * k)[:k])

    def accept(self, accepted, next_token, hidden=None):
        self.pos += len(accepted) + 1


@pytest.fixture(scope="module")
def target(smollm2_default):
    return smollm2_default


@pytest.fixture(scope="module")
def plain(plain_greedy):
    return {p: plain_greedy(p, N) for p in PROMPTS}


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A small random-weight llama with the default model's vocabulary."""
    path = write_gguf("llama", tmp_path_factory.mktemp("draft") / "tiny-draft.gguf", seed=11)
    return load(path, ctx=2048)


def make(kind, target, tiny_draft):
    if kind == "self":
        return build_proposer(SpecConfig(kind="draft", draft_p_min=0.0), target, GREEDY, target)
    if kind == "tiny":
        return build_proposer(SpecConfig(kind="draft", draft_p_min=0.0), target, GREEDY, tiny_draft)
    if kind == "ngram":
        return NgramProposer(1, 4)
    return RandomProposer(target.model.args.vocab_size)


@pytest.mark.parametrize("kind", ["self", "tiny", "ngram", "random"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_identity(target, plain, tiny_draft, kind, k):
    for p in PROMPTS:
        r = generate(target.model, target.tokenizer, chat(target.tokenizer, p), GREEDY, max_tokens=N,
                     ignore_eos=True, proposer=make(kind, target, tiny_draft), draft_length=FixedDraftLength(k))
        assert r.tokens == plain[p], f"{kind} k={k} differs on {p!r}"
        if kind in ("self", "random"):
            assert r.stats.drafted > 0


def test_greedy_identity_without_the_attention_kernel(target, monkeypatch):
    """A machine without a C compiler verifies with one SDPA call per row (AttentionPlan "rows"): still exact."""
    monkeypatch.setattr(target.model, "kernel", False)
    for p in PROMPTS[:2]:
        ids = chat(target.tokenizer, p)
        ref = generate(target.model, target.tokenizer, ids, GREEDY, max_tokens=N, ignore_eos=True)
        r = generate(target.model, target.tokenizer, ids, GREEDY, max_tokens=N, ignore_eos=True,
                     proposer=RandomProposer(target.model.args.vocab_size), draft_length=FixedDraftLength(4))
        assert r.tokens == ref.tokens and r.stats.drafted > 0


@pytest.mark.parametrize("kind", ["tiny", "ngram", "random"])
def test_greedy_identity_with_auto_draft_length(target, plain, tiny_draft, kind):
    from specdec.spec.autok import AutoDraftLength

    for p in PROMPTS:
        r = generate(target.model, target.tokenizer, chat(target.tokenizer, p), GREEDY, max_tokens=N,
                     ignore_eos=True, proposer=make(kind, target, tiny_draft), draft_length=AutoDraftLength())
        assert r.tokens == plain[p], f"{kind} auto differs on {p!r}"


def test_self_draft_accepts_everything(target):
    proposer = build_proposer(SpecConfig(kind="draft", draft_p_min=0.0), target, GREEDY, target)
    r = generate(target.model, target.tokenizer, chat(target.tokenizer, PROMPTS[0]), GREEDY, max_tokens=N,
                 ignore_eos=True, proposer=proposer, draft_length=FixedDraftLength(4))
    assert r.stats.drafted > 0 and r.stats.acceptance_rate == 1.0
    assert r.stats.mean_accepted_length > 4.0  # 4 accepted + the bonus token per forward (the last one may be short)


def test_rollback_leaves_caches_as_if_never_drafted(target, tiny_draft):
    """After generation with many rejections, the target's and the draft's caches equal, bit for bit, the caches of
    a run that never drafted: prefill of the prompt, then one token per forward (plain decoding)."""
    tok = target.tokenizer
    ids = chat(tok, PROMPTS[0])
    proposer = build_proposer(SpecConfig(kind="draft", draft_p_min=0.0), target, GREEDY, tiny_draft)
    engine = Engine(target.model)
    seq = engine.add(Sequence(ids, GREEDY, 24, True, proposer, FixedDraftLength(4)))
    cache = seq.cache
    engine.run([seq])
    r = seq
    assert r.stats.drafted > r.stats.accepted  # there were rejections
    assert cache.length == len(ids) + len(r.out) - 1  # everything but the pending token
    with torch.inference_mode():
        for model, used in ((target.model, cache), (tiny_draft.model, proposer.cache)):
            fresh = model.new_cache()
            model.prefill(ids, fresh)
            for i, t in enumerate(r.out[:used.length - len(ids)]):
                model(torch.tensor([[t]]), torch.tensor([len(ids) + i]), fresh)
            assert fresh.length == used.length
            assert torch.equal(used.entries(0, used.length), fresh.entries(0, used.length))
            nxt = torch.tensor([[r.out[-1]]])
            a, _ = model(nxt, torch.tensor([used.length]), used)
            b, _ = model(nxt, torch.tensor([fresh.length]), fresh)
            assert torch.equal(a, b)


def test_vocabulary_mismatch_is_refused(target, gemma_path):
    """A Gemma draft for the SmolLM2 target: refused on its tokenizer, the first thing build_proposer reads of it
    (a stand-in with Gemma's tokenizer: converting Gemma's weights took ~20 s of CI for nothing)."""
    from types import SimpleNamespace

    from specdec.tokenizer import load_tokenizer

    gemma = SimpleNamespace(tokenizer=load_tokenizer(gemma_path))
    with pytest.raises(ModelError, match="differ"):
        build_proposer(SpecConfig(kind="draft", draft_p_min=0.0), target, GREEDY, gemma)


def test_eos_stop_and_max_tokens_inside_accepted_draft(target):
    tok = target.tokenizer
    ids = chat(tok, "What is 2+2? Answer with a number only.")
    ref = generate(target.model, tok, ids, GREEDY, max_tokens=50)
    assert ref.finish_reason == "stop" and len(ref.tokens) > 4  # ends with EOS
    # the oracle drafts 8 tokens at a time, through the EOS and beyond
    r = generate(target.model, tok, ids, GREEDY, max_tokens=50, proposer=OracleProposer(ref.tokens),
                 draft_length=FixedDraftLength(8))
    assert r.tokens == ref.tokens and r.finish_reason == "stop" and r.text == ref.text
    assert r.stats.accepted > 0
    long = generate(target.model, tok, chat(tok, PROMPTS[1]), GREEDY, max_tokens=N, ignore_eos=True)
    for n in (3, 10, 17):
        r = generate(target.model, tok, chat(tok, PROMPTS[1]), GREEDY, max_tokens=n, ignore_eos=True,
                     proposer=OracleProposer(long.tokens), draft_length=FixedDraftLength(8))
        assert r.tokens == long.tokens[:n] and r.finish_reason == "length"
    stop = long.text[len(long.text) // 2:][:3]
    cut = generate(target.model, tok, chat(tok, PROMPTS[1]), GREEDY, max_tokens=N, ignore_eos=True, stop=[stop],
                   proposer=OracleProposer(long.tokens), draft_length=FixedDraftLength(8))
    assert cut.finish_reason == "stop" and cut.text == long.text[:long.text.find(stop)]


def test_ngram_proposer_lookup():
    p = NgramProposer(1, 3)
    p.begin([1, 2, 3, 4, 5, 9, 2, 3])
    assert p.propose(3).tokens == [4, 5, 9]  # "2 3" was last followed by 4 5 9
    p.accept([4], 7)  # 4 accepted, then 7
    assert p.tokens[-2:] == [4, 7]
    assert p.propose(2).tokens == []  # "4 7", "7" never seen before
    p.begin([5, 6, 5, 6, 5])
    assert p.propose(4).tokens == [6, 5]  # most recent earlier "6 5" / "5" continuation, cut at the context's end
    assert p.draft_class() == 3  # the suffix "5 6 5" was seen before (n capped at ngram_max = 3)
    p.begin([1, 2, 3, 4, 5])
    assert p.draft_class() == 0 and p.propose(2).tokens == []


def test_ngram_lookup_starts_from_one_token_by_default():
    """The default lookup (SpecConfig, the CLI's --ngram-min) drafts from a single-token match, as a class of its
    own and at most NgramProposer.single_max tokens long; --ngram-min 2 does not (docs/results/ngram-min-1208.txt)."""
    from specdec.cli import build_parser

    args = build_parser().parse_args(["generate", "-p", "hi", "--spec", "ngram"])
    assert SpecConfig().ngram_min == args.ngram_min == 1
    context = [7, 8, 9, 3, 7]  # "3 7" never seen, "7" was followed by 8 9 3 7
    p = build_proposer(SpecConfig(kind="ngram"), None, GREEDY)
    p.begin(context)
    assert p.propose(3).tokens == [8, 9] and p.draft_class() == 1  # at most single_max = 2 tokens from one
    two = build_proposer(SpecConfig(kind="ngram", ngram_min=2), None, GREEDY)
    two.begin(context)
    assert two.propose(3).tokens == [] and two.draft_class() == 0
