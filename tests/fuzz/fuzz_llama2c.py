"""Fuzz target: a llama2.c checkpoint (version 0 and the "ak42" version 1),
through cism.loaders.load_llama2c and read_config and, when it loads, the
model's own checks and one forward.

The first input byte picks a mode: odd means "make the file exactly as long as
its header says" (when that is small), so that mutated headers get past the
size check and reach the weight layout; even passes the rest through as is.

    PYTHONPATH=. python tests/fuzz/fuzz_llama2c.py -max_total_time=120
"""
import struct

from _harness import MAX_LEN, Workdir, build_and_run, expect_value_error, instrumented, main

with instrumented():
    from cism.loaders import llama2c

work = Workdir("llama2c")
FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def implied_size(data):
    """Bytes a version 0 or 1 header implies (our own arithmetic), or None."""
    if len(data) >= 8 and struct.unpack_from("<I", data)[0] == 0x616B3432:
        if len(data) < 37:
            return None
        p = dict(zip(FIELDS, struct.unpack_from("<7i", data, 8)))
        offset, tied, version = 256, data[36] == 1, 1
    elif len(data) >= 28:
        p = dict(zip(FIELDS, struct.unpack_from("<7i", data)))
        offset, tied, version = 28, p["vocab_size"] > 0, 0
    else:
        return None
    if min(p.values()) <= -(1 << 31) + 1 or not p["n_heads"] or not p["n_kv_heads"]:
        return None
    dim, hidden, layers = p["dim"], p["hidden_dim"], p["n_layers"]
    vocab = abs(p["vocab_size"])
    kv_dim = dim * p["n_kv_heads"] // p["n_heads"]
    half = dim // p["n_heads"] // 2
    n = vocab * dim + 2 * layers * dim + dim + 2 * layers * dim * dim + 2 * layers * kv_dim * dim
    n += 3 * layers * hidden * dim + (0 if tied else vocab * dim)
    if version == 0:
        n += 2 * p["seq_len"] * half
    size = offset + 4 * n
    return size if 0 < size <= 4 * MAX_LEN else None


def one_input(data):
    if not data:
        return
    mode, body = data[0], data[1:]
    if mode & 1:
        size = implied_size(body)
        if size is not None:
            body = (body + b"\0" * size)[:size]
    work.fresh()
    path = work.write("model.bin", body)
    expect_value_error(lambda: llama2c.read_config(path), path)
    ckpt = expect_value_error(lambda: llama2c.load_llama2c(path), path)
    if ckpt is not None:
        build_and_run(ckpt, llama2c.load_llama2c(path, lazy=True))


def seeds():
    import malformed
    p = malformed.LLAMA2C_PARAMS
    yield b"\0" + malformed.llama2c_bytes()
    yield b"\1" + malformed.llama2c_bytes()
    yield b"\0" + malformed.llama2c_bytes(tied=False)
    n = malformed.llama2c_float_count(p) - p["seq_len"] * (p["dim"] // p["n_heads"])
    v1 = struct.pack("<Ii7iB", 0x616B3432, 1, *p.values(), 1)
    yield b"\0" + v1 + b"\0" * (256 - len(v1)) + b"\0\0\x80\x3f" * n
    for _, case in malformed.llama2c_cases():
        yield b"\0" + case
        yield b"\1" + case


if __name__ == "__main__":
    main(one_input, seeds, "llama2c")
