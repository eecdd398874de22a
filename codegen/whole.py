"""Rows of the C lane form moved as whole vectors: a pass that marks lowered statements.

The lane form (templates/kernel.c.j2) loads and stores a row of D dof as one vector masked to its D
lanes. A masked store, or load, of part of a line was slow on rows from memory (BENCHMARKS.md, "The
integrators' forward at B=40000: rows stored as whole vectors", "The plain C adjoint at B=40000:
gradient rows loaded as whole vectors"). Where the lanes past a row land on the same trajectory's
later rows, and nothing is harmed by them, the row may move as a whole vector. This pass marks such
stores and loads (``Call.whole``, ``Read.whole``), and the lane printer prints them by the macros'
whole forms (``VYW0``, ``VGW0``), which test the row: a vector that would reach past the
trajectory's rows (its last rows) stays masked, so nothing outside them is read or written.

- A store (``stored_in_order``): the lanes past a row are rewritten by the next rows' stores, so a
  macro's stores must be at literal rows 0 .. n-1, each once, in that order. A column that makes them
  in another order (a recurrence's reverse sweep, last row first) may hold them back and make them in
  row order (``in_row_order``), all where the last of them is made or in blocks of rows, each block
  where its last is made, their values kept in registers meanwhile. ``marked`` marks a store whole
  only where the rows its lanes past reach are stored after it (a block's last row, whose next row
  an earlier block stored, stays masked).
- A load (``loaded_literal``): the lanes past a row hold the next row's values, which lane-by-lane
  arithmetic and stores that are masked or rewritten meet only; every load at a literal row (a
  loop's row keeps its test at run time: measured slower).

Which columns qualify (no lane meets another: a fused forward's cost sums over the dof do; a fused
adjoint's terms meet the gradient rows lane by lane) and were measured faster is codegen/render.py's
choice (``whole_rows``, ``whole_loads``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from .statements import Call, Def, For, Read, RunEnd, Statement, Store, transform, walk

Names = Callable[[str], bool]


def stored_in_order(statements: Sequence[Statement], stores: Names, rows: int) -> bool:
    """Whether the stores through the macros ``stores`` accepts (some) are each macro's rows 0 ..
    ``rows`` - 1 once each, in that order, every row a literal one and none in a loop or a run's end
    (run as often as they come)."""
    made = _rows_made(statements, stores)
    return bool(made) and all(r == list(range(rows)) for r in made.values())


def stored_once(statements: Sequence[Statement], stores: Names, rows: int) -> bool:
    """``stored_in_order`` in any order."""
    made = _rows_made(statements, stores)
    return bool(made) and all(all(type(h) is int for h in r) and sorted(r) == list(range(rows)) for r in made.values())


def _rows_made(statements: Sequence[Statement], stores: Names) -> dict[str, list[Any]]:
    """The rows of each macro's stores (through the macros ``stores`` accepts) in the order made; {} where
    one is in a loop or a run's end."""
    by_macro: dict[str, list[Any]] = {}
    for s in statements:
        if isinstance(s, (For, RunEnd)):
            if any(isinstance(n, Call) and stores(n.macro) for n in walk(s)):
                return {}
        elif isinstance(s, Call) and stores(s.macro):
            by_macro.setdefault(s.macro, []).append(s.args[0])
    return by_macro


def in_row_order(statements: Sequence[Statement], stores: Names, block: Optional[int] = None
                 ) -> tuple[Statement, ...]:
    """``statements`` with the stores through the macros ``stores`` accepts held back and made in row
    order, each macro's, in blocks of ``block`` rows (rows 0 .. block - 1, block .. 2 block - 1, ...; None:
    one block of every row), each block at the place of the last of its stores, where some macro's are not
    in row order (a reverse sweep's), each is at a literal row, none twice, none in a loop or a run's end,
    and no statement assigns a variable, or stores through a macro, that their rows or values read (a
    value moved later is then the same value); else ``statements`` as they are (stores each macro makes
    in row order already, interleaved or not, stay where they are)."""
    made = _rows_made(statements, stores)
    if (not made or any(any(type(h) is not int for h in r) or len(set(r)) < len(r) for r in made.values())
            or all(r == sorted(r) for r in made.values())):
        return tuple(statements)
    at = [i for i, s in enumerate(statements) if isinstance(s, Call) and stores(s.macro)]
    calls = [statements[i] for i in at]
    assigned = {n.target for n in walk(tuple(statements)) if isinstance(n, Store) or isinstance(n, Def) and not n.const}
    written = {t.macro for t in assigned if isinstance(t, Read)}
    if any(n in assigned or isinstance(n, Read) and n.macro in written for c in calls for n in walk((c.args, c.value))):
        return tuple(statements)
    of = (lambda row: 0) if block is None else (lambda row: row // block)
    place: dict[int, int] = {}  # a block's rows // block -> the place of its last store
    for i, c in zip(at, calls):
        place[of(c.args[0])] = i
    macro_order = list(made)
    held: dict[int, list[Call]] = {}
    for c in sorted(calls, key=lambda c: (macro_order.index(c.macro), c.args[0])):
        held.setdefault(place[of(c.args[0])], []).append(c)
    moved = set(at)
    return tuple(x for i, s in enumerate(statements) if i in held or i not in moved
                 for x in (held[i] if i in held else (s,)))


def loaded_literal(statements: Sequence[Statement], loads: Names) -> bool:
    """Whether the reads through the macros ``loads`` accepts (some) are each at a literal row."""
    rows = [n.args[0] for n in walk(tuple(statements)) if isinstance(n, Read) and loads(n.macro)]
    return bool(rows) and all(type(h) is int for h in rows)


def marked(statements: Sequence[Statement], stores: Names = lambda _: False, loads: Names = lambda _: False,
           reach: int = 1) -> tuple[Statement, ...]:
    """``statements`` with the reads through ``loads``' macros marked whole, and the stores through
    ``stores``' macros at literal rows, each where the ``reach`` rows after its row (those its vector's
    lanes past the row fall on) are stored after it by the same macro or not at all (rows past the last:
    the whole form's own test keeps those lanes; a caller checks that every row is stored, ``stored_once``)."""
    last = {(s.macro, s.args[0]): i for i, s in enumerate(statements) if isinstance(s, Call) and stores(s.macro)}

    def rewritten(node: Call, i: int) -> bool:
        h = node.args[0]
        return type(h) is int and last.get((node.macro, h)) == i and all(
            last.get((node.macro, h + k), i + 1) > i for k in range(1, reach + 1))

    def mark(node: Any) -> Any:
        if isinstance(node, Read) and loads(node.macro):
            return dataclasses.replace(node, whole=True)
        return None

    return tuple(dataclasses.replace(s, whole=True, value=transform(s.value, mark))
                 if isinstance(s, Call) and stores(s.macro) and rewritten(s, i) else transform(s, mark)
                 for i, s in enumerate(statements))
