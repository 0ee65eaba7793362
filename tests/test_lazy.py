"""Tensor-at-a-time loading (issue 34): lazy tensors (cism.loaders.lazy)
read only the rows asked for and give the eager loader's bits; matrices
packed a block of rows at a time hold the bytes of a whole packing; models
built from lazy tensors equal models built from arrays; a file that changes
after its header was read fails with the loaders' message, naming the
tensor."""
import os

import numpy as np
import pytest

from cism.loaders import CheckpointError, load_checkpoint, load_gguf
from cism.loaders.ggml_types import GGML_TYPES
from cism.loaders.lazy import FileTensor
from cism.matrix import Matrix

# The tests that write GGUF files ask for gguf-py (through write_gguf); the rest do not need it.
from test_loaders import dense_tensors, gguf_meta, gguf_name, gguf_py, llama_cpp_permute, write_gguf

TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}

FLOAT_STORAGES = ("fp32", "fp16", "int8", "int4", "fp4")


@pytest.mark.parametrize("storage", FLOAT_STORAGES)
@pytest.mark.parametrize("rows, cols", [(700, 96), (257, 40), (1, 64)])
def test_pack_rows_in_blocks_equals_one_packing(storage, rows, cols):
    """Rows pack independently (csrc/pack.h): any split into blocks, of any
    thread count, gives the bytes of Matrix(whole): same products, same
    decoded values."""
    rng = np.random.default_rng(rows + cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    whole = Matrix(w, storage, threads=1)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    for splits, threads in (([0, rows], 2), ([0, 1, 255, 256, 300, rows], 1), ([0, 513, rows], 2)):
        m = Matrix.empty(rows, cols, storage)
        bounds = sorted({min(b, rows) for b in splits})
        for r0, r1 in zip(bounds, bounds[1:]):
            m.pack_rows(r0, w[r0:r1].copy(), threads=threads)
        assert m.nbytes == whole.nbytes and m.storage == storage
        assert np.array_equal(m.dequantize(), whole.dequantize()), (storage, splits)
        assert np.array_equal(m.gemm(x, threads=1), whole.gemm(x, threads=1)), (storage, splits)


def test_pack_rows_refuses_what_does_not_fit():
    m = Matrix.empty(10, 8, "int8")
    assert not m.dequantize().any()            # an empty matrix holds zeros
    with pytest.raises(ValueError, match="outside the 10-row matrix"):
        m.pack_rows(8, np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"C-contiguous float32 \(n, 8\)"):
        m.pack_rows(0, np.zeros((3, 7), np.float32))
    with pytest.raises(ValueError, match=r"C-contiguous float32 \(n, 8\)"):
        m.pack_rows(0, np.zeros((3, 8), np.float64))
    with pytest.raises(ValueError, match="holds a GGUF file's own blocks"):
        Matrix.empty(4, 256, "q4_k").pack_rows(0, np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match="packs floats"):
        m.copy_ggml_rows(0, np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="multiple of 256"):
        Matrix.empty(4, 300, "q6_k")
    with pytest.raises(ValueError, match="rows must be in"):
        Matrix.empty(0, 8, "fp32")


@pytest.mark.parametrize("qtype, storage", [("Q4_K", "q4_k"), ("Q6_K", "q6_k")])
def test_copy_ggml_rows_in_blocks_equals_from_ggml(qtype, storage):
    """Rows of a K-quant tensor copied in blocks: from_ggml's bytes."""
    path = os.path.join(os.path.dirname(__file__), "data", "ggml", "tiny-llama.Q4_K_M.gguf")
    ck = load_checkpoint(path, lazy=True)
    t = next(t for t in ck.weights.values()
             if t.type_id == TYPE_IDS[qtype] and len(t.shape) == 2 and t.shape[0] > 20)
    rows, cols = t.shape
    raw = t.raw()
    whole = Matrix.from_ggml(qtype, raw, rows, cols)
    m = Matrix.empty(rows, cols, storage)
    assert not m.dequantize().any()          # all-zero super-blocks are zeros
    for r0, r1 in ((0, 1), (1, 20), (20, rows)):
        m.copy_ggml_rows(r0, raw[r0:r1].copy(), threads=2)
    assert m.nbytes == whole.nbytes and np.array_equal(m.dequantize(), whole.dequantize())
    bad = raw.copy()
    d = 0 if qtype == "Q4_K" else 208                  # the fp16 d of super-block 0
    bad[5, d:d + 2] = [0x00, 0x7c]                     # +inf
    with pytest.raises(ValueError, match="non-finite scale in super-block 0 of row 5"):
        m.copy_ggml_rows(3, bad[3:7].copy())
    with pytest.raises(ValueError, match="not whole"):
        m.copy_ggml_rows(rows - 1, raw[:2].copy())


def _llama_gguf(path, qtype):
    """A two-layer llama GGUF with q/k written in ggml's rotary order (qtype: a ggml type name)."""
    Q = gguf_py().GGMLQuantizationType
    qtype = Q[qtype]
    rng = np.random.default_rng(7)
    heads, kv_heads = 4, 2
    hf = dense_tensors(rng, hidden=64, ffn=96, heads=heads, kv_heads=kv_heads, head_dim=16, vocab=300,
                       layers=2)
    tensors = {}
    for name, value in hf.items():
        if name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        tensors[gguf_name(name)] = (value, qtype if value.ndim == 2 else Q.F32)
    return write_gguf(path, "llama", gguf_meta("llama", layers=2, vocab=300), tensors)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_lazy_rows_equal_the_eager_load(tmp_path, qtype):
    """Any row range of any tensor (q and k reordered within their heads,
    ranges cutting through heads) is the same bits as the eager load's."""
    path = _llama_gguf(tmp_path / "m.gguf", qtype)
    eager = load_gguf(path).weights
    lazy = load_checkpoint(path, lazy=True)
    assert lazy.types == load_gguf(path).types
    rng = np.random.default_rng(1)
    for name, t in lazy.weights.items():
        assert isinstance(t, FileTensor) and t.shape == eager[name].shape, name
        assert np.array_equal(t.load(2), eager[name]), name
        if len(t.shape) == 2:
            for _ in range(5):
                r0, r1 = sorted(rng.integers(0, t.shape[0] + 1, 2))
                assert np.array_equal(t.load_rows(r0, r1, 1), eager[name][r0:r1]), (name, r0, r1)


def test_lazy_safetensors_and_llama2c_equal_the_eager_load(tmp_path, data_dir):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(3)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    tensors = {"a": rng.standard_normal((33, 7)).astype(np.float32),
               "b": rng.standard_normal((5, 3, 4)).astype(np.float16), "c": np.full((), 2.5, np.float32)}
    save_file(tensors, str(d / "model.safetensors"))
    sources = [str(d)]
    stories = data_dir / "models" / "stories260K" / "stories260K.bin"
    if stories.exists():
        sources.append(str(stories))
    for src in sources:
        eager = load_checkpoint(src).weights
        lazy = load_checkpoint(src, lazy=True).weights
        assert list(lazy) == list(eager)
        for name, t in lazy.items():
            got = t.load()
            assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == eager[name].shape
            assert np.array_equal(got, eager[name]), (src, name)
            if len(t.shape) == 2 and t.shape[0] > 3:
                assert np.array_equal(t.load_rows(1, 3), eager[name][1:3]), (src, name)


def test_models_from_lazy_tensors_equal_models_from_arrays(smollm2_gguf, monkeypatch):
    """from_pretrained packs lazy tensors a block of rows at a time: the
    same logits as a model packed from the eager checkpoint's arrays, with
    blocks of any size."""
    import cism._weights
    from cism.dense import Config, Model
    ck = load_gguf(smollm2_gguf)
    prompt = [1, 50, 600, 7000]
    eager = Model(Config.from_hf(ck.config), ck.weights, precision="hybrid-int4", threads=2)
    want = eager.logits(prompt)
    del ck, eager
    assert np.array_equal(Model.from_pretrained(smollm2_gguf, precision="hybrid-int4", threads=2).logits(prompt),
                          want)
    monkeypatch.setattr(cism._weights, "PACK_BLOCK_BYTES", 1)     # 256-row blocks
    assert np.array_equal(Model.from_pretrained(smollm2_gguf, precision="hybrid-int4", threads=1).logits(prompt),
                          want)


def test_a_file_changed_after_its_header_was_read_is_named(tmp_path):
    """Lazy tensors trust the header read at load time; a file truncated
    before the model reads a tensor fails with a CheckpointError naming the
    file and that tensor (never a crash, never stale bytes: every read
    checks its length)."""
    from cism.dense import Config, Model
    path = _llama_gguf(tmp_path / "m.gguf", "Q8_0")
    ck = load_checkpoint(path, lazy=True)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"m\.gguf: file ended inside tensor 'blk\.1\.ffn_down\.weight' \(got 5528 of 6528 bytes\)"):
        Model(Config.from_hf(ck.config), ck.weights, precision="int8")
    os.remove(path)
    with pytest.raises(CheckpointError, match=r"m\.gguf: cannot open"):
        ck.weights["model.embed_tokens.weight"].load()
