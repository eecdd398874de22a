"""Finite-difference weights: exact rationals (moment conditions in Fractions), no pow() in C; the
Lagrange weights of non-uniform nodes (a duration per step) against the same moment conditions."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import sympy as sp

import tensorstep as ts
from tensorstep.codegen.spec import MAX_ACCURACY
from tensorstep.codegen.operator import expand_formulas
from tensorstep.codegen.stencils import lagrange_weights, stencil_offsets, uniform_weights

CASES = [(d, k, a) for k in (1, 2, 3, 4) for d, accs in
         (("backward", range(1, MAX_ACCURACY + 1)), ("central", range(2, MAX_ACCURACY + 1, 2))) for a in accs]


@pytest.mark.parametrize("difference, k, accuracy", CASES, ids=[f"{d}-k{k}-a{a}" for d, k, a in CASES])
def test_weights_are_exact_rationals(difference, k, accuracy):
    """Σ w_i x_i^m / m! = δ_mk for m < n, checked in Fractions: weights stay sp.Rational."""
    offsets = stencil_offsets(k, accuracy, difference)
    weights = uniform_weights(tuple(offsets), k)
    assert all(isinstance(w, sp.Rational) for w in weights), weights
    exact = [Fraction(int(w.p), int(w.q)) for w in weights]
    for m in range(len(offsets)):
        moment = sum(w * Fraction(x) ** m for w, x in zip(exact, offsets)) / math.factorial(m)
        assert moment == int(m == k)


@pytest.mark.parametrize("fields", [dict(difference="backward", accuracy=8),
                                    dict(difference="central", accuracy=8, end="one_sided")])
def test_generated_c_has_no_pow(fields):
    source = ts.source(ts.KernelSpec(horizon=12, dof=1, **fields), "c")
    assert "pow(" not in source


@pytest.mark.parametrize("n, k", [(2, 1), (5, 2), (9, 1), (12, 4), (11, 3)])
def test_lagrange_weights_meet_the_moment_conditions(n, k):
    """At uneven rational nodes (0 among them, as a row's own point), the symbolic weights
    evaluated exactly satisfy Σ w_i x_i^m / m! = δ_mk for every m < n, in Fractions."""
    xs = [sp.Symbol(f"x{i}") for i in range(n)]
    nodes = [i - n // 2 + Fraction(i * i, 17) for i in range(n)]  # increasing, unevenly spaced
    nodes[n // 2] = Fraction(0)
    assert len(set(nodes)) == n
    values = {x: sp.Rational(v.numerator, v.denominator) for x, v in zip(xs, nodes)}
    weights = [Fraction(str(w.xreplace(values))) for w in lagrange_weights(xs, k)]
    for m in range(n):
        moment = sum(w * x ** m for w, x in zip(weights, nodes)) / math.factorial(m)
        assert moment == int(m == k), (m, moment)


def test_expanded_formulas_are_sympys_replace():
    """expand_formulas (each distinct subexpression once) gives the very expressions SymPy's own
    ``replace`` of every applied formula by its definition gives."""
    from sympy.core.function import AppliedUndef

    from tensorstep.codegen.builders import build_operator

    spec = ts.KernelSpec(horizon=14, dof=1, dt="per_step", difference="backward", accuracy=4, end="goal")
    coefficients = build_operator(spec).coefficients()
    with_formulas = [c for c in coefficients if c.atoms(AppliedUndef)]
    assert len(with_formulas) > 50
    for c in with_formulas:
        expected = c.replace(lambda e: isinstance(e, AppliedUndef) and hasattr(type(e), "definition"),
                             lambda e: type(e).definition(*e.args))
        assert expand_formulas(c) == expected
