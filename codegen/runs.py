"""Runs: the one pattern behind every loop the code generator recovers from straight-line code.

A run is a maximal stretch of consecutive items that share a *shape* (compared with ``==``)
and whose numeric *fields* (row, action, table slot...) advance by one constant stride from
each item to the next. Each caller says what an item's shape and fields are, how short a run
may be, and which strides it can loop over (``admits``): e.g. only consecutive rows, or every
table slot at one stride.

>>> rows = [("a", (0, 10)), ("a", (1, 12)), ("a", (2, 14)), ("b", (3, 16)), ("b", (4, 17))]
>>> runs(rows, key=lambda r: r[0], fields=lambda r: r[1])
[Run(start=0, stop=3, stride=(1, 2)), Run(start=3, stop=5, stride=(1, 1))]
>>> runs(rows, key=lambda r: r[0], fields=lambda r: r[1], min_length=3)
[Run(start=0, stop=3, stride=(1, 2))]
>>> [(run.start, run.stop) for run in runs(rows, key=lambda r: r[0], fields=lambda r: r[1],
...                                       admits=lambda stride: stride == (NEXT, NEXT))]
[(0, 1), (1, 2), (2, 3), (3, 5)]
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")
Stride = tuple[int, ...]

#: the stride of consecutive indices (rows, actions, knots, table slots)
NEXT = 1


@dataclasses.dataclass(frozen=True)
class Run:
    """Items [start, stop) of the sequence searched; ``stride``: how each field advances from one
    item to the next (zeros for a run of one item)."""

    start: int
    stop: int
    stride: Stride

    def __len__(self) -> int:
        return self.stop - self.start


def any_stride(stride: Stride) -> bool:
    """Every constant stride can be looped over."""
    return True


def shared(stride: Stride) -> bool:
    """Every field advances by the same step (a loop with one stride for all its slots)."""
    return len(set(stride)) <= 1


def _no_fields(item: Any) -> Stride:
    return ()


def run_at(items: Sequence[T], start: int, key: Callable[[T], Any], fields: Callable[[T], Stride] = _no_fields,
           admits: Callable[[Stride], bool] = any_stride) -> Run:
    """The longest run that begins at ``items[start]`` (whose ``key`` must not be None): the items
    after it with an equal ``key`` whose ``fields`` advance by one stride, which ``admits`` accepts."""
    shape, last = key(items[start]), fields(items[start])
    stride: Stride | None = None
    stop = start + 1
    while stop < len(items) and key(items[stop]) == shape:
        values = fields(items[stop])
        step = tuple(b - a for a, b in zip(last, values))
        if step != stride and (stride is not None or not admits(step)):
            break
        stride, last, stop = step, values, stop + 1
    return Run(start, stop, (0,) * len(last) if stride is None else stride)


def runs(items: Sequence[T], key: Callable[[T], Any], fields: Callable[[T], Stride] = _no_fields,
         min_length: int = 1, admits: Callable[[Stride], bool] = any_stride) -> list[Run]:
    """The runs found left to right, each beginning after the one before it ends (``run_at``),
    that hold ``min_length`` items or more. Items whose ``key`` is None belong to no run: with
    ``min_length`` 1 the runs and those items partition ``items``."""
    found = []
    i = 0
    while i < len(items):
        if key(items[i]) is None:
            i += 1
            continue
        run = run_at(items, i, key, fields, admits)
        if len(run) >= min_length:
            found.append(run)
        i = run.stop
    return found
