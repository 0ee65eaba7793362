"""precision "auto" (the default): a GGUF's tensors keep their encoding
where cism has a native storage and otherwise take the nearest storage that
is not smaller; quantised matrices are decoded one at a time as they are
packed, with the bits of decoding the whole file first."""
import os

import numpy as np
import pytest

import cism
from cism.dense import Config, Model
from cism.loaders import load_gguf
from cism.loaders.ggml_types import AUTO, NATIVE, auto_storages, native_storages

DATA = os.path.join(os.path.dirname(__file__), "data", "ggml")
Q4_K_M = os.path.join(DATA, "tiny-llama.Q4_K_M.gguf")


def test_the_auto_table():
    """Every decodable type has a storage, none smaller (bits per weight,
    scales included) than its source; no 4-bit storage re-rounds a 4-bit
    grid."""
    bits = {"fp32": 32, "fp16": 16, "int8": 8}
    source = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_0": 5.5,
              "Q5_1": 6, "Q4_K": 4.5, "Q4_0": 4.5, "Q4_1": 5, "IQ4_NL": 4.5, "IQ4_XS": 4.25, "Q3_K": 3.4375,
              "Q2_K": 2.625}
    from cism.loaders.ggml_types import DECODED, type_name
    assert {type_name(t) for t in DECODED} == set(source)
    for t, storage in AUTO.items():
        assert bits[storage] >= source[type_name(t)], type_name(t)
    storages = auto_storages({"a": "Q4_K", "b": "Q6_K", "c": "Q5_0", "d": "F32", "e": "BF16"})
    assert storages["c"] == "int8" and storages["d"] == "fp32" and storages["e"] == "fp32"
    native = native_storages()
    for name, t in (("a", "Q4_K"), ("b", "Q6_K")):
        want = native.get(next(k for k in NATIVE if type_name(k) == t))
        assert storages[name] == (want or AUTO[next(k for k in AUTO if type_name(k) == t)])


@pytest.mark.parametrize("path", [Q4_K_M, os.path.join(DATA, "tiny-llama.IQ4_XS.gguf"),
                                  os.path.join(DATA, "tiny-llama.Q5_K_M.gguf")])
def test_auto_loads_encoded_tensors_with_the_bits_of_decoding_first(path):
    """from_pretrained decodes each matrix as it packs it (load_gguf's
    keep_quantized); a model built from the float32 checkpoint with the same
    storages gives the same logits, bit for bit."""
    model = Model.from_pretrained(path, threads=2)
    assert model.precision == "auto"
    ck = load_gguf(path)
    report = model.storage_report()
    storages = auto_storages(ck.types)
    for name, (source, storage) in report.items():
        assert source == ck.types[name] and storage == storages[name], name
    # native storages are built from the file's blocks; every other matrix
    # from the float32 checkpoint
    encoded = load_gguf(path, keep_quantized=True).weights
    weights = {name: encoded[name] if storages.get(name) in NATIVE.values() else value
               for name, value in ck.weights.items()}
    eager = Model(Config.from_hf(ck.config), weights, precision="auto", storages=storages, threads=2)
    prompt = [1, 5, 9, 60, 7, 3]
    assert np.array_equal(model.logits(prompt), eager.logits(prompt))
    assert model.compile_key == eager.compile_key
    # and a fixed precision gets the same bits from encoded tensors as from floats
    int8 = Model.from_pretrained(path, precision="int8", threads=2)
    assert np.array_equal(int8.logits(prompt),
                          Model(Config.from_hf(ck.config), ck.weights, precision="int8", threads=2).logits(prompt))
    assert int8.compile_key != model.compile_key


def test_the_default_for_a_quantised_gguf_is_auto(smollm2_gguf):
    """The packaged SmolLM2 is Q4_1 with a Q8_0 embedding: int8 and fp16."""
    model = cism.load(str(smollm2_gguf), threads=2)
    report = model.storage_report()
    assert model.precision == "auto"
    assert report["model.embed_tokens.weight"] == ("Q8_0", "fp16")
    assert report["model.layers.0.mlp.up_proj.weight"] == ("Q4_1", "int8")
    assert model.create_session([1, 2, 3], 4).next_tokens(4)


def test_storages_validation():
    from models import dense_weights, small_config
    config = small_config()
    w = dense_weights(config)
    with pytest.raises(ValueError, match="storages are for precision 'auto'"):
        Model(config, w, precision="int8", storages={"lm_head.weight": "int8"})
    with pytest.raises(ValueError, match="storage 'int3' of lm_head.weight"):
        Model(config, w, precision="auto", storages={"lm_head.weight": "int3"})
    m = Model(config, w, precision="native", storages={"lm_head.weight": "int8"})
    assert m.precision == "auto" and m.storage_report()["lm_head.weight"] == ("float", "int8")
    assert m.storage_report()["model.layers.0.mlp.up_proj.weight"] == ("float", "fp32")


def test_cli_info_shows_each_type_and_what_it_became(capsys):
    import json

    from cism import cli
    assert cli.main(["info", "--model", Q4_K_M, "--tensors"]) == 0
    out = capsys.readouterr().out
    native = native_storages()
    q4k = native.get(12, AUTO[12])
    assert f"x Q4_K -> {q4k}" in out and "precision: auto" in out
    assert f"model.layers.0.mlp.gate_proj.weight: Q4_K -> {q4k}" in out
    assert "loaded in " in out and " s; peak RSS " in out    # beside the weight bytes (issue 34)
    assert cli.main(["info", "--model", Q4_K_M, "--precision", "int8", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    tensors = model["tensors"]
    assert {(t["source"], t["storage"]) for t in tensors.values()} == {("Q4_K", "int8"), ("Q6_K", "int8")}
    assert model["load_seconds"] > 0 and model["peak_rss_bytes"] > model["weight_bytes"]


@pytest.mark.parametrize("name", ["Q4_K_M", "IQ4_XS", "Q5_K_M", "Q2_K"])
def test_kquant_files_generate_from_the_cli_as_from_the_api(name, capsys):
    """The default (auto) from the command line: the tokens of the API's
    greedy session on the same file."""
    import json

    from cism import cli
    path = os.path.join(DATA, f"tiny-llama.{name}.gguf")
    assert cli.main(["generate", "--model", path, "--prompt", "hello", "--max-new-tokens", "6",
                     "--threads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = cism.load(path, threads=2)
    ids = model.tokenizer.encode("hello")
    assert out["tokens"] == model.create_session(ids, 6).next_tokens(6)
    assert out["prompt_tokens"] == len(ids)
