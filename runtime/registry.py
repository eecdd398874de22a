"""Kernel keys: the constant strings through which torch.library ops reach a loaded launcher."""
from __future__ import annotations

import torch

from .launch import Launcher

_LAUNCHERS: dict[str, Launcher] = {}


def register(launcher: Launcher, device: torch.device) -> str:
    """Make a launcher reachable from the ops; returns its key."""
    key = f"{launcher.spec.name}@{launcher.spec.key}@{device}"
    _LAUNCHERS[key] = launcher
    return key


def launcher(key: str) -> Launcher:
    """The launcher a key names."""
    try:
        return _LAUNCHERS[key]
    except KeyError:
        raise RuntimeError(f"tensorstep: kernel {key!r} is not loaded in this process (call tensorstep.load)") from None
