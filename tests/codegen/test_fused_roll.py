"""Fused columns with their interior rows rolled into loops (codegen/fused.py, codegen/roll.py).

A cost term at a row-relative row (``CostTerms.value_at``, ``slope_at``) is one node at every row,
and placed at a row it is the term ``value`` and ``slope`` build there."""
from __future__ import annotations

import re

import sympy as sp

import tensorstep as ts
from tensorstep.codegen import fused
from tensorstep.codegen.arguments import table
from tensorstep.codegen.printer import COLUMN
from tensorstep.codegen.statements import Rel, place

TERMS = tuple(("bound", s) for s in ("position", "velocity", "acceleration", "jerk")) + (
    ("squared", "position"), ("squared", "velocity"), ("squared", "jerk"))


def _spec(**fields) -> ts.KernelSpec:
    return ts.KernelSpec(horizon=fields.pop("horizon", 12), dof=2, costs=TERMS, outputs=("P",), **fields)


def _parsed(node) -> sp.Expr:
    """A printed expression read back by SymPy (macro reads as symbols)."""
    text = COLUMN.expr(node)
    for name in sorted(set(re.findall(r"[A-Z]+\d*\(\d+\)", text)), key=len, reverse=True):
        text = text.replace(name, name.replace("(", "_").replace(")", ""))
    return sp.sympify(text.replace("TS_MAX", "Max").replace("TS_MIN", "Min"))


def test_a_term_at_a_relative_row_is_one_node_and_placed_is_the_term_at_that_row():
    spec = _spec()  # squared position: its target's slope too
    for wrt in (fused.kinds.Y, fused.kinds.TARGET):
        for narrow in (False, True):
            for unit in (False, True):
                terms = fused.CostTerms(table(spec), narrow, unit)
                for t, kind, k in [x for x in terms.terms if wrt is fused.kinds.Y or x[1] == "squared"]:
                    assert terms.value_at(t, kind, k, Rel(0)) == terms.value_at(t, kind, k, Rel(0))
                    assert terms.slope_at(t, kind, k, Rel(-2), wrt) == terms.slope_at(t, kind, k, Rel(-2), wrt)
                    for h in (1, 5):
                        at = place(terms.value_at(t, kind, k, Rel(0)), h)
                        assert sp.simplify(_parsed(at) - _parsed(terms.value(t, kind, k, h))) == 0
                        at = place(terms.slope_at(t, kind, k, Rel(1), wrt, prefix="yr"), h - 1)
                        assert sp.simplify(_parsed(at) - _parsed(terms.slope(t, kind, k, h, wrt, prefix="yr"))) == 0
