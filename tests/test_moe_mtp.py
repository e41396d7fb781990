"""MTP layers of MoE trunks (DeepSeek-V3: MLA + MoE; GLM-4.5: GQA + MoE), HF layout ``model.layers.{L}`` with enorm /
hnorm / eh_proj / shared_head and a full MoE decoder layer, against a reference written here: the formula of
models/mtp.py around transformers' own decoder layer for layer L (transformers drops these layers from its model, so
we load it with num_hidden_layers = L + 1 to get that layer with the MTP layer's weights).

Tolerance as in test_parity.py: f32 on both sides, max abs diff <= 1e-4 x the logit scale.
"""

from __future__ import annotations

import pytest
import torch
from tiny_moe import IDS, assert_close, write_moe_hf

from specdec.models.mtp import load_mtp_modules
from specdec.models.transformer import Transformer
from specdec.weights import read_model


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp(folder, cfg, sd, h, tokens):
    """MTP module 1 at positions 0..T-1: h [T, dim] (the trunk's hidden after its final norm), tokens [T]."""
    from transformers import AutoModelForCausalLM

    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, num_hidden_layers=L + 1,
                                                 attn_implementation="eager").eval()
    p = f"model.layers.{L}."
    x = torch.cat([rmsnorm(sd["model.embed_tokens.weight"][tokens], sd[p + "enorm.weight"], eps),
                   rmsnorm(h, sd[p + "hnorm.weight"], eps)], -1) @ sd[p + "eh_proj.weight"].T
    T = len(tokens)
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = model.model.layers[L](x[None], attention_mask=mask, position_ids=pos,
                                  position_embeddings=model.model.rotary_emb(x[None], pos))
        x = x[0] if isinstance(x, tuple) else x
    h_next = rmsnorm(x[0], sd[p + "shared_head.norm.weight"], eps)
    return h_next @ sd[p + "shared_head.head.weight"].T, h_next


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_matches_reference(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder, cfg, sd = write_moe_hf(arch, tmp_path / arch, seed=5, n_mtp=1)
    lm = read_model(folder)
    assert (lm.args.n_layers, lm.args.n_mtp_layers, lm.args.mtp_layout) == (3, 1, "deepseek")
    trunk = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64)
    (module,) = load_mtp_modules(trunk, lm.weights, lm.args)
    assert module.block.moe is not None and (module.block.mla is not None) == arch.startswith("deepseek")
    T = len(IDS)
    with torch.inference_mode():
        logits, h = trunk(torch.tensor([IDS]), torch.arange(T), trunk.new_cache())
        out, h_next = module(h[:, :T - 1], torch.tensor([IDS[1:]]), torch.arange(T - 1), module.new_cache())
        cache = module.new_cache()  # prefill, then decode steps and an exact verification: the same logits
        first, _ = module(h[:, :4], torch.tensor([IDS[1:5]]), torch.arange(4), cache)
        steps = [module(h[:, i:i + 1], torch.tensor([[IDS[i + 1]]]), torch.tensor([i]), cache)[0]
                 for i in range(4, 7)]
        exact, _ = module(h[:, 7:T - 1], torch.tensor([IDS[8:]]), torch.arange(7, T - 1), cache, exact=True)
    trunk_ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = trunk_ref.model(torch.tensor([IDS])).last_hidden_state[0]
    assert_close(h[0], hf)  # module 1 reads the trunk's hidden state after its final norm
    ref_logits, ref_h = reference_mtp(folder, cfg, sd, hf[:T - 1], torch.tensor(IDS[1:]))
    assert_close(out[0], ref_logits)
    assert_close(h_next[0], ref_h)
    assert_close(torch.cat([first, *steps, exact], dim=1)[0], ref_logits)
