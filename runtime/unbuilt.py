"""Why a kernel call wrote no output: a fused kernel's C entry point runs the form its call's parameters
allow, built on the first call that runs it (runtime/cbackend.py ``Forms``); where neither that form nor
the general one can be built, it writes nothing, and it cannot raise. The hook keeps why here, by thread,
and the call raises it once the kernel has returned (``raise_unbuilt``)."""
from __future__ import annotations

import threading

#: by thread: why that thread's last kernel call wrote no output
UNBUILT: dict[int, BaseException] = {}


def keep(err: BaseException) -> None:
    """Keep why this thread's kernel call writes no output."""
    UNBUILT[threading.get_ident()] = err


def raise_unbuilt() -> None:
    """Raise why this thread's kernel call wrote no output, if it did not (the callers test ``UNBUILT``
    first: empty on every call but those)."""
    err = UNBUILT.pop(threading.get_ident(), None)
    if err is not None:
        raise RuntimeError(f"tensorstep: no form of the kernel this call runs could be built, so it wrote no "
                           f"output ({type(err).__name__}: {err})") from err
