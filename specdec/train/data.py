"""`specdec make-data`: self-generated training data, Magpie-style (Xu et al. 2024, "Magpie: Alignment Data Synthesis
from Scratch by Prompting Aligned LLMs with Nothing").

1. prompts: the chat model is given only its template's user-turn prefix (the template rendered around a sentinel
   user message, cut at the sentinel) and samples what a user would write there, until its end-of-turn token;
2. filters (FilterConfig; each counts what it drops): empty, cut off at --prompt-max, not English (ASCII letters
   and English stopwords), too short / long, looping (repeated word 3-grams, lines or words), a near-duplicate of a
   kept prompt (word 3-gram Jaccard), and never an evaluation prompt (word 3-gram containment with a Spec-Bench turn);
3. the self-instruct seed tasks come first (the lines before the Magpie ones);
4. answers: the model's own, one per temperature (0 = greedy), decoded together by the batched engine.

One JSON line per prompt, appended as it is done; OUT.meta.json records the settings, the model and the filter
counts, and is the resume point. Every random choice is seeded from (--seed, index), so an interrupted run, resumed,
writes exactly the file an uninterrupted one writes, and so does a run continued to a larger --n-prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import ModelError
from .mtp import _atomic_write, _bar, training_prompts

FORMAT = "specdec-data/1"
SHARED = Path(__file__).resolve().parents[2].parent / "shared/data"
SPEC_BENCH = SHARED / "spec_bench/question.jsonl"
SEED_TASKS = SHARED / "train_prompts_seed_tasks.jsonl"
SENTINEL = "<<MAGPIE-USER-MESSAGE-7f3a>>"
FILTERS = ("empty", "unfinished", "language", "length", "loop", "spec_bench", "duplicate")  # checked in this order

# ---------------------------------------------------------------------------------------------------------------
# the user-turn prefix and seeds
# ---------------------------------------------------------------------------------------------------------------


def user_turn_prefix(template: str, bos_token: str = "", eos_token: str = "") -> str:
    """The text a chat template writes before a (first) user message: rendered around a sentinel, cut there."""
    from ..tokenizer import _render_template

    text = _render_template(template, [{"role": "user", "content": SENTINEL}], add_generation_prompt=False,
                            bos_token=bos_token, eos_token=eos_token)
    if SENTINEL not in text:
        raise ModelError("cannot find the user turn in this model's chat template")
    return text[:text.index(SENTINEL)]


def prefix_tokens(tok) -> list[int]:
    """The user-turn prefix of a tokenizer's chat template, as token ids."""
    if tok.chat_template is None:
        raise ModelError("make-data needs a chat model: this model has no chat template")
    text = user_turn_prefix(tok.chat_template, tok.bos_token or "", tok.eos_token or "")
    return tok.encode(text, add_special_tokens=False)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (the run's seed, what it is for, the index)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------------------------------------
# filters (pure functions over text)
# ---------------------------------------------------------------------------------------------------------------

STOPWORDS = frozenset(
    "a about above after again all also an and any are as at be because been before being below between both but by "
    "can could did do does doing down during each few for from further had has have having he her here hers him his "
    "how i if in into is it its itself just me more most my no nor not now of off on once only or other our ours out "
    "over own same she should so some such than that the their them then there these they this those through to too "
    "under until up very was we were what when where which while who whom why will with would you your yours".split())


def words(text: str) -> list[str]:
    """Lower-cased words (letters, digits, apostrophes) for the n-gram filters."""
    return re.findall(r"[a-z0-9']+", text.lower())


def ngrams(text: str, n: int = 3) -> set[tuple[str, ...]]:
    """The word n-grams of a text (a text of fewer than n words is one gram: itself)."""
    w = words(text)
    if 0 < len(w) < n:
        return {tuple(w)}
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def word_count(text: str) -> int:
    return len(text.split())


def is_looping(text: str, max_repeat: float = 0.3, max_line_repeats: int = 2, max_run: int = 3) -> bool:
    """Degenerate repetition: more than max_repeat of the word 3-grams are repeats, a line (8+ characters) appears
    more than max_line_repeats times, or one word more than max_run times in a row."""
    w = words(text)
    grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    if grams and 1 - len(set(grams)) / len(grams) > max_repeat:
        return True
    lines = Counter(s.strip().lower() for s in text.splitlines() if len(s.strip()) >= 8)
    if lines and max(lines.values()) > max_line_repeats:
        return True
    run = 1
    for a, b in zip(w, w[1:], strict=False):
        run = run + 1 if a == b else 1
        if run > max_run:
            return True
    return False


def is_english(text: str, min_ascii: float = 0.9, min_stopwords: float = 0.1) -> bool:
    """A heuristic: at least min_ascii of the letters are ASCII (drops other scripts) and at least min_stopwords of
    the words are common English function words (drops other Latin-script languages and word salad)."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < min_ascii:
        return False
    w = re.findall(r"[^\W\d_]+", text.lower())  # runs of letters, accented ones included
    return bool(w) and sum(x in STOPWORDS for x in w) / len(w) >= min_stopwords


class NgramIndex:
    """Word 3-gram sets of many texts, with an inverted index: the best overlap of a new text with any of them."""

    def __init__(self, texts: Iterable[str] = ()):
        self.sizes: list[int] = []
        self.postings: dict[tuple[str, ...], list[int]] = {}
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        grams = ngrams(text)
        for g in grams:
            self.postings.setdefault(g, []).append(len(self.sizes))
        self.sizes.append(len(grams))

    def best(self, text: str, measure: str = "jaccard") -> float:
        """Highest overlap with an indexed text: Jaccard |A & B| / |A u B|, or containment |A & B| / min(|A|, |B|) (one
        text inside the other)."""
        grams = ngrams(text)
        shared = Counter(i for g in grams for i in self.postings.get(g, ()))
        if not shared:
            return 0.0
        if measure == "jaccard":
            return max(k / (len(grams) + self.sizes[i] - k) for i, k in shared.items())
        return max(k / min(len(grams), self.sizes[i]) for i, k in shared.items())


@dataclass(frozen=True)
class FilterConfig:
    """Thresholds of the prompt filters. quality=False (--no-filter) keeps only the empty and Spec-Bench filters."""

    min_words: int = 3
    max_words: int = 200
    require_end: bool = True  # drop a prompt cut off at --prompt-max (no end-of-turn token)
    max_repeat: float = 0.3  # looping: fraction of repeated word 3-grams
    max_line_repeats: int = 2
    max_run: int = 3  # the same word more than this many times in a row
    min_ascii: float = 0.9  # language: fraction of ASCII letters ...
    min_stopwords: float = 0.1  # ... and of English stopwords among the words
    dedup: float = 0.6  # word 3-gram Jaccard with a kept prompt
    eval_overlap: float = 0.5  # word 3-gram containment with a Spec-Bench turn (never relaxed)
    quality: bool = True


class Filters:
    """The filter chain: check() names the first filter a prompt fails (counted) or keeps it (remembered for dedup)."""

    def __init__(self, cfg: FilterConfig, eval_texts: Iterable[str] = ()):
        self.cfg = cfg
        self.counts = dict.fromkeys(FILTERS, 0)
        self.eval = NgramIndex(eval_texts)
        self.kept = NgramIndex()

    def is_eval(self, text: str) -> bool:
        return self.eval.best(text, "containment") >= self.cfg.eval_overlap

    def reason(self, text: str, finished: bool = True) -> str | None:
        """Why `text` is dropped (a FILTERS name), or None to keep it. Changes nothing."""
        c = self.cfg
        if not text.strip():
            return "empty"
        if c.quality:
            if c.require_end and not finished:
                return "unfinished"
            if not is_english(text, c.min_ascii, c.min_stopwords):
                return "language"
            if not c.min_words <= word_count(text) <= c.max_words:
                return "length"
            if is_looping(text, c.max_repeat, c.max_line_repeats, c.max_run):
                return "loop"
        if self.is_eval(text):
            return "spec_bench"
        if c.quality and self.kept.best(text) >= c.dedup:
            return "duplicate"
        return None

    def check(self, text: str, finished: bool = True) -> bool:
        """Keep `text`? Counts a drop under its filter; remembers a kept text for the dedup filter."""
        why = self.reason(text, finished)
        if why:
            self.counts[why] += 1
            return False
        self.kept.add(text)
        return True


def spec_bench_turns(path: str | Path | None = SPEC_BENCH) -> list[str]:
    """Every turn of every Spec-Bench question (none when the file is absent)."""
    if path is None or not Path(path).exists():
        return []
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t for r in rows for t in r.get("turns", [])]


def seed_prompts(path: str | Path | None) -> list[str]:
    """The seed prompts (self-instruct seed tasks or {"prompt": ...} lines); refuses a Spec-Bench-like file."""
    if path is None:
        return []
    if not Path(path).exists():
        raise ValueError(f"seed prompts not found: {path} (give --seed-prompts FILE, or none)")
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and "turns" in json.loads(line):
            raise ValueError(f"{path} looks like Spec-Bench (it has \"turns\"): evaluation prompts are never "
                             "training data")
    return training_prompts(path)


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    n_prompts: int = 1000  # Magpie prompts to keep (the seed prompts come on top)
    temps: tuple[float, ...] = (0.0, 0.5, 0.8, 1.0)  # one answer per temperature
    max_new: int = 256  # tokens per answer
    prompt_temp: float = 1.0
    prompt_top_p: float = 0.99
    prompt_max: int = 96  # tokens per Magpie prompt
    answer_top_p: float = 0.95
    seed_prompts: str | None = str(SEED_TASKS)
    spec_bench: str | None = str(SPEC_BENCH)
    batch: int = 8  # sequences per engine run
    seed: int = 0
    max_tries: int = 20  # give up after this many candidates per wanted Magpie prompt
    filters: FilterConfig = field(default_factory=FilterConfig)

    def validate(self) -> None:
        if self.n_prompts < 0:
            raise ValueError("--n-prompts must be >= 0")
        if not self.temps or any(not 0 <= t <= 2 for t in self.temps):
            raise ValueError("--temps takes temperatures in [0, 2], e.g. 0,0.5,0.8,1.0")
        if self.max_new < 1 or self.prompt_max < 1 or self.batch < 1:
            raise ValueError("--max-new, --prompt-max and --batch must be >= 1")
        if not 0 < self.prompt_temp <= 2:
            raise ValueError("--prompt-temp must be in (0, 2]")

    def settings(self) -> dict:
        """What the data depends on (not n_prompts, batch or max_tries: a run may continue with others)."""

        def digest(p: str | None) -> str | None:
            return hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16] if p and Path(p).exists() else None

        s = {k: v for k, v in asdict(self).items() if k not in ("n_prompts", "batch", "max_tries")}
        s["temps"] = list(self.temps)
        s["seed_prompts"] = {"file": Path(self.seed_prompts).name, "sha256": digest(self.seed_prompts)} \
            if self.seed_prompts else None
        s["spec_bench"] = digest(self.spec_bench)
        return s


def _params(temperature: float, top_p: float, seed: int):
    from ..sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0, seed=seed)


def sample_prompts(engine, prefix, seeds: list[int], cfg: DataConfig, eog: frozenset[int]) -> list[tuple[list[int],
                                                                                                        bool]]:
    """Magpie candidates: one sampled continuation of the user-turn prefix per seed -> (tokens, ended its turn)."""
    from ..engine import Sequence

    seqs = [engine.add(Sequence(list(prefix.prompt), _params(cfg.prompt_temp, cfg.prompt_top_p, s), cfg.prompt_max,
                                eog=eog), prefix) for s in seeds]
    engine.run(seqs)
    return [(s.out, s.finish == "stop") for s in seqs]


def answer(model, prompts: list[list[int]], cfg: DataConfig, seeds: list[list[int]], eog: frozenset[int]
           ) -> list[list[list[int]]]:
    """Each prompt's answers, one per temperature, all in one engine run (each prompt prefilled once)."""
    from ..engine import Engine, Sequence

    engine = Engine(model, max_batch=len(prompts) * len(cfg.temps) + 1,
                    max_len=min(max(map(len, prompts)) + cfg.max_new + 1, model.max_len))
    rows = []
    for p, ss in zip(prompts, seeds, strict=True):
        prefix = engine.prefill_prefix(p)
        rows.append([engine.add(Sequence(list(p), _params(t, cfg.answer_top_p, s), cfg.max_new, eog=eog), prefix)
                     for t, s in zip(cfg.temps, ss, strict=True)])
        engine.release_prefix(prefix)
    engine.run([s for r in rows for s in r])
    return [[s.out for s in r] for r in rows]


def meta_path(out: str | Path) -> Path:
    return Path(out).with_suffix(".meta.json")


def _complete_lines(path: Path) -> list[bytes]:
    """The newline-terminated lines of a file (a truncated last line is left out)."""
    if not path.exists():
        return []
    return path.read_bytes().split(b"\n")[:-1]


LOW_YIELD_AFTER = 64  # Magpie candidates tried before make-data judges the yield
LOW_YIELD = 0.05  # kept share below which it says so


def low_yield_warning(counts: dict[str, int], candidates: int, kept: int) -> str | None:
    """One line when Magpie prompting is not working for this model (under LOW_YIELD of LOW_YIELD_AFTER or more
    candidates kept), naming the filter that drops most and what to do; else None. Gemma-3-270M, for one, rarely
    ends its own user turn: 3 of 208 candidates kept (README, "12-07, sixth")."""
    if candidates < LOW_YIELD_AFTER or kept >= LOW_YIELD * candidates:
        return None
    why, n = max(counts.items(), key=lambda kv: kv[1], default=("", 0))
    hint = ("the model rarely ends its own user turn: try a larger --prompt-max, " if why == "unfinished" else "")
    return (f"warning: only {kept} of {candidates} Magpie candidates kept so far ({n} dropped as {why!r}); "
            f"{hint}or give prompts with --seed-prompts FILE --n-prompts 0 (the model answers them itself)")


def make_data(target, out: str | Path, cfg: DataConfig) -> dict:
    """Write (or continue) the data file `out`; returns the run's summary (counts, answers, tokens, seconds)."""
    from ..engine import Engine
    from ..weights.heads import base_fingerprint

    cfg.validate()
    out, mpath = Path(out), meta_path(out)
    tok, model = target.tokenizer, target.model
    eog = frozenset(tok.eog_ids)
    prefix_ids = prefix_tokens(tok)
    filters = Filters(cfg.filters, spec_bench_turns(cfg.spec_bench))
    seeds_all = seed_prompts(cfg.seed_prompts)
    seeds = [p for p in seeds_all if not filters.is_eval(p)]
    run = {"format": FORMAT, "settings": cfg.settings(), "base": base_fingerprint(target)}

    # resume: the meta file is the state after its last line; lines past it are redone (identically)
    lines = _complete_lines(out)
    state = {"lines": 0, "next_candidate": 0, "counts": dict(filters.counts)}
    if mpath.exists():
        meta = json.loads(mpath.read_text())
        if {k: meta.get(k) for k in run} != run:
            raise ValueError(f"{out} was made with other settings or another model (see {mpath}): remove both "
                             "files or write to another -o")
        state = meta["progress"]
    elif lines:
        raise ValueError(f"{out} exists without {mpath.name}: remove it or write to another -o")
    if len(lines) < state["lines"]:
        raise ValueError(f"{out} has {len(lines)} complete lines but {mpath.name} says {state['lines']}: remove "
                         "both files")
    lines = lines[:state["lines"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab") as f:
        f.truncate(sum(len(x) + 1 for x in lines))
    rows = []
    for n, x in enumerate(lines):
        try:
            rows.append(json.loads(x))
            filters.kept.add(rows[-1]["prompt"])
        except (ValueError, KeyError, TypeError) as e:  # named, not just "Unterminated string ..."
            raise ValueError(f"{out}:{n + 1} is not a make-data line ({type(e).__name__}: {str(e)[:80]}): remove "
                             f"the file and {mpath.name}, or write to another -o") from None
    filters.counts.update(state["counts"])
    j = state["next_candidate"]  # the next Magpie candidate
    n_magpie = sum(r["source"] == "magpie" for r in rows)
    stats = {"answers": 0, "tokens": 0, "seed_spec_bench": len(seeds_all) - len(seeds)}
    t0 = time.perf_counter()

    def save(next_candidate: int, counts: dict) -> None:
        _atomic_write(mpath, json.dumps({**run, "n_prompts": cfg.n_prompts, "seed_prompts_kept": len(seeds),
                                         "progress": {"lines": len(rows), "next_candidate": next_candidate,
                                                      "counts": counts}}, indent=1))

    def write(f, bar, items: list[tuple[str, str, int, dict]]) -> None:
        """Answer prompts (source, text, and the state after it: next candidate, filter counts) and append their
        lines, len(cfg.temps) answers per prompt, about cfg.batch answers per engine run."""
        per_run = max(1, cfg.batch // len(cfg.temps))
        for at in range(0, len(items), per_run):
            group = items[at:at + per_run]
            ids = [tok.encode_chat([{"role": "user", "content": text}]) for _, text, _, _ in group]
            aseeds = [[derive_seed(cfg.seed, 1, len(rows) + i, k) for k in range(len(cfg.temps))]
                      for i in range(len(group))]
            for (source, text, next_candidate, counts), p, ss, outs in zip(
                    group, ids, aseeds, answer(model, ids, cfg, aseeds, eog), strict=True):
                answers = [{"temperature": t, "seed": s, "tokens": a,
                            "text": tok.decode(a[:-1] if a and a[-1] in eog else a, skip_special_tokens=True)}
                           for t, s, a in zip(cfg.temps, ss, outs, strict=True)]
                row = {"id": len(rows), "source": source, "prompt": text, "prompt_tokens": p, "answers": answers}
                f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
                f.flush()
                rows.append(row)
                save(next_candidate, counts)
                stats["answers"] += len(outs)
                stats["tokens"] += sum(map(len, outs))
                bar.update(1)

    total = len(seeds) + cfg.n_prompts
    with open(out, "ab") as f, _bar(total, "make-data", min(len(rows), total)) as bar:
        todo = [("seed", p, j, dict(filters.counts)) for p in seeds[len(rows):]]  # lines 0 .. len(seeds) - 1
        write(f, bar, todo)
        for _, p, _, _ in todo:
            filters.kept.add(p)  # a Magpie prompt may not duplicate a seed prompt either
        limit = cfg.max_tries * cfg.n_prompts
        if n_magpie < cfg.n_prompts and j < limit:
            engine = Engine(model, max_batch=cfg.batch + 1, max_len=len(prefix_ids) + cfg.prompt_max + 1)
            prefix = engine.prefill_prefix(prefix_ids)  # prefilled once, copied into every candidate's slot
            j0, kept0, warned = j, n_magpie, False  # this run's yield (a resumed run judges its own candidates)
            while n_magpie < cfg.n_prompts and j < limit:
                js = list(range(j, min(j + cfg.batch, limit)))
                cands = sample_prompts(engine, prefix, [derive_seed(cfg.seed, 0, x) for x in js], cfg, eog)
                stats["tokens"] += sum(len(c) for c, _ in cands)
                kept = []
                for x, (ids, finished) in zip(js, cands, strict=True):
                    j = x + 1
                    text = tok.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
                    if filters.check(text, finished):
                        kept.append(("magpie", text, j, dict(filters.counts)))
                        n_magpie += 1
                        if n_magpie == cfg.n_prompts:
                            break
                write(f, bar, kept)
                save(j, dict(filters.counts))
                bar.set_postfix(candidates=j, kept=n_magpie)
                if not warned and (note := low_yield_warning(filters.counts, j - j0, n_magpie - kept0)):
                    bar.write(note, file=sys.stderr)
                    warned = True
            engine.release_prefix(prefix)
    save(j, dict(filters.counts))
    return {"lines": len(rows), "seed": len(seeds), "magpie": n_magpie, "candidates": j, "wanted": cfg.n_prompts,
            "dropped": dict(filters.counts), **stats, "seconds": time.perf_counter() - t0}


def read_data(path: str | Path, base: dict | None = None) -> list[list[int]]:
    """The training sequences of a make-data file: prompt_tokens + answer tokens, one per answer (a truncated last
    line, from an interrupted run, is skipped). With `base` (weights.heads.base_fingerprint of the model to train
    for), data its meta file says another model made, or token ids past that model's vocabulary, is refused: heads
    must learn their own model's answers."""
    path = Path(path)
    redo = "write training data with `specdec make-data -m MODEL -o FILE`"
    mpath = meta_path(path)
    if base is not None and mpath.exists():
        try:
            made_by = json.loads(mpath.read_text()).get("base", {})
        except (ValueError, AttributeError):
            raise ValueError(f"{mpath} is not a make-data meta file: remove it (the data is then checked by its token "
                             "ids only) or make the data again") from None
        if made_by.get("sha256") != base["sha256"]:
            raise ValueError(f"{path} holds answers of another model ({made_by.get('file', '?')}, see {mpath.name}), "
                             f"not of {base['file']}: {redo}")
    seqs = []
    for i, line in enumerate(_complete_lines(path)):
        try:
            row = json.loads(line)
            prompt = row["prompt_tokens"]
            got = [prompt + a["tokens"] for a in row["answers"]]
            if not all(isinstance(t, int) for s in got for t in s):
                raise ValueError("token ids must be integers")
        except (ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}: line {i + 1} is not a make-data line ({why}); {redo}") from None
        seqs += got
    if not seqs:
        raise ValueError(f"{path} holds no complete make-data line: {redo}")
    if base is not None:
        ids = [t for s in seqs for t in (min(s), max(s)) if s]
        if ids and (max(ids) >= base["vocab_size"] or min(ids) < 0):
            raise ValueError(f"{path} holds token ids outside {base['file']}'s vocabulary of {base['vocab_size']} "
                             f"(data of another model?): {redo}")
    return seqs
