"""Kernel keys: the constant strings through which torch.library ops reach a loaded launcher.

A key holds its spec's fields and the device (``name@device@{json}``), so a graph that names
it can run in a process that never loaded the kernel: a program saved by ``torch.export`` and
loaded elsewhere loads (or builds) the kernel on its first call.
"""
from __future__ import annotations

import json

import torch

from .launch import Launcher

_LAUNCHERS: dict[str, Launcher] = {}


def key_for(spec: object, device: torch.device) -> str:
    """The key of a spec's kernels on a device (its name first, for reading graphs)."""
    fields = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))  # type: ignore[attr-defined]
    return f"{spec.name}@{device}@{fields}"  # type: ignore[attr-defined]


def register(launcher: Launcher, device: torch.device) -> str:
    """Make a launcher reachable from the ops; returns its key."""
    key = key_for(launcher.spec, device)
    _LAUNCHERS[key] = launcher
    return key


def launcher(key: str) -> Launcher:
    """The launcher a key names, loaded now if this process has not loaded it yet."""
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _load(key)
    return found


def _load(key: str) -> Launcher:
    from ..config import spec_from_dict
    from .api import load

    try:
        _, device, fields = key.split("@", 2)
        spec = spec_from_dict(json.loads(fields))
    except (ValueError, TypeError, KeyError) as err:
        raise RuntimeError(f"tensorstep: {key!r} is not a kernel key (name@device@fields): {err}") from None
    _LAUNCHERS[key] = load(spec, device).launcher
    return _LAUNCHERS[key]
