"""codegen/roll.py: when a recurrence becomes a loop, and the straight-line fallback.

What the loops compute is checked against the dense reference by the whole variant grid
(every integrator there is rolled in the C lane form: test_numerics, test_lanes)."""
from __future__ import annotations

import sympy as sp

import tensorstep as ts
from tensorstep.codegen import roll
from tensorstep.codegen.arguments import table
from tensorstep.codegen.lower import lower
from tensorstep.codegen.operator import Operator, Row, action, start
from tensorstep.codegen.schemes import build_operator
from tensorstep.codegen.statements import Def, For, Read, Term, Val, walk

ONE = sp.Integer(1)


def rolled(op: Operator) -> tuple[list, list]:
    """The rolled forward and adjoint statements (what the column and lane forms print)."""
    code = lower(op, table(ts.KernelSpec(horizon=op.horizon, dof=1, control="velocity")))
    return list(code.forward_rolled), list(code.adjoint_rolled)


def loops(statements: list) -> int:
    return sum(isinstance(s, For) for s in statements)


def defined_before_use(statements: list) -> bool:
    """Every value of a fixed row (y<k>_<h>, yb<k>_<h>) is defined before a statement reads it, and
    the top level defines no name twice (loop bodies are their own scope)."""
    defined: set = set()
    for s in statements:
        if any(isinstance(n, Val) and n.prefix in ("y", "yb") and isinstance(n.h, int) and n not in defined
               for n in walk(s.value if isinstance(s, Def) else s)):
            return False
        if isinstance(s, Def):
            if s.target in defined:
                return False
            defined.add(s.target)
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
    yb0_6 = next(s for s in adjoint if isinstance(s, Def) and s.target == Val("yb", 0, 6))
    assert Term(Read("C", (0,)), Val("yb", 0, 11)) in yb0_6.value.terms


def test_short_runs_stay_straight_line():
    spec = ts.KernelSpec(horizon=4, dof=2, control="acceleration")  # rows 2..3: fewer than MIN_ROLL
    forward, adjoint = rolled(build_operator(spec))
    assert loops(forward) == 0 and loops(adjoint) == 0
    assert roll.MIN_ROLL > 2
