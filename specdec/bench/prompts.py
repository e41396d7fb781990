"""Benchmark prompts: Spec-Bench's question.jsonl, a plain {"prompt": ...} JSONL, or a small built-in set."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Spec-Bench folds MT-bench's eight categories into one task
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}

BUILTIN = [
    ("chat", "Explain the difference between a list and a tuple in Python, with an example of each."),
    ("chat", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("summarization", "Summarize the following text in two sentences.\n\nThe printing press, invented by Johannes "
     "Gutenberg around 1440, allowed books to be produced quickly and cheaply. Before it, books were copied by "
     "hand, which made them rare and expensive. The press spread literacy across Europe, helped the Reformation "
     "and the Scientific Revolution, and changed how knowledge was shared. Within fifty years, printing presses "
     "operated in over two hundred cities, and millions of books had been printed."),
    ("code", "Rewrite this function with a docstring and type hints:\n\ndef area(w, h):\n    return w * h\n"),
]


@dataclass
class Prompt:
    category: str
    text: str
    id: str


def load_prompts(path: str | Path | None, categories: str | None = None, limit: int | None = None) -> list[Prompt]:
    """Prompts grouped by category, at most `limit` per category (evenly spaced over the category, file order
    kept). Spec-Bench rows use their first turn."""
    if path is None:
        rows = [Prompt(c, t, f"builtin-{i}") for i, (c, t) in enumerate(BUILTIN)]
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"prompt file not found: {p}")
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n + 1} is not JSON ({e.msg}): one JSON object per line expected") from e
            if not isinstance(d, dict) or not ("turns" in d or "prompt" in d):
                raise ValueError(f"{p}:{n + 1} has neither 'turns' (Spec-Bench) nor 'prompt'")
            turns = d.get("turns")
            text = (turns[0] if isinstance(turns, list) and turns else None) if "turns" in d else d["prompt"]
            if not isinstance(text, str) or not text:
                what = "'turns' must be a list whose first item is" if "turns" in d else "'prompt' must be"
                raise ValueError(f"{p}:{n + 1}: {what} a non-empty string")
            cat = d.get("category", "default")
            rows.append(Prompt("mt_bench" if "turns" in d and cat in MT_BENCH else cat, text,
                               str(d.get("question_id" if "turns" in d else "id", n))))
        if not rows:
            raise ValueError(f"no prompts in {p}: one JSON object per line, with 'prompt' or 'turns'")
    if categories:
        wanted = {c.strip() for c in categories.split(",") if c.strip()}
        known = {r.category for r in rows}
        if wanted - known:  # one unknown name among known ones used to be dropped without a word
            sub = " (MT-bench's sub-tasks are all under mt_bench)" if wanted & MT_BENCH else ""
            raise ValueError(f"no prompts of category {', '.join(sorted(wanted - known))}: the file has "
                             f"{', '.join(sorted(known))}{sub}")
        rows = [r for r in rows if r.category in wanted]
    if limit is not None:  # evenly spaced within each category, so mt_bench's limit covers its eight sub-tasks
        by_cat: dict[str, list[Prompt]] = {}
        for r in rows:
            by_cat.setdefault(r.category, []).append(r)
        keep = {id(group[i * len(group) // n]) for group in by_cat.values()
                for n in [min(limit, len(group))] for i in range(n)}
        rows = [r for r in rows if id(r) in keep]
    return rows
