"""Joint-space cost kinds as data: a pointwise expression per kind, its parameters, and the
derivatives SymPy takes of it.

A cost term ``(kind, state)`` of a spec adds, over every output row h and dof d of the state's
output y, ``expression(y, parameters)``; its weight is ``weight_d · row_weight_h``. The
expression is all a kind is: the adjoint needs its derivative in y (``derivative``), a
Hessian-vector product its second (``second_derivative``), and both are derived here.

>>> KINDS["squared"].derivative
2*w*(-target + y)
>>> KINDS["bound"].derivative
2*w*(-Max(0, lower + margin - y) + Max(0, margin - upper + y))
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import sympy as sp

#: the symbols an expression may use: the state's value, the combined weight, and the kind's parameters
Y, W = sp.Symbol("y", real=True), sp.Symbol("w", real=True)
LOWER, UPPER, MARGIN, TARGET = (sp.Symbol(n, real=True) for n in ("lower", "upper", "margin", "target"))


def _ramp(x: sp.Expr) -> sp.Expr:
    """max(0, x)."""
    return sp.Max(0, x)


class DeadZone(sp.Function):
    """y − min(max(y, a), b) for a ≤ b: how far y is outside [a, b], signed (0 inside). Its square is
    max(0, y − b)² + max(0, a − y)² in three operations instead of six, and its slope is 1 wherever
    it is not 0, so d(w·z²)/dy = 2w·z (``_tidy``)."""

    nargs = 3
    is_real = True

    def fdiff(self, argindex: int = 1) -> sp.Expr:
        y, a, b = self.args
        above, below = sp.Heaviside(y - b, 0), sp.Heaviside(a - y, 0)
        return {1: above + below, 2: -below, 3: -above}[argindex]


@dataclasses.dataclass(frozen=True)
class CostKind:
    """One kind of cost term: its pointwise expression, in ``Y``, ``W`` and any of ``LOWER``,
    ``UPPER`` (a limit), ``MARGIN``; ``target_states``: the states for which ``TARGET`` exists
    (elsewhere it is 0; the squared position term's only). A new kind is one entry of ``KINDS``
    and its name with its ``parameters`` in spec.COST_KINDS (docs/costs.md, "A kind of your own")."""

    name: str
    expression: sp.Expr
    target_states: tuple[str, ...] = ()
    #: the same function in fewer operations where a condition on the parameters holds: (condition,
    #: the kind as that expression); a C call whose parameters meet it on every dof runs this form
    #: (codegen/fused.py ``narrow_check``). Equal values there, bit for bit, is the kind's to show
    #: (tests/codegen/test_cost_kinds.py, tests/kernels/test_costs.py).
    narrow: Optional[tuple[sp.Rel, "CostKind"]] = None

    @functools.cached_property
    def parameters(self) -> tuple[str, ...]:
        """The per-dof parameters the expression reads besides its weight, as spec.COST_KINDS names
        them: "limit" (lower, upper), "margin"."""
        free = self.expression.free_symbols
        return tuple(name for name, symbols in (("limit", {LOWER, UPPER}), ("margin", {MARGIN})) if free & symbols)

    @functools.cached_property
    def derivative(self) -> sp.Expr:
        """d expression / dy, with max(0, a)·step(a) written as max(0, a)."""
        return _tidy(sp.diff(self.expression, Y))

    @functools.cached_property
    def weighted(self) -> bool:
        """The expression is its weight times a function of the rest (w·f): a column can sum f over
        its rows and multiply by the per-dof weight once."""
        return sp.expand(self.expression.xreplace({W: 2 * W}) - 2 * self.expression) == 0

    @functools.cached_property
    def slope_factor(self) -> sp.Expr:
        """A weighted kind's derivative is w times this number times the rest: the adjoint folds the
        number and the weight into one value per column."""
        return self.derivative.as_coeff_Mul()[0]  # (of w·(...): a number times an Add would be distributed)

    @functools.cached_property
    def nonnegative(self) -> bool:
        """The expression is ≥ 0 for every y and parameters with w ≥ 0 (the argument checks refuse
        negative weights): sums of its rows cannot cancel (codegen/fused.py ``run_rows``)."""
        return bool(self.expression.xreplace({W: sp.Symbol("w", nonnegative=True)}).is_nonnegative)

    @functools.cached_property
    def second_derivative(self) -> sp.Expr:
        """d² expression / dy² (a step function where a ramp is squared; 0 at the kink)."""
        return _tidy(sp.diff(self.derivative, Y))


def _tidy(e: sp.Expr) -> sp.Expr:
    """SymPy's derivatives of max(0, a)² as the functions they are: Heaviside(a)·max(0, a) is max(0, a),
    DiracDelta(a)·max(0, a) vanishes, and Heaviside(a) takes 0 at a = 0."""
    def product(m: sp.Mul) -> sp.Expr:
        factors = list(m.args)
        ramps = {f.args[1] for f in factors if isinstance(f, sp.Max) and f.args[0] == 0}
        if any(isinstance(f, sp.DiracDelta) and f.args[0] in ramps for f in factors):
            return sp.Integer(0)
        return sp.Mul(*[f for f in factors if not (isinstance(f, sp.Heaviside) and f.args[0] in ramps)])

    def slope_one(m: sp.Mul) -> sp.Expr:  # a dead zone times its own slope (1 where it is not 0) is itself
        slopes = {z.fdiff(1) for z in m.args if isinstance(z, DeadZone)}
        split = [sp.factor_terms(f).as_coeff_Mul() for f in m.args]
        return sp.Mul(*[c if rest in slopes else c * rest for c, rest in split])

    e = e.replace(lambda x: x.is_Mul, slope_one)
    e = sp.expand(e).replace(lambda x: x.is_Mul, product)
    # (SymPy ≥ 1.9 gives Heaviside(a) the value 1/2 at 0 as a second argument)
    e = e.replace(lambda x: isinstance(x, sp.Heaviside) and x.args[1:] != (0,), lambda x: sp.Heaviside(x.args[0], 0))
    return sp.factor_terms(e)


KINDS: dict[str, CostKind] = {
    kind.name: kind for kind in (
        CostKind("squared", W * (Y - TARGET) ** 2, target_states=("position",)),
        CostKind("bound", W * (_ramp(Y - (UPPER - MARGIN)) ** 2 + _ramp((LOWER + MARGIN) - Y) ** 2),
                 # where the margins leave lower' ≤ upper', y is beyond at most one of them
                 narrow=(sp.Le(LOWER + MARGIN, UPPER - MARGIN),
                         CostKind("bound", W * DeadZone(Y, LOWER + MARGIN, UPPER - MARGIN) ** 2))),
    )
}
