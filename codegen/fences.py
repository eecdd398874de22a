"""Fenced rows: a fused CUDA forward's straight-line rows around its knots' loop (a clamped B-spline's
first and last spans) with a fence (``Fence``, ``TS_FENCE();``) before each few rows, so that ptxas
schedules each stretch's loads and adds apart from the next rows'.

Straight-line, ptxas issued the volatile loads of many rows ahead (the row weights and coefficients
are read where used) and held their values with the column's sums, limits and pointers: at the 128
cap, float32 B-splines of 64 knots with seven terms spilled 8 to 24 bytes there (BENCHMARKS.md "The
straight-line spans fenced"). The statements and their order are the same; only what ptxas may
interleave changes. The loop's body is left as it is.
"""
from __future__ import annotations

from typing import Optional

from .statements import Fence, For, Statement, Val, walk


def _row(s: Statement) -> Optional[int]:
    """The last row a statement defines or reads a value of (None: of no row)."""
    rows = [n.h for n in walk(s) if isinstance(n, Val) and isinstance(n.h, int)]
    return max(rows) if rows else None


def _fenced(statements: list[Statement], rows: int) -> list[Statement]:
    """A fence before each statement that starts a new block of ``rows`` rows (row h in block h // rows)."""
    out: list[Statement] = []
    block = None
    for s in statements:
        h = _row(s)
        if h is not None and h // rows != block:
            block = h // rows
            out.append(Fence())
        out.append(s)
    return out


def rows_fenced(statements: list[Statement], rows: int) -> list[Statement]:
    """``statements`` with a fence before each block of ``rows`` rows of the straight-line spans before
    the first knots' loop (``For`` over ``kn``) and after the last, up to the first statement after it
    of no row (the weights' reads and the sums' stores). Unchanged without such a loop or with ``rows`` 0."""
    loops = [i for i, s in enumerate(statements) if isinstance(s, For) and s.var == "kn"]
    if not loops or rows <= 0:
        return list(statements)
    first, last = loops[0], loops[-1]
    tail = list(statements[last + 1:])
    end = next((i for i, s in enumerate(tail) if _row(s) is None), len(tail))
    return (_fenced(list(statements[:first]), rows) + list(statements[first:last + 1]) + _fenced(tail[:end], rows)
            + tail[end:])
