"""Llama 3.x rope scaling, Qwen2 and Mistral through GGUF files written by
llama.cpp's own converter (convert_hf_to_gguf.py of the llama-cpp-python
sdist): random-init transformers checkpoints, converted, loaded by cism,
against transformers' logits and greedy tokens."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cism

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_dense import YARN_CASES, hf_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [
    ("llama", dict(heads=2, kv=1, head_dim=128, hidden=128, theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("llama", dict(heads=4, kv=2, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # YaRN: the converter writes factor, original context, betas and
    # attention_factor (not mscale or truncate: the third case of test_dense)
    *[(kind, dict(heads=h, kv=kv, head_dim=hd, hidden=128, theta=theta, rope_scaling=scaling))
      for kind, h, kv, hd, theta, scaling in YARN_CASES[:2]],
    ("qwen3", dict(heads=2, kv=2, head_dim=64, theta=1e6,
                   rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32})),
    ("qwen2", dict(heads=4, kv=2, vocab=305)),
    ("qwen2", dict(heads=4, kv=1, tied=True)),
    # llama.cpp writes Mistral as a llama file without its window (and runs
    # it without one): the same model below the window
    ("mistral", dict(heads=4, kv=2, window=64)),
]


@pytest.fixture(scope="module")
def converter():
    import llamacpp_sdist
    return llamacpp_sdist.converter_dir()


@pytest.mark.parametrize("kind,kw", CASES)
def test_converted_gguf_matches_transformers(converter, tmp_path, kind, kw):
    cfg, hf = hf_model(kind, seed=len(str(kw)) + 1, **kw)
    if kind == "qwen2":
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("proj.bias"):
                    p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "m.gguf"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "convert_without_vocab.py"), str(converter),
                           str(tmp_path / "hf"), "--outfile", str(out), "--outtype", "f32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = cism.load(str(out), threads=2)
    assert model.precision == "auto" and model.config.model_type == ("llama" if kind == "mistral" else kind)
    if "rope_scaling" in kw:
        kind = kw["rope_scaling"].get("rope_type", kw["rope_scaling"].get("type"))
        assert model.config.rope_scaling[0] == {"llama3": "factors"}.get(kind, kind)
    prompt = [3, 17, 42, 99, 5, 7, 250, 1, 0, 280, 12, 12, 12]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False)[0, len(prompt):].tolist()
    got = model.logits(prompt)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert model.create_session(prompt, 24).next_tokens(24) == gen
