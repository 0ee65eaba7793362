# How a run ends, and how it is stopped (cimport cism._status): the nogil
# layers' return codes, the finish reasons, the cancel flag (csrc/flag.h).

# Return codes of the nogil layers.
cdef enum:
    OK = 0
    CANCELLED = 1
    NOMEM = -1
    NONFINITE = -2
    ERROR = -3         # an exception was stored on the session (pending_error)
    NONFINITE_SCORE = -4   # an attention score was inf or NaN (the forward stopped)

# Finish reasons (FINISH_NAMES in _status.pyx names them).
cdef enum:
    RUNNING = 0
    STOP = 1
    LENGTH = 2
    CANCEL = 3

cdef object raise_for(int rc, what=*)
cdef object arm_cancel(int *flag, checks)

cdef extern from "flag.h" nogil:
    int cism_flag_get(const int *p)
    void cism_flag_set(int *p, int v)
    int cism_flag_check(int *p)
