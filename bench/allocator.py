"""The bench process's malloc settings: keep freed memory in the process, so every method's
allocations are served from the heap instead of being page-faulted in afresh.

glibc returns a large freed block to the operating system when the free memory at the top of
the heap exceeds a threshold that moves with the process's allocation history, and the next
allocation of that size is then zero-filled page by page. Which calls pay that depends on what
ran before them, so an interleaved run of several methods (each freeing blocks of other sizes)
moved the same case by 2x between runs. Fixing the thresholds, as docs/semantics.md tells users
to do, makes runs comparable; ``--system-malloc`` leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

#: mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the values docs/semantics.md gives users (32 MiB is glibc's largest mmap threshold)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
#: what the bench prints, either way, where the C library is not glibc
NOT_GLIBC = "malloc: not glibc; left as it is"


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> str:
    """Fix glibc's mmap and trim thresholds for this process; returns the line the bench prints.

    >>> keep_freed_memory().startswith("malloc: ")
    True
    """
    libc = _glibc()
    if libc is None:
        return NOT_GLIBC
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "malloc: glibc refused the fixed thresholds; left as it is"
    return (f"malloc: freed memory kept in the process (glibc mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD >> 20} MiB, as docs/semantics.md describes; --system-malloc: "
            "glibc's defaults)")


def leave_as_is() -> str:
    """The line the bench prints with ``--system-malloc``: the C library's own settings.

    >>> leave_as_is().startswith("malloc: ")
    True
    """
    if _glibc() is None:
        return NOT_GLIBC
    return "malloc: glibc's defaults (large outputs may be page-faulted in on every call; see docs/semantics.md)"
