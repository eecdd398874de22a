"""A fused CUDA kernel's column worked out again after its knots' loop (``TS_COLUMN_AGAIN``), so that
the bases used after the loop are not held in registers through it."""
from __future__ import annotations

from typing import Collection

from .statements import Call, For, Statement


def column_again(statements: list[Statement], loops: Collection[str]) -> list[Statement]:
    """``statements`` with what follows the first top-level loop over a variable of ``loops`` in a block of
    its own that works out the thread's column and its bases anew (``TS_COLUMN_AGAIN``, which the CUDA
    template defines, to ``TS_COLUMN_AGAIN_END``) from the thread's indices read again. Else the bases
    used after the loop (the action's, the gradients', a goal's row: 64-bit) are held in registers
    through it, and float64 B-spline adjoints of many terms spilled them at the 128 cap (issue 39).
    The same values, worked out once more a column."""
    first = next((i for i, s in enumerate(statements) if isinstance(s, For) and s.var in loops), len(statements))
    if first >= len(statements) - 1:
        return statements
    return [*statements[:first + 1], Call("TS_COLUMN_AGAIN"), *statements[first + 1:], Call("TS_COLUMN_AGAIN_END")]
