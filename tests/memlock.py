"""A check of Model.lock_pages()/unlock_pages() against the kernel's own count
of this process's locked memory (VmLck in /proc/self/status), so that a
lock_pages() that locks nothing fails it."""
import os
import re
import resource

import pytest

PAGE = os.sysconf("SC_PAGE_SIZE")


def locked_bytes():
    """VmLck: the bytes of this process's pages the kernel holds locked."""
    with open("/proc/self/status") as f:
        return 1024 * int(re.search(r"^VmLck:\s+(\d+) kB", f.read(), re.M).group(1))


def can_lock(n):
    """Whether n more bytes fit under RLIMIT_MEMLOCK (root, with CAP_IPC_LOCK, has no limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or locked_bytes() + n <= soft


def check_lock_pages(m):
    """lock_pages() locks the weight_bytes of the weights as VmLck sees it;
    unlock_pages() gives them back."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status to read VmLck from")
    before = locked_bytes()
    locked = m.lock_pages()
    after = locked_bytes()
    assert m.pages_locked
    if can_lock(m.weight_bytes + 64 * PAGE):
        assert locked == m.weight_bytes
    else:   # RLIMIT_MEMLOCK may refuse some regions: what is reported must still be locked
        assert 0 <= locked <= m.weight_bytes
    # The regions are disjoint, so the pages newly locked hold all the locked
    # bytes but those on pages locked before (nothing else in the process locks
    # memory meanwhile).
    assert after - before >= locked - before, (before, after, locked)
    if locked:
        assert after > before, (before, after, locked)
    with pytest.raises(ValueError, match="weight pages are already locked"):
        m.lock_pages()
    assert locked_bytes() == after
    assert m.unlock_pages() == m.weight_bytes
    assert not m.pages_locked and locked_bytes() == before
    with pytest.raises(ValueError, match="weight pages are not locked"):
        m.unlock_pages()
