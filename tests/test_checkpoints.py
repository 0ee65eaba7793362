"""Real trained checkpoints: stories260K (llama2.c) against an independent
NumPy forward pass, and the SmolLM2-135M GGUF."""
import numpy as np
import pytest

import cism
from cism.dense import Model

from reference import dense as ref_dense
from reference import llama2c as ref_llama2c


@pytest.mark.parametrize("threads", [1, 2])
def test_stories260k_greedy_matches_run_c_reference(stories, threads):
    config, weights = ref_llama2c.load_checkpoint(stories)
    want = ref_llama2c.greedy(config, weights, [1], 60)
    model = cism.load(stories, threads=threads)
    got = model.create_session([1], 60).next_tokens(60)
    assert got == want
    pieces = ref_llama2c.load_tokenizer(stories.parent / "tok512.bin", 512)
    assert ref_llama2c.decode(pieces, got).lstrip().startswith("Once upon a time, there was a little girl")
    z = ref_llama2c.logits(config, weights, [1] + got[:20])[-1]
    assert np.abs(model.logits([1] + got[:20]) - z).max() < 1e-4 * np.abs(z).max()


def test_stories260k_precisions_stay_close(stories):
    fp32 = Model.from_pretrained(stories)
    tokens = [1] + fp32.create_session([1], 100).next_tokens(100)
    base = fp32.nll(tokens)
    for precision, tol in (("fp16", 0.01), ("int8", 0.05), ("hybrid-int4", 0.5), ("hybrid-fp4", 0.5),
                            ("int4", 0.5), ("fp4", 0.5)):
        m = Model.from_pretrained(stories, precision=precision)
        assert abs(m.nll(tokens) - base) < tol, precision


def test_load_refuses_unknown_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        cism.load(tmp_path)


def test_smollm2_loads(smollm2_gguf):
    model = cism.load(smollm2_gguf, precision="int8")
    c = model.config
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.vocab, c.tied) == (576, 30, 9, 3, 49152, True)
    assert c.rope_theta == 100000.0
    assert np.isfinite(model.logits([1, 504, 3458])).all()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return cism.load(smollm2_gguf, precision="fp32"), cism.Tokenizer.from_pretrained(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_gguf):
    from cism.loaders import load_checkpoint
    return load_checkpoint(smollm2_gguf)


def test_smollm2_knows_the_capital_of_france(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    out = model.create_session(ids, 8).next_tokens(8)
    assert tok.decode(out).startswith(" Paris")


# gguf-py's names for a llama block's tensors, and the HF names the NumPy
# reference reads.
GGUF_TO_HF = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def gguf_py_llama(path):
    """HF config and float32 weights of a llama GGUF read and decoded by
    gguf-py alone (GGUFReader, quants.dequantize), so the reference below does
    not share cism's loader or decoders. llama.cpp's converter stores q and k
    rows permuted for its interleaved RoPE (per head: (2, Dh/2) -> (Dh/2, 2));
    the HF rows are that permutation undone."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(str(path))

    def field(key):
        return reader.fields[key].parts[-1][0]

    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))

    def unpermute(w, n):
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    weights = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if t.name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            weights["model.norm.weight"] = w
        else:
            _, layer, part, _ = t.name.split(".")
            w = unpermute(w, heads) if part == "attn_q" else unpermute(w, kv_heads) if part == "attn_k" else w
            weights[f"model.layers.{layer}.{GGUF_TO_HF[part]}.weight"] = w
    config = dict(model_type="llama", hidden_size=int(field("llama.embedding_length")),
                  intermediate_size=int(field("llama.feed_forward_length")),
                  num_hidden_layers=int(field("llama.block_count")), num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=int(field("llama.vocab_size")),
                  rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
                  rope_theta=float(field("llama.rope.freq_base")), tie_word_embeddings="output.weight" not in
                  {t.name for t in reader.tensors})
    return config, weights


def test_smollm2_matches_numpy_reference_on_gguf_py_weights(smollm2, smollm2_gguf, data_dir):
    """512 tokens of text through the fp32 engine (cism's loader) and through
    the float32 NumPy reference fed gguf-py's decode of the same file.

    Bounds from measurement (2026-12-07): NLL 2.77655 both ways, relative
    difference 5.4e-8 (1.7e-9 against a float64 reference, which takes twice
    as long); logits at most 9.6e-5 apart (1.0e-4 against float64) where
    they reach 38.9 in magnitude, 2.5e-6 of the largest. The bounds keep a
    margin of about 20x for the NLL and 10x for the logits: far tighter than
    any decode difference (one Q4_1 step is ~1% of a weight row's scale, a
    wrong RoPE pairing or norm eps moves the NLL by far more than 1e-6) and
    loose enough for a summation-order change in either implementation."""
    model, tok = smollm2
    text = (data_dir / "corpora" / "pride_and_prejudice.txt").read_text()[:8000]
    ids = tok.encode(text)[:512]
    assert len(ids) == 512
    config, weights = gguf_py_llama(smollm2_gguf)
    z = ref_dense.logits(config, weights, ids, dtype=np.float32).astype(np.float64)[:-1]
    m = z.max(-1, keepdims=True)
    want = float(np.mean(m[:, 0] + np.log(np.exp(z - m).sum(-1)) - z[np.arange(511), ids[1:]]))
    got = model.nll(ids)
    assert abs(got - want) < 1e-6 * want, (got, want)
    err = np.abs(model.logits_all(ids)[:-1].astype(np.float64) - z).max()
    assert err < 1e-3 and err < 2.5e-5 * np.abs(z).max(), err


# Measured on 300 tokens of Pride and Prejudice (KL of each precision's
# next-token distribution from fp32's; the GGUF's weights are Q4_1 already,
# so 4-bit storage quantizes them a second time):
#   fp16 KL 4e-7, top-1 99.7%; int8 KL 0.006 (0.010 with int8 activations),
#   top-1 95%; hybrid-int4 KL 0.27, top-1 73%; hybrid-fp4 KL 0.20, top-1 80%;
#   int4 KL 0.55, top-1 62%; fp4 KL 0.43, top-1 67% (every matrix 4-bit).
QUALITY_BOUNDS = {"fp16": (1e-4, 0.99), "int8": (0.02, 0.92),
                  "hybrid-int4": (0.4, 0.68), "hybrid-fp4": (0.3, 0.74),
                  "int4": (0.8, 0.57), "fp4": (0.63, 0.62)}


def log_softmax(z):
    z = z.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("precision", sorted(QUALITY_BOUNDS))
def test_smollm2_precision_quality(smollm2, smollm2_checkpoint, data_dir, precision):
    from cism.dense import Config, Model
    base, tok = smollm2
    ids = tok.encode((data_dir / "corpora" / "pride_and_prejudice.txt").read_text()[:6000])[:300]
    ref = log_softmax(base.logits_all(ids))
    ckpt = smollm2_checkpoint
    m = Model(Config.from_hf(ckpt.config), ckpt.weights, precision=precision)
    max_kl, min_top1 = QUALITY_BOUNDS[precision]
    for act in ("fp32", "int8"):
        m.set_act_precision(act)
        got = log_softmax(m.logits_all(ids))
        kl = (np.exp(ref) * (ref - got)).sum(-1).mean()
        top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
        assert kl < max_kl * (1.5 if act == "int8" else 1) and top1 > min_top1, (act, kl, top1)
