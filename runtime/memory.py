"""New CPU outputs of a large batch: advised to come in transparent huge pages, and kept for reuse.

A kernel's new output is memory that the operating system maps in when the kernel first writes
it, one 4 KiB page at a time: at B=40000 (a 36 MB output) about 8,700 page faults, which took
several times the kernel's own arithmetic on the machine of BENCHMARKS.md. Advised with
``MADV_HUGEPAGE`` before the kernel writes it, its aligned interior comes in huge pages (one
fault each) where the system allows them (transparent huge pages "always" or "madvise");
elsewhere the advice does nothing. Memory already mapped (reused from malloc's heap) keeps
its pages. ``TENSORSTEP_HUGE_PAGES=0`` in the environment (read at import) turns the advice off.

Once the native node is loaded, an output of ``CACHED_FROM`` bytes or more comes from its output
blocks instead (native_node.cpp, ``OutputBlocks``; ``fresh`` is the node's own allocation): a
mapping of its own on a huge-page boundary, so that every page of it is huge, which is kept when
the last tensor on it dies and handed to a later output it fits (a planner calling a step in a
loop then pays the system's page faults and zeroing once). Idle blocks are kept up to
``TENSORSTEP_OUTPUT_CACHE_MB`` MiB (default 1024; 0 keeps none), read when the node first
allocates (a value it cannot read is warned about, naming the default it keeps to);
``empty_cache()`` gives every idle one back to the system (``torch.cuda.empty_cache``'s
counterpart), ``cache_info()`` says what is kept.
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


#: the size in bytes from which a CPU output is a block of the native node's cache (native_node.cpp
#: ``OutputBlocks::FROM``)
CACHED_FROM = 1 << 20


_OPS: dict[str, Callable] = {}


def _op(name: str) -> Optional[Callable]:
    """The native node's op ``name`` once its library is loaded (it registers its ops on load), else
    None; found once, then kept."""
    op = _OPS.get(name)
    if op is None:
        try:
            op = _OPS[name] = getattr(torch.ops.tensorstep_native, name)
        except (AttributeError, RuntimeError):
            return None
    return op


def _cache(limit: int = -1, release: bool = False) -> dict[str, int]:
    op = _op("output_cache")
    info = op(limit, release) if op is not None else [0, 0, 0]
    return dict(zip(("idle_bytes", "idle_blocks", "limit"), info))


def empty_cache() -> None:
    """Give every idle output block back to the system (memory of tensors still alive stays theirs)."""
    _cache(release=True)


def cache_info() -> dict[str, int]:
    """What the output blocks' cache keeps: ``idle_bytes``, ``idle_blocks``, and its cap ``limit``
    in bytes (all 0 where the native node is not loaded)."""
    return _cache()


def set_cache_limit(nbytes: int) -> None:
    """A new cap in bytes on the idle blocks kept (0: none; the idle ones beyond it are given back)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"set_cache_limit: nbytes must be a non-negative int, got {nbytes!r}")
    _cache(limit=nbytes)


def _tracing() -> bool:
    """Whether Dynamo or a dispatch mode (torch.export, make_fx, fake tensors) sees this call."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for a kernel's output: on the CPU, a large one a block of the native node's
    cache once it is loaded, else advised (``advise``); neither while Dynamo or a dispatch mode
    traces, whose tensors have no memory."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.nbytes < CACHED_FROM or t.device.type != "cpu" or _tracing():
        return t  # a small output's path: torch.empty and two tests
    op = _op("empty_output")
    if op is not None:
        return op(list(shape), dtype)  # (t, never written, is freed untouched)
    if t.nbytes >= ADVISED_FROM:
        advise(t)
    return t
