"""Training EAGLE-3 heads (Li et al. 2025) with training-time test (TTT), as `speculators` and the EAGLE-3 reference
code train them; the inference twin is models/eagle3.Eagle3Module (a test checks they agree step by step).

One sequence of T tokens t_0..t_{T-1} with the trunk's aux features A_p (inputs of the aux layers at position p) and
its final hidden states h_p. Step 0 at index p reads g_p = fc(A_p) and t_{p+1} at position p and predicts t_{p+2};
step k >= 1 at index p reads the layer's own step-(k-1) output there and the true token t_{p+1+k}, at position
p + k, and predicts t_{p+2+k}. Step k's queries attend the step-0 keys of indices <= p (causal) and the keys of steps
1..k at their own index p (a diagonal), which is exactly what a k-th drafted token sees at inference: the cache of
real positions plus its own chain. Loss per step: KL(target || draft) over the draft vocabulary, the target's
distribution at p + 1 + k being softmax(h_{p+1+k} E_draft^T); steps weighted by decay^k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.eagle3 import LAYER_NAMES
from ..models.transformer import apply_rope


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * w if w is not None else x


class TrainEagle3(nn.Module):
    """EAGLE-3's fc + one decoder layer + final norm (float32, autograd). The embedding and the draft head are
    the target's, frozen, passed in."""

    def __init__(self, args, ffn_dim: int, n_aux: int = 3, init: dict[str, torch.Tensor] | None = None):
        super().__init__()
        dim, H, Hkv, D = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        self.H, self.Hkv, self.D, self.eps, self.scale, self.n_aux = H, Hkv, D, args.norm_eps, args.query_scale, n_aux

        def p(*shape, std=0.02):
            return nn.Parameter(torch.randn(*shape) * std)

        ones = lambda n: nn.Parameter(torch.ones(n))  # noqa: E731
        self.input_norm, self.hidden_norm, self.attn_out_norm, self.norm = (ones(dim) for _ in range(4))
        # fc starts as "take the highest feature": the layer begins near one more trunk layer
        fc = torch.randn(dim, n_aux * dim) * 0.01
        fc[:, (n_aux - 1) * dim:] += torch.eye(dim)
        self.fc = nn.Parameter(fc)
        self.wq, self.wk, self.wv = p(H * D, 2 * dim), p(Hkv * D, 2 * dim), p(Hkv * D, 2 * dim)
        self.wo = p(dim, H * D)
        self.w_gate, self.w_up, self.w_down = p(ffn_dim, dim), p(ffn_dim, dim), p(dim, ffn_dim)
        if init:  # the trunk's last layer: its q/k/v on the hidden half, its FFN cut to ffn_dim, as far as it is
            # one of these (an MLA layer has no q/k/v of these shapes, a MoE layer no dense FFN: those start random)
            def fits(name: str, shape: tuple[int, ...]) -> bool:  # at least this shape (the FFN is cut)
                return name in init and all(a <= b for a, b in zip(shape, init[name].shape, strict=True))

            with torch.no_grad():
                attn = (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"))
                if all(src in init and init[src].shape == getattr(self, ours)[:, dim:].shape for ours, src in attn) \
                        and init.get("attn_output", torch.empty(0)).shape == self.wo.shape:
                    for ours, src in attn:
                        getattr(self, ours)[:, dim:].copy_(init[src])
                    self.wo.copy_(init["attn_output"])
                self.hidden_norm.copy_(init["attn_norm"])
                self.attn_out_norm.copy_(init["ffn_norm"])
                if fits("ffn_gate", (ffn_dim, dim)) and fits("ffn_down", (dim, ffn_dim)):
                    self.w_gate.copy_(init["ffn_gate"][:ffn_dim])
                    self.w_up.copy_(init["ffn_up"][:ffn_dim])
                    self.w_down.copy_(init["ffn_down"][:, :ffn_dim])
                if "output_norm" in init:  # the head's logits start at the trunk's scale
                    self.norm.copy_(init["output_norm"])

    def layer(self, g: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One TTT step over n indices of B sequences: g [B, n, dim], e [B, n, dim] next-token embeddings, rope
        [n, D]; keys: the (k, v) [B, n_i, Hkv, D] of earlier steps (step 0's first, attended causally; later ones on
        the diagonal), extended with this step's. -> x [B, n, dim] (pre-norm)."""
        B, n = g.shape[:2]
        u = torch.cat([_rms(e, self.input_norm, self.eps), _rms(g, self.hidden_norm, self.eps)], dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        q = apply_rope((u @ self.wq.T).view(B, n, self.H, self.D), cos, sin)
        k = apply_rope((u @ self.wk.T).view(B, n, self.Hkv, self.D), cos, sin)
        v = (u @ self.wv.T).view(B, n, self.Hkv, self.D)
        keys.append((k, v))
        rep = self.H // self.Hkv
        k0, v0 = (t[:, :n].repeat_interleave(rep, dim=2) for t in keys[0])  # [B, n, H, D]
        s0 = torch.einsum("bphd,bjhd->bhpj", q, k0) * self.scale  # [B, H, n, n] over step 0's keys
        s0 = s0.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=g.device).tril(), float("-inf"))
        diag = [(q * kk[:, :n].repeat_interleave(rep, dim=2)).sum(-1).transpose(1, 2) * self.scale
                for kk, _ in keys[1:]]  # [B, H, n]
        w = torch.softmax(torch.cat([s0] + [d[..., None] for d in diag], dim=-1), dim=-1)
        o = torch.einsum("bhpj,bjhd->bphd", w[..., :n], v0)
        for i, (_, vv) in enumerate(keys[1:]):
            o = o + w[..., n + i].transpose(1, 2)[..., None] * vv[:, :n].repeat_interleave(rep, dim=2)
        x = g + o.reshape(B, n, -1) @ self.wo.T
        f = _rms(x, self.attn_out_norm, self.eps)
        return x + (F.silu(f @ self.w_gate.T) * (f @ self.w_up.T)) @ self.w_down.T

    def unroll(self, A: torch.Tensor, tokens: torch.Tensor, E: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
        """Training-time test: A [T, n_aux dim] aux features, tokens [T] -> the normed outputs [n_k, dim] of each
        step k (n_k = T - 1 - k indices: those whose input token t_{p+1+k} exists). A batch of B right-padded
        sequences (A [B, T, n_aux dim], tokens [B, T]) gives [B, n_k, dim]: attention is causal, so an index never
        sees the padding after its sequence's end."""
        one = tokens.dim() == 1
        if one:
            A, tokens = A[None], tokens[None]
        T = tokens.shape[1]
        g = A[:, :T - 1] @ self.fc.T
        keys: list = []
        outs = []
        for k in range(steps):
            n = T - 1 - k
            if n <= 0:
                break
            x = self.layer(g[:, :n], E[tokens[:, 1 + k:1 + k + n]], cos[k:k + n], sin[k:k + n], keys)
            outs.append(_rms(x, self.norm, self.eps))
            g = x
        return [o[0] for o in outs] if one else outs

    def _named(self) -> dict[str, nn.Parameter]:
        ours = {"attn_norm": self.input_norm, "hidden_norm": self.hidden_norm, "attn_q": self.wq,
                "attn_k": self.wk, "attn_v": self.wv, "attn_output": self.wo, "ffn_norm": self.attn_out_norm,
                "ffn_gate": self.w_gate, "ffn_up": self.w_up, "ffn_down": self.w_down, "fc": self.fc,
                "norm": self.norm}
        return {LAYER_NAMES[k]: v for k, v in ours.items()}

    def export(self) -> dict[str, torch.Tensor]:
        """Tensors under speculators / vLLM EAGLE-3 names (models/eagle3.LAYER_NAMES)."""
        return {k: v.detach().clone() for k, v in self._named().items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of export(): set the parameters from a heads file's tensors."""
        with torch.no_grad():
            for name, prm in self._named().items():
                prm.copy_(tensors[name].float())


def eagle3_loss(net: TrainEagle3, A: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor, E: torch.Tensor,
                head: torch.Tensor, rope, steps: int, decay: float, lengths: torch.Tensor | None = None
                ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Per-step KL losses (mean over the predicted tokens, weighted by decay^k) and top-1 agreement counts for one
    sequence, or for B right-padded ones (A [B, T, .], h [B, T, dim], tokens [B, T], their `lengths` [B]). h: the
    trunk's final hidden states (after its norm), whose head rows give the teacher."""
    if tokens.dim() == 1:
        A, h, tokens = A[None], h[None], tokens[None]
    B, T = tokens.shape
    if lengths is None:
        lengths = torch.full((B,), T, device=tokens.device)
    outs = net.unroll(A, tokens, E, rope.cos, rope.sin, steps)
    # the draft-vocabulary matmuls are most of the work: bf16 (AMX / AVX-512 BF16 where the CPU has them), the teacher
    # once for all steps; log-softmax and KL in float32
    head16 = head.to(torch.bfloat16)
    with torch.no_grad():
        teacher = torch.log_softmax((h[:, 1:].to(torch.bfloat16) @ head16.T).float(), dim=-1)  # once for all steps
        top = teacher.argmax(-1)
    losses, acc = [], []
    for k, out in enumerate(outs):
        n = out.shape[1]
        valid = torch.arange(n, device=tokens.device)[None] < (lengths[:, None] - 1 - k)  # t_{p+1+k} in the sequence
        count = int(valid.sum())
        if count == 0:
            break
        logq = torch.log_softmax((out.to(torch.bfloat16) @ head16.T).float(), dim=-1)
        tgt = teacher[:, k:k + n]
        kl = F.kl_div(logq, tgt, log_target=True, reduction="none").sum(-1)  # [B, n]
        losses.append(decay ** k * (kl * valid).sum() / count)
        acc.append((int(((logq.detach().argmax(-1) == top[:, k:k + n]) & valid).sum()), count))
    return losses, acc
