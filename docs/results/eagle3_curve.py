"""Issue 16's learning curve: greedy acceptance by draft position of EAGLE-3 heads trained on more and more data,
on held-out Spec-Bench prompts (mt_bench first turns and summarization; evaluation only, never trained on).

The target's own greedy answers to the prompts are the reference. Drafting a chain greedily, draft position k is
accepted iff positions 0..k-1 were and the head's argmax equals the target's next greedy token; as long as
everything before was accepted, the head's inputs are exactly the target's tokens and aux features, so the head
unrolled by training-time test (train/eagle3.TrainEagle3.unroll, teacher-forced on the greedy answer) gives each
position's outcome without running the verifier. Only answer positions count (not the prompt).

    python docs/results/eagle3_curve.py --heads A.safetensors B.safetensors ... --json docs/results/eagle3-curve.json
        --png docs/results/eagle3-curve.png
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch


def reference(target, prompts, n: int, cache: Path) -> list[dict]:
    """Greedy answers and the trunk's features (aux inputs + final hidden) for each prompt, cached."""
    from specdec.generate import generate
    from specdec.models.eagle3 import default_aux_layers
    from specdec.sampling import SamplingParams

    if cache.exists():
        return torch.load(cache)
    tok, model = target.tokenizer, target.model
    out = []
    for i, p in enumerate(prompts):
        ids = tok.encode_chat([{"role": "user", "content": p.text}])
        ans = generate(model, tok, ids, SamplingParams(temperature=0.0), max_tokens=n).tokens
        seq = ids + ans
        model.aux_layers = default_aux_layers(model.args.n_layers)
        _, h = model.prefill(seq, model.new_cache(len(seq) + 1))
        model.aux_layers = ()
        out.append({"category": p.category, "tokens": seq, "prompt_len": len(ids), "hidden": h.to(torch.bfloat16)})
        print(f"reference {i + 1}/{len(prompts)} ({p.category}): {len(ans)} tokens", file=sys.stderr)
    torch.save(out, cache)
    return out


def head_net(path: str, target):
    """The trainable twin of a heads file (float32), its draft vocabulary, training tokens."""
    from safetensors.torch import load_file

    from specdec.models.eagle3 import draft_args
    from specdec.train.eagle3 import TrainEagle3
    from specdec.weights.heads import read_header

    header = read_header(path)
    t = load_file(path)
    ids = t.pop("d2t")
    net = TrainEagle3(draft_args(target.model.args), header["ffn_dim"], len(header["aux_layers"]))
    net.load(t)
    return net, ids, header["train"].get("tokens", 0)


def acceptance(net, ids, refs, target, steps: int) -> dict:
    from specdec.models.transformer import Rope, rope_inv_freq

    a = target.model.args
    E = target.model.embed.rows(torch.arange(a.vocab_size)).float()
    head = E[ids]
    maxlen = max(len(r["tokens"]) for r in refs) + steps + 1
    rope = Rope(rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), maxlen, torch.float32, "cpu")
    d = 3 * a.dim
    per_cat: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for r in refs:
            toks = torch.tensor(r["tokens"])
            outs = net.unroll(r["hidden"].float()[:, :d], toks, E, rope.cos, rope.sin, steps)
            ok = None
            rows = []
            lo = r["prompt_len"] - 1  # index p drafts t_{p+2+k}: the first draft, after answer token t_P, is p = P-1
            for k, o in enumerate(outs):
                n = o.shape[0]
                pred = ids[(o @ head.T).argmax(-1)]
                hit = pred[:n - 1] == toks[2 + k:2 + k + n - 1]
                ok = hit if ok is None else ok[:hit.shape[0]] & hit
                rows.append(ok[max(lo, 0):].tolist())
            per_cat.setdefault(r["category"], []).append(rows)
    res = {}
    for cat, seqs in list(per_cat.items()) + [("all", [s for v in per_cat.values() for s in v])]:
        cum = []
        for k in range(steps):
            vals = [x for s in seqs if k < len(s) for x in s[k][:len(s[-1])]]
            cum.append(sum(vals) / max(len(vals), 1))
        res[cat] = {"cumulative": [round(c, 4) for c in cum],
                    "conditional": [round(c / p, 4) if p else 0.0 for c, p in zip(cum, [1.0] + cum[:-1],
                                                                                  strict=True)],
                    "accepted_per_step": round(sum(cum), 4), "tau": round(1 + sum(cum), 4)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("-m", "--model", default=None, help="the heads' target (default: the embedded SmolLM2; aliases as "
                                                        "in specdec)")
    ap.add_argument("--limit", type=int, default=20, help="prompts per category (default 20)")
    ap.add_argument("-n", type=int, default=128, help="greedy answer tokens (default 128)")
    ap.add_argument("--steps", type=int, default=4, help="draft positions evaluated (default 4)")
    ap.add_argument("--cache", default=None, help="the reference answers and features, reused when present "
                                                  "(default /tmp/eagle3-curve-ref-MODEL.pt)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --json for heads files not evaluated now (their files may be gone)")
    a = ap.parse_args()
    from specdec.bench.prompts import load_prompts
    from specdec.config import ModelError
    from specdec.loader import load
    from specdec.paths import resolve_model_path

    try:
        target = load(resolve_model_path(a.model), ctx=2048)
    except ModelError as e:
        print(f"eagle3_curve: {e}", file=sys.stderr)
        return 1
    root = Path(__file__).resolve().parents[2].parent
    prompts = load_prompts(root / "shared/data/spec_bench/question.jsonl", "mt_bench,summarization", a.limit)
    cache = Path(a.cache or f"/tmp/eagle3-curve-ref-{Path(target.path).stem}.pt")
    refs = reference(target, prompts, a.n, cache)
    rows = []
    if a.append and a.json and Path(a.json).exists():
        named = {Path(p).name for p in a.heads}
        rows = [r for r in json.loads(Path(a.json).read_text())["rows"] if r["heads"] not in named]
    for path in a.heads:
        net, ids, tokens = head_net(path, target)
        res = acceptance(net, ids, refs, target, a.steps)
        rows.append({"heads": Path(path).name, "train_tokens": tokens, "measured": date.today().isoformat(), **res})
        print(f"{Path(path).name:40s} {tokens:>9,} tokens  " + "  ".join(
            f"{c}: first {v['cumulative'][0]:.3f} tau {v['tau']:.2f}" for c, v in res.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"prompts_per_category": a.limit, "answer_tokens": a.n, "rows": rows},
                                           indent=1))
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows.sort(key=lambda r: r["train_tokens"])
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for cat in ("mt_bench", "summarization", "all"):
            x = [r["train_tokens"] for r in rows]
            ax[0].plot(x, [r[cat]["cumulative"][0] for r in rows], "o-", label=cat)
            ax[1].plot(x, [r[cat]["tau"] for r in rows], "o-", label=cat)
        for axis, title in zip(ax, ("first-position acceptance", "tokens per verify (tau), greedy chain"),
                               strict=True):
            axis.set_xscale("log")
            axis.set_xlabel("training tokens")
            axis.set_title(title)
            axis.grid(alpha=0.3)
            axis.legend()
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
