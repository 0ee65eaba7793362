"""A minimal install (cism with numpy and safetensors, and pytest: no text
extras, no torch, no hypothesis) still collects the suite: each optional
package is asked for by the tests that need it, so only those skip. Checked by
collecting in a subprocess where the optional packages are shadowed by modules
whose import fails as a missing package's does."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The text extras, gguf-py, the transformers oracles and hypothesis (a package:
# its pytest plugin is switched off as if it were not installed).
OPTIONAL = ("gguf", "torch", "transformers", "regex", "tokenizers", "jinja2", "hypothesis/__init__")

# Tests that need none of them, from the files whose imports this guards.
NUMPY_ONLY = [
    "tests/test_loaders.py::test_malformed_checkpoint_is_rejected[gguf:bad-magic]",
    "tests/test_loaders.py::test_malformed_checkpoint_is_rejected[hf:safetensors-overlap]",
    "tests/test_loaders.py::test_llama2c_synthetic_mapping[True]",
    "tests/test_dense.py::test_config_validation_messages",
    "tests/test_tokenizer.py::test_missing_files",
    "tests/test_lazy.py::test_pack_rows_refuses_what_does_not_fit",
    "tests/test_matrix.py::test_row_and_sizes",
    "tests/test_sampling.py::test_greedy_and_degenerate_settings",
    "tests/test_paging.py::test_pool_basics_and_errors",
    "tests/test_engine.py::test_the_pool_counts_against_the_kv_budget",
    # property tests are collected too, and skip when run
    "tests/test_paging.py::test_pool_machine",
    "tests/test_engine.py::test_engine_machine[dense]",
]


def collect(tmp_path, blocked, paths, plugins=()):
    """`pytest --collect-only` of paths with the blocked modules (or packages,
    "name/__init__") failing to import: (exit code, collected test ids, output)."""
    shadow = tmp_path / "shadow"
    for module in blocked:
        name = module.split("/")[0]
        path = shadow / f"{module}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        message = f"No module named {name!r} (blocked by {Path(__file__).name})"
        path.write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    env = dict(os.environ, PYTHONPATH=f"{shadow}{os.pathsep}{REPO}")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *plugins, *paths], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ids = {line for line in run.stdout.splitlines() if "::" in line}
    return run.returncode, ids, run.stdout + run.stderr


def count(ids, prefix):
    return sum(i.startswith(prefix) for i in ids)


@pytest.mark.slow
def test_the_suite_collects_without_the_optional_packages(tmp_path):
    code, ids, out = collect(tmp_path, OPTIONAL, ["tests"], plugins=["-p", "no:hypothesispytest"])
    assert code == 0 and "ERROR" not in out, out[-3000:]
    assert set(NUMPY_ONLY) <= ids, set(NUMPY_ONLY) - ids
    # the whole malformed corpus, and the dense tests but the transformers parity
    assert count(ids, "tests/test_loaders.py::test_malformed_checkpoint_is_rejected[") > 600
    assert count(ids, "tests/test_dense.py::") > 40

