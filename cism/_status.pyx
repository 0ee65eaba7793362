"""How a run ends, and how it is stopped: the names of the finish reasons,
the exceptions for the nogil layers' return codes, and the cancel flag's
testing hook."""
from cism._config import is_int

FINISH_NAMES = ("", "stop", "length", "cancelled")


cdef object arm_cancel(int *flag, checks):
    """The sessions' _cancel_after(checks): arm the cancel flag to trip at the
    checks-th cancellation point the compute reaches (csrc/flag.h), so tests
    stop a run at every point on purpose instead of by thread timing.
    cancel() still wins at any time, and a cancelled session stays so."""
    if not is_int(checks) or not 1 <= checks < 2**31:
        raise ValueError(f"checks must be an integer in [1, 2^31), got {checks!r}")
    if not cism_flag_get(flag):
        cism_flag_set(flag, -<int>checks)


cdef object raise_for(int rc, what="inference"):
    if rc == NOMEM:
        raise MemoryError(f"out of memory during {what}; the session is cancelled")
    if rc == NONFINITE:
        raise RuntimeError(f"non-finite logits during {what}; the session is cancelled")
    if rc == NONFINITE_SCORE:
        raise RuntimeError(f"non-finite attention score during {what}; the session is cancelled")
