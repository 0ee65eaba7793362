"""The fuzz targets' inputs replayed without atheris (not a CI dependency):
every target's committed seeds (tests/fuzz/seeds/<target>/: inputs found by
fuzzing and every crash found so far), its generated seeds and any saved
artifacts go through its one_input, in its own process under the harness's
address-space cap, and break none of the rules of tests/fuzz/_harness.py
(only the documented exceptions, no MemoryError)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"
REPO = FUZZ.parents[1]
sys.path.insert(0, str(FUZZ))
from run_all import TARGETS  # noqa: E402
from _harness import MAX_LEN, committed_seeds  # noqa: E402


def test_every_target_is_listed_and_has_committed_seeds():
    assert sorted(TARGETS) == sorted(p.stem[len("fuzz_"):] for p in FUZZ.glob("fuzz_*.py"))
    for target in TARGETS:
        seeds = committed_seeds(target)
        assert seeds, target
        # a seed longer than libFuzzer's -max_len would be cut, its tail never replayed
        assert all(os.path.getsize(p) <= MAX_LEN for p in seeds), target


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_inputs_replay_within_the_rules(target):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(FUZZ / f"fuzz_{target}.py"), "--replay"],
                          env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    counts = re.search(r"replayed (\d+) committed seeds, (\d+) generated", proc.stdout)
    assert counts, log
    assert int(counts[1]) == len(committed_seeds(target)) and int(counts[2]) > 0, log
