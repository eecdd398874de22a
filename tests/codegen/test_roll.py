"""codegen/roll.py: when a recurrence becomes a loop, and the straight-line fallback.

What the loops compute is checked against the dense reference by the whole variant grid
(every integrator there is rolled in the C lane form: test_numerics, test_lanes)."""
from __future__ import annotations

import re

import sympy as sp

import tensorstep as ts
from tensorstep.codegen import roll
from tensorstep.codegen.arguments import table
from tensorstep.codegen.lower import lower
from tensorstep.codegen.operator import Operator, Row, action, start
from tensorstep.codegen.printer import COLUMN
from tensorstep.codegen.schemes import build_operator

ONE = sp.Integer(1)


def rolled(op: Operator) -> tuple[list[str], list[str]]:
    """The rolled forward and adjoint columns, as the column form prints them."""
    code = lower(op, table(ts.KernelSpec(horizon=op.horizon, dof=1, control="velocity")))
    return COLUMN.lines(code.forward_rolled), COLUMN.lines(code.adjoint_rolled)


def loops(lines: list[str]) -> int:
    return sum(line.startswith("for (int64_t r") for line in lines)


def defined_before_use(lines: list[str]) -> bool:
    """Every value name (y<k>_<h>, yb<k>_<h>) is declared before a line reads it, and the body's
    top level declares no name twice (loop bodies are their own scope)."""
    defined: set[str] = set()
    for line in lines:
        m = re.match(r"\s*(?:const )?T (\w+) = (.*);", line)
        target, expr = (m.group(1), m.group(2)) if m else (None, line)
        if any(name not in defined for name in re.findall(r"\byb?\d+_\d+\b", expr)):
            return False
        if target and not line.startswith(" "):
            if target in defined:
                return False
            defined.add(target)
    return True


def chain(horizon: int, far_read: bool = False) -> Operator:
    """y1_h = U(h-1); y0_h = y0_(h-1) + c·y1_h; optionally the last row also reads y0 of a middle row."""
    c = sp.Symbol("dt", positive=True)
    rows = [Row(0, 0, ((ONE, start(0)),)), Row(1, 0, ((ONE, start(1)),))]
    for h in range(1, horizon):
        rows.append(Row(1, h, ((ONE, action(h - 1)),)))
        prev = start(0) if h == 1 else ("y", 0, h - 1)
        terms = [(ONE, prev), (c, ("y", 1, h))]
        if far_read and h == horizon - 1:
            terms.append((c, ("y", 0, horizon // 2)))
        rows.append(Row(0, h, tuple(terms)))
    return Operator(horizon=horizon, order=1, n_actions=horizon - 1, dt_symbols=(c,), rows=rows)


def test_repeating_rows_become_one_loop_each_way():
    forward, adjoint = rolled(chain(12))
    assert loops(forward) == 1 and loops(adjoint) == 1
    assert defined_before_use(forward) and defined_before_use(adjoint)


def test_a_read_the_loop_does_not_carry_falls_back_to_straight_line():
    """The last row reads y0_6, which a loop over rows 2..10 would not keep: the forward stays
    straight-line. In the adjoint, row 6 gets one more contribution, which splits the run."""
    forward, adjoint = rolled(chain(12, far_read=True))
    assert loops(forward) == 0 and defined_before_use(forward)
    assert loops(adjoint) == 2 and defined_before_use(adjoint)  # rows 10..7 roll, 6 does not, 5..2 roll
    assert "C(0)*yb0_11" in next(line for line in adjoint if line.startswith("const T yb0_6 ="))


def test_short_runs_stay_straight_line():
    spec = ts.KernelSpec(horizon=4, dof=2, control="acceleration")  # rows 2..3: fewer than MIN_ROLL
    forward, adjoint = rolled(build_operator(spec))
    assert loops(forward) == 0 and loops(adjoint) == 0
    assert roll.MIN_ROLL > 2
