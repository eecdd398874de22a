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
  in another order (a recurrence's reverse sweep, last row first) may hold them back to where the
  last of them is made and make them there in row order (``in_row_order``), their values kept in
  registers meanwhile.
- A load (``loaded_literal``): the lanes past a row hold the next row's values, which lane-by-lane
  arithmetic and stores that are masked or rewritten meet only; every load at a literal row (a
  loop's row keeps its test at run time: measured slower).

Which columns qualify (no lane meets another: a fused forward's cost sums over the dof do; a fused
adjoint's terms meet the gradient rows lane by lane) and were measured faster is codegen/render.py's
choice (``whole_rows``, ``whole_loads``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .statements import Call, Def, For, Read, RunEnd, Statement, Store, transform, walk

Names = Callable[[str], bool]


def stored_in_order(statements: Sequence[Statement], stores: Names, rows: int) -> bool:
    """Whether the stores through the macros ``stores`` accepts (some) are each macro's rows 0 ..
    ``rows`` - 1 once each, in that order, every row a literal one and none in a loop or a run's end
    (run as often as they come)."""
    by_macro: dict[str, list[Any]] = {}
    for s in statements:
        if isinstance(s, (For, RunEnd)):
            if any(isinstance(n, Call) and stores(n.macro) for n in walk(s)):
                return False
        elif isinstance(s, Call) and stores(s.macro):
            by_macro.setdefault(s.macro, []).append(s.args[0])
    return bool(by_macro) and all(r == list(range(rows)) for r in by_macro.values())


def in_row_order(statements: Sequence[Statement], stores: Names) -> tuple[Statement, ...]:
    """``statements`` with the stores through the macros ``stores`` accepts held back to the place of the
    last of them and made there, each macro's in row order, where some macro's are not in that order
    (a reverse sweep's), each is at a literal row, none twice, none in a loop or a run's end, and no
    statement assigns a variable, or stores through a macro, that their rows or values read (a value
    moved later is then the same value); else ``statements`` as they are (stores each macro makes in
    row order already, interleaved or not, stay where they are)."""
    at = [i for i, s in enumerate(statements) if isinstance(s, Call) and stores(s.macro)]
    calls = [statements[i] for i in at]
    rows: dict[str, list[Any]] = {}
    for c in calls:
        rows.setdefault(c.macro, []).append(c.args[0])
    nested = any(isinstance(n, Call) and stores(n.macro) for s in statements if isinstance(s, (For, RunEnd))
                 for n in walk(s))
    if (not calls or nested or any(type(r) is not int or len(set(r_)) < len(r_) for r_ in rows.values() for r in r_)
            or all(r_ == sorted(r_) for r_ in rows.values())):
        return tuple(statements)
    assigned = {n.target for n in walk(tuple(statements)) if isinstance(n, Store) or isinstance(n, Def) and not n.const}
    written = {t.macro for t in assigned if isinstance(t, Read)}
    if any(n in assigned or isinstance(n, Read) and n.macro in written for c in calls for n in walk((c.args, c.value))):
        return tuple(statements)
    macro_order = list(rows)
    held = sorted(calls, key=lambda c: (macro_order.index(c.macro), c.args[0]))
    return tuple(x for i, s in enumerate(statements) if i == at[-1] or i not in at
                 for x in (held if i == at[-1] else (s,)))


def loaded_literal(statements: Sequence[Statement], loads: Names) -> bool:
    """Whether the reads through the macros ``loads`` accepts (some) are each at a literal row."""
    rows = [n.args[0] for n in walk(tuple(statements)) if isinstance(n, Read) and loads(n.macro)]
    return bool(rows) and all(type(h) is int for h in rows)


def marked(statements: Sequence[Statement], stores: Names = lambda _: False, loads: Names = lambda _: False
           ) -> tuple[Statement, ...]:
    """``statements`` with the stores through ``stores``' macros and the reads through ``loads``' marked
    whole."""
    def mark(node: Any) -> Any:
        if isinstance(node, Call) and stores(node.macro):
            return dataclasses.replace(node, whole=True, value=transform(node.value, mark))
        if isinstance(node, Read) and loads(node.macro):
            return dataclasses.replace(node, whole=True)
        return None
    return transform(tuple(statements), mark)

