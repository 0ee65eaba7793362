"""One rule for thread counts: ``None`` means the physical cores this process
may run on, unless OMP_NUM_THREADS says otherwise; explicit counts must lie
in [1, 64]. Results never depend on the count."""
import os

MAX_THREADS = 64


def physical_cores():
    """Physical cores among the CPUs this process may use (hyperthreads count once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "core_id") as f:
                core = f.read().strip()
            with open(base + "physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def default_threads():
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value >= 1:
            return min(value, MAX_THREADS)
    return min(physical_cores(), MAX_THREADS)


def resolve_threads(threads):
    """Validate a user's thread count (None -> default_threads())."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int):
        try:
            import numpy as np
            if isinstance(threads, np.integer):
                threads = int(threads)
            else:
                raise TypeError
        except TypeError:
            raise ValueError(f"threads must be an integer in [1, {MAX_THREADS}] or None, "
                             f"got {threads!r}") from None
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
    return threads
