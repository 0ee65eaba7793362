"""Fuzz target: one safetensors file (header and tensor reads).

    PYTHONPATH=. python tests/fuzz/fuzz_safetensors.py -max_total_time=120
"""
import sys

from _harness import Workdir, expect_value_error, instrumented, main

with instrumented():
    from cism.loaders.safetensors_file import read_header, read_tensors

work = Workdir("safetensors")


def one_input(data):
    work.fresh()
    path = work.write("model.safetensors", data)

    def run():
        entries, _ = read_header(path)
        read_tensors(path, entries)

    expect_value_error(run, path)


def seeds():
    import malformed
    header, data = malformed.valid_safetensors_parts()
    yield malformed.safetensors_bytes(header, data)
    for _, case in malformed.safetensors_cases():
        yield case


if __name__ == "__main__":
    main(one_input, seeds, "safetensors")
