"""`specdec train-mtp`: self-distilled MTP heads for any model (Medusa-2, Cai et al. 2024; EAGLE, Li et al. 2024).

The target is frozen. It writes its own answers to training prompts (several samples each; never Spec-Bench), and the
heads learn to predict the target's own next-token distributions at the positions ahead of them (KL divergence to the
target's distribution, restricted to the draft vocabulary: the N tokens most frequent in the generated data, as
EAGLE-3's d2t and FR-Spec do). Stages, each cached in the work directory so an interrupted run resumes:

1. generate: the target's answers (seeded sampling), saved every few prompts;
2. hidden: one target forward per sequence, keeping the final hidden states the heads read;
3. train: AdamW over the sequences, a checkpoint (weights, optimizer, RNG) after every epoch;
4. export: safetensors in a native layout (DeepSeek-V3 MTP names for sequential modules, Medusa names for parallel
   heads) with a JSON header naming the base model's architecture and the SHA-256 of its weights file.

Sequential modules mirror models/mtp.MTPModule exactly (checked by a test): module d at position p reads h^{d-1}_p and
the embedding of t_{p+d}: x = eh_proj([enorm(emb); hnorm(h)]), one transformer block (causal over the sequence),
h^d = shared_head_norm(x), logits = h^d E_draft^T. Parallel heads: h_k = h + SiLU(W_k h + b_k), logits = h_k E_draft^T.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.eagle3 import default_aux_layers, draft_args
from ..models.transformer import apply_rope
from .eagle3 import TrainEagle3, eagle3_loss

FORMAT = "specdec-heads/1"


@dataclass
class TrainConfig:
    kind: str = "sequential"  # sequential | parallel | eagle3
    depth: int = 1  # sequential modules / parallel heads; eagle3: training-time-test steps
    samples: int = 2  # answers generated per training prompt
    max_new: int = 160  # tokens per answer
    temperature: float = 0.8
    epochs: int = 4
    lr: float = 1e-3
    seed: int = 0
    vocab: int = 8192  # draft vocabulary size; 0 = the whole vocabulary
    feature_weight: float = 1.0  # EAGLE's feature regression: a depth-d output should be the trunk's h_{p+d}
    weight_decay: float = 0.0
    noise: float = 0.0  # std of Gaussian noise on the input hidden states while training (EAGLE's augmentation)
    ffn_dim: int = 0  # FFN width of a sequential module's block; 0 = the trunk's
    prompts: str = ""
    data: str = ""  # a `specdec make-data` JSONL: train on its sequences instead of generating answers
    data_tokens: int = 0  # with data: a seeded random subset of about this many tokens (0 = all)
    limit: int = 0  # use only this many prompts (0 = all)
    decay: float = 1.0  # eagle3: loss weight decay^k of training-time-test step k (speculators' default 1)
    extra: dict = field(default_factory=dict)


def training_prompts(path: str | Path, limit: int = 0) -> list[str]:
    """Instruction prompts from self-instruct seed tasks (`instruction` + optional `instances[0].input`) or
    {"prompt": ...} lines."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "instruction" in d:
            inp = (d.get("instances") or [{}])[0].get("input", "")
            out.append(d["instruction"] + (f"\n\n{inp}" if inp else ""))
        elif "prompt" in d:
            out.append(d["prompt"])
        elif "turns" in d:
            raise ValueError(f"{path} looks like Spec-Bench (evaluation prompts): never train on it")
    return out[:limit] if limit else out


# ---------------------------------------------------------------------------------------------------------------
# trainable modules (float32, autograd)
# ---------------------------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * w if w is not None else x


class TrainSequential(nn.Module):
    """One sequential MTP module (DeepSeek-V3 layout) on a Llama-family trunk."""

    def __init__(self, args, ffn_dim: int, init: dict[str, torch.Tensor] | None = None):
        super().__init__()
        dim, H, Hkv, D = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        self.H, self.Hkv, self.D, self.eps, self.scale = H, Hkv, D, args.norm_eps, args.query_scale

        def p(*shape, std=0.02):
            return nn.Parameter(torch.randn(*shape) * std)

        ones = lambda n: nn.Parameter(torch.ones(n))  # noqa: E731
        self.enorm, self.hnorm, self.attn_norm, self.ffn_norm, self.shared_head_norm = (ones(dim) for _ in range(5))
        # eh_proj starts as "take the hidden state": the module begins as one extra trunk layer
        self.eh_proj = nn.Parameter(torch.cat([torch.randn(dim, dim) * 0.01, torch.eye(dim)], dim=1))
        self.wq, self.wk, self.wv = p(H * D, dim), p(Hkv * D, dim), p(Hkv * D, dim)
        self.wo = p(dim, H * D)
        self.w_gate, self.w_up, self.w_down = p(ffn_dim, dim), p(ffn_dim, dim), p(dim, ffn_dim)
        self.bq = nn.Parameter(torch.zeros(H * D)) if args.qkv_bias else None
        self.bk = nn.Parameter(torch.zeros(Hkv * D)) if args.qkv_bias else None
        self.bv = nn.Parameter(torch.zeros(Hkv * D)) if args.qkv_bias else None
        self.q_norm = ones(D) if args.qk_norm else None
        self.k_norm = ones(D) if args.qk_norm else None
        if init:  # the trunk's last layer (its FFN cut to ffn_dim) is a much better start than noise
            with torch.no_grad():
                for name, src in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm"), ("wq", "attn_q"),
                                  ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output")):
                    getattr(self, name).copy_(init[src])
                self.w_gate.copy_(init["ffn_gate"][:ffn_dim])
                self.w_up.copy_(init["ffn_up"][:ffn_dim])
                self.w_down.copy_(init["ffn_down"][:, :ffn_dim])

    def forward(self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [T, dim] previous hidden states, e [T, dim] next-token embeddings -> h^d [T, dim] (after the module's
        final norm; the head and the next depth read it)."""
        T = h.shape[0]
        x = torch.cat([_rms(e, self.enorm, self.eps), _rms(h, self.hnorm, self.eps)], dim=-1) @ self.eh_proj.T
        a = _rms(x, self.attn_norm, self.eps)
        q = F.linear(a, self.wq, self.bq).view(T, self.H, self.D)
        k = F.linear(a, self.wk, self.bk).view(T, self.Hkv, self.D)
        v = F.linear(a, self.wv, self.bv).view(T, self.Hkv, self.D)
        if self.q_norm is not None:
            q, k = _rms(q, self.q_norm, self.eps), _rms(k, self.k_norm, self.eps)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, D]: the same rotation for every head
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=self.scale, enable_gqa=self.H != self.Hkv)
        x = x + o[0].transpose(0, 1).reshape(T, -1) @ self.wo.T
        f = _rms(x, self.ffn_norm, self.eps)
        x = x + (F.silu(f @ self.w_gate.T) * (f @ self.w_up.T)) @ self.w_down.T
        return _rms(x, self.shared_head_norm, self.eps)

    def export(self, layer: int) -> dict[str, torch.Tensor]:
        """Tensors under Hugging Face DeepSeek-V3 MTP names (model.layers.{L+i}.*)."""
        pre = f"model.layers.{layer}."
        names = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
                 "shared_head_norm": "shared_head.norm.weight", "attn_norm": "input_layernorm.weight",
                 "ffn_norm": "post_attention_layernorm.weight", "wq": "self_attn.q_proj.weight",
                 "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
                 "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
                 "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
                 "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
        return {pre + hf: getattr(self, ours).detach().clone() for ours, hf in names.items()
                if getattr(self, ours) is not None}


class TrainParallel(nn.Module):
    """K Medusa heads: h_k = h + SiLU(W_k h + b_k); W starts at 0 so every head starts as the trunk's head."""

    def __init__(self, dim: int, k: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(k, dim, dim))
        self.b = nn.Parameter(torch.zeros(k, dim))

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        return [h + F.silu(h @ self.w[i].T + self.b[i]) for i in range(self.w.shape[0])]

    def export(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(self.w.shape[0]):
            out[f"medusa_head.{i}.0.linear.weight"] = self.w[i].detach().clone()
            out[f"medusa_head.{i}.0.linear.bias"] = self.b[i].detach().clone()
        return out


# ---------------------------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------------------------


def _bar(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, initial=initial, file=sys.stderr, dynamic_ncols=True)


def sample_answers(model, prompt: list[int], n: int, max_new: int, params, eog: set[int]) -> list[list[int]]:
    """n sampled answers to one prompt (sample j seeded with params.seed + j), decoded together by the batched
    engine (one forward per step serves all of them). Each stops at its first EOS, which it keeps."""
    from dataclasses import replace

    from ..engine import Engine, Sequence

    engine = Engine(model, max_batch=n + 1, max_len=len(prompt) + max_new + 1)
    base = params.seed if params.seed is not None else 0
    prefix = engine.prefill_prefix(list(prompt))  # the prompt once, copied into each sample's slot
    seqs = [engine.add(Sequence(list(prompt), replace(params, seed=base + j), max_new, eog=frozenset(eog)), prefix)
            for j in range(n)]
    engine.release_prefix(prefix)
    engine.run(seqs)
    return [s.out for s in seqs]


def generate_data(target, prompts: list[str], cfg: TrainConfig, work: Path) -> list[list[int]]:
    """Stage 1: the target's own answers (prompt tokens + answer tokens per sequence); resumes a partial run."""
    from ..sampling import SamplingParams

    path = work / "data.json"
    seqs: list[list[int]] = json.loads(path.read_text())["sequences"] if path.exists() else []
    total = len(prompts) * cfg.samples
    if len(seqs) >= total:
        return seqs[:total]
    tok = target.tokenizer
    with _bar(len(prompts), "generating answers", len(seqs) // cfg.samples) as bar:
        for i in range(len(seqs) // cfg.samples, len(prompts)):
            prompt = prompts[i]
            ids = tok.encode_chat([{"role": "user", "content": prompt}]) if tok.chat_template else tok.encode(prompt)
            params = SamplingParams(temperature=cfg.temperature, top_p=0.95, seed=cfg.seed * 100_003 + i)
            seqs += [ids + a for a in sample_answers(target.model, ids, cfg.samples, cfg.max_new, params,
                                                     tok.eog_ids)]
            bar.update(1)
            if (i + 1) % 10 == 0 or i + 1 == len(prompts):
                _atomic_write(path, json.dumps({"sequences": seqs}))
    return seqs


def token_subset(seqs: list[list[int]], tokens: int, seed: int) -> list[list[int]]:
    """A seeded random subset of the sequences holding about `tokens` tokens (all of them when 0), for learning
    curves: each size draws from the whole data, not from its first lines."""
    if not tokens:
        return seqs
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    out, n = [], 0
    for i in order:
        if n >= tokens:
            break
        out.append(seqs[i])
        n += len(seqs[i])
    return out


def hidden_states(target, seqs: list[list[int]], work: Path, aux: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Stage 2: the trunk's final hidden state at every position of every sequence (bf16, cached under a hash of
    the sequences); with `aux` (EAGLE-3), the inputs of those layers first, concatenated: [T, (len(aux) + 1) dim]."""

    key = hashlib.sha1(json.dumps(seqs).encode()).hexdigest()[:12]
    path = work / (f"hidden-{key}.pt" if not aux else f"hidden-aux{'-'.join(map(str, aux))}-{key}.pt")
    if path.exists():
        hs = torch.load(path)
        if len(hs) == len(seqs):
            return hs
    hs = []
    model = target.model
    model.aux_layers = aux
    try:
        with torch.inference_mode(), _bar(len(seqs), "target hidden states") as bar:
            for s in seqs:
                cache = model.new_cache(len(s) + 1)
                _, h = model.prefill(s, cache)
                hs.append(h.to(torch.bfloat16).clone())
                bar.update(1)
    finally:
        model.aux_layers = ()
    torch.save(hs, path)
    return hs


def draft_vocab(seqs: list[list[int]], n: int, vocab_size: int, keep: set[int]) -> torch.Tensor:
    """The n most frequent tokens of the generated data (plus `keep`, e.g. end-of-turn tokens), sorted by id."""
    if n <= 0 or n >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=vocab_size)
    for t in keep:
        counts[t] = counts.max() + 1
    return torch.sort(torch.topk(counts, n).indices).values


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def train_mtp(target, out: str | Path, cfg: TrainConfig, work: str | Path | None = None) -> dict:
    """Run every stage and write the heads file to `out`; returns the training summary."""
    from ..models.transformer import Rope, make_rope, rope_inv_freq
    from ..weights.heads import base_fingerprint, save_heads

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    args = target.model.args
    # an EAGLE-3 layer is a plain Llama layer whatever the trunk (models/eagle3.draft_args); parallel heads read only
    # the final hidden state; a sequential module is a trunk layer, which is trained here for dense GQA trunks only
    if cfg.kind == "sequential" and args.family != "llama":
        raise ValueError(f"train-mtp --kind sequential supports Llama-family trunks (llama, qwen2, qwen3), not "
                         f"{args.arch}: use --kind eagle3")
    if cfg.kind == "parallel" and args.family == "gemma3":
        raise ValueError("train-mtp --kind parallel does not support Gemma 3 trunks: use --kind eagle3")
    if not args.tie_embeddings and cfg.vocab:
        raise ValueError("a reduced draft vocabulary needs tied embeddings: use --vocab 0 for this model")
    fingerprint = base_fingerprint(target)
    t0 = time.perf_counter()
    seqs = None
    if cfg.data:  # answers made beforehand by `specdec make-data`, checked before the work directory is bound to them
        from .data import read_data

        seqs = token_subset(read_data(cfg.data, fingerprint), cfg.data_tokens, cfg.seed)
        seqs = seqs[:cfg.limit] if cfg.limit else seqs
    out = Path(out)
    work = Path(work) if work else out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    # the data stages depend on these settings only, so one work directory serves heads of every kind and size
    data_cfg = {k: getattr(cfg, k) for k in ("samples", "max_new", "temperature", "seed", "prompts", "limit", "data",
                                             "data_tokens")}
    meta_path = work / "data-config.json"
    run_cfg = {"data": data_cfg, "base": fingerprint}
    if meta_path.exists() and json.loads(meta_path.read_text()) != run_cfg:
        raise ValueError(f"{work} holds data for other settings or another model: remove it or pass --work DIR")
    _atomic_write(meta_path, json.dumps(run_cfg, indent=1))
    train_key = hashlib.sha1(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:10]
    if seqs is None:
        seqs = generate_data(target, training_prompts(cfg.prompts, cfg.limit), cfg, work)
    t_gen = time.perf_counter() - t0
    aux = default_aux_layers(args.n_layers) if cfg.kind == "eagle3" else ()
    hs = hidden_states(target, seqs, work, aux)
    ids = draft_vocab(seqs, cfg.vocab, args.vocab_size, set(target.tokenizer.eog_ids))
    E = target.model.embed.rows(torch.arange(args.vocab_size))  # [V, dim] the embedding table
    head = (E if args.tie_embeddings else output_rows(target))[ids]  # [V_draft, dim] the target's head: the teacher
    span = max(len(s) for s in seqs) + 1
    rope = (make_rope(draft_args(args), span, torch.float32, "cpu") if cfg.kind == "eagle3" else
            Rope(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), span, torch.float32, "cpu"))
    if cfg.kind == "sequential":
        init = _trunk_last_layer(target)
        ffn = cfg.ffn_dim or args.ffn_dim
        net = nn.ModuleList([TrainSequential(args, ffn, init) for _ in range(cfg.depth)])
    elif cfg.kind == "parallel":
        net = TrainParallel(args.dim, cfg.depth)
    elif cfg.kind == "eagle3":
        net = TrainEagle3(draft_args(args), cfg.ffn_dim or args.ffn_dim, len(aux), _trunk_last_layer(target))
    else:
        raise ValueError("--kind must be sequential, parallel or eagle3")
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * len(seqs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    ckpt = work / f"checkpoint-{cfg.kind}{cfg.depth}-{train_key}.pt"
    epoch, log = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        epoch, log = state["epoch"], state["log"]
        torch.set_rng_state(state["rng"])
    t_train = time.perf_counter()
    while epoch < cfg.epochs:
        order = torch.randperm(len(seqs)).tolist()
        totals = [0.0] * cfg.depth
        hits = [0] * cfg.depth
        count = [0] * cfg.depth
        with _bar(len(order), f"epoch {epoch + 1}/{cfg.epochs}") as bar:
            for i in order:
                s, h = seqs[i], hs[i].float()
                if cfg.kind == "eagle3":
                    d = len(aux) * args.dim
                    losses, acc = eagle3_loss(net, h[:, :d], h[:, d:], torch.tensor(s), E, head, rope, cfg.depth,
                                              cfg.decay)
                    losses += [torch.zeros((), requires_grad=True)] * (cfg.depth - len(losses))
                    acc += [(0, 0)] * (cfg.depth - len(acc))
                else:
                    losses, acc = _sequence_loss(net, cfg, s, h, E, head, rope, cfg.noise)
                loss = sum(losses)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                for d, (l_d, a_d) in enumerate(zip(losses, acc, strict=True)):
                    totals[d] += l_d.item() * a_d[1]
                    hits[d] += a_d[0]
                    count[d] += a_d[1]
                bar.update(1)
                bar.set_postfix(kl=f"{loss.item():.3f}", top1=f"{hits[0] / max(count[0], 1):.2f}")
        epoch += 1
        log.append({"epoch": epoch, "kl": [t / max(c, 1) for t, c in zip(totals, count, strict=True)],
                    "top1": [x / max(c, 1) for x, c in zip(hits, count, strict=True)]})
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch,
                    "log": log, "rng": torch.get_rng_state()}, ckpt)
        print(f"epoch {epoch}: KL {[round(x, 3) for x in log[-1]['kl']]} top-1 agreement with the target "
              f"{[round(x, 3) for x in log[-1]['top1']]}", file=sys.stderr)
    summary = {"kind": cfg.kind, "depth": cfg.depth, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
               "draft_vocab": len(ids), "epochs": cfg.epochs, "log": log, "seed": cfg.seed,
               "generate_s": round(t_gen, 1), "train_s": round(time.perf_counter() - t_train, 1),
               "total_s": round(time.perf_counter() - t0, 1), "config": asdict(cfg)}
    if cfg.kind == "sequential":
        tensors = {}
        for d, mod in enumerate(net):
            tensors.update(mod.export(args.n_layers + d))
    else:
        tensors = net.export()
    tensors["d2t"] = ids.to(torch.int64)
    save_heads(out, tensors, kind=cfg.kind, depth=1 if cfg.kind == "eagle3" else cfg.depth, base=fingerprint,
               args=args, ffn_dim=(cfg.ffn_dim or args.ffn_dim) if cfg.kind != "parallel" else 0, train=summary,
               aux_layers=list(aux))
    (out.with_suffix(".log.json")).write_text(json.dumps(summary, indent=1))
    return summary


def _trunk_last_layer(target) -> dict[str, torch.Tensor]:
    """The trunk's last layer as float tensors (dequantized again from the file), and its output norm."""
    from ..weights import read_model

    # the output norm as the model applies it (Gemma's 1 + w folded in)
    return last_layer(read_model(target.path), target.model.output_norm[0])


def last_layer(lm, output_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """A file's last decoder layer (weights.LoadedModel, read lazily) as float tensors under its short names
    (attn_q, ffn_gate, ...), and `output_norm`: the init of a draft layer (TrainSequential / TrainEagle3)."""
    prefix = f"blk.{lm.args.n_layers - 1}."
    out = {n[len(prefix):]: lm.weights[n].float() for n in lm.weights if n.startswith(prefix)}
    out["output_norm"] = output_norm.float()
    return out


def output_rows(target) -> torch.Tensor:
    """The output head's rows [V, dim] in float (of an untied model: its own matrix, read again from the file), so
    that the teacher of training is the target's own next-token distribution softmax(h W^T)."""
    from ..weights import read_model

    if target.model.args.tie_embeddings:
        return target.model.embed.rows(torch.arange(target.model.args.vocab_size))
    return read_model(target.path).weights["output"].float()


def _sequence_loss(net, cfg: TrainConfig, s: list[int], h: torch.Tensor, E: torch.Tensor, head: torch.Tensor,
                   rope, noise: float = 0.0) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Per-depth loss on one sequence, and top-1 agreement counts. The loss is KL(target || draft) over the draft
    vocabulary plus, as in EAGLE (Li et al. 2024), a smooth-L1 regression of the head's feature onto the trunk's own
    hidden state at the position it stands for (a far richer signal per token than one distribution).

    The teacher for the token at position j + 1 is the target's distribution there: softmax(h_j E^T), restricted
    to the draft vocabulary (renormalized)."""
    T = len(s)
    teacher = torch.log_softmax(h @ head.T, dim=-1)  # [T, V_draft] target's next-token distributions
    tokens = torch.tensor(s)
    losses, acc = [], []
    h_in = h + noise * torch.randn_like(h) if noise else h
    if cfg.kind == "sequential":
        prev = h_in
        for d, mod in enumerate(net, start=1):
            n = T - d - 1  # positions p with a token p + d and a teacher at p + d
            if n <= 0:
                break
            e = E[tokens[d:d + n]]
            out = mod(prev[:n], e, rope.cos[:n], rope.sin[:n])  # [n, dim]
            logq = torch.log_softmax(out @ head.T, dim=-1)
            tgt = teacher[d:d + n]
            losses.append(F.kl_div(logq, tgt, log_target=True, reduction="batchmean")
                          + cfg.feature_weight * F.smooth_l1_loss(out, h[d:d + n]))
            acc.append((int((logq.argmax(-1) == tgt.argmax(-1)).sum()), n))
            prev = out
    else:
        outs = net(h_in)
        for k, out in enumerate(outs, start=1):
            n = T - k
            if n <= 0:
                break
            logq = torch.log_softmax(out[:n] @ head.T, dim=-1)
            tgt = teacher[k:k + n]
            losses.append(F.kl_div(logq, tgt, log_target=True, reduction="batchmean")
                          + cfg.feature_weight * F.smooth_l1_loss(out[:n], h[k:k + n]))
            acc.append((int((logq.argmax(-1) == tgt.argmax(-1)).sum()), n))
    while len(losses) < cfg.depth:
        losses.append(torch.zeros((), requires_grad=True))
        acc.append((0, 0))
    return losses, acc
