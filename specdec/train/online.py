"""Online self-distillation of EAGLE-3 heads on one accelerator: issue 16's lever (data volume) at GPU speed.

On a GPU the trunk answers a thousand prompts at once, so the training data need not be stored: each round

1. samples Magpie prompts (Xu et al. 2024; train/data: the chat template's user-turn prefix, the same filters, never
   a Spec-Bench turn; the self-instruct seed tasks in the first round),
2. samples the trunk's own answers to them, one per temperature (0 = greedy),
3. takes the trunk's features on those sequences (the inputs of the aux layers and the final normed hidden state,
   by forward hooks), and
4. trains the EAGLE-3 head on them (train/eagle3: training-time test, KL to the target over the draft vocabulary),
   right-padded batches, each sequence once (a stream, not epochs).

The trunk runs in transformers (a Llama model built from specdec's dequantized reading of the file, bf16); its
features match specdec's own forward to cosine >= 0.996, with the same next-token argmax, on SmolLM2
(docs/results/eagle3-online.md). The draft vocabulary is counted on the first rounds' tokens. Heads written at given
token counts give the learning curve in one run; `pack` turns one into a heads file bound to its model (run where
specdec loads the model):

    python -m specdec.train.online train MODEL.gguf --device cuda --minutes 8 -o DIR
    python -m specdec.train.online pack DIR/heads-final.safetensors -m MODEL.gguf -o heads.safetensors
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import multiprocessing as mp
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from ..config import ModelError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def load_trunk(path: Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The trunk as a transformers Llama model (in `dtype`) built from specdec's own reading of the file (dequantized
    tensor by tensor, q/k already in rotate-half order), specdec's tokenizer, and the reading itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..tokenizer import load_tokenizer
    from ..weights import read_model

    lm = read_model(path)
    a = lm.args
    if a.family != "llama" or a.qkv_bias or a.qk_norm or a.rope_scaling:
        raise ModelError(f"online training supports plain Llama trunks (no biases, q/k norms or RoPE scaling), not "
                         f"{a.arch}")
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_dim,
                      num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                      head_dim=a.head_dim, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                      max_position_embeddings=a.max_seq_len, tie_word_embeddings=a.tie_embeddings)
    hf = LlamaForCausalLM(cfg)
    state = {"model.embed_tokens.weight": lm.weights["token_embd"], "model.norm.weight": lm.weights["output_norm"]}
    if not a.tie_embeddings:
        state["lm_head.weight"] = lm.weights["output"]
    for i in range(a.n_layers):
        state.update({f"model.layers.{i}.{hn}.weight": lm.weights[f"blk.{i}.{n}"] for n, hn in HF_NAMES.items()})
    state = {k: v.to(dtype) for k, v in state.items()}
    if a.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf.to(device, dtype).eval(), load_tokenizer(path), lm


@torch.no_grad()
def sample(hf, rows: list[list[int]], temperature: float, top_p: float, max_new: int, eog: list[int],
           batch: int) -> list[tuple[list[int], bool]]:
    """Continuations of each row (left-padded batches, by length) -> (tokens through the first end-of-generation
    token, ended there)."""
    dev = hf.device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list[tuple[list[int], bool]] = [([], False)] * len(rows)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        T = max(len(rows[i]) for i in idx)
        ids = torch.full((len(idx), T), eog[0], dtype=torch.long)
        mask = torch.zeros((len(idx), T), dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, T - len(rows[i]):] = torch.tensor(rows[i])
            mask[j, T - len(rows[i]):] = 1
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
            dict(do_sample=False)
        gen = hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                          eos_token_id=eog, pad_token_id=eog[0], **kw)[:, T:].tolist()
        for j, i in enumerate(idx):
            g = gen[j]
            end = next((k for k, t in enumerate(g) if t in eog), None)
            out[i] = (g[:end + 1], True) if end is not None else (g, False)
    return out


_FILTERS = None


def _init_filters(spec_bench: str | None) -> None:
    global _FILTERS
    from .data import FilterConfig, Filters, spec_bench_turns

    _FILTERS = Filters(FilterConfig(), spec_bench_turns(spec_bench))


def _filter(cands: list[tuple[str, bool]]) -> tuple[list[str], dict[str, int]]:
    """In the filter process (its Filters remember every kept prompt, for dedup): the candidates kept, the counts."""
    return [t for t, fin in cands if _FILTERS.check(t, fin)], dict(_FILTERS.counts)


class Features:
    """The trunk's EAGLE-3 features of right-padded sequences: [inputs of the aux layers; final normed hidden]."""

    def __init__(self, hf, aux: tuple[int, ...]):
        self.hf, self.caps = hf, {}
        for i in aux:  # layer n_layers: the trunk's output before its norm (tiny models)
            mod = hf.model.layers[i] if i < len(hf.model.layers) else hf.model.norm
            mod.register_forward_pre_hook(self._hook(i), with_kwargs=True)
        self.aux = aux

    def _hook(self, i: int):
        def f(_mod, args, kwargs):
            self.caps[i] = args[0] if args else kwargs["hidden_states"]
        return f

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hf.model(input_ids=tokens).last_hidden_state
        return torch.cat([self.caps[i] for i in self.aux], dim=-1).float(), h.float()


def batches(seqs: list[list[int]], tokens: int, rng: random.Random) -> list[list[list[int]]]:
    """Shuffled batches of about `tokens` padded tokens, sequences of similar length together."""
    seqs = sorted(seqs, key=len)
    out, cur = [], []
    for s in seqs:
        if cur and (len(cur) + 1) * len(s) > tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def train(a: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from ..models.eagle3 import default_aux_layers, draft_args
    from ..models.transformer import make_rope
    from .data import FilterConfig, Filters, prefix_tokens, seed_prompts, spec_bench_turns
    from .eagle3 import TrainEagle3, eagle3_loss
    from .mtp import draft_vocab, last_layer

    t0 = time.time()
    deadline = t0 + a.minutes * 60
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf, tok, lm = load_trunk(Path(a.model), dev)
    # the filters in a process of their own (spawned, not forked from a process holding the device), one round
    # behind the device
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_init_filters,
                               initargs=(a.spec_bench,))
    args = lm.args
    aux = default_aux_layers(args.n_layers)
    feats = Features(hf, aux)
    eog = sorted(tok.eog_ids)
    prefix = prefix_tokens(tok)
    evals = Filters(FilterConfig(), spec_bench_turns(a.spec_bench))
    seeds = [p for p in seed_prompts(a.seed_prompts) if not evals.is_eval(p)] if a.seed_prompts else []
    E = hf.model.embed_tokens.weight.detach().float()  # [V, dim]: tied, so also the target's head
    # a Llama trunk's output norm is applied as stored
    net = TrainEagle3(draft_args(args), a.ffn, len(aux), last_layer(lm, lm.weights["output_norm"])).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.0)
    rope = make_rope(draft_args(args), 4096, torch.float32, dev)
    _log(f"loaded in {time.time() - t0:.1f} s; eog {eog}; {len(seeds)} seed prompts; aux layers {aux}")

    ids = head = None
    pending: list[list[int]] = []  # sequences made before the draft vocabulary is known
    kept_prompts: list[str] = []
    log: dict = {"config": vars(a), "rounds": [], "checkpoints": []}
    marks = sorted(float(x) for x in a.checkpoints.split(",")) if a.checkpoints else []
    trained = steps = 0
    t_train = None
    round_s = 0.0
    r = 0

    def save(name: str) -> None:
        tensors = {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in net.export().items()}
        tensors["d2t"] = ids.cpu().to(torch.int64)
        meta = {"tokens": trained, "steps": steps, "rounds": r, "seed": a.seed, "ffn_dim": a.ffn,
                "aux_layers": list(aux), "elapsed_s": round(time.time() - t0, 1)}
        save_file(tensors, out / f"{name}.safetensors", metadata={"specdec_online": json.dumps(meta)})
        log["checkpoints"].append({"file": f"{name}.safetensors", **meta})
        _log(f"saved {name}: {trained:,} tokens, {steps} steps")

    todo = list(seeds)  # prompts to answer this round: the seeds, then the previous round's kept Magpie prompts
    while time.time() + 1.3 * round_s < deadline - a.reserve and (not a.rounds or r < a.rounds):
        tr = time.time()
        cand = sample(hf, [prefix] * a.prompt_batch, a.prompt_temp, 0.99, a.prompt_max, eog, a.gen_batch)
        texts = [tok.decode(c[:-1] if fin else c, skip_special_tokens=True).strip() for c, fin in cand]
        pending_filter = pool.submit(_filter, list(zip(texts, (fin for _, fin in cand), strict=True)))
        chats = [tok.encode_chat([{"role": "user", "content": p}]) for p in todo]
        seqs = []
        for temp in a.temps if chats else ():
            if time.time() > deadline - a.reserve:  # a long round stops at the deadline: the answers so far count
                break
            seqs += [c + ans for c, (ans, _) in zip(chats, sample(hf, chats, temp, 0.95, a.max_new, eog,
                                                                  a.gen_batch), strict=True)]
        tf = time.time()
        todo, filter_counts = pending_filter.result()  # filtered while the answers were generated
        kept_prompts += todo
        t_wait = time.time() - tf
        t_gen = time.time() - tr
        made = sum(map(len, seqs))
        if ids is None:
            pending += seqs
            if sum(map(len, pending)) >= a.vocab_tokens or time.time() + 2 * round_s > deadline - a.reserve:
                ids = draft_vocab(pending, a.vocab, args.vocab_size, set(eog)).to(dev)
                head = E[ids]
                seqs, pending = pending, []
                t_train = time.time()
                _log(f"draft vocabulary: {len(ids)} tokens from {sum(map(len, seqs)):,} generated tokens")
            else:
                seqs = []
        stats = {"round": r, "kept_prompts": len(kept_prompts), "made_tokens": made, "gen_s": round(t_gen, 1),
                 "filter_wait_s": round(t_wait, 1)}
        tl = time.time()
        kl_sum = [0.0] * a.depth
        hit = [0] * a.depth
        cnt = [0] * a.depth
        for b in batches(seqs, a.batch_tokens, rng):
            if time.time() > deadline - a.reserve:
                break
            T = max(map(len, b))
            x = torch.full((len(b), T), eog[0], dtype=torch.long)
            for j, s in enumerate(b):
                x[j, :len(s)] = torch.tensor(s)
            x = x.to(dev)
            lengths = torch.tensor([len(s) for s in b], device=dev)
            A, h = feats(x)
            frac = min(1.0, (time.time() - t_train) / max(deadline - a.reserve - t_train, 1.0))
            for g in opt.param_groups:
                g["lr"] = a.lr * min(1.0, (steps + 1) / a.warmup) * max(0.5 * (1 + math.cos(math.pi * frac)), 0.02)
            losses, acc = eagle3_loss(net, A, h, x, E, head, rope, a.depth, a.decay, lengths)
            opt.zero_grad(set_to_none=True)
            sum(losses).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            steps += 1
            for d, (lo, (hh, cc)) in enumerate(zip(losses, acc, strict=False)):
                kl_sum[d] += lo.item() / a.decay ** d * cc
                hit[d] += hh
                cnt[d] += cc
            trained += int(lengths.sum())
            while marks and trained >= marks[0]:
                save(f"heads-{int(marks.pop(0)):d}")
        if cnt[0]:
            stats.update(train_s=round(time.time() - tl, 1), trained_tokens=trained, steps=steps,
                         kl=[round(k / max(c, 1), 4) for k, c in zip(kl_sum, cnt, strict=True)],
                         top1=[round(k / max(c, 1), 4) for k, c in zip(hit, cnt, strict=True)])
        stats["filters"] = filter_counts
        log["rounds"].append(stats)
        (out / "online-log.json").write_text(json.dumps(log, indent=1))
        round_s = time.time() - tr
        _log(f"round {r}: {json.dumps(stats)} ({time.time() - t0:.0f} s)")
        r += 1
    pool.shutdown(cancel_futures=True)
    if ids is not None:
        save("heads-final")
    with gzip.open(out / "magpie-prompts.jsonl.gz", "wt", encoding="utf-8") as f:
        for p in kept_prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    (out / "online-log.json").write_text(json.dumps(log, indent=1))
    _log(f"done in {time.time() - t0:.0f} s: {trained:,} tokens trained, {len(kept_prompts)} Magpie prompts")
    return 0


def pack(a: argparse.Namespace) -> int:
    """An online checkpoint -> a specdec heads file bound to its model (weights/heads.save_heads)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ..loader import load
    from ..weights.heads import base_fingerprint, save_heads

    with safe_open(a.checkpoint, "pt") as f:
        meta = json.loads((f.metadata() or {}).get("specdec_online", "null") or "null")
    if meta is None:
        raise ValueError(f"{a.checkpoint} is not an online-training checkpoint (no specdec_online metadata)")
    target = load(a.model, ctx=2048)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(a.checkpoint).items()}
    summary = {"kind": "eagle3", "depth": a.depth, "tokens": meta["tokens"], "steps": meta["steps"],
               "seed": meta["seed"], "online": meta, "log": a.log and json.loads(Path(a.log).read_text())}
    save_heads(a.out, tensors, kind="eagle3", depth=1, base=base_fingerprint(target),
               args=target.model.args, ffn_dim=meta["ffn_dim"], train=summary,
               aux_layers=meta["aux_layers"])
    Path(a.out).with_suffix(".log.json").write_text(json.dumps(summary, indent=1))
    _log(f"wrote {a.out} ({meta['tokens']:,} training tokens)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .data import SEED_TASKS, SPEC_BENCH

    ap = argparse.ArgumentParser(prog="python -m specdec.train.online", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="generate and train on one device until --minutes")
    t.add_argument("model")
    t.add_argument("-o", "--out", required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget, loading included")
    t.add_argument("--reserve", type=float, default=20.0, help="seconds kept for the final writes")
    t.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: when --minutes run out)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--seed-prompts", default=str(SEED_TASKS))
    t.add_argument("--spec-bench", default=str(SPEC_BENCH), help="turns never used as prompts (filter)")
    t.add_argument("--prompt-batch", type=int, default=1024, help="Magpie candidates per round")
    t.add_argument("--prompt-temp", type=float, default=1.0)
    t.add_argument("--prompt-max", type=int, default=96)
    t.add_argument("--temps", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.5, 0.8, 1.0])
    t.add_argument("--max-new", type=int, default=256)
    t.add_argument("--gen-batch", type=int, default=1024, help="rows per generate() call")
    t.add_argument("--vocab", type=int, default=8192)
    t.add_argument("--vocab-tokens", type=float, default=1e6, help="generated tokens counted for the vocabulary")
    t.add_argument("--ffn", type=int, default=1536)
    t.add_argument("--depth", type=int, default=3, help="training-time-test steps")
    t.add_argument("--decay", type=float, default=1.0)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per optimizer step")
    t.add_argument("--checkpoints", default="1e6,3e6,1e7,3e7", help="token counts at which heads are written")
    p = sub.add_parser("pack", help="an online checkpoint -> a specdec heads file")
    p.add_argument("checkpoint")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--log", default=None, help="the run's online-log.json, kept in the heads' summary")
    p.add_argument("--depth", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "train" and a.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {a.device}: this machine's PyTorch sees no CUDA device (use --device cpu, "
                             "slowly, or run it where a GPU is)")
        return train(a) if a.cmd == "train" else pack(a)
    except (ModelError, ValueError, OSError) as e:  # a one-line error, as the specdec command gives
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
