"""The layout cache (specdec/weights/layout.py): a mapped load is the converted model, bit for bit; entries that do
not match their file are rebuilt; two files never share an entry; loading stays near the weights' size in memory."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import write_gguf

from specdec.cache import anonymous_memory
from specdec.loader import load
from specdec.weights import layout

SESSION = Path(os.environ["SPECDEC_CACHE"])  # the test session's cache (conftest.py), with the compiled kernels
MIX = {"blk.0.*": "Q4_K", "blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K",
       "blk.1.ffn_gate.weight": "Q5_K", "token_embd.weight": "Q8_0"}


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    # the kernels are compiled once per machine into the real cache; reuse them instead of compiling again
    root.mkdir()
    for so in SESSION.glob("*.so"):
        (root / so.name).symlink_to(so)
    return root


def logits(loaded, ids=(1, 5, 9, 200, 7, 3)) -> torch.Tensor:
    m = loaded.model
    with torch.inference_mode():
        out, _ = m(torch.tensor([list(ids)]), torch.arange(len(ids)), m.new_cache(), exact=True)
    return out


def entries(root: Path) -> list[Path]:
    return sorted((root / "layouts").glob("*.safetensors"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_cached_load_is_bitwise_the_conversion(cache, tmp_path, qtype):
    path = write_gguf("llama", tmp_path / "m.gguf", qtype=qtype, seed=3, tied=False, tensor_qtypes=MIX)
    fresh = load(path, ctx=64, cache=False)
    first = load(path, ctx=64)
    assert first.load_kind.startswith("first load") and len(entries(cache)) == 1
    mapped = load(path, ctx=64, use_mmap=True)
    read = load(path, ctx=64)  # a layout this small is read into memory by default
    assert mapped.load_kind == "cached layout mapped" and read.load_kind == "cached layout read into memory"
    assert mapped.model.weight_format == read.model.weight_format == fresh.model.weight_format
    ref = logits(fresh)
    assert all(torch.equal(logits(m), ref) for m in (first, mapped, read))
    # the mapped model keeps no weights of its own: its tensors live in the entry file's pages; the other one's in
    # anonymous memory
    (entry,) = entries(cache)
    for m, where in ((mapped, str(entry.resolve())), (read, None)):
        for t in (m.model.layers[0].w13.weight, m.model.output.weight, m.model.embed.weight):
            assert mapped_file(t.data_ptr()) == where


def test_k_quants_are_kept_as_they_are(cache, tmp_path):
    """Under quant "auto" a Q4_K tensor keeps its own scales (q4_k) and, where the kernel has AVX-512 VNNI, a Q6_K
    one its codes (q6_k) instead of int8; a fused layer of both (blk.1's q|k|v: q, k Q4_K, v Q6_K) stacks the two
    formats (StackedLinear) instead of becoming int8 whole. The model stays the file's: its logits track the float32
    dequantization (quant "none") as closely as the activations' int8 quantization allows, and the cached entry
    gives them bit for bit."""
    from specdec import kernels

    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_K", seed=4, tied=False, tensor_qtypes=MIX)
    auto, ref = load(path, ctx=64, cache=False), load(path, ctx=64, quant="none", dtype="f32", cache=False)
    fmt = auto.model.weight_format
    if kernels.matmul_isa() is None:
        pytest.skip("no matmul kernel on this CPU")
    assert "q4_k" in fmt and "q6_k" in fmt and "q5_k" in fmt, fmt
    qkv, w13 = auto.model.layers[1].wqkv, auto.model.layers[1].w13  # q, k Q4_K over v Q6_K; gate Q5_K over up Q4_K
    assert type(qkv).__name__ == "StackedLinear" and [p.bits for p in qkv.parts] == [kernels.Q4K, kernels.Q6K]
    assert type(w13).__name__ == "StackedLinear" and [p.bits for p in w13.parts] == [kernels.Q5K, kernels.Q4K]
    a, r = logits(auto)[0].float(), logits(ref)[0]
    assert (a - r).abs().max() <= 0.05 * r.abs().max(), (a - r).abs().max()
    assert torch.equal(logits(load(path, ctx=64)), logits(auto))  # the first load, converted and cached


def test_q5_0_q5_1_are_kept_as_they_are(cache, tmp_path):
    """Under quant "auto" (the AVX-512 or the AVX2 kernel), Q5_0 / Q5_1 tensors keep their codes and f16 factors
    (format Q5: no m stored for Q5_0) instead of becoming int8, and a fused layer whose v has no such codes (Q8_0)
    stacks a Q5 part over an int8 one; the logits track the float32 dequantization and the cached entry gives them
    bit for bit."""
    from specdec import kernels

    mix = {"blk.1.attn_q.weight": "Q5_1", "blk.1.attn_k.weight": "Q5_1", "blk.1.attn_v.weight": "Q8_0",
           "blk.1.ffn_*": "Q5_1", "token_embd.weight": "Q8_0"}
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q5_0", seed=6, tied=False, tensor_qtypes=mix)
    auto, ref = load(path, ctx=64, cache=False), load(path, ctx=64, quant="none", dtype="f32", cache=False)
    if kernels.matmul_isa() is None:
        pytest.skip("no matmul kernel on this CPU")
    assert "q5_0 x" in auto.model.weight_format and "q5_1 x" in auto.model.weight_format, auto.model.weight_format
    l0, l1 = auto.model.layers
    assert l0.wqkv.bits == l0.w13.bits == kernels.Q5 and l0.wqkv.zeros is None  # Q5_0: m = -16 d, not stored
    assert l1.w13.bits == kernels.Q5 and l1.w13.zeros is not None  # Q5_1's own m
    assert type(l1.wqkv).__name__ == "StackedLinear" and [p.bits for p in l1.wqkv.parts] == [kernels.Q5, 8]
    a, r = logits(auto)[0].float(), logits(ref)[0]
    assert (a - r).abs().max() <= 0.05 * r.abs().max(), (a - r).abs().max()
    assert torch.equal(logits(load(path, ctx=64)), logits(auto))  # the first load, converted and cached
    assert torch.equal(logits(load(path, ctx=64)), logits(auto))  # the cached entry


def test_entries_are_per_kernel_instruction_set(cache, tmp_path, monkeypatch):
    """Loading a file where the kernel is another build (AVX2 against AVX-512: the host changed under a kept cache
    directory) uses an entry of its own instead of mapping the other build's (when only the AVX-512 build had Q6K,
    an AVX2 build mapped its entries and failed with "kernel shapes" at the first forward)."""
    from specdec import kernels

    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=7)
    load(path, ctx=64)
    isa = kernels.matmul_isa()
    other = "AVX2" if isa == "AVX-512 VNNI" else "AVX-512 VNNI"
    monkeypatch.setattr(kernels, "matmul_isa", lambda: other)
    second = load(path, ctx=64)
    assert second.load_kind.startswith("first load") and len(entries(cache)) == 2


def test_entries_of_an_older_layout_version_are_pruned(cache, tmp_path, monkeypatch):
    """A first load removes the entries of an older layout version (no load can use them again), keeps a newer
    version's (another install's) and the current ones of other settings."""
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=5)
    current = layout.LAYOUT_VERSION
    for v in (current + 1, current - 1):  # a newer install's entry, then an older one's (which keeps the newer)
        monkeypatch.setattr(layout, "LAYOUT_VERSION", v)
        load(path, ctx=64)
    assert len(entries(cache)) == 2
    monkeypatch.setattr(layout, "LAYOUT_VERSION", current)
    load(path, ctx=64, dtype="f32")  # another setting: its own entry
    load(path, ctx=64)
    versions = sorted(json.loads(layout.read_metadata(e)["specdec_layout"])["version"] for e in entries(cache))
    assert versions == [current, current, current + 1]


def test_least_recently_used_entries_leave_a_cache_over_its_budget(cache, tmp_path, monkeypatch, capfd):
    """Writing an entry removes the least recently used others while all entries take more than
    SPECDEC_LAYOUT_CACHE_GB; a load marks its entry as used, so a model loaded again stays over older ones."""
    paths = {name: write_gguf("llama", tmp_path / f"{name}.gguf", qtype="Q4_0", seed=i)
             for i, name in enumerate("abcd")}
    for i, name in enumerate("abc"):
        load(paths[name], ctx=64)
        entry = next(e for e in entries(cache) if e.name.startswith(f"{name}.gguf"))
        os.utime(entry, (1e9 + i, 1e9 + i))  # used long ago, a before b before c
    size = entries(cache)[0].stat().st_size
    assert all(e.stat().st_size == size for e in entries(cache))
    assert load(paths["a"], ctx=64).load_kind.startswith("cached")  # a is now the most recently used
    monkeypatch.setenv("SPECDEC_LAYOUT_CACHE_GB", str(2.5 * size / 1e9))
    capfd.readouterr()
    load(paths["d"], ctx=64)  # a first load: 4 entries, room for 2
    assert sorted(e.name[0] for e in entries(cache)) == ["a", "d"]
    err = capfd.readouterr().err
    assert err.count("to keep the layout cache under") == 2 and "b.gguf" in err and "c.gguf" in err


@pytest.mark.parametrize("value,left", [("none", 3), ("0", 1), ("lots", 3)])
def test_the_budget_setting(cache, tmp_path, monkeypatch, capfd, value, left):
    """SPECDEC_LAYOUT_CACHE_GB=none bounds nothing; 0 keeps only the entry just written; a value that is not a
    number is named in a note and the default budget (far above these entries) applies."""
    monkeypatch.setenv("SPECDEC_LAYOUT_CACHE_GB", value)
    for i in range(3):
        load(write_gguf("llama", tmp_path / f"m{i}.gguf", qtype="Q4_0", seed=i), ctx=64)
    assert [e.name[:2] for e in entries(cache)] == ["m0", "m1", "m2"][3 - left:]
    err = capfd.readouterr().err
    assert ("ignoring SPECDEC_LAYOUT_CACHE_GB='lots'" in err) == (value == "lots")
    assert err.count("to keep the layout cache under") == 3 - left


def test_entry_read_into_memory_is_a_copy(cache, tmp_path):
    """read_entry(in_memory=True): the tensors are the entry's bytes, copied (rewriting the file leaves them as they
    were) into anonymous memory."""
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=5)
    load(path, ctx=64)
    (entry,) = entries(cache)
    _, mapped = layout.read_entry(entry)
    _, mem = layout.read_entry(entry, in_memory=True)
    assert mapped.keys() == mem.keys() and all(torch.equal(mapped[k], mem[k]) for k in mem)
    before = {k: t.clone() for k, t in mem.items()}
    (n,) = struct.unpack("<Q", entry.read_bytes()[:8])
    with open(entry, "r+b") as f:  # every data byte changed in place
        f.seek(8 + n)
        f.write(bytes(b ^ 0xFF for b in entry.read_bytes()[8 + n:]))
    assert all(torch.equal(mem[k], before[k]) for k in mem)
    assert mapped_file(mem["lin.blk.0.w13.weight"].data_ptr()) is None


def test_anonymous_memory_takes_huge_pages():
    """The memory a layout is read into (and nothing else) is advised into transparent huge pages wherever the
    kernel offers them: private (a shared anonymous mapping is shmem, which they leave alone by default)."""
    modes = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not modes.exists() or "[never]" in modes.read_text():
        pytest.skip("no transparent huge pages on this kernel")
    buf = anonymous_memory(8 << 20)
    plain = anonymous_memory(8 << 20, huge=False)
    at = [torch.frombuffer(b, dtype=torch.uint8).data_ptr() for b in (buf, plain)]
    assert [smaps_field(a, "THPeligible") for a in at] == ["1", "0" if "[madvise]" in modes.read_text() else "1"]


def smaps_field(addr: int, field: str) -> str | None:
    """A field of /proc/self/smaps for the mapping that holds address `addr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == field + ":":
            return line.split()[1]
    return None


def mapped_file(addr: int) -> str | None:
    """The file mapped at address `addr` of this process (/proc/self/maps), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


def test_entry_is_valid_safetensors(cache, tmp_path):
    from safetensors import safe_open

    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=4)
    load(path, ctx=64)
    (entry,) = entries(cache)
    with safe_open(str(entry), framework="pt") as f:
        info = json.loads(f.metadata()["specdec_layout"])
        names = [k for k in f.keys() if not k.startswith("__pad")]  # noqa: SIM118
        t = f.get_tensor("lin.blk.0.w13.weight")
    assert info["args"]["n_layers"] == 2 and "lin.blk.0.wqkv.weight" in names
    _, mapped = layout.read_entry(entry)
    assert torch.equal(mapped["lin.blk.0.w13.weight"], t)
    assert all(mapped[n].data_ptr() % layout.ALIGN == 0 for n in names if mapped[n].numel())


def _damage(entry: Path, how: str) -> None:
    data = entry.read_bytes()
    if how == "truncated":
        entry.write_bytes(data[:len(data) // 2])
    elif how == "header":
        entry.write_bytes(data[:8] + b"{not json" + data[17:])
    elif how == "length":
        entry.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    elif how == "empty":
        entry.write_bytes(b"")


@pytest.mark.parametrize("how", ["truncated", "header", "length", "empty"])
def test_damaged_entry_is_rebuilt(cache, tmp_path, how, capfd):
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=5)
    ref = logits(load(path, ctx=64))
    (entry,) = entries(cache)
    _damage(entry, how)
    again = load(path, ctx=64)
    assert again.load_kind.startswith("first load")
    assert "rebuilding the cached layout" in capfd.readouterr().err
    assert torch.equal(logits(again), ref)
    assert load(path, ctx=64).load_kind.startswith("cached layout")


def test_stale_entry_is_rebuilt_even_with_same_size_and_mtime(cache, tmp_path):
    """A file rewritten in place (another model of the same shapes, its mtime restored) is never served the old
    layout: the entry records a hash of the file's header and of samples of its data."""
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=6)
    old = logits(load(path, ctx=64))
    st = path.stat()
    write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=7)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = load(path, ctx=64)
    assert new.load_kind.startswith("first load")
    ref = logits(load(path, ctx=64, cache=False))
    assert torch.equal(logits(new), ref) and not torch.equal(ref, old)
    assert len(entries(cache)) == 1  # the rewritten file replaced its own entry


def test_a_stale_entry_is_not_read(cache, tmp_path, monkeypatch):
    """A changed model file is found stale from the entry's header alone: its data is neither read into memory nor
    mapped before the rebuild."""
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=6)
    load(path, ctx=64)
    write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=7)
    reads = []
    real = layout.read_entry
    monkeypatch.setattr(layout, "read_entry", lambda p, *a: reads.append(p) or real(p, *a))
    assert load(path, ctx=64).load_kind.startswith("first load")
    (entry,) = entries(cache)
    assert reads == [entry]  # only the new entry, after it was written


def test_different_files_never_share_an_entry(cache, tmp_path):
    a = write_gguf("llama", tmp_path / "a" / "m.gguf", qtype="Q4_0", seed=8)
    b = write_gguf("llama", tmp_path / "b" / "m.gguf", qtype="Q4_0", seed=9)
    la, lb = logits(load(a, ctx=64)), logits(load(b, ctx=64))
    assert len(entries(cache)) == 2
    assert torch.equal(logits(load(a, ctx=64)), la) and torch.equal(logits(load(b, ctx=64)), lb)
    assert not torch.equal(la, lb)
    # other settings (here: plain float weights) are another entry too
    load(a, ctx=64, quant="none")
    assert len(entries(cache)) == 3
    # entries of deleted files go when the next entry is written
    b.unlink()
    c = write_gguf("llama", tmp_path / "c" / "m.gguf", qtype="Q4_0", seed=11)
    load(c, ctx=64)
    assert len(entries(cache)) == 3 and all("specdec_layout" in layout.read_entry(e)[0] for e in entries(cache))


def test_unwritable_cache_converts_in_memory(tmp_path, monkeypatch, capfd):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    monkeypatch.setenv("SPECDEC_CACHE", str(blocked))  # a file: nothing can be created under it
    monkeypatch.setattr("specdec.kernels.cache_dir", lambda: SESSION)
    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=10)
    loaded = load(path, ctx=64)
    assert loaded.load_kind == "converted in memory"
    assert "converting in memory" in capfd.readouterr().err
    assert torch.equal(logits(loaded), logits(load(path, ctx=64, cache=False)))


PEAK = """
import resource, sys, torch
from specdec.cache import anonymous_memory
from specdec.loader import load
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = load(sys.argv[1], ctx=2048)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, m.load_kind, m.model.weight_bytes)
"""


def test_peak_memory_of_loading_the_default_model(cache, smollm2_path):
    """Peak RSS above `import torch` for the 98 MB default model, converting then mapping.

    Bounds: the weights in memory (m.model.weight_bytes, 90 MB: int4 codes with bf16 scales and zeros, the int8
    tied head) plus the tokenizer (~5 MB), plus for the first load the conversion's transients, which are now a few
    MB (the embedding is requantized from ranges of rows, weights.Rows, and packed by ranges of rows,
    kernels.PACK_ROWS) beside the table's int8 codes before packing (28 MB). Measured 12-06: first load +135 MB
    (+299 MB before rows: the 49152 x 576 embedding whole in f32, 113 MB, and int16 copies of its codes while
    packing), mapped +34 MB. Before the layout cache every load cost +600 MB."""
    env = dict(os.environ, SPECDEC_CACHE=str(cache))
    tok_dir = SESSION / "tokenizers"
    if tok_dir.exists():  # the tokenizer conversion (transformers, once per file) is not what this measures
        (cache / "tokenizers").symlink_to(tok_dir)
    rows = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", PEAK, str(smollm2_path)], env=env, capture_output=True,
                             text=True, check=True)
        base, peak, *kind, wbytes = out.stdout.split()
        rows.append(((int(peak) - int(base)) / 1024, " ".join(kind), int(wbytes) / 2**20))
    (first, kind1, wmb), (mapped, kind2, _) = rows
    assert kind1.startswith("first load") and kind2.startswith("cached layout")
    assert mapped < wmb + 80, rows
    assert first < wmb + 100, rows


def test_scaffold_keeps_no_storage():
    """While a first load streams layers into the cache, the model built alongside is a scaffold whose tensors
    share nothing with the converted ones (a zero-length view would keep each layer's whole storage alive: an 8B
    file's first load held every layer until the end, 6.6 GB peak for a 5.0 GB model)."""
    from specdec.quant import Int8Linear
    from specdec.weights import LazyWeights

    class Recorder:
        def __init__(self):
            self.sizes = {}

        def add(self, name, t):
            self.sizes[name] = t.untyped_storage().nbytes()

    w = LazyWeights.of({"m": torch.randn(64, 64), "t": torch.randn(32, 64)})
    w.recorder = Recorder()
    lin = w.linear("m", lambda: Int8Linear(w["m"], None))
    table = w.table("t", lambda: w["t"].to(torch.bfloat16))
    assert w.recorder.sizes["lin.m.weight"] == 64 * 64 and w.recorder.sizes["table.t"] == 32 * 64 * 2
    assert all(t.untyped_storage().nbytes() == 0 for t in (*lin.tensors(), table))
    assert table.shape == (0, 64) and table.dtype == torch.bfloat16


def test_mmap_flags_and_the_free_memory(cache, tmp_path, monkeypatch, capfd):
    """--mmap / --no-mmap on the command line pick how a cached layout comes in (the summary line says which), and
    weights larger than the free memory are mapped even under --no-mmap, with a note."""
    import psutil

    from specdec.cli import main

    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=6)
    load(path, ctx=64)
    for flag, kind in (("--mmap", "cached layout mapped"), ("--no-mmap", "cached layout read into memory")):
        assert main(["generate", "-m", str(path), "-p", "hi", "-n", "2", "--temp", "0", flag]) == 0
        assert kind in capfd.readouterr().err
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1000))
    assert load(path, ctx=64, use_mmap=False).load_kind == "cached layout mapped"
    assert "do not fit in the free memory" in capfd.readouterr().err
    assert load(path, ctx=64).load_kind == "cached layout mapped"


def test_serve_reads_weights_into_memory_whatever_their_size(cache, tmp_path, monkeypatch):
    """`specdec serve` (long-lived) reads the cached weights into memory even past READ_MAX, where `generate` maps
    them; its --mmap still maps."""
    import specdec.server
    from specdec.cli import main

    path = write_gguf("llama", tmp_path / "m.gguf", qtype="Q4_0", seed=6)
    load(path, ctx=64)
    monkeypatch.setattr(layout, "READ_MAX", 0)  # every layout counts as big
    assert load(path, ctx=64).load_kind == "cached layout mapped"
    kinds = []
    monkeypatch.setattr(specdec.server, "serve", lambda load, **kw: kinds.append(load()[1].load_kind) or 0)
    for flags in ([], ["--mmap"]):
        assert main(["serve", "-m", str(path), "-c", "64", *flags]) == 0
    assert kinds == ["cached layout read into memory", "cached layout mapped"]
