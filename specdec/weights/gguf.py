"""GGUF files as llama.cpp writes them: the header walked by specdec (GGUFFile), the tensors dequantized in PyTorch
(Q4_K, Q6_K, Q8_0: TORCH_DEQUANT) or by the `gguf` package (the other types).

Metadata keys and tensor names are llama.cpp's (``{arch}.block_count``, ``blk.N.attn_q.weight`` ...). Two conversions
made by llama.cpp's convert_hf_to_gguf.py are undone here so the model sees Hugging Face's conventions: the q/k
rows of arch ``llama`` are permuted for interleaved RoPE (we restore rotate_half order), and the row/column order of
the GGUF shape (ne0 = columns) is the reverse of PyTorch's, which the reader already gives us.

Multi-token-prediction modules (llama.cpp's "nextn", from GLM-4.5 / DeepSeek-V3 conversions): metadata
``{arch}.nextn_predict_layers`` = n, and the MTP modules are the LAST n blocks (``block_count`` counts them). Their
tensors ``blk.{L+i}.nextn.{eh_proj, enorm, hnorm, embed_tokens, shared_head_head, shared_head_norm}`` and
``blk.{L+i}.{attn_q, ..., ffn_down}`` are exposed as ``mtp.{i}.*`` (L = the trunk's layer count), so the trunk
never sees them.
"""

from __future__ import annotations

import collections
import math
import mmap
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..config import FAMILIES, SUPPORTED, ModelArgs, ModelError, yarn_mscale
from . import LazyWeights, LoadedModel, Q5Codes, Q6Codes, Q501Codes, Rows, rope_layout, unpermute_rotary

GGUF_MAGIC = b"GGUF"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's mixture-of-experts architectures -> ours (deepseek2 is V2 or V3 by its gating function, see below)
MOE_ARCHS = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "deepseek2": "deepseek_v2"}
# stacked expert tensors [E, N, K] -> the canonical per-expert name exp.{e}.<short>
_STACKED = {"ffn_gate_exps": "ffn_gate", "ffn_up_exps": "ffn_up", "ffn_down_exps": "ffn_down"}


def _open(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (no GGUF magic): give a llama.cpp .gguf or a Hugging Face folder")
    return GGUFFile(path)


class GGUFTensor(NamedTuple):
    """One tensor as gguf-py's ReaderTensor describes it (the fields read_gguf uses)."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]  # GGUF order: ne0 (the row length) first
    n_elements: int
    n_bytes: int
    data_offset: int  # in the file
    data: np.ndarray  # a view of the mapped file: [*reversed(shape)] elements, or bytes per row for quantized types


class GGUFFile:
    """A GGUF file's metadata and tensors, read by the same walk that validates its header (_check_header), the
    tensors as views of one read-only mapping (gguf-py's GGUFReader builds a numpy view of every vocabulary string
    first: 17 s for Gemma 3's 262k tokens, 4.3 s for SmolLM2's 49k, against < 0.1 s here). The tokenizer's large
    arrays (tokens, scores, token types, merges) are stepped over: the tokenizer reads them itself."""

    def __init__(self, path: Path):
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.meta, infos, start, order = _check_header(path)
        self.data = np.memmap(path, mode="r")
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset, nbytes in infos:
            qtype = GGMLQuantizationType(ttype)
            shape = tuple(reversed(dims))
            item = plain.get(qtype.name)
            if item is None:  # quantized: bytes per row
                item, shape = np.uint8, quant_shape_to_byte_shape(shape, qtype)
            dtype = np.dtype(item).newbyteorder(order)
            at = start + offset
            data = self.data[at:at + nbytes].view(dtype).reshape(shape)
            self.tensors.append(GGUFTensor(name, ttype, dims, math.prod(dims), nbytes, at, data))


# byte size of each scalar GGUF value type (gguf.GGUFValueType); 8 = STRING and 9 = ARRAY have a length first
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# the tokenizer's large arrays: stepped over when the metadata is read (the tokenizer reads them itself)
_TOKENIZER_ARRAYS = tuple(f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges"))
_UINT32, _STRING, _ARRAY = 4, 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Reads a GGUF header front to back and refuses every length that runs past the end of the file."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

    def corrupt(self, what: str) -> ModelError:
        return ModelError(f"{self.path} is truncated or corrupt ({what}): download the file again")

    def skip(self, n: int, what: str) -> int:
        """Step over n bytes; -> where they start."""
        if n > len(self.buf) - self.pos:
            raise self.corrupt(f"{what} runs past the end of the file")
        self.pos += n
        return self.pos - n

    def ints(self, fmt: str, what: str) -> tuple[int, ...]:
        fmt = self.order + fmt
        return struct.unpack_from(fmt, self.buf, self.skip(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        """A key or tensor name, cut to 64 printable characters (it is only quoted in messages, or compared)."""
        n = self.ints("Q", what)[0]
        start = self.skip(n, what)
        text = self.buf[start:start + min(n, 64)].decode(errors="replace")
        return "".join(ch if ch.isprintable() else "?" for ch in text) + ("..." if n > 64 else "")

    def text(self, what: str) -> str:
        """A whole string (UTF-8, as gguf-py decodes it)."""
        n = self.ints("Q", what)[0]
        start = self.skip(n, what)
        try:
            return self.buf[start:start + n].decode()
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8 text") from None

    def value(self, vtype: int, what: str, keep: bool = False):
        """Step over one metadata value; -> the value (as gguf-py's field.contents() gives it) when `keep`, else None
        (but a UINT32 always: general.alignment is one)."""
        if vtype in _SCALAR_BYTES:
            start = self.skip(_SCALAR_BYTES[vtype], what)
            if keep or vtype == _UINT32:
                return struct.unpack_from(self.order + _SCALAR_FORMATS[vtype], self.buf, start)[0]
            return None
        if vtype == _STRING:
            if keep:
                return self.text(what)
            self.skip(self.ints("Q", what)[0], what)
        elif vtype == _ARRAY:
            itype, n = self.ints("IQ", what)
            if itype in _SCALAR_BYTES:
                start = self.skip(n * _SCALAR_BYTES[itype], what)
                if keep:
                    return list(struct.unpack_from(f"{self.order}{n}{_SCALAR_FORMATS[itype]}", self.buf, start))
            elif itype == _STRING and keep:
                if n * 8 > len(self.buf) - self.pos:
                    raise self.corrupt(f"{what} runs past the end of the file")
                return [self.text(what) for _ in range(n)]
            elif itype == _STRING:  # a vocabulary: ~100k strings, so the loop is kept tight
                pos, end, fmt = self.pos, len(self.buf), self.order + "Q"
                if n * 8 > end - pos:
                    raise self.corrupt(f"{what} runs past the end of the file")
                for _ in range(n):
                    pos += 8 + (struct.unpack_from(fmt, self.buf, pos)[0] if pos + 8 <= end else end)
                    if pos > end:
                        raise self.corrupt(f"{what} runs past the end of the file")
                self.pos = pos
            else:  # llama.cpp's reader refuses nested arrays too
                raise self.corrupt(f"{what} is an array of type {itype}")
        else:
            raise self.corrupt(f"{what} has unknown type {vtype}")
        return None


def _check_header(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int, int]], int, str]:
    """Validate and read a GGUF header (KV metadata, then tensor infos), as llama.cpp's
    gguf_init_from_file does: every count, string and array length must fit the file, value types must be known,
    tensor dimensions positive (at most 4) and their product consistent with the tensor's type, and each tensor's
    bytes aligned, inside the file and apart from the others (GGUFReader itself reads past the end as empty arrays,
    so an array count that lies makes it loop, appending, until memory runs out).
    -> (metadata {key: value} without the tokenizer's large arrays, tensor infos [(name, dims, type, offset from
    the data section, bytes)] in file order, where the data section starts, the byte order "<" or ">")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, path)
        c.skip(4, "the magic")
        version = c.ints("I", "the version")[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine (GGUFReader detects it the same way)
            c.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            raise ModelError(f"{path} has GGUF version {version}, not 2 or 3: the file is corrupt or newer than "
                             "specdec, download it again or update specdec")
        n_tensors, n_kv = c.ints("QQ", "the header")
        if 13 * n_kv + 24 * n_tensors > len(buf):  # the smallest KV takes 13 bytes, the smallest tensor info 24
            raise c.corrupt(f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in {len(buf)} bytes")
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        meta: dict = {}
        for i in range(n_kv):
            key = c.text(f"metadata key {i}")
            what = f"metadata '{key[:64]}'"
            value = c.value(c.ints("I", what)[0], what, keep=key not in _TOKENIZER_ARRAYS)
            if key not in _TOKENIZER_ARRAYS:
                meta[key] = value
            if key == "general.alignment":
                if not value or value & (value - 1):
                    raise c.corrupt(f"general.alignment {value} is not a power of two")
                alignment = value
        infos, names = [], set()
        for i in range(n_tensors):
            name = c.text(f"tensor info {i}")
            what = f"tensor '{name[:64]}'"
            if name in names:
                raise c.corrupt(f"{what} appears twice")
            names.add(name)
            n_dims = c.ints("I", what)[0]
            if not 1 <= n_dims <= _MAX_DIMS:
                raise c.corrupt(f"{what} has {n_dims} dimensions")
            dims = c.ints(f"{n_dims}Q", what)
            ttype, offset = c.ints("IQ", what)
            infos.append((offset, what, dims, ttype, name))
        data = -(-c.pos // alignment) * alignment  # the data section starts at the next multiple of the alignment
        readable = getattr(quants, "_type_traits", None)  # the types gguf.quants.dequantize handles, F32 and F16 aside
        prev_end, prev, sizes = 0, "", {}
        for offset, what, dims, ttype, name in sorted(infos):
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise c.corrupt(f"{what} has unknown type {ttype}") from None
            if readable is not None and qtype not in readable and qtype.name not in ("F32", "F16"):
                raise ModelError(f"{path}: {what} has type {qtype.name}, which specdec cannot dequantize: "
                                 "use a file of F32, F16, BF16, Q4_0 ... Q8_0 or K-quant tensors")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if min(dims) < 1 or dims[0] % block:
                raise c.corrupt(f"{what} has dimensions {list(dims)} for type {qtype.name}")
            nbytes = math.prod(dims) // block * type_size
            if offset % alignment:
                raise c.corrupt(f"{what} starts at {offset}, not a multiple of {alignment}")
            if offset < prev_end:
                raise c.corrupt(f"{what} overlaps {prev}")
            if data + offset + nbytes > len(buf):
                raise c.corrupt(f"{what} ends at byte {data + offset + nbytes} of a {len(buf)}-byte file")
            prev_end, prev = offset + nbytes, what
            sizes[name] = nbytes
    tensors = [(name, dims, ttype, offset, sizes[name]) for offset, _, dims, ttype, name in infos]
    return meta, tensors, data, c.order


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a file that is not a GGUF or whose header is truncated or corrupt (the header's walk
    alone: milliseconds)."""
    _open(path)


def read_gguf(path: Path) -> LoadedModel:
    """Read the config from GGUF metadata and return lazily dequantized tensors under canonical names."""
    from gguf import GGMLQuantizationType

    reader = _open(path)
    meta = reader.meta
    arch = meta.get("general.architecture")
    if arch not in FAMILIES and arch not in MOE_ARCHS:
        raise ModelError(f"unknown architecture '{arch}' in {path.name}: specdec supports {SUPPORTED}")
    tensors = {t.name.removesuffix(".weight"): t for t in reader.tensors}
    if arch in FAMILIES and any(n.endswith(("ffn_gate_inp", "ffn_gate_exps")) for n in tensors):
        raise ModelError(f"{path.name} is a mixture-of-experts variant of '{arch}' (e.g. Mixtral), which specdec "
                         "does not support: its MoE architectures are qwen3moe, glm4moe and deepseek2")
    try:
        args = _args_from_meta(arch, meta, tensors)
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of the wrong type, a zero head count ...
        raise ModelError(f"{path} has corrupt metadata ({brief(e)}): download the file again") from e

    def canonical(name: str) -> str:
        m = _BLOCK_RE.match(name)
        if name.endswith(".exp_probs_b.bias"):  # the sigmoid router's bias, stored as a .bias of nothing
            name = name.removesuffix(".bias")
            m = _BLOCK_RE.match(name)
        if m and int(m[1]) >= args.n_layers:  # an MTP block: blk.{L+i}.nextn.eh_proj -> mtp.{i}.eh_proj
            return f"mtp.{int(m[1]) - args.n_layers}.{m[2].removeprefix('nextn.')}"
        return name

    mm = getattr(reader.data, "_mmap", None)

    def release(t) -> None:
        """Drop this tensor's file pages from our mapping once it is converted: they stay in the page cache, but
        no longer count in our resident memory (else a first load's RSS would grow by the whole file)."""
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        lo = t.data_offset // page * page
        mm.madvise(mmap.MADV_DONTNEED, lo, min(t.data_offset + t.n_bytes, len(mm)) - lo)

    def permuted(w: torch.Tensor, name: str) -> torch.Tensor:
        if arch == "llama" and name.endswith(("attn_q", "attn_q.bias")):
            return unpermute_rotary(w, args.n_heads)
        if arch == "llama" and name.endswith(("attn_k", "attn_k.bias")):
            return unpermute_rotary(w, args.n_kv_heads)
        return w

    def loader(t, name: str, expert: int | None = None):
        """expert: one expert's [N, K] slice of a stacked [E, N, K] tensor (only its bytes are read)."""

        def load() -> torch.Tensor:
            data = t.data if expert is None else t.data[expert]
            shape = tuple(int(s) for s in reversed(t.shape))[0 if expert is None else 1:]
            w = dequantize_f32(data, GGMLQuantizationType(t.tensor_type), shape)
            if expert is None or expert == t.shape[-1] - 1:
                release(t)
            return rope_layout(args, name, permuted(w, name))

        return load

    def row_loader(t, shape: tuple[int, int]) -> Rows:
        """The matrix by ranges of rows (only the bytes of those rows are read and dequantized); its file pages are
        released once the last row is read."""

        def read(a: int, b: int) -> torch.Tensor:
            w = dequantize_f32(t.data[a:b], GGMLQuantizationType(t.tensor_type), (b - a, shape[1]))
            if b == shape[0]:
                release(t)
            return w

        return Rows(shape, read)

    def code_loader(t, name: str, expert: int | None = None):
        def load() -> tuple[torch.Tensor, ...]:
            data = t.data if expert is None else t.data[expert]
            parts = own_codes(np.asarray(data), GGMLQuantizationType(t.tensor_type))
            if expert is None or expert == t.shape[-1] - 1:
                release(t)
            return type(parts)(rope_layout(args, name, permuted(x, name)) for x in parts)

        return load

    loaders, nbytes, numel, codes, shapes, rows = {}, {}, {}, {}, {}, {}
    for name, t in tensors.items():
        if name == "rope_freqs":
            continue  # folded into args.rope_scaling
        name = canonical(name)
        shape = tuple(int(s) for s in reversed(t.shape))
        coded = GGMLQuantizationType(t.tensor_type).name in (*INT4_CODES, *OWN_CODES)  # codes as they are
        stacked = _STACKED.get(name.rsplit(".", 1)[-1]) if len(shape) == 3 else None
        if stacked:  # blk.N.ffn_up_exps [E, N, K] -> blk.N.exp.{e}.ffn_up [N, K], each loaded on its own
            for e in range(shape[0]):
                one = f"{name.rsplit('.', 1)[0]}.exp.{e}.{stacked}"
                shapes[one], loaders[one] = shape[1:], loader(t, one, e)
                if coded:
                    codes[one] = code_loader(t, one, e)
                nbytes[one], numel[one] = int(t.n_bytes) // shape[0], int(t.n_elements) // shape[0]
            continue
        shapes[name] = shape
        loaders[name] = loader(t, name)
        if name in ("token_embd", "output") and len(shape) == 2:  # never permuted (rope_layout leaves them)
            rows[name] = row_loader(t, shape)
        if coded and len(t.shape) == 2:
            codes[name] = code_loader(t, name)
        nbytes[name] = int(t.n_bytes)
        numel[name] = int(t.n_elements)
    check_model(args, shapes, str(path))
    # the modules the file really holds (a converter may keep the metadata but drop the MTP tensors)
    args.n_mtp_layers = sum(f"mtp.{i}.eh_proj" in loaders for i in range(args.n_mtp_layers))
    args.mtp_layout = args.mtp_layout if args.n_mtp_layers else None
    types = collections.Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) == 2)
    main_type = types.most_common(1)[0][0] if types else "F32"
    mixed = "" if len(types) <= 1 else " (mixed: " + ", ".join(f"{k} x{v}" for k, v in types.most_common()) + ")"
    return LoadedModel(args, LazyWeights(loaders, nbytes, numel, codes, rows), path, f"GGUF {main_type}{mixed}",
                       extra={"meta": meta})


def brief(e: BaseException) -> str:
    """An exception as a short single line, to quote inside a ModelError."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def check_model(args: ModelArgs, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Refuse, in one line, a model whose config and tensors disagree, before the model is built from them.

    args: the config as read; shapes: canonical tensor name -> PyTorch shape ([out, in] for matrices). The config
    must be sane (sizes positive, heads a multiple of KV heads, an even head_dim for RoPE), and every tensor the
    trunk reads (models/transformer.py) must exist with the shape the config implies. Both readers call this (the
    names are llama.cpp's, hence its place here)."""
    sizes = {"vocab_size": args.vocab_size, "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim, "ffn_dim": args.ffn_dim,
             "max_seq_len": args.max_seq_len}
    bad = [f"{k} = {v}" for k, v in sizes.items() if v < 1]
    if not bad and args.n_heads % args.n_kv_heads:
        bad.append(f"n_heads = {args.n_heads} is not a multiple of n_kv_heads = {args.n_kv_heads}")
    if not bad and args.head_dim % 2:
        bad.append(f"head_dim = {args.head_dim} is odd")
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type") == "freq_factors" and len(scaling["factors"]) != args.head_dim // 2:
        bad.append(f"rope_freqs has {len(scaling['factors'])} factors for head_dim {args.head_dim}")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if scaling.get("rope_type") == "llama3" and not all(isinstance(scaling.get(k), int | float) for k in need):
        bad.append(f"llama3 rope scaling needs {', '.join(need)}")
    if args.n_experts and not 1 <= args.n_experts_used <= args.n_experts:
        bad.append(f"{args.n_experts_used} experts per token of {args.n_experts}")
    if args.n_experts and (args.n_experts % args.router_groups or args.router_topk_groups > args.router_groups):
        bad.append(f"{args.n_experts} experts in {args.router_groups} groups, {args.router_topk_groups} kept")
    if bad:
        raise ModelError(f"{where}: the config is corrupt ({'; '.join(bad)}): download or convert the model again")
    D, F, hd = args.dim, args.ffn_dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    want = {"token_embd": (args.vocab_size, D), "output_norm": (D,)}
    if not args.tie_embeddings:
        want["output"] = (args.vocab_size, D)
    layer = {"attn_norm": (D,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D), "attn_output": (D, q),
             "ffn_norm": (D,)}
    if args.attention == "mla":
        r, qk = args.kv_lora_rank, args.n_heads * (args.qk_nope_dim + args.qk_rope_dim)
        layer = {"attn_norm": (D,), "attn_kv_a_mqa": (r + args.qk_rope_dim, D), "attn_kv_a_norm": (r,),
                 "attn_output": (D, args.n_heads * args.v_head_dim), "ffn_norm": (D,)}
        ql = args.q_lora_rank
        layer.update({"attn_q_a": (ql, D), "attn_q_a_norm": (ql,), "attn_q_b": (qk, ql)} if ql else {"attn_q": (qk, D)})
    dense = {"ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    Fm, Fs = args.moe_ffn_dim, args.moe_ffn_dim * args.n_shared_experts
    moe = {"ffn_gate_inp": (args.n_experts, D)}
    for e in range(args.n_experts):
        moe.update({f"exp.{e}.ffn_gate": (Fm, D), f"exp.{e}.ffn_up": (Fm, D), f"exp.{e}.ffn_down": (D, Fm)})
    if Fs:
        moe.update(ffn_gate_shexp=(Fs, D), ffn_up_shexp=(Fs, D), ffn_down_shexp=(D, Fs))
    if args.qkv_bias:
        layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if args.qk_norm:
        layer.update(attn_q_norm=(hd,), attn_k_norm=(hd,))
    if args.sandwich_norms:
        layer.update(post_attention_norm=(D,), post_ffw_norm=(D,))
    want.update({f"blk.{i}.{k}": shape for i in range(args.n_layers)
                 for k, shape in {**layer, **(moe if args.moe_layers[i] else dense)}.items()})
    for name, shape in want.items():
        if name not in shapes:
            raise ModelError(f"{where} lacks tensor {name}: the file is incomplete, download or convert it again")
        if tuple(shapes[name]) != shape:
            raise ModelError(f"{where}: tensor {name} has shape {list(shapes[name])} where the config implies "
                             f"{list(shape)}: the file is corrupt, download or convert it again")


INT4_CODES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit formats whose codes our int4 layout holds as they are
OWN_CODES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")  # formats whose codes the kernel takes as they are (quant.Int6Linear)


def _bytes(blocks: np.ndarray, block_bytes: int) -> torch.Tensor:
    """A tensor's quantized bytes (read-only file pages) as a writable uint8 tensor [blocks, block_bytes]."""
    return torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True)).reshape(-1, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> [...] float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _q6_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [n, 210] (ql: low nibbles, qh: 2 high bits, 16 int8 scales, f16 d) -> codes q [n, 256]
    uint8 in 0..63, scales sc [n, 16] int8, d [n, 1] f32: w = d sc (q - 32) per 16."""
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    lo = torch.cat([ql & 15, ql >> 4], dim=2).reshape(n, 256)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 256)
    return lo | (hi << 4), b[:, 192:208].contiguous().view(torch.int8), _f16(b[:, 208:210])[:, None]


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [n, 210] -> [n, 256] f32 as gguf-py's Q6_K.dequantize_blocks computes them ((d scale) q,
    q = ql | qh << 4 - 32), bit for bit."""
    q, sc, d = _q6_k_parts(b)
    n = b.shape[0]
    scale = (d * sc.float()).reshape(n, 16, 1)
    return (scale * (q.view(torch.int8) - 32).reshape(n, 16, 16).float()).reshape(n, 256)


def q5_codes(blocks: np.ndarray) -> Q5Codes:
    """A Q5_K tensor's own codes and scales, without dequantizing: blocks [N, bytes per row] -> Q5Codes (q [N, K]
    uint8 in 0..31, d, dmin [N, K/256] f32, sc, mn [N, K/32] uint8). A Q5_K super-block is Q4_K's (f16 d, dmin, 12
    bytes of scales, 128 of nibbles) with 32 bytes of fifth bits before the nibbles: sub-block i's from bit i."""
    N = blocks.shape[0]
    b = _bytes(blocks, 176)
    lo, d, dmin, sc, mn = _q4_k_parts(torch.cat([b[:, :16], b[:, 48:]], dim=1))
    qh = b[:, 16:48]
    hi = torch.stack([(qh >> i) & 1 for i in range(8)], dim=1)  # [n, 8, 32]
    return Q5Codes(t.reshape(N, -1) for t in ((lo | (hi << 4)), d, dmin, sc, mn))


def q6_codes(blocks: np.ndarray) -> Q6Codes:
    """A Q6_K tensor's own codes and scales, without dequantizing: blocks [N, bytes per row] -> (q [N, K] uint8 in
    0..63, sc [N, K/16] int8, d [N, K/256] f32) with w = d sc (q - 32), as _q6_k reads them."""
    N = blocks.shape[0]
    return Q6Codes(t.reshape(N, -1) for t in _q6_k_parts(_bytes(blocks, 210)))


def q501_codes(blocks: np.ndarray, qtype) -> Q501Codes:
    """A Q5_0 / Q5_1 tensor's own codes and factors, without dequantizing: blocks [N, bytes per row] -> Q501Codes
    (q [N, K] uint8 in 0..31, d, m [N, K/32] f32; Q5_0: m = -16 d, exact). A block of 32: f16 d (Q5_1: then f16 m),
    a little-endian uint32 whose bit j is element j's fifth bit, 16 bytes of nibbles (element j in the low nibble of
    byte j, j + 16 in the high one), as gguf-py's Q5_0 / Q5_1 dequantize_blocks read them."""
    size = 24 if qtype.name == "Q5_1" else 22
    N = blocks.shape[0]
    b = _bytes(blocks, size).reshape(N, -1, size)
    d = _f16(b[..., :2])  # [N, G]
    m = _f16(b[..., 2:4]) if size == 24 else -16 * d
    qh = b[..., size - 20:size - 16, None] >> torch.arange(8, dtype=torch.uint8)  # [N, G, 4, 8]: bit 8 k + i
    qs = b[..., size - 16:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1) | ((qh & 1).reshape(N, -1, 32) << 4)
    return Q501Codes((q.reshape(N, -1), d, m))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [n, 34] (f16 d, 32 int8) -> [n, 32] f32, x d as gguf-py computes it."""
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])[:, None]


def _q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K super-blocks [n, 144] (f16 d, dmin; 8 6-bit scales and minimums in 12 bytes, as llama.cpp's
    get_scale_min_k4 reads them; 128 bytes of nibbles) -> codes [n, 8, 32] uint8, d and dmin [n, 1] f32, sc and mn
    [n, 8] uint8: the sub-block of 32 j holds w = (d sc_j) q - dmin mn_j. Elements 64 i .. 64 i + 31 are the low
    nibbles of bytes 32 i .. 32 i + 31, the next 32 their high nibbles."""
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    s = b[:, 4:16].reshape(-1, 3, 4)
    sc = torch.cat([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], dim=-1)
    mn = torch.cat([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], dim=-1)
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    return torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32), d, dmin, sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [n, 144] -> [n, 256] f32, (d sc) q - dmin mn as gguf-py computes them."""
    q, d, dmin, sc, mn = _q4_k_parts(b)
    return ((d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]).reshape(-1, 256)


# formats dequantized in PyTorch, by bytes per block (vectorized and threaded: 1.7-2.9x gguf-py's NumPy on 2 cores,
# the same floats; docs/results/first-load-torch-1206.txt); the others by gguf-py
TORCH_DEQUANT = {"Q4_K": (144, _q4_k), "Q6_K": (210, _q6_k), "Q8_0": (34, _q8_0)}


def dequantize_f32(data: np.ndarray, qtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes (all, an expert's, a range of rows) dequantized: a writable f32 tensor of `shape`."""
    from gguf import GGMLQuantizationType, dequantize

    if qtype.name in TORCH_DEQUANT:
        block_bytes, f = TORCH_DEQUANT[qtype.name]
        return f(_bytes(data, block_bytes)).reshape(shape)
    arr = np.asarray(data) if qtype == GGMLQuantizationType.F32 else dequantize(data, qtype)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy()).reshape(shape)


def int4_codes(blocks: np.ndarray, qtype) -> tuple[torch.Tensor, ...]:
    """A Q4_0 / Q4_1 / Q4_K tensor's own codes and per-32 scales, without dequantizing: blocks [N, bytes per row]
    -> (q [N, K] uint8 in 0..15, scale [N, K/32], zero [N, K/32] f32) with w = (q - 8) scale + zero; Q4_K adds its
    own scales, (d, dmin [N, K/256] f32, sc, mn [N, K/32] uint8), which the kernel takes as they are (quant.py).

    Q4_0: w = d (q - 8); Q4_1: w = d q + m; Q4_K: super-blocks of 256 with 8 sub-blocks of 32, w = d sc q - dmin mn
    (6-bit sc, mn packed in 12 bytes as llama.cpp's get_scale_min_k4 reads them). Nibble order: Q4_0 / Q4_1 keep
    element j in the low nibble of byte j and j + 16 in the high one; Q4_K does so per 64 elements (32 bytes)."""
    name = qtype.name
    N = blocks.shape[0]
    if name in ("Q4_0", "Q4_1"):
        b = _bytes(blocks, 18 if name == "Q4_0" else 20).reshape(N, -1, 18 if name == "Q4_0" else 20)
        d = _f16(b[..., :2])  # [N, G]
        qs = b[..., 2 if name == "Q4_0" else 4:]  # [N, G, 16]
        zero = torch.zeros_like(d) if name == "Q4_0" else _f16(b[..., 2:4]) + 8 * d
        return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, -1), d, zero
    if name == "Q4_K":
        q, d, dmin, sc, mn = _q4_k_parts(_bytes(blocks, 144))  # every super-block of every row
        scale, dm = (d * sc.float()).reshape(N, -1), (dmin * mn.float()).reshape(N, -1)
        return (q.reshape(N, -1), scale, 8 * scale - dm, d.reshape(N, -1), dmin.reshape(N, -1), sc.reshape(N, -1),
                mn.reshape(N, -1))
    raise ValueError(name)


def own_codes(blocks: np.ndarray, qtype) -> tuple[torch.Tensor, ...]:
    """A tensor's codes as the kernel keeps them, by format: int4_codes (INT4_CODES), Q5Codes, Q6Codes, Q501Codes."""
    if qtype.name in ("Q5_0", "Q5_1"):
        return q501_codes(blocks, qtype)
    own = {"Q6_K": q6_codes, "Q5_K": q5_codes}.get(qtype.name)
    return own(blocks) if own else int4_codes(blocks, qtype)


def _args_from_meta(arch: str, meta: dict, tensors: dict) -> ModelArgs:
    def g(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key: str):
        v = g(key)
        if v is None:
            raise ModelError(f"GGUF metadata lacks '{arch}.{key}': the file is incomplete, convert it again")
        return v

    n_heads = int(need("attention.head_count"))
    kv = g("attention.head_count_kv", n_heads)
    if isinstance(kv, list | tuple):
        if len(set(kv)) != 1:
            raise ModelError("per-layer KV head counts are not supported")
        kv = kv[0]
    dim = int(need("embedding_length"))
    head_dim = int(g("attention.key_length", dim // n_heads))
    if "token_embd" not in tensors:
        raise ModelError("GGUF has no token_embd tensor: the file is incomplete, convert it again")
    vocab = int(tensors["token_embd"].shape[1])
    n_mtp = int(g("nextn_predict_layers", 0) or 0)
    n_layers = int(need("block_count")) - n_mtp  # llama.cpp counts the MTP blocks in block_count
    if n_layers < 1 or n_mtp < 0:
        raise ModelError(f"GGUF metadata: {arch}.nextn_predict_layers = {n_mtp} does not fit block_count")
    if n_layers > len(tensors):  # before ModelArgs makes per-layer lists
        raise ModelError(f"GGUF metadata: {arch}.block_count = {n_layers} for {len(tensors)} tensors: the file is "
                         "corrupt, download it again")
    rope_scaling = None
    if "rope_freqs" in tensors:  # llama-3 rope scaling, precomputed by the converter as per-frequency divisors
        rope_scaling = {"rope_type": "freq_factors", "factors": np.asarray(tensors["rope_freqs"].data).tolist()}
    elif g("rope.scaling.type") not in (None, "none"):
        kind = g("rope.scaling.type")
        if kind == "yarn":
            rope_scaling = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor", 1.0)),
                            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
                            "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                            "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0))}
        elif kind != "linear":
            raise ModelError(f"rope scaling '{kind}' is not supported (linear, llama3 and yarn are)")
        else:
            rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
    args = dict(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=int(kv),
        head_dim=head_dim, ffn_dim=int(need("feed_forward_length")),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, max_seq_len=int(g("context_length", 4096)), tie_embeddings="output" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm" in tensors,
        n_mtp_layers=n_mtp, mtp_layout="deepseek" if n_mtp else None,
    )
    if FAMILIES.get(arch) == "gemma3":
        window = g("attention.sliding_window")
        pattern = g("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list | tuple):
            sliding = [bool(x) for x in pattern][:n_layers]
        else:  # llama.cpp: every pattern-th layer is global, the others slide
            sliding = [(i % int(pattern)) < int(pattern) - 1 for i in range(n_layers)]
        args.update(
            sliding_window=int(window) if window else None, sliding_layers=sliding if window else [],
            rope_local_theta=float(g("rope.freq_base_swa", 10000.0)), embed_scale=dim**0.5,
            activation="gelu_tanh", sandwich_norms=True, qk_norm=True,
            final_logit_softcap=g("final_logit_softcapping"),
        )
    elif g("attention.sliding_window"):
        args["sliding_window"] = int(g("attention.sliding_window"))
    if arch in MOE_ARCHS:
        args.update(_moe_meta(arch, g, need, n_heads, rope_scaling,
                              [f"blk.{i}.ffn_gate_inp" in tensors for i in range(n_layers)]))
    return ModelArgs(**args)


def _moe_meta(arch: str, g, need, n_heads: int, rope_scaling: dict | None, moe_layers: list[bool]) -> dict:
    """The mixture-of-experts and MLA fields of ModelArgs from llama.cpp's metadata (convert_hf_to_gguf.py's
    Qwen3MoeModel, Glm4MoeModel, DeepseekV2Model: expert_count, expert_used_count, expert_feed_forward_length,
    expert_shared_count, leading_dense_block_count, expert_gating_func, expert_group_count / _used_count,
    expert_weights_scale / _norm; MLA: attention.q_lora_rank, kv_lora_rank, key_length_mla, value_length_mla,
    rope.dimension_count). moe_layers: which layers have a router (leading dense layers, Qwen3's mlp_only_layers
    and decoder_sparse_step all show that way)."""
    from gguf import ExpertGatingFuncType

    gating = int(g("expert_gating_func", ExpertGatingFuncType.SIGMOID if arch == "glm4moe" else
                   ExpertGatingFuncType.SOFTMAX))
    if gating not in (ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SIGMOID):
        raise ModelError(f"GGUF metadata: {arch}.expert_gating_func = {gating} is a MoE variant specdec does not "
                         "support (softmax and sigmoid routing are)")
    sigmoid = gating == ExpertGatingFuncType.SIGMOID
    name = "deepseek_v3" if arch == "deepseek2" and sigmoid else MOE_ARCHS[arch]
    groups = int(g("expert_group_count", 1) or 1)
    out = dict(arch=name, n_experts=int(need("expert_count")), n_experts_used=int(need("expert_used_count")),
               moe_ffn_dim=int(need("expert_feed_forward_length")),
               n_shared_experts=int(g("expert_shared_count", 0) or 0),
               moe_layers=moe_layers, router="sigmoid" if sigmoid else "softmax",
               router_groups=groups, router_topk_groups=int(g("expert_group_used_count", groups) or groups),
               router_group_score="top2" if sigmoid else "max",
               norm_topk_prob=bool(g("expert_weights_norm", arch == "qwen3moe")),
               routed_scaling=float(g("expert_weights_scale", 1.0) or 1.0))
    if arch == "glm4moe":
        out["rotary_dim"] = int(g("rope.dimension_count", int(need("attention.key_length")) // 2))
    if arch == "deepseek2":
        from .hf import yarn_attention_factor

        n_rope = int(need("rope.dimension_count"))
        qk, r = int(need("attention.key_length_mla")), int(need("attention.kv_lora_rank"))
        ql = g("attention.q_lora_rank")
        out.update(attention="mla", q_lora_rank=int(ql) if ql else None, kv_lora_rank=r, qk_nope_dim=qk - n_rope,
                   qk_rope_dim=n_rope, v_head_dim=int(need("attention.value_length_mla")), head_dim=qk,
                   n_kv_heads=n_heads, qkv_bias=False, qk_norm=False)
        scale = qk ** -0.5
        if rope_scaling and rope_scaling["rope_type"] == "yarn":
            # the converter keeps 0.1 * mscale_all_dim (yarn_log_multiplier) but not mscale: every DeepSeek
            # config has mscale == mscale_all_dim, so YaRN's cos/sin factor is 1 (as llama.cpp computes it)
            mscale_all = float(g("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            if mscale_all:
                rope_scaling.update(mscale=mscale_all, mscale_all_dim=mscale_all)
                scale *= yarn_mscale(rope_scaling["factor"], mscale_all) ** 2
            out["rope_attention_factor"] = yarn_attention_factor(rope_scaling)
        out["query_scale"] = scale
    elif rope_scaling and rope_scaling["rope_type"] == "yarn":
        from .hf import yarn_attention_factor

        out["rope_attention_factor"] = yarn_attention_factor(rope_scaling)
    return out
