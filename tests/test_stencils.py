"""Finite-difference weights: exact rationals (moment conditions in Fractions), no pow() in C."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import sympy as sp

import tensorstep as ts
from tensorstep.codegen.spec import MAX_ACCURACY
from tensorstep.codegen.stencils import stencil_offsets, uniform_weights

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
