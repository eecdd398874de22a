"""Why a kernel call wrote no output: a fused kernel's C entry point runs the form its call's parameters
allow, built on the first call that runs it (runtime/cbackend.py ``Forms``); where neither that form nor
the general one can be built, it writes nothing, and it cannot raise. The hook keeps why here, by thread,
and the call raises it once the kernel has returned: the Python path's callers (``raise_unbuilt``), and
the native node (runtime/native_node.cpp), told by ``FLAG`` that this thread has a record, which its
forward and its backward raise through the same function."""
from __future__ import annotations

import threading
from typing import Callable, Optional

#: by thread: why that thread's last kernel call wrote no output (the error, and the kernel in words)
UNBUILT: dict[int, tuple[BaseException, str]] = {}
#: set by runtime/native.py once the native node is loaded: its flag for this thread (1: a record is
#: kept, 0: it was taken), so that it raises after the kernels it calls
FLAG: Optional[Callable[[int], None]] = None


def keep(err: BaseException, what: str) -> None:
    """Keep why this thread's kernel call writes no output: ``err``, the general form's failure, and
    ``what`` the call ran, in words ("the adjoint kernel of <spec> (its narrow form, then the general
    form)")."""
    UNBUILT[threading.get_ident()] = (err, what)
    if FLAG is not None:
        FLAG(1)


def raise_unbuilt() -> None:
    """Raise why this thread's kernel call wrote no output, if it did not (the callers test ``UNBUILT``
    first: empty on every call but those), and forget it."""
    kept = UNBUILT.pop(threading.get_ident(), None)
    if kept is None:
        return
    if FLAG is not None:
        FLAG(0)
    err, what = kept
    raise RuntimeError(f"tensorstep: no form of {what} could be built, so this call wrote no output "
                       f"({type(err).__name__}: {err})") from err
