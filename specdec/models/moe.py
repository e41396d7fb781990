"""Mixture-of-experts feed-forward layers: a router picks k of E expert FFNs per token (GShard, Lepikhin et al. 2020,
arXiv 2006.16668; Switch Transformer, Fedus et al. 2021, arXiv 2101.03961), plus shared experts every token runs
(DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066).

Routing, for a token's normed hidden state h and router weights W [E, dim] (logits s = W h, in float32):
- "softmax" (Qwen3-MoE, DeepSeek-V2): p = softmax(s); the k largest p are chosen, weights p (renormalized to sum
  to 1 when norm_topk_prob). DeepSeek-V2's group_limited_greedy first keeps the topk_groups groups (of E / n_groups
  experts) with the largest max p.
- "sigmoid" (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2, "noaux_tc"; GLM-4.5): p = sigmoid(s); the choice ranks
  p + b (b: the auxiliary-loss-free load-balancing bias, e_score_correction_bias), first by group (a group scores
  the sum of its two best p + b), then by expert within the topk_groups best groups; the weights are p itself
  (not p + b), renormalized when norm_topk_prob.
Then the weights are multiplied by routed_scaling_factor. Ties break as torch.topk breaks them (transformers uses
it too, so we choose what it chooses).

Compute reads only the active experts: the rows of a step are grouped by chosen expert, each chosen expert runs
once over its rows (through the same Linear layers, quantized or not, as dense FFNs), and experts no row chose are
never touched. Batch invariance (a row's output never depends on the other rows of the step, so a verification
row is bitwise the decode step of that token): the expert matmuls are batch-invariant where the dense ones are (the
int8 / int4 kernel and bf16; see quant.py), the router of an exact step runs row by row, and each row sums its k
expert outputs in its own top-k order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..config import ModelArgs
from ..quant import Linear, make_linear


def route(logits: torch.Tensor, args: ModelArgs, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits s [R, E] float32 -> (weights [R, k] float32, expert ids [R, k] int64), as described above."""
    E, k = logits.shape[-1], args.n_experts_used
    scores = logits.sigmoid() if args.router == "sigmoid" else logits.softmax(dim=-1)  # [R, E]
    choice = scores + bias if bias is not None else scores
    G = args.router_groups
    if G > 1 and args.router_topk_groups < G:  # keep only the topk_groups best groups of E / G experts
        grouped = choice.view(-1, G, E // G)
        group_score = (grouped.max(dim=-1).values if args.router_group_score == "max"
                       else grouped.topk(2, dim=-1).values.sum(dim=-1))  # [R, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(args.router_topk_groups, dim=-1).indices, True)
        # DeepSeek-V2 zeroes the masked softmax scores, V3 / GLM set them to -inf: the same choice either way,
        # unless fewer than k experts of the kept groups score above 0 (impossible for the softmax: all are > 0)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices  # [R, k]
    weights = scores.gather(1, ids)
    if args.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if args.router == "sigmoid" else 0.0))
    return weights * args.routed_scaling, ids


class MoE:
    """Routed experts (and shared experts) of one layer: x [B, T, dim] -> x + FFN_moe(norm(x)).

    A plain object like Block. Tensors (canonical names, llama.cpp's): ffn_gate_inp [E, dim] (router),
    exp_probs_b [E] (sigmoid routing's bias), exp.{e}.ffn_{gate,up,down} (expert e), ffn_{gate,up,down}_shexp."""

    def __init__(self, args: ModelArgs, src, prefix: str, dtype: torch.dtype, quant: str, device: torch.device,
                 norm):
        self.args, self.dtype, self.norm = args, dtype, norm
        self.last_ids: torch.Tensor | None = None  # the last call's chosen experts [R, k] (last_distinct)

        def linear(key: str, names: tuple[str, ...]) -> Linear:
            full = [prefix + n for n in names]

            def make():
                w = lambda: torch.cat([src[n].to(device) for n in full])  # noqa: E731
                codes = src.codes(*full) if quant in ("auto", "int4") and device.type == "cpu" else None
                return make_linear(w, None, dtype, quant, src.bits(*full), codes)

            return src.linear(prefix + key, make)

        self.router = src.raw(prefix + "ffn_gate_inp").to(device, torch.float32)  # [E, dim], kept in float32
        bias = prefix + "exp_probs_b"
        self.bias = src.raw(bias).to(device, torch.float32) if bias in src else None  # [E]
        if args.router == "sigmoid" and self.bias is None:
            self.bias = torch.zeros(args.n_experts, device=device)
        self.experts = [(linear(f"exp.{e}.w13", (f"exp.{e}.ffn_gate", f"exp.{e}.ffn_up")),
                         linear(f"exp.{e}.w2", (f"exp.{e}.ffn_down",))) for e in range(args.n_experts)]
        # every routed expert in one kernels.experts call when all are packed for matmul.c alike (else per expert)
        self.tables = None
        w13s, w2s = [pair[0] for pair in self.experts], [pair[1] for pair in self.experts]
        alike = all(getattr(lin, "native", False) and lin.bias is None and lin.bits == group[0].bits
                    for group in (w13s, w2s) for lin in group)
        if alike and w13s[0].out_features % 32 == 0:
            self.tables = (kernels.head_pointers(w13s).T.contiguous(), kernels.head_pointers(w2s).T.contiguous(),
                           w13s[0].bits, w2s[0].bits, w13s[0].out_features // 2)
        self.shared = None
        if args.n_shared_experts:
            self.shared = (linear("w13_shexp", ("ffn_gate_shexp", "ffn_up_shexp")),
                           linear("w2_shexp", ("ffn_down_shexp",)))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds (a forward reads the router, the shared experts and the chosen experts)."""
        pairs = self.experts + ([self.shared] if self.shared else [])
        out = [t for pair in pairs for lin in pair for t in lin.tensors()] + [self.router]
        return out + ([self.bias] if self.bias is not None else [])

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all experts have the same shapes)."""
        return sum(t.numel() * t.element_size() for lin in self.experts[0] for t in lin.tensors())

    def router_logits(self, h: torch.Tensor, exact: bool) -> torch.Tensor:
        """h [R, dim] -> s [R, E] float32. exact: row by row, so that a row's choice never depends on the other
        rows (float32 matmuls are not batch-invariant)."""
        h = h.float()
        if not exact or h.shape[0] == 1:
            return F.linear(h, self.router)
        return torch.cat([F.linear(h[r:r + 1], self.router) for r in range(h.shape[0])])

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x [B, T, dim] (the residual stream) -> x + routed + shared experts of norm(x)."""
        shape = x.shape
        h = self.norm(x).reshape(-1, shape[-1])  # [R, dim]
        weights, ids = route(self.router_logits(h, exact), self.args, self.bias)  # [R, k] each
        R, k = ids.shape
        self.last_ids = ids
        if self.tables is not None and h.dtype in kernels.DTYPES:  # one call: grouped, each row as if alone
            out = kernels.experts(h, ids, *self.tables)
            return self._combine(x, h, [out[:, j] for j in range(k)], weights.to(h.dtype))
        if R == 1:  # a decode step: its k experts in top-k order, no grouping (the same operations, so the same bits)
            chosen = ids[0].tolist()
            outs = [self.experts[e][1](self.experts[e][0].apply(h, swiglu=True)) for e in chosen]
            return self._combine(x, h, outs, weights.to(h.dtype))
        flat = ids.flatten()  # [R k]: slot j of row r at r k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.args.n_experts).tolist()
        out = h.new_empty(R * k, shape[-1])  # [R k, dim] each slot's expert output
        at = 0
        for e, n in enumerate(counts):  # only the experts some row chose
            if n == 0:
                continue
            slots = order[at:at + n]
            at += n
            w13, w2 = self.experts[e]
            out[slots] = w2(w13.apply(h[slots // k], swiglu=True))
        out = out.view(R, k, -1)
        return self._combine(x, h, [out[:, j] for j in range(k)], weights.to(h.dtype))

    @property
    def last_distinct(self) -> int:
        """Distinct experts the last call ran (bench/roofline.py's routing measurement), counted when asked: not in
        the decode loop."""
        return 0 if self.last_ids is None else len(set(self.last_ids.flatten().tolist()))

    def _combine(self, x: torch.Tensor, h: torch.Tensor, outs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        """x + the rows' k expert outputs outs[j] [R, dim] weighted by w [R, k], summed in each row's own top-k
        order, + the shared experts of h [R, dim]."""
        y = outs[0] * w[:, :1]
        for j in range(1, len(outs)):
            y = y + outs[j] * w[:, j:j + 1]
        if self.shared is not None:
            w13, w2 = self.shared
            y = y + w2(w13.apply(h, swiglu=True))
        return x + y.view(x.shape)
