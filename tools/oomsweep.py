"""Fail each Python-level allocation of one `cism.load` in turn and report
what the caller sees (docs/HARDENING.md, "Out of memory").

    python tools/oomsweep.py PATH [--precision int8] [--stride 1] [--limit 4000]

Uses CPython's own fault injector (`_testcapi.set_nomemory(n, n + 1)`: the
n-th allocation through PyMem/PyObject fails, every other one succeeds), so
it reaches the small allocations an RLIMIT_AS cap rarely hits first. numpy's
data buffers come from malloc directly and are covered by tests/test_memory.py
instead. Needs a CPython built with _testcapi (pyenv and python.org builds
have it); not part of CI: a full sweep of stories260K takes about two minutes.
"""
import argparse
import collections
import sys
import traceback

import _testcapi

import cism
import cism.dense  # noqa: F401  (imports allocate too: not under the injector)
import cism.fwkv  # noqa: F401
import cism.surjo  # noqa: F401


def outcome(path, precision, n):
    _testcapi.set_nomemory(n, n + 1)
    try:
        cism.load(path, precision=precision, threads=2)
        return "ok", None
    except BaseException as e:  # noqa: B902 - everything is reported
        _testcapi.remove_mem_hooks()
        if isinstance(e, MemoryError) and str(e).startswith(f"{path}: out of memory while "):
            return "named: " + str(e).split(" while ", 1)[1], None
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"{type(e).__name__}: {str(e)[:50]!r}", f"{where.filename}:{where.lineno}"
    finally:
        _testcapi.remove_mem_hooks()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--limit", type=int, default=4000, help="allocations to try")
    args = ap.parse_args()
    cism.load(args.path, precision=args.precision, threads=2)   # warm every lazy import
    seen = collections.Counter()
    places = collections.defaultdict(set)
    for n in range(0, args.limit, args.stride):
        what, where = outcome(args.path, args.precision, n)
        seen[what] += 1
        if where:
            places[what].add(where)
    for what, count in seen.most_common():
        print(f"{count:6d}  {what}")
        for where in sorted(places[what]):
            print(f"          at {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
