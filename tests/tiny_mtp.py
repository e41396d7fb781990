"""Writers of tiny random-weight models with native multi-token-prediction (MTP) modules, in the layouts real
models ship (see specdec/models/mtp.py for the formula):

* GGUF, as llama.cpp's converter writes GLM-4.5 / DeepSeek ("nextn"): ``{arch}.nextn_predict_layers`` = n, the MTP
  modules are the LAST n blocks (``block_count`` = trunk layers + n), with ``blk.{L+i}.nextn.{eh_proj, enorm, hnorm,
  embed_tokens, shared_head_head, shared_head_norm}`` (names from ``gguf.TENSOR_NAMES[MODEL_TENSOR.NEXTN_*]``;
  ``eh_proj`` is the HF ``[dim, 2 dim]`` matrix unchanged, GGUF ne = ``{2 dim, dim}``) and the block's usual
  ``blk.{L+i}.attn_q ...`` tensors (q/k permuted for arch llama, as every block).
* Hugging Face, DeepSeek-V3 / GLM-4.5 style: config.json ``num_nextn_predict_layers`` = n (``num_hidden_layers``
  does not count them); ``model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
  embed_tokens}`` + the block's ``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``.
* Hugging Face, MiMo style (XiaomiMiMo/MiMo-7B: ``model_type`` "mimo", a qwen2 trunk): ``model.mtp_layers.{i}.
  {token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` + the block tensors; ``input_proj`` takes
  [hidden; embedding].

The trunk is exactly the one ``tiny_models`` writes for ``num_hidden_layers = L + n`` (whose last n layers become the
MTP blocks), so the trunk tensors are those of ``hf_state_dict(arch, num_hidden_layers=L + n)`` minus those layers.
Every writer returns ``MTPFixture(path, tensors, cfg)``: ``tensors`` holds every tensor in HF names (the MTP ones
as the layout names them; for GGUF, the DeepSeek HF names llama.cpp converts from), ``cfg`` the trunk's config.json
dict (``num_hidden_layers`` = L, ``num_nextn_predict_layers`` = n).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from tiny_models import hf_config, hf_state_dict, write_gguf, write_hf

from specdec.models.eagle3 import default_aux_layers, draft_args
from specdec.train.eagle3 import TrainEagle3
from specdec.weights.heads import base_fingerprint, save_heads

N_LAYERS = 2  # trunk layers of the tiny models (tiny_models' default for the Llama family)


@dataclass
class MTPFixture:
    path: Path
    tensors: dict[str, torch.Tensor]  # HF names, float32
    cfg: dict  # config.json of the trunk: num_hidden_layers = trunk layers, num_nextn_predict_layers = n


def _mtp_tensors(cfg: dict, n_mtp: int, seed: int, layout: str, own_head: bool, own_embed: bool
                 ) -> dict[str, torch.Tensor]:
    """Seeded random MTP-specific tensors (norms ~ 1, projections std 0.08) in the layout's HF names."""
    gen = torch.Generator().manual_seed(10_000 + int(seed))
    dim, vocab, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = {}
    for i in range(n_mtp):
        norm = lambda: 1.0 + 0.1 * torch.randn(dim, generator=gen)  # noqa: E731
        if layout == "mimo":
            p = f"model.mtp_layers.{i}."
            out[p + "token_layernorm.weight"] = norm()
            out[p + "hidden_layernorm.weight"] = norm()
            out[p + "input_proj.weight"] = 0.08 * torch.randn(dim, 2 * dim, generator=gen)
            out[p + "final_layernorm.weight"] = norm()
            continue
        p = f"model.layers.{L + i}."
        out[p + "enorm.weight"] = norm()
        out[p + "hnorm.weight"] = norm()
        out[p + "eh_proj.weight"] = 0.08 * torch.randn(dim, 2 * dim, generator=gen)
        out[p + "shared_head.norm.weight"] = norm()
        if own_head:
            out[p + "shared_head.head.weight"] = 0.08 * torch.randn(vocab, dim, generator=gen)
        if own_embed:
            out[p + "embed_tokens.weight"] = 0.08 * torch.randn(vocab, dim, generator=gen)
    return out


def _trunk_and_blocks(arch: str, n_mtp: int, seed: int, tied: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config with L + n layers, its state dict): layers L .. L + n - 1 are the MTP blocks."""
    cfg = hf_config(arch, num_hidden_layers=N_LAYERS + n_mtp)
    cfg["tie_word_embeddings"] = bool(tied)
    return cfg, hf_state_dict(arch, cfg, seed=seed, tied=tied)


def _trunk_cfg(arch: str, n_mtp: int, tied: bool) -> dict:
    cfg = hf_config(arch, num_hidden_layers=N_LAYERS)
    cfg["tie_word_embeddings"] = bool(tied)
    cfg["num_nextn_predict_layers"] = n_mtp
    return cfg


@contextlib.contextmanager
def _gguf_extras(tensors: dict[str, np.ndarray], kv: dict[str, int]):
    """Within the block, every ``gguf.GGUFWriter`` also writes `tensors` and the uint32 metadata `kv` (keys with
    ``{arch}``) just before its header: ``tiny_models.write_gguf`` then writes the nextn tensors too."""
    original = gguf.GGUFWriter

    class Writer(original):
        def write_header_to_file(self, *args, **kwargs):
            for key, value in kv.items():
                self.add_uint32(key.format(arch=self.arch), value)
            for name, arr in tensors.items():
                self.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
            return super().write_header_to_file(*args, **kwargs)

    gguf.GGUFWriter = Writer
    try:
        yield
    finally:
        gguf.GGUFWriter = original


# HF (DeepSeek) MTP tensor -> llama.cpp MODEL_TENSOR, as gguf-py's tensor_mapping maps them
_NEXTN = {
    "eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
    "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
    "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM,
    "embed_tokens": gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS,
    "shared_head.head": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
    "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}


def write_mtp_gguf(trunk_arch: str, path: Path, *, n_mtp: int = 1, seed: int = 0, tied: bool = True,
                   own_head: bool = True, own_embed: bool = True) -> MTPFixture:
    """A tiny ``trunk_arch`` (llama / qwen2 / qwen3 ...) F32 GGUF with ``n_mtp`` nextn modules (llama.cpp layout).

    ``own_head`` / ``own_embed``: write ``nextn.shared_head_head`` / ``nextn.embed_tokens`` (optional in llama.cpp;
    GLM-4.5 has them, GLM-4.6 does not)."""
    cfg_all, sd = _trunk_and_blocks(trunk_arch, n_mtp, seed, tied)
    cfg = _trunk_cfg(trunk_arch, n_mtp, tied)
    mtp = _mtp_tensors(cfg, n_mtp, seed, "deepseek", own_head, own_embed)
    extras = {}
    for hf_name, t in mtp.items():
        layer, part = hf_name.removeprefix("model.layers.").split(".", 1)
        extras[gguf.TENSOR_NAMES[_NEXTN[part.removesuffix(".weight")]].format(bid=int(layer)) + ".weight"] = t.numpy()
    with _gguf_extras(extras, {gguf.Keys.LLM.NEXTN_PREDICT_LAYERS: n_mtp}):
        path = write_gguf(trunk_arch, path, seed=seed, tied=tied, tokenizer=False,
                          num_hidden_layers=N_LAYERS + n_mtp)
    return MTPFixture(Path(path), {**sd, **mtp}, cfg)


def write_mtp_hf(trunk_arch: str, folder: Path, *, layout: str = "deepseek", n_mtp: int = 1, seed: int = 0,
                 tied: bool = True, own_head: bool = True, own_embed: bool = True) -> MTPFixture:
    """A tiny ``trunk_arch`` HF folder (write_hf's trunk) with ``n_mtp`` MTP modules in ``layout`` "deepseek"
    (``model.layers.{L+i}``, DeepSeek-V3 / GLM-4.5) or "mimo" (``model.mtp_layers.{i}``, config model_type "mimo";
    ``own_head`` / ``own_embed`` do not apply: MiMo shares both with the trunk)."""
    from safetensors.torch import load_file, save_file

    if layout not in ("deepseek", "mimo"):
        raise ValueError(f"unknown MTP layout {layout!r}")
    folder = Path(write_hf(trunk_arch, folder, seed=seed, tied=tied, tokenizer=False,
                           num_hidden_layers=N_LAYERS + n_mtp))
    _, sd = _trunk_and_blocks(trunk_arch, n_mtp, seed, tied)
    cfg = _trunk_cfg(trunk_arch, n_mtp, tied)
    stored = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(stored[k], sd[k]) for k in stored) and set(stored) == set(sd)
    if layout == "mimo":  # the MTP blocks move from model.layers.{L+i} to model.mtp_layers.{i}
        for k in list(sd):
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= N_LAYERS:
                i = int(k.split(".")[2]) - N_LAYERS
                sd[f"model.mtp_layers.{i}." + k.split(".", 3)[3]] = sd.pop(k)
        cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    sd.update(_mtp_tensors(cfg, n_mtp, seed, layout, own_head, own_embed))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    written = json.loads((folder / "config.json").read_text())  # + torch_dtype, transformers_version
    (folder / "config.json").write_text(json.dumps({**written, **cfg}, indent=2) + "\n")
    return MTPFixture(folder, sd, cfg)


def eagle3_file(t, tmp_path: Path, ffn: int = 48, vocab: int | None = None, seed: int = 1, name: str = "e3"
                ) -> tuple[str, TrainEagle3]:
    """A heads file with random EAGLE-3 weights (bf16-exact, so the trainable module equals what is loaded)."""
    args = t.model.args
    torch.manual_seed(seed)
    net = TrainEagle3(draft_args(args), ffn)
    with torch.no_grad():
        for prm in net.parameters():
            prm.add_(torch.randn_like(prm) * 0.05)
            prm.copy_(prm.to(torch.bfloat16).float())
    tensors = net.export()
    V = args.vocab_size
    tensors["d2t"] = torch.arange(V) if vocab is None else torch.randperm(V)[:vocab].sort().values
    path = tmp_path / f"{name}.safetensors"
    save_heads(path, tensors, kind="eagle3", depth=1, base=base_fingerprint(t), args=args, ffn_dim=ffn, train={},
               aux_layers=list(default_aux_layers(args.n_layers)))
    return str(path), net
