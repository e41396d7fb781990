"""Heads files: trained MTP modules / Medusa heads as safetensors, with a JSON header binding them to a base model.

Tensor names follow the native layouts (DeepSeek-V3's `model.layers.{L+i}.*` MTP modules, Medusa's
`medusa_head.{k}.0.linear.*`, EAGLE-3's `fc`, `layers.0.*`, `norm` as speculators and vLLM name them) plus `d2t`, the
draft vocabulary as target ids (EAGLE-3's name; its files store offsets, `specdec export-heads` converts). The
safetensors metadata key "specdec" holds the header: format, kind, depth, the base model's architecture and the SHA-256
of its weights file(s), the module shapes (EAGLE-3: the aux layers it reads), and the training summary. Loading heads
on another model is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..config import ModelError, release_freed_memory

FORMAT = "specdec-heads/1"


def _weights_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.safetensors"))
    return [path]


def file_sha256(path: Path) -> str:
    """SHA-256 of a model's weights file(s), cached under ~/.cache/specdec by (path, size, mtime)."""
    from ..config import cache_dir

    files = _weights_files(path)
    key = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    store = cache_dir() / "sha256.json"
    known = json.loads(store.read_text()) if store.exists() else {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    known[key] = digest
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(known))
    return digest


def base_fingerprint(target) -> dict:
    """What a heads file records about the model it was trained on."""
    a = target.model.args
    return {"arch": a.arch, "file": target.path.name, "sha256": file_sha256(target.path), "dim": a.dim,
            "n_layers": a.n_layers, "vocab_size": a.vocab_size}


def save_heads(path: str | Path, tensors: dict[str, torch.Tensor], *, kind: str, depth: int, base: dict, args,
               ffn_dim: int, train: dict, aux_layers: list[int] | None = None) -> None:
    from safetensors.torch import save_file

    header = {"format": FORMAT, "kind": kind, "depth": depth, "base": base, "num_hidden_layers": args.n_layers,
              "ffn_dim": ffn_dim, "train": train}
    if aux_layers:  # eagle3: the trunk layers whose inputs the head reads
        header["aux_layers"] = aux_layers
    out = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata={"specdec": json.dumps(header)})


def read_header(path: str | Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        raise ModelError(f"{path} is not a heads file (safetensors): {e}") from e
    if "specdec" not in meta:
        raise ModelError(f"{path} has no specdec header: give a file written by `specdec train-mtp`")
    header = json.loads(meta["specdec"])
    if header.get("format") != FORMAT:
        raise ModelError(f"{path} is in format {header.get('format')}, this specdec reads {FORMAT}")
    return header


def check_base(header: dict, target, path) -> None:
    """Refuse heads trained on another model (architecture or weights differ)."""
    base = header["base"]
    a = target.model.args
    if base["arch"] != a.arch or base["dim"] != a.dim or base["vocab_size"] != a.vocab_size:
        raise ModelError(f"{path} was trained for a {base['arch']} model ({base['file']}), not this {a.arch} "
                         f"model: train heads for it with `specdec train-mtp -m MODEL`")
    if base["sha256"] != file_sha256(target.path):
        raise ModelError(f"{path} was trained for {base['file']} (sha256 {base['sha256'][:12]}...), not for "
                         f"{target.path.name}: train heads for this model with `specdec train-mtp -m MODEL`")


def load_heads(path: str | Path, target, dtype=None, quant: str | None = None):
    """(kind, drafter, vocab_map) for a heads file: drafter is a list of MTPModule (sequential) or ParallelHeads."""
    heads = _build_heads(path, target, dtype, quant)
    release_freed_memory()  # the float copies the layers were made from (config.release_freed_memory)
    return heads


def _build_heads(path: str | Path, target, dtype, quant: str | None):
    from safetensors.torch import load_file

    from ..models.heads import ParallelHeads, SubsetHead

    header = read_header(path)
    check_base(header, target, path)
    tensors = load_file(str(path))
    trunk = target.model
    ids = tensors.pop("d2t", None)
    head = SubsetHead(trunk, ids, quant) if ids is not None and len(ids) < trunk.args.vocab_size else trunk.output
    vocab_map = ids if head is not trunk.output else None
    if header["kind"] == "eagle3":
        from ..models.eagle3 import Eagle3Module

        try:
            mod = Eagle3Module(trunk, tensors, tuple(header["aux_layers"]), head, dtype or trunk.dtype,
                               quant or ("none" if trunk.quant == "none" else "int8"))
        except KeyError as e:
            raise ModelError(f"{path} lacks tensor {e} of its EAGLE-3 layer: the file is incomplete") from e
        trunk.aux_layers = mod.aux  # the trunk's hidden output now carries the features the head reads
        return "eagle3", [mod], vocab_map
    if header["kind"] == "parallel":
        w = [(tensors[f"medusa_head.{k}.0.linear.weight"].float(), tensors[f"medusa_head.{k}.0.linear.bias"].float())
             for k in range(header["depth"])]
        return "parallel", ParallelHeads(w, head, dtype or trunk.dtype, trunk.device), vocab_map
    from ..models.mtp import MTPModule
    from ..weights import LazyWeights
    from ..weights.hf import canonical_name

    per_module: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():  # DeepSeek-V3 names -> canonical mtp.{i}.* (weights/hf.py)
        c = canonical_name(name, False, header["num_hidden_layers"])
        if c and c.startswith("mtp."):
            _, i, short = c.split(".", 2)
            per_module.setdefault(int(i), {})[short] = t.float().to(trunk.device)
    modules = []
    for i in range(header["depth"]):
        try:
            src = LazyWeights.of({f"mtp.{i}.{n}": t for n, t in per_module[i].items()}, bits=16.0)
            mod = MTPModule(trunk, src, f"mtp.{i}.", trunk.args, dtype or trunk.dtype,
                            quant or ("none" if trunk.quant == "none" else "int8"))
        except KeyError as e:
            raise ModelError(f"{path} lacks tensor {e} of MTP module {i}: the file is incomplete") from e
        mod.head = head
        modules.append(mod)
    return "sequential", modules, vocab_map


def shipped_heads() -> list[Path]:
    """Heads files shipped inside the package (specdec/heads/)."""
    folder = Path(__file__).resolve().parent.parent / "heads"
    return sorted(folder.glob("*.safetensors"))


def find_heads(target, kind: str | None = None) -> Path | None:
    """A shipped heads file trained for exactly this model's weights (EAGLE-3, then sequential modules, then
    Medusa heads), if any."""
    digest = None
    found = []
    for path in shipped_heads():
        try:
            header = read_header(path)
        except ModelError:
            continue
        if header["base"]["arch"] != target.model.args.arch or header["base"]["dim"] != target.model.args.dim:
            continue
        if kind is not None and header["kind"] != kind:
            continue
        digest = digest or file_sha256(target.path)
        if header["base"]["sha256"] == digest:
            found.append(({"eagle3": 0, "sequential": 1}.get(header["kind"], 2), path))
    return min(found)[1] if found else None
