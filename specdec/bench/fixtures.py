"""Random-weight GGUF files in real model shapes and real quantization mixes, for benchmarks at real sizes.

Decoding speed depends on the shapes and formats of the weights, not on their values, and no model larger than
SmolLM2-135M / Gemma-3-270M ships on this machine's package index. So these files have the exact tensor shapes of
Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B / 7B / 14B and the tensor types llama.cpp's quantizer gives them (Q4_0,
Q8_0, or Q4_K_M: Q4_K, with Q6_K for the output head and for attn_v / ffn_down in the layers llama.cpp's
`use_more_bits` picks, llama-quant.cpp), filled with random valid blocks (fp16 block scales chosen so the weights
have a standard deviation of ~0.02). The SmolLM2 tokenizer is copied in, its token list padded with unused tokens
to the shape's vocabulary size, so llama.cpp runs the very same file.

    python -m specdec.bench.fixtures --shape llama-3.2-1b --quant Q4_0 -o out/fixtures/
    python -m specdec.bench.fixtures --list

Tensors are generated and written one at a time (gguf's streaming writer), so writing an 8B file takes seconds of
CPU and little memory.
"""

from __future__ import annotations

import argparse
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
QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
# byte offsets of the fp16 block scale d and (for formats with one) the minimum / dmin
_SCALES = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q8_0": (0, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape '{name}': choose from {', '.join(SHAPES)}")
    return Shape(name, *SHAPES[name])


def tensor_type(quant: str, name: str, layer: int | None, n_layers: int) -> str:
    """The type llama.cpp's quantizer gives a 2-D tensor for `quant` (llama-quant.cpp, llama_tensor_get_type)."""
    if quant != "Q4_K_M":
        return quant if name != "output" else ("Q8_0" if quant == "Q8_0" else "Q6_K")
    if name == "output":
        return "Q6_K"
    more_bits = layer is not None and (layer < n_layers // 8 or layer >= 7 * n_layers // 8
                                       or (layer - n_layers // 8) % 3 == 2)
    if name in ("attn_v", "ffn_down") and more_bits:
        return "Q6_K"
    return "Q4_K"


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


def write_fixture(shape_name: str, quant: str, out: Path, seed: int = 0, progress: bool = True) -> Path:
    """Write the random-weight GGUF for a shape and quantization mix; returns its path."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"unknown quantization '{quant}': choose from {', '.join(QUANTS)}")
    s = shape(shape_name)
    path = out / f"{s.name}-{quant}.gguf" if out.is_dir() or not out.suffix else out
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"{s.name} random weights ({quant}, specdec fixture)")
    w.add_context_length(s.context)
    w.add_embedding_length(s.dim)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5 if s.arch == "llama" else 1e-6)
    w.add_vocab_size(s.vocab)
    w.add_file_type({"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}[quant])
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

    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s.vocab, s.dim),
                                                        tensor_type(quant, "token_embd", None, s.n_layers))]
    hd = s.head_dim
    for i in range(s.n_layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (s.dim,), "F32")]
        for name, rows in (("attn_q", s.n_heads * hd), ("attn_k", s.n_kv * hd), ("attn_v", s.n_kv * hd)):
            tensors.append((p + name + ".weight", (rows, s.dim), tensor_type(quant, name, i, s.n_layers)))
            if s.arch == "qwen2":
                tensors.append((p + name + ".bias", (rows,), "F32"))
        t = lambda name, i=i: tensor_type(quant, name, i, s.n_layers)  # noqa: E731
        tensors += [(p + "attn_output.weight", (s.dim, s.n_heads * hd), t("attn_output")),
                    (p + "ffn_norm.weight", (s.dim,), "F32"),
                    (p + "ffn_gate.weight", (s.ffn, s.dim), t("ffn_gate")),
                    (p + "ffn_up.weight", (s.ffn, s.dim), t("ffn_up")),
                    (p + "ffn_down.weight", (s.dim, s.ffn), t("ffn_down"))]
    tensors.append(("output_norm.weight", (s.dim,), "F32"))
    if not s.tied:
        tensors.append(("output.weight", (s.vocab, s.dim), tensor_type(quant, "output", None, s.n_layers)))

    def make(name: str, shp: tuple[int, ...], qtype: str) -> np.ndarray:
        seed_t = zlib.crc32(f"{seed}:{name}".encode())
        if qtype == "F32":
            rng = np.random.default_rng(seed_t)
            if name.endswith("norm.weight"):
                return (1.0 + 0.05 * rng.standard_normal(shp)).astype(np.float32)
            return (0.02 * rng.standard_normal(shp)).astype(np.float32)
        return random_blocks(qtype, shp[0], shp[1], seed_t)

    for name, shp, qtype in tensors:
        qt = gguf.GGMLQuantizationType[qtype]
        block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        n_bytes = int(np.prod(shp)) * 4 if qtype == "F32" else int(np.prod(shp)) // block * nbytes
        byte_shape = shp if qtype == "F32" else (shp[0], shp[1] // block * nbytes)  # as the writer takes raw blocks
        w.add_tensor_info(name, byte_shape, np.dtype(np.float32 if qtype == "F32" else np.uint8), n_bytes,
                          raw_dtype=None if qtype == "F32" else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    from tqdm import tqdm

    for name, shp, qtype in tqdm(tensors, desc=f"writing {path.name}", unit="tensor", disable=not progress,
                                 file=sys.stderr):
        w.write_tensor_data(make(name, shp, qtype))
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.fixtures", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=[], help=f"one of {', '.join(SHAPES)} (repeatable)")
    p.add_argument("--quant", action="append", default=[], help=f"one of {', '.join(QUANTS)} (repeatable)")
    p.add_argument("-o", "--out", default="out/fixtures", help="folder (or .gguf file) to write (default "
                                                               "out/fixtures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    a = p.parse_args(argv)
    if a.list or not a.shape:
        for name, v in SHAPES.items():
            print(f"{name}: {v[0]}, dim {v[1]}, {v[2]} layers, {v[3]}/{v[4]} heads, ffn {v[5]}, vocab {v[6]}, "
                  f"{'tied' if v[7] else 'untied'}")
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
