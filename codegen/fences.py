"""Fenced rows: a fused CUDA forward's straight-line rows after its knots' loop (a clamped B-spline's
last spans) in blocks of a few rows each (``Fenced``, ``if (TS_FENCE(n)) { ... }``), so that ptxas
schedules each block's loads and adds apart from the next rows'.

Straight-line, ptxas issued the volatile loads of many rows ahead (the row weights and coefficients
are read where used) and held their values with the column's sums, limits and pointers: at the 128
cap, float32 B-splines of 64 knots with seven terms spilled 8 to 24 bytes there (BENCHMARKS.md "The
last spans fenced"). The statements and their order are the same; only what ptxas may interleave
changes. The rows of the loop and of the first spans are left as they are.
"""
from __future__ import annotations

from typing import Optional

from .statements import Def, Fenced, For, Statement, Val, Var, walk


def _row(s: Statement) -> Optional[int]:
    """The last row a statement defines or reads a value of (None: of no row)."""
    rows = [n.h for n in walk(s) if isinstance(n, Val) and isinstance(n.h, int)]
    return max(rows) if rows else None


def _names(statements: list[Statement]) -> set:
    return {n for s in statements for n in walk(s) if isinstance(n, (Var, Val))}


def tail_fenced(statements: list[Statement], rows: int) -> list[Statement]:
    """``statements`` with the rows after the last knots' loop (``For`` over ``kn``), up to the first
    statement of no row (the weights' reads and the sums' stores), in blocks of ``rows`` rows
    (absolute row h in block h // rows); a block whose definitions a later statement reads is
    joined to the next. Unchanged without such a loop or with ``rows`` 0."""
    loops = [i for i, s in enumerate(statements) if isinstance(s, For) and s.var == "kn"]
    if not loops or rows <= 0:
        return list(statements)
    head, tail = list(statements[:loops[-1] + 1]), list(statements[loops[-1] + 1:])
    end = next((i for i, s in enumerate(tail) if _row(s) is None), len(tail))
    groups: list[list[Statement]] = []
    key = None
    for s in tail[:end]:
        k = _row(s) // rows
        if groups and k == key:
            groups[-1].append(s)
        else:
            groups.append([s])
        key = k
    fenced: list[Statement] = []
    carried: list[Statement] = []
    for i, g in enumerate(groups):
        g = carried + g
        defined = {s.target for s in g if isinstance(s, Def)}
        if defined & _names([s for h in groups[i + 1:] for s in h] + tail[end:]):
            carried = g
        else:
            fenced.append(Fenced(len(fenced), tuple(g)))
            carried = []
    return head + fenced + carried + tail[end:]
