"""Fuzz target: a GGUF checkpoint (header, metadata, tensor infos, data),
through cism.loaders.load_gguf, its read_config and read_gguf_metadata, and,
when it loads, the model's own checks and one forward.

    PYTHONPATH=. python tests/fuzz/fuzz_gguf.py -max_total_time=120
"""
from _harness import Workdir, build_and_run, expect_value_error, instrumented, main

with instrumented():
    from cism.loaders import gguf_file, load_gguf, read_gguf_metadata

work = Workdir("gguf")


def one_input(data):
    work.fresh()
    path = work.write("model.gguf", data)
    expect_value_error(lambda: read_gguf_metadata(path), path)
    expect_value_error(lambda: gguf_file.read_config(path), path)
    ckpt = expect_value_error(lambda: load_gguf(path, threads=1), path)
    if ckpt is not None:
        build_and_run(ckpt, load_gguf(path, threads=1, lazy=True))


def seeds():
    import malformed
    yield malformed.valid_gguf()
    infos, data = malformed.gguf_tensor_infos()
    # a qwen3 variant and a tied/untied pair, so that every mapping is seen
    yield malformed.gguf_bytes(malformed.gguf_metadata("qwen3"), infos, data)
    tensors = malformed.GGUF_TENSORS + [("output.weight", (32, 8), 0)]
    i2, d2 = malformed.gguf_tensor_infos(tensors)
    yield malformed.gguf_bytes(malformed.gguf_metadata(), i2, d2)
    for _, case in malformed.gguf_cases():
        yield case


if __name__ == "__main__":
    main(one_input, seeds, "gguf")
