"""Seeded samples of parametrised grids whose cases run one code path (no PyTorch here: tests/codegen
uses it too).

CI runs a fixed sample of such a grid (the seed fixes it, so every run and every xdist worker collects
the same cases); ``TENSORSTEP_FULL_SWEEP=1`` runs every case, for a longer check before a release or
after a change to the path the grid exercises.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

FULL = os.environ.get("TENSORSTEP_FULL_SWEEP", "") not in ("", "0")


def sample(cases: Iterable[T], k: int, seed: int) -> list[T]:
    """``k`` of ``cases`` drawn with ``seed``, in their order; all of them under ``TENSORSTEP_FULL_SWEEP=1``."""
    cases = list(cases)
    if FULL or k >= len(cases):
        return cases
    kept = sorted(random.Random(seed).sample(range(len(cases)), k))
    return [cases[i] for i in kept]
