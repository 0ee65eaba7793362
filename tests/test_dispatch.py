"""CPU detection (csrc/dispatch.c) against what the OS reports: the flags
of /proc/cpuinfo, and for AMX the tile state Linux grants on request. A
detection bug would otherwise pass every test: a level left out is a level
whose kernels no test runs (the `for isa in ISAS` loops go over the levels
found), a level wrongly claimed crashes elsewhere."""
import pytest

from cism import _kernels

from conftest import cpuinfo_flags, expected_cpu_features, expected_isas


def test_cpu_features_are_the_flags_linux_reports():
    flags = cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags (not Linux)")
    got, want = _kernels.cpu_features(), expected_cpu_features(flags)
    assert set(got) == set(want)  # every feature cism reports is checked
    wrong = {k: f"cism {got[k]}, /proc/cpuinfo {want[k]}" for k in want if got[k] != want[k]}
    assert not wrong, wrong


def test_available_isas_are_the_levels_this_cpu_runs():
    want = expected_isas()
    if want is None:
        pytest.skip("no /proc/cpuinfo flags (not Linux)")
    assert list(_kernels.available_isas()) == want
    assert _kernels.isa_max() == want[-1]
    # and each of them can be installed
    before = _kernels.isa()
    try:
        for isa in want:
            _kernels.set_isa(isa)
            assert _kernels.isa() == isa
    finally:
        _kernels.set_isa(before)
