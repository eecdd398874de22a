"""New CPU outputs of a large batch, advised to come in transparent huge pages.

A kernel's new output is memory that the operating system maps in when the kernel first writes
it, one 4 KiB page at a time: at B=40000 (a 36 MB output) about 8,700 page faults, which took
several times the kernel's own arithmetic on the machine of BENCHMARKS.md. Advised with
``MADV_HUGEPAGE`` before the kernel writes it, its aligned interior comes in huge pages (one
fault each) where the system allows them (transparent huge pages "always" or "madvise");
elsewhere the advice does nothing. Memory already mapped (reused from malloc's heap) keeps
its pages. The native node (native_node.cpp, ``fresh``) advises the outputs it allocates the
same way. ``TENSORSTEP_HUGE_PAGES=0`` in the environment (read at import) turns the advice off.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

#: where Linux gives the size of a transparent huge page (absent: none)
HUGE_PAGE_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


#: set to "0" to advise nothing (outputs then come in the system's default pages)
SWITCH = "TENSORSTEP_HUGE_PAGES"


@functools.lru_cache(maxsize=1)
def huge_page_size() -> int:
    """The transparent huge page size in bytes; 0 where the system has none or the environment
    variable ``TENSORSTEP_HUGE_PAGES`` is ``0``."""
    if os.environ.get(SWITCH) == "0":
        return 0
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        return int(HUGE_PAGE_SIZE_FILE.read_text())
    except (OSError, ValueError):
        return 0


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[Callable[[int, int, int], int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advised_range(address: int, nbytes: int, huge: int) -> Optional[tuple[int, int]]:
    """The whole huge pages inside [address, address + nbytes): (start, length), or None where the
    block is smaller than two huge pages (it may hold none)."""
    if not huge or nbytes < 2 * huge:
        return None
    start = -(-address // huge) * huge
    return start, (address + nbytes) // huge * huge - start


def advise(t: torch.Tensor) -> None:
    """Advise a new contiguous CPU tensor's huge pages (a hint: where refused, nothing changes)."""
    span = advised_range(t.data_ptr(), t.nbytes, huge_page_size())
    madvise = _madvise() if span else None
    if madvise is not None:
        madvise(span[0], span[1], mmap.MADV_HUGEPAGE)


#: the size in bytes from which a new output is advised (infinite where there are no huge pages);
#: a constant, so that a small output's allocation (or Dynamo tracing one) calls nothing more
ADVISED_FROM: float = 2 * huge_page_size() or float("inf")


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for a kernel's output: on the CPU, a large one advised (``advise``; not
    while Dynamo traces, whose tensors have no memory)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.nbytes >= ADVISED_FROM and t.device.type == "cpu" and not torch.compiler.is_compiling():
        advise(t)
    return t
