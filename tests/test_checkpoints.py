"""Real trained checkpoints: stories260K (llama2.c) against an independent
NumPy forward pass, and the SmolLM2-135M GGUF."""
import numpy as np
import pytest

import cism
from cism.dense import Model

from reference import dense as ref_dense
from reference import llama2c as ref_llama2c


@pytest.fixture(scope="module")
def stories(data_dir):
    return data_dir / "models" / "stories260K" / "stories260K.bin"


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
    for precision, tol in (("fp16", 0.01), ("int8", 0.05), ("hybrid-int4", 0.5), ("hybrid-fp4", 0.5)):
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
