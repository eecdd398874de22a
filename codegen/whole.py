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
  an earlier block stored, stays masked). A rolled column's reverse sweep stores rows in a loop over r,
  each iteration a few rows, last row first: each iteration's are held to the place of its last store
  and made in row order, and so are the straight-line stores between loops (``in_row_order``); the
  order stores are made in, a loop's once per iteration (``_made``), decides which are whole (an
  iteration's top row, whose next row the iteration before stored, stays masked).
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

from .statements import Call, Def, For, Read, Rel, RunEnd, Statement, Store, transform, walk

Names = Callable[[str], bool]


def stored_in_order(statements: Sequence[Statement], stores: Names, rows: int) -> bool:
    """Whether the stores through the macros ``stores`` accepts (some) are each macro's rows 0 ..
    ``rows`` - 1 once each, in that order, every row a literal one and none in a loop or a run's end
    (run as often as they come)."""
    made = _rows_made(statements, stores)
    return bool(made) and all(r == list(range(rows)) for r in made.values())


def stored_once(statements: Sequence[Statement], stores: Names, rows: int) -> bool:
    """Whether the stores through the macros ``stores`` accepts (some) are each macro's rows 0 .. ``rows``
    - 1 once each, in any order: literal rows, or a loop's rows relative to r (``_made``)."""
    made = _made(statements, stores)
    return bool(made) and all(sorted(h for h, _ in r) == list(range(rows)) for r in made.values())


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


Place = tuple[int, ...]  # a store's statement: its index among the statements, then in a loop's body


def _has_store(node: Statement, stores: Names) -> bool:
    return any(isinstance(n, Call) and stores(n.macro) for n in walk(node))


def _made(statements: Sequence[Statement], stores: Names) -> Optional[dict[str, list[tuple[int, Place]]]]:
    """Each macro's stores (through the macros ``stores`` accepts) in the order made, as (row, place): a
    store at a literal row once, one at a row relative to r in a loop's body (not nested) over r between
    literal rows, once per iteration; None where one is elsewhere (a nested loop, a run's end, a shared loop)."""
    made: dict[str, list[tuple[int, Place]]] = {}
    for i, s in enumerate(statements):
        if isinstance(s, Call) and stores(s.macro):
            if type(s.args[0]) is not int:
                return None
            made.setdefault(s.macro, []).append((s.args[0], (i,)))
        elif isinstance(s, For) and _has_store(s, stores):
            body = [(j, c) for j, c in enumerate(s.body) if isinstance(c, Call) and stores(c.macro)]
            if (type(s.first) is not int or type(s.last) is not int or s.var != "r" or s.shared or not s.step
                    or any(not isinstance(c.args[0], Rel) for _, c in body)
                    or any(_has_store(x, stores) for x in s.body if not (isinstance(x, Call) and stores(x.macro)))):
                return None
            for r in range(s.first, s.last + (1 if s.step > 0 else -1), s.step):
                for j, c in body:
                    made.setdefault(c.macro, []).append((r + c.args[0].rel, (i, j)))
        elif _has_store(s, stores):
            return None
    return made


def _position(h: Any) -> Optional[int]:
    """A store's row as a number to order by: a literal row, or a loop's row relative to r."""
    return h if type(h) is int else h.rel if isinstance(h, Rel) else None


def in_row_order(statements: Sequence[Statement], stores: Names, block: Optional[int] = None
                 ) -> tuple[Statement, ...]:
    """``statements`` with the stores through the macros ``stores`` accepts held back and made in row
    order, each macro's, in blocks of ``block`` rows (rows 0 .. block - 1, block .. 2 block - 1, ...; None:
    one block of every row), each block at the place of the last of its stores, where some macro's are not
    in row order (a reverse sweep's), each is at a literal row, none twice, none in a loop or a run's end,
    and no statement assigns a variable, or stores through a macro, that their rows or values read (a
    value moved later is then the same value); else ``statements`` as they are (stores each macro makes
    in row order already, interleaved or not, stay where they are). Where loops over r store some (a rolled
    column's), the statements between them are held as such, and each loop's body holds its iteration's
    stores (rows relative to r) to the place of the last of them, in row order, the loop's rows one block."""
    if not any(isinstance(s, (For, RunEnd)) and _has_store(s, stores) for s in statements):
        return _held(statements, stores, block)
    out: list[Statement] = []
    run: list[Statement] = []
    for s in statements:
        if isinstance(s, (For, RunEnd)) and _has_store(s, stores):
            out += _held(run, stores, block)
            out.append(dataclasses.replace(s, body=_held(s.body, stores, None)) if isinstance(s, For) else s)
            run = []
        else:
            run.append(s)
    return (*out, *_held(run, stores, block))


def _held(statements: Sequence[Statement], stores: Names, block: Optional[int]) -> tuple[Statement, ...]:
    """``in_row_order`` of statements with no loop that stores, their rows all literal or all relative to r."""
    made = _rows_made(statements, stores)
    rows = [h for r in made.values() for h in r]
    if (not made or len({type(h) for h in rows}) > 1 or any(_position(h) is None for h in rows)
            or any(len(set(r)) < len(r) for r in made.values())
            or all([_position(h) for h in r] == sorted(_position(h) for h in r) for r in made.values())):
        return tuple(statements)
    at = [i for i, s in enumerate(statements) if isinstance(s, Call) and stores(s.macro)]
    calls = [statements[i] for i in at]
    assigned = {n.target for n in walk(tuple(statements)) if isinstance(n, Store) or isinstance(n, Def) and not n.const}
    written = {t.macro for t in assigned if isinstance(t, Read)}
    if any(n in assigned or isinstance(n, Read) and n.macro in written for c in calls for n in walk((c.args, c.value))):
        return tuple(statements)
    of = (lambda row: 0) if block is None else (lambda row: _position(row) // block)
    place: dict[int, int] = {}  # a block's rows // block -> the place of its last store
    for i, c in zip(at, calls):
        place[of(c.args[0])] = i
    macro_order = list(made)
    held: dict[int, list[Call]] = {}
    for c in sorted(calls, key=lambda c: (macro_order.index(c.macro), _position(c.args[0]))):
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
    ``stores``' macros each where, every time it is made (a loop's, in every iteration: ``_made``), its row
    is not stored again and the ``reach`` rows after it (those its vector's lanes past the row fall on) are
    stored after it by the same macro or not at all (rows past the last: the whole form's own test keeps
    those lanes; a caller checks that every row is stored, ``stored_once``)."""
    whole: dict[Place, bool] = {}
    for made in (_made(statements, stores) or {}).values():
        last = {h: t for t, (h, _) in enumerate(made)}
        for t, (h, at) in enumerate(made):
            whole[at] = whole.get(at, True) and last[h] == t and all(last.get(h + k, t + 1) > t
                                                                     for k in range(1, reach + 1))

    def mark(node: Any) -> Any:
        if isinstance(node, Read) and loads(node.macro):
            return dataclasses.replace(node, whole=True)
        return None

    def at(s: Statement, place: Place) -> Statement:
        if isinstance(s, Call) and whole.get(place):
            return dataclasses.replace(s, whole=True, value=transform(s.value, mark))
        if isinstance(s, For) and any(p[:1] == place for p in whole):
            return transform(dataclasses.replace(s, body=tuple(at(x, (*place, j)) for j, x in enumerate(s.body))), mark)
        return transform(s, mark)

    return tuple(at(s, (i,)) for i, s in enumerate(statements))
