"""Fuzz target: a Hugging Face model directory (config.json, one file or an
index with shards, files outside the directory, symlinks), loaded with
cism.loaders.load_hf_dir and read_config.

The input is a set of files (see _harness.pack_files). Symlink slots take
their payload as the link target, so inputs can point anywhere; the loader
must refuse whatever resolves outside the model directory.

    PYTHONPATH=. python tests/fuzz/fuzz_hf_dir.py -max_total_time=120
"""
import json
import os

from _harness import Workdir, expect_value_error, instrumented, main, pack_files, unpack_files

with instrumented():
    from cism.loaders import hf_dir, load_hf_dir

SLOTS = ["config.json", "model.safetensors", "model.safetensors.index.json", "s1.safetensors",
         "s2.safetensors", "../outside.safetensors", "link:link.safetensors",
         "link:model.safetensors", "dir:sub", "tokenizer.json", "link:s2.safetensors",
         "pytorch_model.bin"]

work = Workdir("hf_dir")


def build(data):
    root = work.fresh()
    model = os.path.join(root, "model")
    os.makedirs(model)
    for slot, payload in unpack_files(SLOTS, data).items():
        if slot.startswith("link:"):
            target = payload.replace(b"\0", b"").decode("utf-8", "replace")
            link = os.path.join(model, slot[5:])
            if target and not os.path.lexists(link):
                os.symlink(target, link)
        elif slot.startswith("dir:"):
            os.makedirs(os.path.join(model, slot[4:]), exist_ok=True)
        else:
            path = os.path.join(model, slot)
            if not os.path.lexists(path):
                work.write(os.path.relpath(path, root), payload)
    return root, model


def one_input(data):
    root, model = build(data)
    expect_value_error(lambda: hf_dir.read_config(model), root)
    expect_value_error(lambda: load_hf_dir(model), root)


def seeds():
    import malformed
    config = json.dumps(malformed.CONFIG).encode()
    good = malformed._good_file()
    header, data = malformed.valid_safetensors_parts()
    s1 = malformed.safetensors_bytes({k: header[k] for k in ("a", "b")}, data)
    s2 = malformed.safetensors_bytes({"c": dict(header["c"], data_offsets=[0, 8])}, data)
    index = json.dumps({"metadata": {}, "weight_map": malformed.GOOD_MAP}).encode()
    yield pack_files(SLOTS, {"config.json": config, "model.safetensors": good})
    yield pack_files(SLOTS, {"config.json": config, "model.safetensors.index.json": index,
                             "s1.safetensors": s1, "s2.safetensors": s2})
    bad_map = dict(malformed.GOOD_MAP, c="../outside.safetensors")
    yield pack_files(SLOTS, {"config.json": config, "s1.safetensors": s1,
                             "model.safetensors.index.json": json.dumps({"weight_map": bad_map}).encode(),
                             "../outside.safetensors": s2})
    yield pack_files(SLOTS, {"config.json": config, "../outside.safetensors": good,
                             "link:model.safetensors": b"../outside.safetensors"})
    yield pack_files(SLOTS, {"config.json": config, "s1.safetensors": s1,
                             "model.safetensors.index.json": json.dumps(
                                 {"weight_map": dict(malformed.GOOD_MAP, c="link.safetensors")}).encode(),
                             "link:link.safetensors": b"s1.safetensors"})
    yield pack_files(SLOTS, {"config.json": config, "dir:sub": b"",
                             "model.safetensors.index.json": json.dumps(
                                 {"weight_map": {"a": "sub"}}).encode()})
    for value in (dict(malformed.CONFIG, hidden_size="32"), {"model_type": 3}, [1],
                  dict(malformed.CONFIG, rope_scaling=[1]), dict(malformed.CONFIG, head_dim=None)):
        yield pack_files(SLOTS, {"config.json": json.dumps(value).encode(), "model.safetensors": good})
    for _, case in malformed.safetensors_cases()[::3]:
        yield pack_files(SLOTS, {"config.json": config, "model.safetensors": case})


if __name__ == "__main__":
    main(one_input, seeds, "hf_dir")
