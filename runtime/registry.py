"""Kernel keys: the constant strings through which torch.library ops reach a loaded launcher.

A key holds its spec's fields and the device (``name@device@{json}``), so a graph that names
it can run in a process that never loaded the kernel: a program saved by ``torch.export`` and
loaded elsewhere loads (or builds) the kernel on its first call. The loading itself is
runtime/api.py's (``set_loader``): this module holds only the mapping.

A loaded step's launcher is held weakly (the step holds it): a program that loads many specs and
drops them gets them back. A launcher loaded here for a key no step holds (a saved program, a
compiled graph or a native graph that outlived its step) is kept for the key, once: its callers
name it by key on every call and hold nothing else.
"""
from __future__ import annotations

import json
import weakref
from typing import Callable, Optional

import torch

from ..codegen.spec import spec_from_dict
from .launch import Launcher

#: key → the launcher of a step that registered it (held by the step)
_LAUNCHERS: "weakref.WeakValueDictionary[str, Launcher]" = weakref.WeakValueDictionary()
#: key → a launcher loaded here for its key (no step holds it)
_LOADED: dict[str, Launcher] = {}
#: (spec, device) → launcher, for a key this process has not loaded (set by runtime/api.py)
_LOADER: Optional[Callable[[object, str], Launcher]] = None


def key_for(spec: object, device: torch.device) -> str:
    """The key of a spec's kernels on a device (its name first, for reading graphs)."""
    fields = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))  # type: ignore[attr-defined]
    return f"{spec.name}@{device}@{fields}"  # type: ignore[attr-defined]


def register(launcher: Launcher, device: torch.device) -> str:
    """Make a launcher reachable from the ops; returns its key."""
    key = key_for(launcher.spec, device)
    _LAUNCHERS[key] = launcher
    return key


def set_loader(load: Callable[[object, str], Launcher]) -> None:
    """Set how the launcher of a key not loaded in this process is loaded (or built)."""
    global _LOADER
    _LOADER = load


def launcher(key: str) -> Launcher:
    """The launcher a key names, loaded now where no step holds one and none was loaded for it."""
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _LOADED.get(key)
    if found is None:
        found = _LOADED[key] = _load(key)
    return found


def _load(key: str) -> Launcher:
    try:
        _, device, fields = key.split("@", 2)
        spec = spec_from_dict(json.loads(fields))
    except (ValueError, TypeError, KeyError) as err:
        raise RuntimeError(f"tensorstep: {key!r} is not a kernel key (name@device@fields): {err}") from None
    if _LOADER is None:
        raise RuntimeError(f"tensorstep: cannot load kernel {spec.name}: call tensorstep.register_ops() first "
                           "(it imports the runtime that loads kernels)")
    return _LOADER(spec, device)
