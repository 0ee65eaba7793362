"""Weights mapped from their file (issue 34, item 2; cism/loaders/mapping.py):
a tensor whose storage is the file's encoding (F32 at fp32, F16 at fp16, a
GGUF's Q4_K/Q6_K at q4_k/q6_k) is multiplied where the file is mapped.
Mapped and copied weights give the same logits and tokens bit for bit; a
file changed after the load is a CheckpointError naming it, never a crash;
lock_pages/touch/scan work on mapped weights; the mapped pages are the page
cache's (shared), not private memory."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cism.dense import Model
from cism.loaders import CheckpointError, load_checkpoint

from test_loaders import dense_tensors, gguf_meta, gguf_name, write_gguf

pytest.importorskip("gguf")  # every test here writes its GGUF with gguf-py
from gguf import GGMLQuantizationType as Q  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
Q4_K_M = os.path.join(HERE, "data", "ggml", "tiny-llama.Q4_K_M.gguf")
PROMPT = [1, 5, 9, 2, 7, 3, 11, 4]


def qwen3_gguf(path, qtype, layers=2):
    """A qwen3 GGUF (no q/k reordering) with every matrix in qtype, vectors F32."""
    rng = np.random.default_rng(11)
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=300,
                       layers=layers, qwen3=True, head=True)
    tensors = {gguf_name(n): (v, qtype if v.ndim == 2 else Q.F32) for n, v in hf.items()}
    return write_gguf(path, "qwen3", gguf_meta("qwen3", layers=layers, vocab=300, key_length=16), tensors)


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def assert_same_model(path, precision, expect_storages):
    mapped = Model.from_pretrained(path, precision=precision, threads=2, mmap=True)
    copied = Model.from_pretrained(path, precision=precision, threads=2, mmap=False)
    report = mapped.mapping_report()
    n_mapped = sum(v == "mapped" for v in report.values())
    assert n_mapped > 0, report
    for name, v in report.items():
        if v == "mapped":
            assert mapped.matrix(name).mapped and mapped.matrix(name).storage in expect_storages, name
            assert np.array_equal(mapped.matrix(name).codes, copied.matrix(name).codes), name
    assert not any(copied.matrix(n).mapped for n in report)
    assert all(v == "copied: mmap off" for v in copied.mapping_report().values())
    assert mapped.weight_bytes == copied.weight_bytes and 0 < mapped.mapped_bytes <= mapped.weight_bytes
    assert copied.mapped_bytes == 0
    assert same_bits(mapped.logits(PROMPT), copied.logits(PROMPT))
    assert same_bits(mapped.logits_all(PROMPT), copied.logits_all(PROMPT))
    a = mapped.create_session(PROMPT, 12).next_tokens(12)
    b = copied.create_session(PROMPT, 12).next_tokens(12)
    assert a == b and len(a) == 12
    return mapped, report


@pytest.mark.parametrize("qtype, precision", [(Q.F32, "fp32"), (Q.F16, "fp16")])
def test_mapped_float_gguf_is_bit_identical(tmp_path, qtype, precision):
    path = qwen3_gguf(tmp_path / "m.gguf", qtype)
    model, report = assert_same_model(path, precision, {precision})
    # every matrix maps: GGUF offsets are 32-aligned, and the file's last
    # tensor is a vector (copied), so each matrix has slack inside the file
    assert set(report.values()) == {"mapped"}, report


def test_mapped_kquants_are_bit_identical():
    """llama-quantize's Q4_K_M file at precision auto: q4_k and q6_k
    matrices map, llama's q and k (rows reordered) are copied."""
    model, report = assert_same_model(Q4_K_M, "auto", {"q4_k", "q6_k"})
    storages = {model.matrix(n).storage for n, v in report.items() if v == "mapped"}
    assert storages == {"q4_k", "q6_k"}, storages
    for name, v in report.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            assert v == "copied: rows reordered (llama rotary pairs)", (name, v)


@pytest.mark.parametrize("dtype, precision", [(np.float32, "fp32"), (np.float16, "fp16")])
def test_mapped_safetensors_are_bit_identical(tmp_path, dtype, precision):
    from safetensors.numpy import save_file
    src = qwen3_gguf(tmp_path / "m.gguf", Q.F32)
    ck = load_checkpoint(src)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ck.config))
    save_file({n: np.ascontiguousarray(v.astype(dtype)) for n, v in ck.weights.items()},
              str(d / "model.safetensors"))
    model, report = assert_same_model(d, precision, {precision})
    for v in report.values():
        assert v == "mapped" or v.startswith("copied: offset") or "readable" in v, v


def test_what_does_not_map_is_copied_with_its_reason(tmp_path):
    path = qwen3_gguf(tmp_path / "m.gguf", Q.F32)
    m = Model.from_pretrained(path, precision="int8", threads=1)          # storage != the file's
    assert set(m.mapping_report().values()) == {"copied: F32 packed as int8"}
    assert m.mapped_bytes == 0
    m = Model.from_pretrained(Q4_K_M, precision="fp32", threads=1)
    assert all(v.startswith("copied: Q") for v in m.mapping_report().values())


def test_memory_controls_work_on_mapped_weights(tmp_path):
    path = qwen3_gguf(tmp_path / "m.gguf", Q.F16)
    m = Model.from_pretrained(path, precision="fp16", threads=2)
    assert m.mapped_bytes > 0
    before = m.logits(PROMPT)
    assert m.touch() == m.weight_bytes
    assert m.scan() == m.weight_bytes
    locked = m.lock_pages()
    assert locked >= 0 and m.pages_locked
    m.unlock_pages()
    assert same_bits(m.logits(PROMPT), before)
    mat = next(m.matrix(n) for n, v in m.mapping_report().items() if v == "mapped")
    with pytest.raises(ValueError, match="read-only"):
        mat.pack_rows(0, np.zeros((1, mat.cols), np.float32))
    assert not mat.codes.flags.writeable


def _smaps(path, pid="self"):
    """[{field: kB}] of each mapping of path in /proc/<pid>/smaps."""
    out, cur = [], None
    real = os.path.realpath(path)
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                cur = {} if parts[-1] == real else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                cur[parts[0][:-1]] = int(parts[1])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_two_mapped_loads_share_the_page_cache(tmp_path):
    """Two models mapping one file: each mapping's resident pages are shared
    (one page-cache copy mapped twice: Pss is half the Rss), with no private
    or anonymous pages: the weights are not in private memory. (Shared_Dirty
    rather than Shared_Clean when the file sits in tmpfs or was just written.)"""
    path = qwen3_gguf(tmp_path / "m.gguf", Q.F32, layers=4)
    a = Model.from_pretrained(path, precision="fp32", threads=1)
    b = Model.from_pretrained(path, precision="fp32", threads=1)
    assert same_bits(a.logits(PROMPT), b.logits(PROMPT))
    maps = _smaps(path)
    assert len(maps) == 2, maps
    mapped_kb = a.mapped_bytes // 1024
    for m in maps:
        assert m["Private_Dirty"] == 0 and m["Private_Clean"] == 0 and m.get("Anonymous", 0) == 0, m
        assert m["Shared_Clean"] + m["Shared_Dirty"] >= 0.9 * mapped_kb, (m, mapped_kb)
        assert m["Pss"] <= 0.55 * m["Rss"], m


HOLD_SCRIPT = r"""
import sys
from cism.dense import Model
m = Model.from_pretrained(sys.argv[1], precision="fp32", threads=1)
m.logits([1, 2, 3])
print(m.mapped_bytes, flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_two_processes_share_the_mapped_weights(tmp_path):
    """Two processes holding the same mapped model: in each, the file's
    mapping is resident, shared (Pss about half its Rss: one page-cache copy
    for both) and holds no private or anonymous pages."""
    path = qwen3_gguf(tmp_path / "m.gguf", Q.F32, layers=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        mapped_kb = [int(p.stdout.readline()) // 1024 for p in procs][0]
        assert mapped_kb > 0
        for p in procs:
            maps = _smaps(path, p.pid)
            assert len(maps) == 1, maps
            m = maps[0]
            assert m["Private_Dirty"] == 0 and m["Private_Clean"] == 0 and m.get("Anonymous", 0) == 0, m
            assert m["Rss"] >= 0.9 * mapped_kb and m["Pss"] <= 0.55 * m["Rss"], (m, mapped_kb)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0]


CHANGE_SCRIPT = r"""
import os, sys
from cism.dense import Model
path, how = sys.argv[1], sys.argv[2]
m = Model.from_pretrained(path, precision=sys.argv[3], threads=1)
assert m.mapped_bytes > 0
m.logits([1, 2, 3])
s = m.create_session([1, 2, 3], 8)
if how == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
elif how == "rewrite":       # the same size, new bytes, in place
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 4096)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))   # (a coarse clock can miss the write)
for call in ("logits", "generate", "session"):
    try:
        if call == "logits":
            m.logits([1, 2, 3])
        elif call == "generate":
            m.generate([1, 2, 3], max_new_tokens=4)
        else:
            m.create_session([1, 2, 3], 4).next_tokens(4)
        print(call, "no error")
    except ValueError as e:
        print(call, type(e).__name__, e)
"""


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
@pytest.mark.parametrize("qtype, precision", [(Q.F32, "fp32"), (None, "auto")])
def test_a_mapped_file_changed_after_the_load_is_a_clear_error(tmp_path, how, qtype, precision):
    """In a child process (a SIGBUS would show as its return code): after the
    file is truncated or rewritten in place, logits, generate and a new
    session raise CheckpointError naming the file."""
    path = tmp_path / "m.gguf"
    if qtype is None:
        path.write_bytes(open(Q4_K_M, "rb").read())
    else:
        qwen3_gguf(path, qtype)
    r = subprocess.run([sys.executable, "-c", CHANGE_SCRIPT, str(path), how, precision],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert "CheckpointError" in line and str(path) in line and "changed on disk" in line, line


def test_a_file_replaced_by_rename_keeps_the_mapped_weights(tmp_path):
    """Tools that save by writing a new file and renaming it leave the mapped
    inode alive: the model keeps computing with the weights it loaded."""
    path = qwen3_gguf(tmp_path / "m.gguf", Q.F32)
    m = Model.from_pretrained(path, precision="fp32", threads=1)
    before = m.logits(PROMPT)
    other = qwen3_gguf(tmp_path / "n.gguf", Q.F16)
    os.replace(other, path)
    assert same_bits(m.logits(PROMPT), before)


def _poisoned(codes_bytes, shift):
    """codes_bytes placed `shift` bytes into a buffer whose following
    CISM_SLACK bytes are all 0xff (NaN as fp32 and fp16, inf scales as
    K-quants): the worst bytes a mapped tensor's slack can hold."""
    n = len(codes_bytes)
    buf = np.full(n + shift + 128 + 64, 0xFF, np.uint8)
    base = (-buf.ctypes.data) % 64 + shift
    buf[base:base + n] = codes_bytes
    return buf[base:base + n]


@pytest.mark.parametrize("storage, cols, shift", [("fp32", 77, 4), ("fp32", 64, 36), ("fp16", 77, 2),
                                                  ("fp16", 130, 34), ("q4_k", 512, 2), ("q6_k", 256, 18)])
def test_mapped_matrix_ignores_its_slack_on_every_isa(storage, cols, shift, isa_level):
    """Every kernel variant the host runs: a matrix over a view that is
    only element-aligned and followed by NaN/inf bytes (instead of cism's
    64-byte aligned buffer followed by zeros) gives the copy's bits, for
    one token and several, fp32 and int8 activations."""
    from conftest import runnable_isas
    from cism.matrix import Matrix
    rng = np.random.default_rng(cols + shift)
    rows = 37
    if storage in ("q4_k", "q6_k"):
        ck = load_checkpoint(Q4_K_M, lazy=True)
        t = next(t for t in ck.weights.values()
                 if t.type_name == storage.upper() and len(t.shape) == 2 and t.heads is None)
        rows, cols = t.shape
        raw = np.ascontiguousarray(t.raw())
        copied = Matrix.from_ggml(storage.upper(), raw, rows, cols)
        raw = raw.reshape(-1)
    else:
        copied = Matrix(rng.standard_normal((rows, cols)).astype(np.float32), storage)
        raw = np.ascontiguousarray(copied.codes).view(np.uint8).reshape(-1)
    view = _poisoned(raw, shift)
    assert view.ctypes.data % 64 == shift
    mapped = Matrix._mapped(storage, view, rows, cols)
    assert mapped.mapped and not copied.mapped
    for isa in runnable_isas():
        isa_level(isa)
        for act in ("fp32", "int8"):
            mapped.act_precision = copied.act_precision = act
            for T in (1, 3, 17):
                x = rng.standard_normal((T, cols)).astype(np.float32)
                assert same_bits(mapped.gemm(x, threads=2), copied.gemm(x, threads=2)), (isa, act, T)
        assert same_bits(mapped.row(rows - 1), copied.row(rows - 1)), isa


def test_mapped_matrix_checks_what_it_is_given():
    from cism.matrix import Matrix
    w = np.ones((4, 8), np.float32)
    raw = w.view(np.uint8).reshape(-1)
    with pytest.raises(ValueError, match="4-byte aligned"):
        Matrix._mapped("fp32", _poisoned(raw, 2), 4, 8)
    with pytest.raises(ValueError, match="not a file encoding"):
        Matrix._mapped("int8", raw, 4, 8)
    with pytest.raises(ValueError, match="uint8 array of 512 bytes"):
        Matrix._mapped("fp32", raw, 4, 32)
    bad = w.copy()
    bad[2, 3] = np.inf
    with pytest.raises(ValueError, match="finite"):
        Matrix._mapped("fp32", bad.view(np.uint8).reshape(-1), 4, 8)
