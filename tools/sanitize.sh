#!/usr/bin/env bash
# Run pytest (or the leak check) against the AddressSanitizer +
# UndefinedBehaviorSanitizer build in build/sanitize, made by `make sanitize`
# (docs/HARDENING.md).
#
#   tools/sanitize.sh [pytest args...]               the sanitized suite
#   tools/sanitize.sh --each-isa [pytest args...]    once per ISA level this CPU runs
#   tools/sanitize.sh --leaks                        tools/leakcheck.py
#
# CPython and numpy are not instrumented, so the sanitizer runtimes are
# preloaded (ASan must come first in the process). UB aborts at its first
# report (-fno-sanitize-recover at build time, halt_on_error here). Leak
# detection is off for pytest because CPython keeps its own allocations at
# exit; --leaks checks cism's own allocations instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
lib=$(ls -d build/sanitize/lib.* 2>/dev/null | head -n 1 || true)
if [ -z "$lib" ]; then
    echo "no sanitizer build in build/sanitize: run 'make sanitize' first" >&2
    exit 2
fi
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# The sanitized package first; the repository after it (for tests.reference).
# -P keeps the current directory, with its in-place build, off sys.path.
export PYTHONPATH="$PWD/$lib:$PWD"
# tests that build native harnesses (tests/native) build them sanitized too
export CISM_SANITIZE="${CISM_SANITIZE:-address,undefined}"
"$PYTHON" -P -c 'import sys, cism; f = cism._kernels.__file__; sys.exit(0 if "build/sanitize" in f else f"not the sanitized build: {f}")'

case "${1:-}" in
--leaks)
    exec "$PYTHON" -P tools/leakcheck.py
    ;;
--each-isa)
    shift
    isas=$("$PYTHON" -P -c 'from cism import _kernels; print(" ".join(_kernels.available_isas()))')
    for isa in $isas; do
        echo "=== CISM_ISA=$isa"
        CISM_ISA=$isa "$PYTHON" -P -m pytest -p no:cacheprovider "$@"
    done
    ;;
*)
    "$PYTHON" -P -c 'from cism import _kernels; print("sanitized cism, kernels:", _kernels.isa())'
    exec "$PYTHON" -P -m pytest -p no:cacheprovider "$@"
    ;;
esac
