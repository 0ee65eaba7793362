"""What every fuzz target shares (see docs/HARDENING.md).

A target is ``fuzz_<name>.py`` with a ``one_input(data: bytes)`` function and
a ``seeds()`` generator; run it with ``python tests/fuzz/fuzz_<name>.py
[libFuzzer flags]``, or ``--replay`` to feed it, without atheris, its committed
seeds (``seeds/<name>/``: inputs a fuzzing run found, and every crash found so
far), what ``seeds()`` generates and any saved artifacts
(tests/test_fuzz_replay.py runs that for every target). The rules every input
must obey:

- the only exception is a ValueError (CheckpointError is one) whose message
  names the file or directory that was handed over;
- no MemoryError: the address space is capped a little above what the
  process uses when the target starts, so an allocation sized from a lying
  header fails loudly instead of passing unnoticed on a big machine;
- no hang (libFuzzer's -timeout, 10 s by default here).
"""
import atexit
import contextlib
import glob
import os
import resource
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO = os.path.dirname(TESTS)
for p in (TESTS,):
    if p not in sys.path:
        sys.path.insert(0, p)

# Inputs are capped at this many bytes (libFuzzer -max_len), so that anything
# the code allocates beyond HEADROOM is sized from a lie, not from the data.
MAX_LEN = 1 << 16
HEADROOM = 512 << 20


def instrumented():
    """Import cism inside this to give atheris coverage of its Python code."""
    try:
        import atheris
    except ImportError:          # replay without atheris
        return contextlib.nullcontext()
    return atheris.instrument_imports(include=["cism"])


class Workdir:
    """One scratch directory per target (in /dev/shm when there is one),
    emptied before each input, removed at exit."""

    def __init__(self, name):
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = tempfile.mkdtemp(prefix=f"cism-fuzz-{name}-", dir=base)
        atexit.register(shutil.rmtree, self.root, True)

    def fresh(self):
        for entry in os.listdir(self.root):
            p = os.path.join(self.root, entry)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        return self.root

    def write(self, name, data):
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return path


def expect_value_error(fn, *names):
    """Run fn(); a ValueError must name one of ``names``; anything else escapes."""
    try:
        return fn()
    except ValueError as e:
        text = str(e)
        if not any(str(n) in text for n in names):
            raise AssertionError(f"ValueError does not name the file ({names}): {text!r}") from e
        return None


def cap_memory():
    """Limit the address space to what is mapped now plus HEADROOM."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))


def committed_seeds(name):
    """Paths of the seeds kept in git for a target (tests/fuzz/seeds/<name>/)."""
    d = os.path.join(HERE, "seeds", name)
    return sorted(os.path.join(d, f) for f in os.listdir(d)) if os.path.isdir(d) else []


def main(one_input, seeds, name):
    """Run under atheris: the corpus is tests/fuzz/corpus/<name> (on first
    use the committed seeds and seeds()) unless corpus directories are
    given. With --replay, run replay() instead."""
    if "--replay" in sys.argv[1:]:
        sys.exit(replay(one_input, seeds, name))
    import atheris
    args = list(sys.argv)
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = os.path.join(HERE, "corpus", name)
        if not os.path.isdir(corpus):
            os.makedirs(corpus)
            for path in committed_seeds(name):
                shutil.copy(path, corpus)
            for i, data in enumerate(seeds()):
                with open(os.path.join(corpus, f"seed-{i:04d}"), "wb") as f:
                    f.write(data[:MAX_LEN])
        args.append(corpus)
    if not any(a.startswith("-max_len=") for a in args):
        args.append(f"-max_len={MAX_LEN}")
    if not any(a.startswith("-timeout=") for a in args):
        args.append("-timeout=10")
    dicts = {"safetensors": "safetensors", "hf_dir": "safetensors", "tok_json": "tokenizer_json",
             "tok_gpt2": "tokenizer_json"}
    if name in dicts and not any(a.startswith("-dict=") for a in args):
        # libFuzzer takes one dictionary: the format's words and JSON's, merged
        merged = os.path.join(HERE, "corpus", f"{name}.dict")
        os.makedirs(os.path.dirname(merged), exist_ok=True)
        with open(merged, "w") as out:
            for part in ("json", dicts[name]):
                with open(os.path.join(HERE, "dicts", f"{part}.dict")) as f:
                    out.write(f.read())
        args.append(f"-dict={merged}")
    if not any(a.startswith("-artifact_prefix=") for a in args):
        artifacts = os.path.join(HERE, "artifacts")
        os.makedirs(artifacts, exist_ok=True)
        args.append(f"-artifact_prefix={artifacts}/{name}-")
    cap_memory()
    atheris.Setup(args, one_input)
    atheris.Fuzz()


def replay(one_input, seeds, name):
    """Feed one target, without atheris and under the same address-space
    cap, its committed seeds, then seeds(), then the saved artifacts
    (tests/fuzz/artifacts/<name>-*). An input that breaks a rule raises
    out of here after its name is printed; the last line counts the inputs
    of each kind (tests/test_fuzz_replay.py reads it). Returns 0."""
    cap_memory()

    def feed(label, data):
        try:
            one_input(data[:MAX_LEN])
        except BaseException:
            print(f"{name}: input {label} broke a rule", file=sys.stderr, flush=True)
            raise

    committed = committed_seeds(name)
    for path in committed:
        with open(path, "rb") as f:
            feed(os.path.relpath(path, REPO), f.read())
    generated = 0
    for generated, data in enumerate(seeds(), 1):
        feed(f"seeds()[{generated - 1}]", data)
    artifacts = [p for p in sorted(glob.glob(os.path.join(HERE, "artifacts", f"{name}-*")))
                 if not p.endswith(".log")]
    for path in artifacts:
        with open(path, "rb") as f:
            feed(os.path.relpath(path, REPO), f.read())
    print(f"{name}: replayed {len(committed)} committed seeds, {generated} generated, "
          f"{len(artifacts)} artifacts", flush=True)
    return 0


# --- several files in one input ------------------------------------------------
# A multi-file target reads its input as records: one byte choosing the slot
# (the file name, modulo the target's list of names), a little-endian u16
# length and that many bytes (fewer at the end of the input). Later records for
# the same slot replace earlier ones. Simple enough that libFuzzer's mutations
# of lengths and slot bytes stay meaningful.


def pack_files(slots, files):
    """Encode {name: bytes} for a target whose slot names are ``slots``."""
    out = bytearray()
    for name, data in files.items():
        data = data[:0xFFFF]
        out += bytes([slots.index(name)]) + len(data).to_bytes(2, "little") + data
    return bytes(out)


def unpack_files(slots, data):
    files = {}
    pos = 0
    while pos + 3 <= len(data):
        name = slots[data[pos] % len(slots)]
        n = int.from_bytes(data[pos + 1:pos + 3], "little")
        files[name] = data[pos + 3:pos + 3 + n]
        pos += 3 + n
    return files


def build_and_run(checkpoint, lazy=None):
    """Past a loader: the model's own checks (Config bounds, weight shapes,
    finiteness), then one forward of one token. The model's errors are
    ValueErrors about fields, not files; a forward may also stop with the
    documented RuntimeError for non-finite logits (fuzzed weights can be huge).

    ``lazy``: the same file loaded with lazy=True (what from_pretrained
    packs from): it must build exactly when the float32 checkpoint does
    and give the same logits, bit for bit."""
    import numpy as np
    from cism.dense import Config, Model
    try:
        config = Config.from_hf(checkpoint.config)
        model = Model(config, checkpoint.weights, threads=1)
    except ValueError:
        model = None
    if lazy is not None:
        try:
            lazy_model = Model(Config.from_hf(lazy.config), lazy.weights, threads=1)
        except ValueError:
            lazy_model = None
        assert (model is None) == (lazy_model is None), "lazy and eager loads disagree on building"
    if model is None:
        return
    try:
        logits = model.logits([0])
    except RuntimeError as e:
        if "non-finite logits" not in str(e):
            raise
        return
    if lazy is not None:
        assert np.array_equal(lazy_model.logits([0]), logits), "lazy and eager logits differ"


TEXTS = ["Hello world", " leading  spaces\tand\nlines\r\n", "ünïcödé ✓ 中文 🙂",
         "<s></s><unk><|endoftext|>[EMPTY_0]", "a" * 200, "ab" * 50 + " " * 20, ""]


def exercise_tokenizer(tok):
    """A loaded tokenizer must encode any text (or refuse it with a ValueError
    naming its file, when the vocabulary has no unk token for a character)
    and decode what it encoded, whole and streaming, without raising."""
    for text in TEXTS:
        ids = expect_value_error(lambda: tok.encode(text), tok._source)
        if ids is None:
            continue
        assert all(0 <= i < tok.vocab_size for i in ids), ids
        whole = tok.decode(ids)
        stream = tok.stream_decoder(skip_special=False)
        parts = [stream.push(i) for i in ids]
        parts.append(stream.flush())
        assert "".join(parts) == whole, (text, ids)
