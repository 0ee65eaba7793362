"""The opt-in bf16 precision (AVX512-BF16 or AMX): Matrix products against a float64
emulation of its rounding, the invariances it keeps (threads, tokens per
call, rows' split), and dense models with bf16 prefill: close to exact,
identical however a prompt is chunked, batched, paged, evicted or forked,
and refused cleanly (a warning, exact prefill) where the CPU cannot run it.

Each test runs on every bf16 kernel (the `bf16_unit` fixture): the amx
level's tile kernel, on the emulated tile unit where the CPU has no AMX
(tests/amx_emulator.py), whose TDPBF16PS follows the SDM's pseudo-code, so
there the products are also compared bit for bit with emulate_tile_unit;
and the VDPBF16PS kernel where the CPU has AVX512-BF16, compared bit for
bit with the instruction's definition (vdpbf16ps)."""
import warnings

import numpy as np
import pytest

from cism import _kernels
from cism.matrix import FLOAT_STORAGES, Matrix, bf16_available

from models import small_model

def bf16(a):
    """float32 -> nearest bfloat16 (ties to even), as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def flush(a):
    """Denormal float32 values as zeros of their sign (DAZ/FTZ)."""
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < np.float32(2.0 ** -126), np.copysign(np.float32(0), a), a).astype(np.float32)


def emulate(m, X):
    """float64 products of the bf16-rounded dequantized weights and
    activations (int8: the codes, times the row scale after), and the sum of
    the products' magnitudes (the scale of any fp32 summation error)."""
    Wd = m.dequantize()
    if m.storage == "int8":
        codes = np.round(Wd / m.scales[:, None])
        Wb = bf16(codes).astype(np.float64) * m.scales[:, None]
        assert np.array_equal(bf16(codes), codes)  # int8 codes are exact in bf16
    else:
        Wb = bf16(Wd).astype(np.float64)
    Xb = bf16(X).astype(np.float64)
    return Xb @ Wb.T, np.abs(Xb) @ np.abs(Wb).T


def emulate_tile_unit(m, X):
    """The bf16 kernel's products as the SDM's pseudo-code defines
    TDPBF16PS, in the kernel's steps (csrc/gemm/gemm_amx.c): inputs rounded
    as emulate() does (denormal floats converted to zero); per step of 32
    elements two fp32 chains of fused multiply-adds from zero, the even and
    the odd elements, then their sum, then that added to the output; every
    step rounded to nearest even with denormals read and written as zero;
    the int8 row scale multiplies the finished sum. float64 holds each
    exact bf16 product and its sum with a float32 (53 >= 2 * 24 + 2 bits,
    so rounding that to float32 is the single rounding of an FMA). The
    oracle of the emulated unit (tests/native/amx_emulate.h), bit for bit."""
    Wd = np.round(m.dequantize() / m.scales[:, None]) if m.storage == "int8" else m.dequantize()
    Wb, Xb = bf16(flush(Wd)).astype(np.float64), bf16(flush(X)).astype(np.float64)
    cols = Wb.shape[1]
    with np.errstate(over="ignore"):
        acc = np.zeros((len(X), len(Wb)), np.float32)
        for k0 in range(0, cols, 32):
            even, odd = np.zeros_like(acc), np.zeros_like(acc)
            for k in range(k0, min(k0 + 32, cols)):
                half = even if k % 2 == 0 else odd
                # (the padding past cols adds exact zeros: left out)
                half[...] = flush(Xb[:, k, None] * Wb[None, :, k] + half.astype(np.float64))
            acc = flush(flush(acc) + flush(flush(even) + flush(odd)))
    return acc * m.scales[None, :] if m.storage == "int8" else acc


SHAPES = [(64, 64, 16), (70, 100, 5), (33, 1040, 47), (1, 31, 1), (200, 3072, 40), (96, 576, 70)]


def bf16_kernel():
    return _kernels.kernel_variants()["gemm (bf16, opt-in)"]


def vdpbf16ps(m, X):
    """Intel's definition of VDPBF16PS over one weight row per lane: for each
    k pair p in order, acc += x[2p+1] * w[2p+1], then acc += x[2p] * w[2p],
    each sum rounded to nearest even in fp32 (a product of two bf16 is exact
    in fp32); K padded with zeros to whole 32-element blocks; int8 codes
    multiplied, the row scale applied to the finished dot."""
    Wd = m.dequantize()
    codes = np.round(Wd / m.scales[:, None]) if m.storage == "int8" else Wd
    n = m.cols
    kp = -(-n // 32) * 32
    Wb = np.zeros((m.rows, kp), np.float32)
    Wb[:, :n] = bf16(codes)
    Xb = np.zeros((X.shape[0], kp), np.float32)
    Xb[:, :n] = bf16(X)
    acc = np.zeros((X.shape[0], m.rows), np.float32)
    with np.errstate(all="ignore"):
        for k in range(0, kp, 2):
            acc += np.outer(Xb[:, k + 1], Wb[:, k + 1])
            acc += np.outer(Xb[:, k], Wb[:, k])
    if m.storage == "int8":
        acc *= m.scales[None, :].astype(np.float32)
    return acc


@pytest.mark.parametrize("storage", FLOAT_STORAGES)
@pytest.mark.parametrize("rows,cols,T", SHAPES[:4] + SHAPES[5:])
def test_avx512bf16_is_the_instruction_definition(storage, rows, cols, T, isa_level):
    """The AVX512-BF16 kernel gives, bit for bit, Intel's pseudo-code of the
    instruction in lane order (the AMX unit rounds differently, so this
    holds on the VDPBF16PS kernel only)."""
    if not _kernels.cpu_features()["avx512_bf16"]:
        pytest.skip("no AVX512-BF16 on this CPU")
    isa_level("avx512vnni")
    assert bf16_kernel() == "avx512bf16"
    rng = np.random.default_rng(rows + cols + T)
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    m = Matrix(W, storage)
    m.act_precision = "bf16"
    assert np.array_equal(m.gemm(X, threads=2), vdpbf16ps(m, X))


@pytest.mark.parametrize("storage", FLOAT_STORAGES)
@pytest.mark.parametrize("rows,cols,T", SHAPES)
def test_matrix_bf16_is_the_rounded_product(storage, rows, cols, T, bf16_unit):
    rng = np.random.default_rng(rows * cols + T)
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    m = Matrix(W, storage)
    exact = m.gemm(X, threads=2)
    m.act_precision = "bf16"
    assert m.act_precision == "bf16"
    Y = m.gemm(X, threads=2)
    want, mag = emulate(m, X)
    # inputs rounded exactly as emulated: only the fp32 summation differs
    # (truncating instead of rounding would be ~1e-3 of the magnitudes)
    assert np.all(np.abs(Y - want) <= 2e-6 * mag + 1e-30)
    if bf16_unit == "emulated":
        unit = emulate_tile_unit(m, X)
        bad = np.argwhere(Y.view(np.uint32) != unit.view(np.uint32))
        assert not len(bad), f"{len(bad)} outputs differ from the tile unit's arithmetic, first {bad[:4].tolist()}"
    if bf16_unit == "avx512bf16":
        assert np.array_equal(Y, vdpbf16ps(m, X))  # the instruction's definition, bit for bit
    if storage in ("fp32", "fp16") or (T > 1 and cols > 32):
        assert not np.array_equal(Y, exact)  # it is not the canonical path
    # each output depends on its own row and token only
    assert np.array_equal(Y, m.gemm(X, threads=1))
    assert np.array_equal(Y[:1], m.gemm(X[:1], threads=1))
    perm = rng.permutation(T)
    assert np.array_equal(Y[perm], m.gemm(X[perm], threads=2))
    assert np.array_equal(Y[-1], m.gemv(X[-1]))
    if rows > 32:
        sub = Matrix(W[32:], storage)
        sub.act_precision = "bf16"
        assert np.array_equal(Y[:, 32:], sub.gemm(X, threads=2))


def test_matrix_bf16_extremes(bf16_unit):
    """Large and tiny magnitudes stay finite and rounded; a zero input gives zeros."""
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((40, 96)) * 1e18).astype(np.float32)
    X = (rng.standard_normal((3, 96)) * 1e-18).astype(np.float32)
    m = Matrix(W, "fp32")
    m.act_precision = "bf16"
    Y = m.gemm(X)
    want, mag = emulate(m, X)
    assert np.all(np.isfinite(Y)) and np.all(np.abs(Y - want) <= 2e-6 * mag)
    assert not np.any(m.gemm(np.zeros((2, 96), np.float32)))
    # subnormal activations and weights count as zero (the conversion flushes them)
    big = Matrix(np.full((16, 32), 1e30, np.float32), "fp32")
    big.act_precision = "bf16"
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1e-39
    assert not np.any(big.gemm(x))
    tiny = Matrix(np.full((16, 32), 1e-39, np.float32), "fp32")
    tiny.act_precision = "bf16"
    assert not np.any(tiny.gemm(np.full((1, 32), 1e30, np.float32)))


def test_matrix_bf16_refused_where_unavailable():
    m = Matrix(np.ones((4, 8), np.float32), "fp32")
    with pytest.raises(ValueError, match="fp32, int8 or bf16"):
        m.act_precision = "fp8"
    before = _kernels.isa()
    _kernels.set_isa("ref")
    try:
        assert not bf16_available()
        with pytest.raises(ValueError, match="needs AVX512-BF16 or AMX-BF16"):
            m.act_precision = "bf16"
        assert m.act_precision == "fp32"
    finally:
        _kernels.set_isa(before)


# ------------------------------------------------- prompt attention ---

def pair_chain(A, B, acc):
    """VDPBF16PS's definition along the middle axis of A (m, K) @ B (K, n):
    acc += A[:, 2p+1] B[2p+1] then acc += A[:, 2p] B[2p], each rounded to
    fp32, for the pairs p in order, inputs rounded to bf16, an odd K padded
    with a zero."""
    K = A.shape[1]
    Ab = np.zeros((A.shape[0], K + K % 2), np.float32)
    Ab[:, :K] = bf16(A)
    Bb = np.zeros((K + K % 2, B.shape[1]), np.float32)
    Bb[:K] = bf16(B)
    acc = np.array(acc, np.float32)
    with np.errstate(all="ignore"):
        for k in range(0, K, 2):
            acc += np.outer(Ab[:, k + 1], Bb[k + 1])
            acc += np.outer(Ab[:, k], Bb[k])
    return acc


@pytest.fixture
def bf16_attention(isa_level):
    if not _kernels.cpu_features()["avx512_bf16"]:
        pytest.skip("no AVX512-BF16 on this CPU")
    isa_level("avx512vnni")
    assert _kernels.kernel_variants()["prompt attention (bf16, opt-in)"] == "avx512bf16"


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("hd,nq", [(64, 16), (64, 3), (17, 1), (128, 20), (200, 5)])
def test_bf16_attention_kernels_are_the_instruction_definition(hd, nq, half, bf16_attention):
    """The bf16 prefill's scores (keys in lanes) and weighted sums (key
    pairs in order, continued through O; an odd count's last key paired
    with zeros), bit for bit the instruction's definition; a sum split at
    an even key is the same chain."""
    rng = np.random.default_rng(hd * nq + half)
    Q = rng.standard_normal((nq, hd)).astype(np.float32)
    Kt = rng.standard_normal((hd, 16)).astype(np.float32)
    if half:
        Kt = Kt.astype(np.float16)
    for nk in (16, 5):
        got = _kernels.scores16(Q, Kt, nk, bf16=True)
        want = pair_chain(Q, Kt.astype(np.float32), np.zeros((nq, 16)))
        want[:, nk:] = 0
        assert np.array_equal(got, want), nk
    for nk in (1, 2, 37, 150):
        P = rng.random((nq, nk)).astype(np.float32)
        V = rng.standard_normal((nk, hd)).astype(np.float16 if half else np.float32)
        O = rng.standard_normal((nq, hd)).astype(np.float32)
        got = _kernels.axpy_tile(P, V, O, bf16=True)
        assert np.array_equal(got, pair_chain(P, V.astype(np.float32), O)), nk
        cut = nk // 4 * 2
        part = _kernels.axpy_tile(P[:, :cut], V[:cut], O, bf16=True)
        assert np.array_equal(_kernels.axpy_tile(P[:, cut:], V[cut:], part, bf16=True), got), nk


def test_bf16_attention_refused_where_unavailable(isa_level):
    isa_level("avx512")
    with pytest.raises(RuntimeError, match="no bf16 attention kernels"):
        _kernels.scores16(np.zeros((1, 16)), np.zeros((16, 16)), bf16=True)


# ------------------------------------------------------------ models ---

def bf16_model(model_type="llama", precision="fp32", threads=2, seed=0, **kw):
    model = small_model(model_type, precision, threads=threads, seed=seed, **kw)
    model.set_prefill_precision("bf16")
    return model


def test_prefill_precision_validated():
    model = small_model()
    assert model.prefill_precision == "exact"
    with pytest.raises(ValueError, match="prefill_precision must be exact or bf16"):
        model.set_prefill_precision("fp16")
    from cism.dense import Model
    with pytest.raises(ValueError, match="prefill_precision must be exact or bf16"):
        Model.from_pretrained("/nonexistent/checkpoint", prefill_precision="bf8")


def test_prefill_bf16_warns_and_stays_exact_without_amx():
    model = small_model(seed=4)
    prompt = list(range(1, 40))
    want = model.logits(prompt)
    before = _kernels.isa()
    _kernels.set_isa("ref")
    try:
        with pytest.warns(RuntimeWarning, match="prefill stays exact"):
            model.set_prefill_precision("bf16")
        assert model.prefill_precision == "exact"
    finally:
        _kernels.set_isa(before)
    assert np.array_equal(model.logits(prompt), want)


@pytest.mark.parametrize("precision", ["fp32", "int8", "hybrid-int4", "int4"])
def test_prefill_bf16_close_to_exact(precision, bf16_unit):
    exact = small_model("qwen3", precision, seed=5)
    fast = bf16_model("qwen3", precision, seed=5)
    assert fast.prefill_precision == "bf16" and fast.compile_key != exact.compile_key
    assert "prefill_precision='bf16'" in repr(fast)
    rng = np.random.default_rng(6)
    prompt = list(rng.integers(0, 97, 90))
    a, b = exact.logits(prompt), fast.logits(prompt)
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert abs(exact.nll(prompt) - fast.nll(prompt)) < 0.01
    # switching back is exact again
    fast.set_prefill_precision("exact")
    assert np.array_equal(fast.logits(prompt), a) and fast.compile_key == exact.compile_key


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
def test_prefill_bf16_same_bits_however_the_prompt_runs(kv, bf16_unit):
    model = bf16_model("llama", seed=7, kv_precision=kv)
    one = bf16_model("llama", seed=7, threads=1, kv_precision=kv)
    rng = np.random.default_rng(8)
    prompt = list(rng.integers(0, 97, 300))  # past one 256-token prefill chunk
    last = model.logits(prompt)
    assert np.array_equal(one.logits(prompt), last)
    rows = model.logits_all(prompt)
    assert np.array_equal(rows[-1], last)
    for k in (1, 17, 256, 257):
        assert np.array_equal(model.logits(prompt[:k]), rows[k - 1])
    assert np.array_equal(model.paged_logits(prompt), last)


def test_generation_after_bf16_prefill_agrees_across_session_kinds(bf16_unit):
    """Batched, paged (through eviction and forks) and speculative decoding
    agree with plain sessions when both prefill in bf16: prompt tokens are
    bf16 wherever they run, generated ones canonical."""
    model = bf16_model("qwen3", seed=9)
    rng = np.random.default_rng(10)
    prompts = [list(rng.integers(0, 97, n)) for n in (37, 5, 61)]
    solo = [model.create_session(p, 20).next_tokens(20) for p in prompts]
    assert model.create_batch_session(prompts, 20).next_tokens(20) == solo
    # speculation verifies generated tokens: canonical, as plain decoding
    rep = prompts[0] * 3
    plain = model.create_session(rep, 24).next_tokens(24)
    assert model.create_session(rep, 24).next_tokens(24, spec_k=4) == plain
    # paged, with an eviction (the recompute runs the prompt part in bf16
    # and the generated part canonically, as they first ran)
    dense = model.create_session(prompts[0], 30)
    paged = model.create_paged_session(prompts[0], 30)
    assert paged.next_tokens(10) == dense.next_tokens(10)
    child_prompt = prompts[0] + [5, 6, 7]
    child = model.create_paged_fork_session(child_prompt, 12, src=paged, prefix_len=33)
    assert child.next_tokens(12) == model.create_session(child_prompt, 12).next_tokens(12)
    pool = model.paged_pool()
    assert pool.evict_one(-1) != -1 and pool.evict_one(-1) != -1
    assert paged.next_tokens(10) == dense.next_tokens(10)
    assert paged.recomputes == 1
    assert np.array_equal(paged.last_logits, dense.last_logits)
    # and the bf16 prompt really changes what follows it
    exact = small_model("qwen3", seed=9)
    ref = exact.create_session(prompts[0], 1)
    ref.next_tokens(1)
    s = model.create_session(prompts[0], 1)
    s.next_tokens(1)
    assert not np.array_equal(ref.last_logits, s.last_logits)


@pytest.mark.parametrize("unit", ["as found", "amx"])
def test_cli_prefill_precision(data_dir, capsys, unit, request):
    """--prefill-precision: bf16 perplexity close to exact; a note, not an
    error, where bf16 cannot run (as found on a CPU without AMX; with the
    tile unit, real or emulated, the bf16 branch)."""
    import json
    if unit == "amx":
        request.getfixturevalue("amx_unit")

    from cism import cli
    stories = data_dir / "models" / "stories260K" / "stories260K.bin"
    f = data_dir / "corpora" / "tinyshakespeare.txt"

    def ppl(*extra):
        code = cli.main(["perplexity", "--model", str(stories), "--file", str(f), "--ctx", "64",
                         "--chunks", "4", "--json", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        r = json.loads(out)
        assert r["prefill_precision"] == (extra[-1] if extra and bf16_available() else "exact")
        return r["ppl"], err

    exact, _ = ppl()
    fast, err = ppl("--prefill-precision", "bf16")
    if bf16_available():
        assert fast != exact and abs(fast - exact) < 0.01 * exact and not err
    else:
        assert fast == exact and "prefill stays exact" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(stories), "--prompt", "x", "--prefill-precision", "fp8"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_prefill_precision_is_for_dense_models(tmp_path, capsys):
    """A recurrent model asked for bf16 prefill: one line naming the problem."""
    from cism import cli
    from test_fwkv import config, save_dir, weights
    c = config()
    d = save_dir(tmp_path / "fwkv", c, weights(c, 0))
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 50)
    code = cli.main(["perplexity", "--model", str(d), "--file", str(f), "--prefill-precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "cism: error: --prefill-precision bf16 is for dense models, not fwkv"
