"""Bad model files (issue 12): hundreds of mutated copies of a tiny GGUF and of a tiny Hugging Face folder.

Each case either loads (the model builds and one forward computes logits) or fails with specdec's one-line
ModelError. A hang, a crash of the interpreter, a MemoryError (the address space of the worker is capped at its
baseline + MEMORY_HEADROOM, so an allocation far beyond the file's size fails instead of swapping the machine)
or any other exception fails the test.

The GGUF mutations follow the file's structure (gguf-py's GGUFReader tells where each part lies): bit flips in the
header and metadata, truncation at every section boundary, tensor / KV counts, string and array lengths, value
types, dimensions, tensor types and offsets set huge, zero, "negative" (wrapped to 2**64 - 1) or overlapping. The
safetensors mutations lie in the 8-byte header length, in the JSON header (dtype, shape, data_offsets, bad JSON)
and in config.json. The cases are a pure function of SEED.

Cases run in a worker process (this file run as a script) that reports one JSON line per case; the parent kills a
worker that spends more than CASE_TIMEOUT_S on a case and starts a new one at the next case.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import queue
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SEED = 12
CASE_TIMEOUT_S = 30.0
MEMORY_HEADROOM = 1 << 30  # bytes of address space a worker may add to its baseline (the files are < 1 MB)
U64_MAX = 2**64 - 1
VOCAB = 256  # small vocabulary: files of ~70 kB (GGUF) / ~600 kB (safetensors) that parse in milliseconds
BAD_OUTCOMES = ("bug", "MemoryError", "timeout", "crash")
MARK = "@fuzz "  # the worker's report lines start with this


@dataclass
class Case:
    """One mutated copy: `file` (relative to the base) gets `patches` [(offset, bytes)] and is cut to `size`."""

    name: str
    fmt: str  # "gguf" or "hf"
    file: str
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    size: int | None = None
    full: bool = False  # load through specdec.loader.load (tokenizer included) instead of read_model + forward


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def _u32(v: int) -> bytes:
    return struct.pack("<I", v % 2**32)


# ------------------------------------------------------------------------------------------------------------------
# base files
# ------------------------------------------------------------------------------------------------------------------


def _add_array_kvs(path: Path) -> None:
    """Insert array KVs as llama.cpp's converter writes them (string arrays general.tags / general.languages, an
    INT32 array tokenizer.ggml.token_type) after the last KV of a GGUF file, so the fuzz also reaches array
    parsing. Tensor offsets are relative to the data section: only kv_count and the padding before the data
    change."""
    import gguf

    r = gguf.GGUFReader(path)
    blob = path.read_bytes()
    last = list(r.fields.values())[-1]
    kv_end = last.offset + sum(int(p.nbytes) for p in last.parts)

    def string(s: str) -> bytes:
        return _u64(len(s.encode())) + s.encode()

    def array(key: str, items: list[str]) -> bytes:
        body = _u32(gguf.GGUFValueType.STRING) + _u64(len(items)) + b"".join(string(s) for s in items)
        return string(key) + _u32(gguf.GGUFValueType.ARRAY) + body

    ints = string("tokenizer.ggml.token_type") + _u32(gguf.GGUFValueType.ARRAY) + _u32(gguf.GGUFValueType.INT32)
    ints += _u64(4) + struct.pack("<4i", 3, 3, 1, 1)
    extra = array("general.tags", ["tiny", "fuzz", "text-generation"]) + array("general.languages", ["en"]) + ints
    infos_end = r.tensors[0].field.offset + sum(
        sum(int(p.nbytes) for p in t.field.parts) for t in r.tensors)
    head = blob[:16] + _u64(len(r.fields) - 3 + 3) + blob[24:kv_end] + extra + blob[kv_end:infos_end]
    pad = -len(head) % r.alignment
    path.write_bytes(head + b"\0" * pad + blob[r.data_offset:])


def write_bases(root: Path) -> dict[str, Path]:
    """The pristine files: a GGUF with Q4_0 / Q8_0 / F16 / F32 tensors (no vocabulary), an HF folder (f32
    safetensors, no tokenizer), and an HF folder with the SmolLM2 tokenizer for the full-load cases."""
    from tiny_models import write_gguf, write_hf

    gguf_path = write_gguf("llama", root / "base.gguf", qtype="Q4_0", seed=0, tokenizer=False, vocab_size=VOCAB,
                           tensor_qtypes={"blk.1.ffn_*": "Q8_0", "blk.1.attn_output.weight": "F16"})
    _add_array_kvs(gguf_path)
    hf = write_hf("llama", root / "hf", seed=0, tokenizer=False, vocab_size=VOCAB)
    hf_tok = write_hf("llama", root / "hf_tok", seed=0, dtype=__import__("torch").bfloat16)
    return {"gguf": gguf_path, "hf": hf, "hf_tok": hf_tok}


# ------------------------------------------------------------------------------------------------------------------
# GGUF cases
# ------------------------------------------------------------------------------------------------------------------


def _parts(field_) -> list[tuple[int, int]]:
    """(absolute offset, byte size) of each part of a GGUFReader field, in file order."""
    out, off = [], field_.offset
    for p in field_.parts:
        out.append((off, int(p.nbytes)))
        off += int(p.nbytes)
    return out


def gguf_cases(path: Path, rng: random.Random) -> list[Case]:
    import gguf

    r = gguf.GGUFReader(path)
    size = path.stat().st_size
    cases: list[Case] = []

    def add(name: str, patches: list[tuple[int, bytes]] | None = None, cut: int | None = None) -> None:
        cases.append(Case(name, "gguf", path.name, patches or [], cut))

    add("pristine")
    # header: magic, version, tensor count, KV count
    for bit in (0, 9, 31):
        add(f"magic bit {bit}", [(bit // 8, bytes([path.read_bytes()[bit // 8] ^ (1 << bit % 8)]))])
    for v in (0, 1, 2, 4, 2**16, 2**32 - 1):
        add(f"version {v}", [(4, _u32(v))])
    n_tensors, n_kv = len(r.tensors), len(r.fields) - 3  # less GGUF.version, .tensor_count, .kv_count
    for label, off, n in (("tensor_count", 8, n_tensors), ("kv_count", 16, n_kv)):
        for v in (0, 1, n - 1, n + 1, 2 * n, 10**6, 2**31, 2**32 + n, 2**63, U64_MAX):
            add(f"{label} = {v}", [(off, _u64(v))])

    # truncation at every section boundary (and one byte either side of a few)
    kv_fields = [f for k, f in r.fields.items() if not k.startswith("GGUF.")]
    bounds = {0, 4, 8, 16, 24, r.data_offset, size - 1}
    for f in kv_fields:
        for off, _ in _parts(f):
            bounds.add(off)
        bounds.add(_parts(f)[-1][0] + _parts(f)[-1][1])
    for t in r.tensors:
        for off, _ in _parts(t.field):
            bounds.add(off)
        bounds.add(t.data_offset)
        bounds.add(t.data_offset + t.n_bytes)
    bounds = {b for b in bounds if b < size}
    for b in sorted(bounds):
        add(f"truncated at {b}", cut=b)
    for b in rng.sample(sorted(bounds), 8):
        add(f"truncated at {b} + 1", cut=min(b + 1, size - 1))

    # metadata: key lengths, value types, string lengths, array types and lengths, scalar values
    for f in kv_fields:
        parts = _parts(f)
        (klen_off, _), _, (type_off, _) = parts[:3]
        vtype = f.types[0]
        add(f"{f.name}: key length huge", [(klen_off, _u64(2**62))])
        add(f"{f.name}: key length past the end", [(klen_off, _u64(size))])
        add(f"{f.name}: value type 99", [(type_off, _u32(99))])
        if vtype == gguf.GGUFValueType.STRING:
            add(f"{f.name}: string length past the end", [(parts[3][0], _u64(size - parts[3][0]))])
            add(f"{f.name}: string length -1", [(parts[3][0], _u64(-1))])
        elif vtype == gguf.GGUFValueType.ARRAY:
            (itype_off, _), (alen_off, _) = parts[3], parts[4]
            add(f"{f.name}: array of 2**60 items", [(alen_off, _u64(2**60))])
            add(f"{f.name}: array length -1", [(alen_off, _u64(-1))])
            add(f"{f.name}: array of {size} items", [(alen_off, _u64(size))])
            add(f"{f.name}: array item type 99", [(itype_off, _u32(99))])
            add(f"{f.name}: array of arrays", [(itype_off, _u32(gguf.GGUFValueType.ARRAY))])
            if f.types[-1] == gguf.GGUFValueType.STRING:
                add(f"{f.name}: array item string length huge", [(parts[5][0], _u64(2**40))])
        else:
            off, n = parts[3]
            for v in (0, 1, 3, 2**(8 * n - 1), 2**(8 * n) - 1):
                add(f"{f.name} = {v} ({n} bytes)", [(off, v.to_bytes(n, "little"))])
            if vtype == gguf.GGUFValueType.UINT32:
                add(f"{f.name}: type float32", [(type_off, _u32(gguf.GGUFValueType.FLOAT32))])
                add(f"{f.name}: type uint64", [(type_off, _u32(gguf.GGUFValueType.UINT64))])
                add(f"{f.name}: type string", [(type_off, _u32(gguf.GGUFValueType.STRING))])
                add(f"{f.name}: type bool", [(type_off, _u32(gguf.GGUFValueType.BOOL))])

    # tensor infos: name length, dimension count, dimensions, type, offset
    picks = [r.tensors[i] for i in (0, 1, 2, 3, 7, 12, len(r.tensors) - 1)]
    for t in picks:
        parts = _parts(t.field)
        (nlen_off, _), _, (ndim_off, _), (dims_off, dims_n), (type_off, _), (toff_off, _) = parts
        nd = dims_n // 8
        add(f"{t.name}: name length huge", [(nlen_off, _u64(2**61))])
        add(f"{t.name}: name length 0", [(nlen_off, _u64(0))])
        for v in (0, nd + 1, 5, 2**31, 2**32 - 1):
            add(f"{t.name}: n_dims {v}", [(ndim_off, _u32(v))])
        for j in range(nd):
            d = int(t.shape[j])
            for v in (0, 1, 2 * d, d + 32, 2**32, 2**63, U64_MAX):
                add(f"{t.name}: dim {j} = {v}", [(dims_off + 8 * j, _u64(v))])
        if nd == 2:  # the two dimensions swapped: same element count, wrong layout
            add(f"{t.name}: dims swapped", [(dims_off, _u64(int(t.shape[1])) + _u64(int(t.shape[0])))])
            # products that wrap around 2**64 to 0 or to the true element count (numpy's uint64 product would)
            add(f"{t.name}: dims 2**32 x 2**32", [(dims_off, _u64(2**32) + _u64(2**32))])
            n = int(t.shape[0]) * int(t.shape[1])
            add(f"{t.name}: dims wrap to {n}", [(dims_off, _u64(2**63 + n // 2) + _u64(2))])
        for ty in (99, 2**32 - 1, 4, 0, 1, 8, 12, 24):  # unknown, removed Q4_2, F32, F16, Q8_0, Q4_K, I8
            if ty != int(t.tensor_type):
                add(f"{t.name}: type {ty}", [(type_off, _u32(ty))])
        rel = t.data_offset - r.data_offset
        for label, v in (("huge", 2**62), ("-1", -1), ("-32", rel - 2**64 - 32 if rel else -32),
                         ("past the end", size - r.data_offset), ("unaligned", rel + 1), ("+32", rel + 32),
                         ("0 (overlaps)", 0), ("at the last tensor", r.tensors[-1].data_offset - r.data_offset)):
            if v != rel:
                add(f"{t.name}: offset {label}", [(toff_off, _u64(v))])

    # random bit flips in the header, metadata and tensor infos
    for _ in range(120):
        flips = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            off = rng.randrange(r.data_offset)
            flips.append((off, 1 << rng.randrange(8)))
        blob = bytearray(path.read_bytes())
        for off, bit in flips:
            blob[off] ^= bit
        add(f"bit flips {flips}", [(off, bytes([blob[off]])) for off, _ in flips])
    return cases


# ------------------------------------------------------------------------------------------------------------------
# safetensors / HF cases
# ------------------------------------------------------------------------------------------------------------------


def _st_header(blob: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


def _st_with_header(blob: bytes, header: dict) -> bytes:
    """The same file with another JSON header (same data bytes)."""
    n, _ = _st_header(blob)
    text = json.dumps(header).encode()
    return _u64(len(text)) + text + blob[8 + n:]


def hf_cases(folder: Path, rng: random.Random) -> list[Case]:
    st = folder / "model.safetensors"
    blob = st.read_bytes()
    n, header = _st_header(blob)
    size = len(blob)
    cases: list[Case] = []

    def add(name: str, patches: list[tuple[int, bytes]] | None = None, cut: int | None = None,
            file: str = "model.safetensors") -> None:
        cases.append(Case(name, "hf", file, patches or [], cut))

    def lie(name: str, new_header: dict) -> None:
        """A header rewritten: the whole file becomes one patch, cut to its new length."""
        new = _st_with_header(blob, new_header)
        add(name, [(0, new)], cut=len(new))

    add("pristine")
    for v in (0, 1, 2, 7, n - 1, n + 1, n + 64, size - 8, size, 2**31, 2**40, 2**63, U64_MAX):
        add(f"header length {v}", [(0, _u64(v))])
    tensors = [k for k in header if k != "__metadata__"]
    bounds = {0, 4, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, size - 1}
    for k in tensors:
        b, e = header[k]["data_offsets"]
        bounds.update((8 + n + b, 8 + n + e))
    for b in sorted(x for x in bounds if x < size):
        add(f"truncated at {b}", cut=b)
    picks = rng.sample(tensors, 6) + ["model.embed_tokens.weight"]
    for k in dict.fromkeys(picks):
        info = header[k]
        shape, (b, e) = info["shape"], info["data_offsets"]
        for dt in ("F16", "BF16", "I32", "U32", "I64", "U8", "F64", "BOOL", "F8_E4M3", "F8_E8M0", "F4", "C64",
                   "Q4_0", "", 7):
            lie(f"{k}: dtype {dt!r}", {**header, k: {**info, "dtype": dt}})
        shapes = [[], [0], [-1, shape[-1]], [2**63, 2], [2**32, 2**32], [*shape, 1], [shape[0] * 2, *shape[1:]],
                  shape[::-1], [shape[0] // 2, *shape[1:]], "64", [1.5]]
        for s in shapes:
            lie(f"{k}: shape {s}", {**header, k: {**info, "shape": s}})
        for offs in ([0, 0], [e, b], [b, e + 4], [b - 4 if b else 4, e], [0, e - b], [b, size], [b, 2**63],
                     [-4, e], [b], "x"):
            lie(f"{k}: data_offsets {offs}", {**header, k: {**info, "data_offsets": offs}})
        lie(f"{k}: no dtype", {**header, k: {x: y for x, y in info.items() if x != "dtype"}})
        lie(f"{k}: not an object", {**header, k: [1, 2]})
        rest = {x: y for x, y in header.items() if x != k}
        lie(f"{k}: missing", rest)
    lie("__metadata__ not strings", {**header, "__metadata__": {"format": 3}})
    # bad JSON: bytes of the header replaced
    for _ in range(40):
        off = 8 + rng.randrange(n)
        byte = rng.choice((0x00, 0xFF, 0x22, 0x7B, 0x5D, 0x2C, 0x31, 0xC3, rng.randrange(256)))
        add(f"header byte {off} = {byte:#x}", [(off, bytes([byte]))])
    # config.json lies (shapes that no longer match the tensors)
    cfg = json.loads((folder / "config.json").read_text())
    for key, v in (("hidden_size", 32), ("hidden_size", 0), ("num_attention_heads", 0), ("num_attention_heads", 3),
                   ("num_attention_heads", 8), ("num_key_value_heads", 1), ("num_key_value_heads", 0),
                   ("head_dim", 8), ("head_dim", 0), ("intermediate_size", 64), ("vocab_size", 512),
                   ("vocab_size", 0), ("num_hidden_layers", 3), ("num_hidden_layers", 0),
                   ("num_hidden_layers", 10**9), ("num_hidden_layers", -1), ("hidden_size", "64"),
                   ("max_position_embeddings", 0), ("rms_norm_eps", -1.0), ("rope_theta", 0.0),
                   ("tie_word_embeddings", False), ("model_type", "llama4"), ("num_attention_heads", None),
                   ("num_nextn_predict_layers", 2), ("rope_scaling", {"rope_type": "yarn"}), ("rope_scaling", 3),
                   ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), ("sliding_window", -4)):
        text = json.dumps({**cfg, key: v}).encode()
        add(f"config {key} = {v!r}", [(0, text)], cut=len(text), file="config.json")
    text = (folder / "config.json").read_bytes()
    add("config.json truncated", cut=len(text) // 2, file="config.json")
    add("config.json is a list", [(0, b"[1]")], cut=3, file="config.json")
    return cases


def full_cases() -> list[Case]:
    """A few cases through specdec.loader.load (quant auto, tokenizer included) on the folder with a tokenizer."""
    out = [Case("full: pristine", "hf_tok", "model.safetensors", full=True)]
    out.append(Case("full: header length huge", "hf_tok", "model.safetensors", [(0, _u64(2**40))], full=True))
    out.append(Case("full: truncated", "hf_tok", "model.safetensors", size=4096, full=True))
    return out


# ------------------------------------------------------------------------------------------------------------------
# the worker: runs cases, one JSON line each
# ------------------------------------------------------------------------------------------------------------------


def _limit_memory() -> None:
    """Cap the address space at the current size + MEMORY_HEADROOM: a huge allocation raises MemoryError.
    (Linux only: elsewhere the cases run uncapped.)"""
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration):
        return
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY_HEADROOM, resource.RLIM_INFINITY))


def _run_case(case: Case, src: Path, work: Path) -> tuple[str, str]:
    """Apply `case` to a copy of the base file `src` (a GGUF, or a file in an HF folder) and load it."""
    import torch

    from specdec.config import ModelError
    from specdec.models.transformer import Transformer
    from specdec.weights import read_model

    if case.fmt == "gguf":
        target = model = work / "model.gguf"
        data = bytearray(src.read_bytes())
    else:
        model = work / case.fmt
        if not model.exists():
            shutil.copytree(src, model)
        target = model / case.file
        data = bytearray((src / case.file).read_bytes())
    for off, patch in case.patches:
        data[off:off + len(patch)] = patch
    if case.size is not None:
        del data[case.size:]
    target.write_bytes(bytes(data))
    try:
        try:
            if case.full:
                from specdec.loader import load

                loaded = load(model, ctx=64, cache=False, device="cpu")
                net, vocab = loaded.model, loaded.model.args.vocab_size
            else:
                lm = read_model(model)
                net, vocab = Transformer(lm.args, lm.weights, torch.float32, "none", max_len=64), lm.args.vocab_size
            with torch.no_grad():
                logits, _ = net(torch.zeros(1, 3, dtype=torch.long), torch.arange(3), net.new_cache())
            if tuple(logits.shape) != (1, 3, vocab):
                return "bug", f"logits of shape {tuple(logits.shape)}"
            return "loaded", "finite" if bool(torch.isfinite(logits).all()) else "non-finite logits"
        except ModelError as e:
            msg = str(e)
            if not msg or "\n" in msg:
                return "bug", f"ModelError not one line: {msg!r}"
            return "ModelError", msg
        except MemoryError as e:
            return "MemoryError", repr(e)[:300]
        except Exception as e:
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            return "bug", f"{type(e).__name__}: {str(e)[:200]} at {Path(where.filename).name}:{where.lineno}"
    finally:
        # the HF copy is shared by the cases: put the pristine file back for the next one
        if case.fmt != "gguf":
            target.write_bytes((src / case.file).read_bytes())


def worker(cases_path: str, start: int) -> None:
    """Run the cases from index `start`, printing {"i", "outcome", "detail"} for each (and {"i", "begin"} first)."""
    import tempfile

    import torch

    import specdec.models.transformer  # noqa: F401  (imports before the cap: they are not the file's doing)
    import specdec.weights.gguf  # noqa: F401
    import specdec.weights.hf  # noqa: F401

    torch.set_num_threads(1)
    spec = json.loads(Path(cases_path).read_text())
    bases = {k: Path(v) for k, v in spec["bases"].items()}
    cases = [Case(**{**c, "patches": [(o, base64.b64decode(p)) for o, p in c["patches"]]}) for c in spec["cases"]]
    work = Path(tempfile.mkdtemp(prefix="fuzz-", dir=spec["tmp"]))
    _limit_memory()
    for i in range(start, len(cases)):
        print(MARK + json.dumps({"i": i, "begin": True}), flush=True)
        outcome, detail = _run_case(cases[i], bases[cases[i].fmt], work)
        print(MARK + json.dumps({"i": i, "outcome": outcome, "detail": detail}), flush=True)


# ------------------------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------------------------


def _pump(stream, put) -> None:
    """Hand each line of `stream` to `put`, then None at its end."""
    for line in stream:
        put(line)
    put(None)


def run_cases(cases: list[Case], bases: dict[str, Path], tmp: Path) -> list[tuple[str, str]]:
    """Outcome and detail of each case, restarting the worker after a case that hangs or kills it."""
    spec = {"bases": {k: str(v) for k, v in bases.items()}, "tmp": str(tmp),
            "cases": [{**asdict(c), "patches": [(o, base64.b64encode(p).decode()) for o, p in c.patches]}
                      for c in cases]}
    cases_path = tmp / "cases.json"
    cases_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2", SPECDEC_LAYOUT_CACHE="0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    results: list[tuple[str, str] | None] = [None] * len(cases)
    start = 0
    while start < len(cases):
        proc = subprocess.Popen([sys.executable, __file__, str(cases_path), str(start)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue[str | None] = queue.Queue()
        errors: list[str] = []
        threading.Thread(target=_pump, args=(proc.stdout, lines.put), daemon=True).start()
        threading.Thread(target=_pump, args=(proc.stderr, errors.append), daemon=True).start()
        current, deadline = None, time.monotonic() + 120  # the first case also waits for torch's import
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                proc.wait()
                results[current if current is not None else start] = ("timeout", f"> {CASE_TIMEOUT_S} s")
                break
            if line is None:  # the worker exited
                rc = proc.wait()
                if current is None:
                    err = ''.join(filter(None, errors))[-2000:]
                    raise RuntimeError(f"fuzz worker failed to start (rc {rc}): {err}")
                if results[current] is None:
                    results[current] = ("crash", f"worker exited with {rc}: {''.join(filter(None, errors))[-300:]}")
                break
            if not line.startswith(MARK):
                continue  # something the loader printed
            msg = json.loads(line[len(MARK):])
            if msg.get("begin"):
                current, deadline = msg["i"], time.monotonic() + CASE_TIMEOUT_S
            else:
                results[msg["i"]] = (msg["outcome"], msg["detail"])
        start = max(i for i, r in enumerate(results) if r is not None) + 1
    return [r for r in results if r is not None]


def test_mutated_files_load_or_fail_cleanly(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    bases = write_bases(tmp_path)
    rng = random.Random(SEED)
    cases = gguf_cases(bases["gguf"], rng) + hf_cases(bases["hf"], rng) + full_cases()
    results = run_cases(cases, bases, tmp_path)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bad = []
    for case, (outcome, detail) in zip(cases, results, strict=True):
        counts["gguf" if case.fmt == "gguf" else "safetensors"][outcome] += 1
        if outcome in BAD_OUTCOMES:
            bad.append(f"{case.fmt} {case.name}: {outcome}: {detail}")
    summary = "; ".join(f"{fmt}: {c.total()} cases, " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                        for fmt, c in counts.items())
    print(f"\nfuzz ({time.perf_counter() - t0:.0f} s): {summary}")
    for line in bad:
        print(line)
    assert results[0] == ("loaded", "finite"), results[0]  # the pristine GGUF
    assert not bad, f"{len(bad)} of {len(cases)} mutated files failed badly, first: {bad[:10]}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(sys.argv[1], int(sys.argv[2]))
