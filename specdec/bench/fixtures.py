"""Random-weight GGUF files in real model shapes and real quantization mixes, for benchmarks at real sizes.

Decoding speed depends on the shapes and formats of the weights, not on their values, and no model larger than
SmolLM2-135M / Gemma-3-270M ships on this machine's package index. So these files have the exact tensor shapes of
Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B / 7B / 14B and the tensor types llama.cpp's quantizer gives them (Q4_0,
Q5_0, Q5_1, Q8_0: that type with a Q6_K output head, or Q8_0's own; Q4_K_M: Q4_K, with Q6_K for the output head and
for attn_v / ffn_down in the layers llama.cpp's `use_more_bits` picks, llama-quant.cpp, or Q5_K_M: the same with
Q5_K), filled with random valid blocks (fp16 block scales chosen so the weights have a standard deviation of ~0.02).
The SmolLM2 tokenizer is copied in, its token list padded with unused tokens to the shape's vocabulary size, so
llama.cpp runs the very same file.

Mixture-of-experts shapes (MOE_SHAPES) are written as llama.cpp's converter lays them out: experts stacked into
3-D ffn_{gate,up,down}_exps [E, N, K], the router ffn_gate_inp kept F32 (the quantizer never quantizes it), shared
experts ffn_*_shexp, and for `deepseek2` (MLA) attn_kv_a_mqa, attn_kv_a_norm and the split attn_k_b [H, r, n] /
attn_v_b [H, v, r] of the current converter. Q4_K_M follows llama-quant.cpp for them too: every tensor whose name
holds "ffn_down" (ffn_down_exps, ffn_down_shexp) takes Q6_K in the use_more_bits layers (the layer read from the
name, as it does for n_expert > 1), attn_kv_b counts as attn_v, and a row length that is not a multiple of the
type's block falls back as tensor_type_fallback does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16): e.g.
DeepSeek-V2-Lite's experts of 1408 get Q5_0 / Q8_0 ffn_down_exps, as its published Q4_K_M file has. Sizes at
Q4_K_M: qwen3-30b-a3b 18.6 GB, deepseek-v2-lite 10.4 GB (as the published files), qwen3-moe-mini 5.1 GB,
olmoe-1b-7b 4.2 GB.

    python -m specdec.bench.fixtures --shape llama-3.2-1b --quant Q4_0 -o out/fixtures/
    python -m specdec.bench.fixtures --shape olmoe-1b-7b --quant Q4_K_M -o out/fixtures/
    python -m specdec.bench.fixtures --list

Tensors are generated and written one at a time (gguf's streaming writer), so writing an 8B file takes seconds of
CPU and little memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# name -> (arch, dim, layers, heads, kv heads, ffn, vocab, tied, rope theta, context); from the models' config.json
SHAPES = {
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 131072),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1000000.0, 32768),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0, 32768),
    "qwen2.5-14b": ("qwen2", 5120, 48, 40, 8, 13824, 152064, False, 1000000.0, 32768),
}
QUANTS = ("Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M")
# byte offsets of the fp16 block scale d and (for formats with one) the minimum / dmin
_SCALES = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q5_0": (0, None), "Q5_1": (0, 2), "Q8_0": (0, None), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208, None)}
# llama-quant.cpp tensor_type_fallback: a row length the type's block does not divide
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass
class Shape:
    name: str
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int
    head_size: int = 0  # 0: dim / heads (Qwen3 has 128 whatever dim / heads)
    # mixture of experts: routed experts (0: dense), per token, each one's hidden size, shared experts, leading
    # dense layers (of ffn), top-k weights renormalized, routed scaling factor
    n_experts: int = 0
    n_experts_used: int = 0
    moe_ffn: int = 0
    n_shared: int = 0
    first_dense: int = 0
    norm_topk: bool = False
    routed_scaling: float = 1.0
    # multi-head latent attention (deepseek2): q low-rank (0: a plain q), kv latent, nope / rope / value head sizes
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    yarn: tuple[float, int, float] | None = None  # (factor, original context, mscale_all_dim)
    norm_eps: float = 0.0  # 0: llama 1e-5, others 1e-6

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def describe(self) -> str:
        text = (f"{self.arch}, dim {self.dim}, {self.n_layers} layers, {self.n_heads}/{self.n_kv} heads"
                + (f" of {self.head_dim}" if self.head_size else "") + f", ffn {self.ffn}, vocab {self.vocab}, "
                f"{'tied' if self.tied else 'untied'}")
        if self.n_experts:
            text += (f"; {self.n_experts_used} of {self.n_experts} experts of {self.moe_ffn}"
                     + (f" + {self.n_shared} shared" if self.n_shared else "")
                     + (f", first {self.first_dense} dense" if self.first_dense else ""))
        if self.kv_lora_rank:
            text += (f"; MLA kv_lora {self.kv_lora_rank}, q_lora {self.q_lora_rank or 'none'}, qk {self.qk_nope}+"
                     f"{self.qk_rope}, v {self.v_head}")
        return text


# from the models' config.json. OLMoE (llama.cpp arch `olmoe`, q/k norms over the whole projection, no top-k
# renormalization) is not an architecture specdec reads, so its shape is written as `qwen3moe` (per-head q/k
# norms): the same tensors and bytes per token, llama.cpp renormalizing the top-k weights as Qwen3 does.
MOE_SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", "qwen3moe", 2048, 48, 32, 4, 6144, 151936, False, 1000000.0, 40960,
                           head_size=128, n_experts=128, n_experts_used=8, moe_ffn=768, norm_topk=True),
    "qwen3-moe-mini": Shape("qwen3-moe-mini", "qwen3moe", 2048, 24, 32, 4, 6144, 151936, False, 1000000.0, 40960,
                            head_size=128, n_experts=64, n_experts_used=8, moe_ffn=768, norm_topk=True),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", "qwen3moe", 2048, 16, 16, 16, 1024, 50304, False, 10000.0, 4096,
                         n_experts=64, n_experts_used=8, moe_ffn=1024),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", "deepseek2", 2048, 27, 16, 16, 10944, 102400, False, 10000.0,
                              163840, n_experts=64, n_experts_used=6, moe_ffn=1408, n_shared=2, first_dense=1,
                              kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128, yarn=(40.0, 4096, 0.707)),
}


def shape(name: str) -> Shape:
    if name in MOE_SHAPES:
        return MOE_SHAPES[name]
    if name not in SHAPES:
        raise ValueError(f"unknown shape '{name}': choose from {', '.join([*SHAPES, *MOE_SHAPES])}")
    return Shape(name, *SHAPES[name])


def tiny_shape(shape_name: str, **overrides) -> Shape:
    """A few-layer, small-dimension variant of a shape, of the same kind (arch, experts, MLA, leading dense layers),
    for tests: dims that exercise the block fallbacks (rows of 160 or 352 are no multiple of 256), the SmolLM2
    vocabulary. llama.cpp reads a deepseek2 file without q_lora_rank only at 26 or 27 layers (it takes those for
    the "lite" models): pass n_layers=27 for a tiny DeepSeek-V2-Lite that llama.cpp loads too."""
    s = shape(shape_name)
    small = dict(name=f"{shape_name}-tiny", dim=256, n_layers=2 + s.first_dense, n_heads=2,
                 n_kv=2 if s.n_kv == s.n_heads else 1, ffn=352, vocab=49152, context=4096)
    if s.head_size:
        small["head_size"] = 64
    if s.n_experts:
        small.update(n_experts=4, n_experts_used=2, moe_ffn=160)
    if s.kv_lora_rank:
        small.update(n_kv=2, kv_lora_rank=256, qk_nope=64, qk_rope=32, v_head=64)
    return dataclasses.replace(s, **{**small, **overrides})


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama-quant.cpp use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(quant: str, name: str, layer: int | None, n_layers: int, row: int | None = None,
                n_experts: int = 0) -> str:
    """The type llama.cpp's quantizer gives a 2-D or 3-D (stacked experts) tensor for `quant` (llama-quant.cpp,
    llama_tensor_get_type): name without "blk.N." and ".weight"; row: its row length (ggml's ne[0]), for the
    block-size fallback; n_experts: the model's expert count (its 8-expert, Mixtral rules)."""
    if name == "ffn_gate_inp" or name.endswith("norm"):
        return "F32"  # never quantized
    if quant not in ("Q4_K_M", "Q5_K_M"):
        t = quant if name != "output" else ("Q8_0" if quant == "Q8_0" else "Q6_K")
        if n_experts == 8 and name in ("attn_v", "attn_kv_b", "attn_k"):
            t = "Q8_0"
    elif name == "output":
        t = "Q6_K"
    elif n_experts == 8 and name in ("attn_v", "attn_kv_b", "attn_k"):
        t = "Q8_0"  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    elif n_experts == 8 and name == "attn_output":
        t = "Q5_K"
    elif (name in ("attn_v", "attn_kv_b") or "ffn_down" in name) and layer is not None and _more_bits(layer,
                                                                                                      n_layers):
        t = "Q6_K"
    else:
        t = quant[:4]  # Q4_K (Q4_K_M) or Q5_K (Q5_K_M): the same rules, llama_tensor_get_type
    return _fallback(t, row)


def _fallback(qtype: str, row: int | None) -> str:
    """llama-quant.cpp tensor_type_fallback: a type whose block does not divide the row length falls back to a
    32-block type, and to F16 when even that does not divide it."""
    import gguf

    if row is None or qtype in ("F32", "F16"):
        return qtype
    block = lambda t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]  # noqa: E731
    if row % block(qtype):
        qtype = _FALLBACK.get(qtype, qtype)
        if row % block(qtype):
            qtype = "F16"
    return qtype


def random_blocks(qtype: str, rows: int, cols: int, seed: int, std: float = 0.02) -> np.ndarray:
    """Random valid `qtype` blocks for a [rows, cols] matrix as raw bytes [rows, bytes per row]: random codes and
    sub-scales, fp16 block scales (and minimums) set so the dequantized values have mean ~0 and std ~`std`."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    d_at, m_at = _SCALES[qtype]

    def put(at: int, values: np.ndarray, rows_: slice = slice(None)) -> None:
        blocks[rows_, at:at + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)

    # calibrate on a sample: unit scales, the minimum chosen to centre the values, then rescale to `std`
    sample = slice(0, min(n, 512))
    k = sample.stop
    put(d_at, np.ones(k, np.float32), sample)
    if m_at is not None:
        put(m_at, np.zeros(k, np.float32), sample)
        mean0 = float(gguf.quants.dequantize(blocks[sample], qt).mean())
        put(m_at, np.ones(k, np.float32), sample)
        slope = float(gguf.quants.dequantize(blocks[sample], qt).mean()) - mean0  # mean per unit of the minimum
        m_unit = -mean0 / slope if slope else 0.0
        put(m_at, np.full(k, m_unit, np.float32), sample)
    spread = float(gguf.quants.dequantize(blocks[sample], qt).std()) or 1.0
    d = (std / spread) * rng.uniform(0.75, 1.25, size=n).astype(np.float32)
    put(d_at, d)
    if m_at is not None:
        put(m_at, d * m_unit)
    return blocks.reshape(rows, -1)


def _tokenizer_fields(vocab: int) -> dict:
    """The SmolLM2 tokenizer's GGUF metadata, its token list padded with unused tokens to `vocab`."""
    import gguf

    from ..loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out[key] = (field.contents(), field.types)
    tokens = list(out["tokenizer.ggml.tokens"][0])
    types = list(out["tokenizer.ggml.token_type"][0])
    pad = vocab - len(tokens)
    out["tokenizer.ggml.tokens"] = (tokens + [f"<|fixture_unused_{i}|>" for i in range(pad)], None)
    out["tokenizer.ggml.token_type"] = (types + [int(gguf.TokenType.UNUSED)] * pad, None)
    return out


def write_fixture(shape_name: str | Shape, quant: str, out: Path, seed: int = 0, progress: bool = True) -> Path:
    """Write the random-weight GGUF for a shape (a name, or a Shape such as tiny_shape()'s) and quantization mix;
    returns its path."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"unknown quantization '{quant}': choose from {', '.join(QUANTS)}")
    s = shape(shape_name) if isinstance(shape_name, str) else shape_name
    path = out / f"{s.name}-{quant}.gguf" if out.is_dir() or not out.suffix else out
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"{s.name} random weights ({quant}, specdec fixture)")
    w.add_context_length(s.context)
    w.add_embedding_length(s.dim)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(1 if s.kv_lora_rank else s.n_kv)  # MLA is converted to MQA over the latent
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.norm_eps or (1e-5 if s.arch == "llama" else 1e-6))
    w.add_vocab_size(s.vocab)
    w.add_file_type({"Q4_0": 2, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17}[quant])
    if s.n_experts:
        _add_moe_metadata(w, s)
    for key, (value, types) in _tokenizer_fields(s.vocab).items():
        if key == "tokenizer.ggml.model":
            w.add_tokenizer_model(value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif types and types[0] == gguf.GGUFValueType.BOOL:
            w.add_bool(key, bool(value))
        else:
            w.add_uint32(key, int(value))

    tensors = fixture_tensors(s, quant)

    def make(name: str, shp: tuple[int, ...], qtype: str) -> np.ndarray:
        seed_t = zlib.crc32(f"{seed}:{name}".encode())
        if qtype in ("F32", "F16"):
            rng = np.random.default_rng(seed_t)
            if name.endswith("norm.weight"):
                return (1.0 + 0.05 * rng.standard_normal(shp)).astype(np.float32)
            return (0.02 * rng.standard_normal(shp)).astype(np.float32 if qtype == "F32" else np.float16)
        rows = int(np.prod(shp[:-1]))
        return random_blocks(qtype, rows, shp[-1], seed_t).reshape(*shp[:-1], -1)

    for name, shp, qtype in tensors:
        qt = gguf.GGMLQuantizationType[qtype]
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        if qtype in ("F32", "F16"):
            dtype = np.dtype(np.float32 if qtype == "F32" else np.float16)
            w.add_tensor_info(name, shp, dtype, int(np.prod(shp)) * dtype.itemsize)
            continue
        n_bytes = int(np.prod(shp)) // block * nbytes
        byte_shape = (*shp[:-1], shp[-1] // block * nbytes)  # as the writer takes raw blocks
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n_bytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    from tqdm import tqdm

    for name, shp, qtype in tqdm(tensors, desc=f"writing {path.name}", unit="tensor", disable=not progress,
                                 file=sys.stderr):
        w.write_tensor_data(make(name, shp, qtype))
    w.close()
    return path


def _add_moe_metadata(w, s: Shape) -> None:
    """The keys llama.cpp's converter writes for Qwen3MoeModel / DeepseekV2Model (and our reader reads)."""
    import gguf

    w.add_expert_count(s.n_experts)
    w.add_expert_used_count(s.n_experts_used)
    w.add_expert_feed_forward_length(s.moe_ffn)
    if s.norm_topk:
        w.add_expert_weights_norm(True)
    if s.arch == "qwen3moe":
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        return
    w.add_leading_dense_block_count(s.first_dense)
    w.add_expert_shared_count(s.n_shared)
    w.add_expert_weights_scale(s.routed_scaling)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    r = s.kv_lora_rank
    if s.q_lora_rank:
        w.add_q_lora_rank(s.q_lora_rank)
    w.add_kv_lora_rank(r)
    w.add_key_length(r + s.qk_rope)
    w.add_value_length(r)
    w.add_key_length_mla(s.qk_nope + s.qk_rope)
    w.add_value_length_mla(s.v_head)
    w.add_rope_dimension_count(s.qk_rope)
    if s.yarn:
        factor, original, mscale_all = s.yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)  # the converter's legacy 0.1 factor


def fixture_tensors(s: Shape, quant: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [outer ..., row], type) of every tensor of the shape, in llama.cpp's names."""
    E = s.n_experts
    ty = lambda name, layer, shp: tensor_type(quant, name, layer, s.n_layers, shp[-1], E)  # noqa: E731
    tensors = [("token_embd.weight", (s.vocab, s.dim), ty("token_embd", None, (s.dim,)))]
    hd = s.head_dim
    for i in range(s.n_layers):
        p = f"blk.{i}."
        layer: list[tuple[str, tuple[int, ...]]] = [("attn_norm", (s.dim,))]
        if s.kv_lora_rank:  # MLA, as the converter splits kv_b_proj (k_b transposed)
            H, r, qk = s.n_heads, s.kv_lora_rank, s.qk_nope + s.qk_rope
            if s.q_lora_rank:
                layer += [("attn_q_a", (s.q_lora_rank, s.dim)), ("attn_q_a_norm", (s.q_lora_rank,)),
                          ("attn_q_b", (H * qk, s.q_lora_rank))]
            else:
                layer.append(("attn_q", (H * qk, s.dim)))
            layer += [("attn_kv_a_mqa", (r + s.qk_rope, s.dim)), ("attn_kv_a_norm", (r,)),
                      ("attn_k_b", (H, r, s.qk_nope)), ("attn_v_b", (H, s.v_head, r)),
                      ("attn_output", (s.dim, H * s.v_head))]
        else:
            for name, rows in (("attn_q", s.n_heads * hd), ("attn_k", s.n_kv * hd), ("attn_v", s.n_kv * hd)):
                layer.append((name, (rows, s.dim)))
                if s.arch == "qwen2":
                    layer.append((name + ".bias", (rows,)))
            layer.append(("attn_output", (s.dim, s.n_heads * hd)))
            if s.arch == "qwen3moe":
                layer += [("attn_q_norm", (hd,)), ("attn_k_norm", (hd,))]
        layer.append(("ffn_norm", (s.dim,)))
        if E and i >= s.first_dense:
            F = s.moe_ffn
            layer += [("ffn_gate_inp", (E, s.dim)), ("ffn_gate_exps", (E, F, s.dim)),
                      ("ffn_up_exps", (E, F, s.dim)), ("ffn_down_exps", (E, s.dim, F))]
            if s.n_shared:
                Fs = F * s.n_shared
                layer += [("ffn_gate_shexp", (Fs, s.dim)), ("ffn_up_shexp", (Fs, s.dim)),
                          ("ffn_down_shexp", (s.dim, Fs))]
        else:
            layer += [("ffn_gate", (s.ffn, s.dim)), ("ffn_up", (s.ffn, s.dim)), ("ffn_down", (s.dim, s.ffn))]
        for name, shp in layer:
            full = p + name + ("" if name.endswith(".bias") else ".weight")
            tensors.append((full, shp, "F32" if len(shp) == 1 else ty(name, i, shp)))
    tensors.append(("output_norm.weight", (s.dim,), "F32"))
    if not s.tied:
        tensors.append(("output.weight", (s.vocab, s.dim), ty("output", None, (s.dim,))))
    return tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.fixtures", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=[],
                   help=f"one of {', '.join([*SHAPES, *MOE_SHAPES])} (repeatable)")
    p.add_argument("--quant", action="append", default=[], help=f"one of {', '.join(QUANTS)} (repeatable)")
    p.add_argument("-o", "--out", default="out/fixtures", help="folder (or .gguf file) to write (default "
                                                               "out/fixtures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    a = p.parse_args(argv)
    if a.list or not a.shape:
        for name in [*SHAPES, *MOE_SHAPES]:
            print(f"{name}: {shape(name).describe()}")
        return 0
    try:
        for s in a.shape:
            for q in a.quant or ["Q4_0"]:
                print(write_fixture(s, q, Path(a.out), a.seed))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
