"""bench/llamacpp.py writes the GGUFs both engines run; these tests load what
it writes (a tiny dense shape, so they stay fast) with cism."""
import numpy as np
import pytest

import cism
from cism import bench as cbench

from bench_scripts import load_script

pytest.importorskip("gguf")


TINY = dict(model_type="qwen3", hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2,
            head_dim=16, vocab=49200, context=256, eps=1e-6, rope_theta=1000000.0, tied=True)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(cbench.SHAPES, "tiny-qwen3", TINY)
    return "tiny-qwen3"


def test_written_shape_loads_with_its_config_and_padded_tokenizer(tiny_shape, smollm2_gguf, tmp_path):
    llamacpp = load_script("llamacpp")
    path = tmp_path / "tiny.F32.gguf"
    llamacpp.write_shape(tiny_shape, str(smollm2_gguf), str(path))
    m = cism.load(str(path), precision="fp32", threads=1)
    c = m.config
    assert (c.hidden, c.intermediate, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab) == \
        (64, 96, 2, 4, 2, 16, 49200)
    assert c.tied
    # the SmolLM2 tokens come first, the padding after them
    smol = cism.load(str(smollm2_gguf), precision="int8", threads=1)
    text = "Hello there, tiny model."
    assert m.tokenizer.encode(text) == smol.tokenizer.encode(text)
    assert m.tokenizer.decode(smol.tokenizer.encode(text)) == smol.tokenizer.decode(smol.tokenizer.encode(text))
    logits = m.logits(m.tokenizer.encode(text))
    assert logits.shape == (49200,) and np.isfinite(logits).all()

    # a re-quantized variant of it is the same model at that format
    q8 = tmp_path / "tiny.Q8_0.gguf"
    llamacpp.write_variant(str(path), str(q8), "Q8_0")
    m8 = cism.load(str(q8), precision="int8", threads=1)
    logits8 = m8.logits(m.tokenizer.encode(text))
    assert np.corrcoef(logits, logits8)[0, 1] > 0.99


def test_shape_with_fewer_tokens_than_the_tokenizer_is_refused(monkeypatch, smollm2_gguf, tmp_path):
    llamacpp = load_script("llamacpp")
    monkeypatch.setitem(cbench.SHAPES, "too-small", dict(TINY, vocab=1000))
    with pytest.raises(ValueError, match="more than too-small's 1000"):
        llamacpp.write_shape("too-small", str(smollm2_gguf), str(tmp_path / "x.gguf"))


def test_shape_must_be_a_dense_one(capsys):
    llamacpp = load_script("llamacpp")
    with pytest.raises(SystemExit):
        llamacpp.main(["--shape", "myosotis-1-base"])
    err = capsys.readouterr().err
    assert "invalid choice: 'myosotis-1-base'" in err and "qwen3-0.6b" in err
