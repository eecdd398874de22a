"""The operator IR: an affine straight-line program over one (batch, dof) column.

Every variant — finite-difference stencils, integration recurrences, cuRobo's legacy
kernels — is expressed as an ordered list of rows ``Y[k][h] = Σ coeff · ref``, where a ref
is a row of an input argument of the spec's argument table (codegen/arguments.py),
``(argument, row)``: an action ``("u", j)``, a start-state entry ``("p0", 0)`` … ``("j0", 0)``
(``start(m)``), a goal-state entry ``("gp", 0)`` … (``goal(m)``; end="goal" only), any other
input a table adds; or an earlier output row ``("y", k, h)``. Coefficients are SymPy
expressions in the step-duration symbols. The adjoint (reverse accumulation), the
dt-derivatives and the dense matrices are all derived from this one description.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Sequence

import numpy as np
import sympy as sp
from sympy.core.function import AppliedUndef

from .arguments import GOAL_NAMES, START_NAMES, ArgumentTable

Ref = tuple  # (argument, row) | ("y", k, h)
RowTerm = tuple  # (coefficient: sp.Expr, ref: Ref): one term of a row (statements.Term is a lowered one)

N_START = len(START_NAMES)  # p0, v0, a0, j0
N_GOAL = len(GOAL_NAMES)  # gp, gv, ga, gj
ROW = "y"  # the first entry of a reference to an earlier output row
ACTION = "u"  # the actions' (a B-spline's knots') argument


def action(j: Any) -> Ref:
    """Action row j (a knot, for a B-spline)."""
    return (ACTION, j)


def start(m: int) -> Ref:
    """Entry m of the start state (p0, v0, a0, j0)."""
    return (START_NAMES[m], 0)


def goal(m: int) -> Ref:
    """Entry m of the goal state (gp, gv, ga, gj)."""
    return (GOAL_NAMES[m], 0)


def is_row(ref: Ref) -> bool:
    return ref[0] == ROW


def is_action(ref: Ref) -> bool:
    return ref[0] == ACTION


def reads(table: ArgumentTable) -> tuple[tuple[str, int], ...]:
    """The inputs an operator over this table may read, with their rows per trajectory, in table
    order: the actions (N rows), then every [rows, D] input (one row each)."""
    columns = table.columns
    return tuple((a.name, table.size(a.shape[1]) if a.layout else 1) for a in table.tensors
                 if a.layout or a in columns)


@dataclasses.dataclass(frozen=True)
class Row:
    """One output value: ``Y[k][h] = Σ coeff · ref`` over ``terms``."""

    k: int
    h: int
    terms: tuple[RowTerm, ...]


@dataclasses.dataclass
class Operator:
    """An affine operator on one column, in evaluation order."""

    horizon: int
    order: int
    n_actions: int
    dt_symbols: tuple[sp.Symbol, ...]
    rows: list[Row]
    #: Named intermediate quantities (e.g. node times), in dependency order; coefficients
    #: may use these symbols. Kept as short lines so that they are differentiated line by line.
    program: list[tuple[sp.Symbol, sp.Expr]] = dataclasses.field(default_factory=list)
    #: The input arguments the rows may read, with their rows per trajectory, in the argument
    #: table's order (``reads(table)``); the default is a step without a goal.
    inputs: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.inputs:
            self.inputs = ((ACTION, self.n_actions),) + tuple((name, 1) for name in START_NAMES)

    @property
    def columns(self) -> tuple[str, ...]:
        """The inputs of one row per trajectory (read once per column), in table order."""
        return tuple(name for name, _ in self.inputs if name != ACTION)

    @property
    def n_outputs(self) -> int:
        return self.order + 1

    def coefficients(self) -> list[sp.Expr]:
        """Distinct non-unit coefficients, in first-use order."""
        seen: dict[sp.Expr, None] = {}
        for row in self.rows:
            for coef, _ in row.terms:
                if coef not in (sp.Integer(1), sp.Integer(-1)):
                    seen.setdefault(coef, None)
        return list(seen)

    def dense_inputs(self, dt_values: Sequence[float]) -> dict[str, np.ndarray]:
        """Dense float64 matrices at numeric step durations, one per input argument: M_a [K, H, rows],
        so that Y_k = Σ_a M_a[k] @ a for one column (a's rows: the N actions, or one)."""
        coefs = self.coefficients()
        env = dict(zip(self.dt_symbols, (float(v) for v in dt_values)))
        for sym, expr in self.program:
            env[sym] = float(expr.xreplace(env))
        args = list(env)
        values = sp.lambdify(args, coefs, "math")(*env.values()) if coefs else []
        value_of = {c: float(v) for c, v in zip(coefs, values)}
        value_of[sp.Integer(1)], value_of[sp.Integer(-1)] = 1.0, -1.0
        offsets, width = {}, 0
        for name, rows in self.inputs:
            offsets[name], width = width, width + rows
        vectors: dict[tuple[int, int], np.ndarray] = {}
        for row in self.rows:
            vec = np.zeros(width)
            for coef, ref in row.terms:
                if is_row(ref):
                    vec += value_of[coef] * vectors[(ref[1], ref[2])]
                else:
                    vec[offsets[ref[0]] + ref[1]] += value_of[coef]
            vectors[(row.k, row.h)] = vec
        out = np.zeros((self.n_outputs, self.horizon, width))
        for (k, h), vec in vectors.items():
            out[k, h] = vec
        return {name: out[:, :, offsets[name]:offsets[name] + rows] for name, rows in self.inputs}

    def dense(self, dt_values: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's dense matrices (M_u [K, H, N], M_s [K, H, 4], M_g [K, H, 4 or 0]) at numeric
        step durations: Y_k = M_u[k] @ u + M_s[k] @ s + M_g[k] @ g for one column,
        s = (p0, v0, a0, j0), g = (gp, gv, ga, gj) (M_g has no columns without a goal)."""
        return step_matrices(self.dense_inputs(dt_values))


def step_matrices(by_input: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``dense_inputs``' matrices grouped as a step's: the actions', the start state's (its four
    entries side by side) and the goal state's (none without a goal)."""
    m_u = by_input[ACTION]
    empty = np.zeros(m_u.shape[:2] + (0,))
    state = lambda names: np.concatenate([by_input[n] for n in names if n in by_input] or [empty], axis=2)
    return m_u, state(START_NAMES), state(GOAL_NAMES)


def combine(terms: Iterable[RowTerm]) -> tuple[RowTerm, ...]:
    """Merge terms on the same ref, drop zero coefficients, keep first-use order."""
    acc: dict[Ref, sp.Expr] = {}
    for coef, ref in terms:
        acc[ref] = acc[ref] + coef if ref in acc else coef  # (no 0 + coef: each SymPy sum costs)
    return tuple((c, r) for r, c in acc.items() if c != 0)


def dt_symbols(horizon: int, mode: str) -> tuple[sp.Symbol, ...]:
    """The step-duration symbols the kernel reads: (dt,) or (dt_0, ..., dt_{H-1})."""
    if mode != "per_step":  # uniform, or per trajectory (uniform along each trajectory)
        return (sp.Symbol("dt", positive=True),)
    return tuple(sp.Symbol(f"dt_{h}", positive=True) for h in range(horizon))


def step_durations(symbols: Sequence[sp.Symbol], horizon: int) -> list[sp.Symbol]:
    """dt_h for every row h (uniform: the one symbol repeated)."""
    return list(symbols) * horizon if len(symbols) == 1 else list(symbols)


def start_rows(order: int) -> list[Row]:
    """Row 0 of each output is the start state as given (snap starts at zero)."""
    return [Row(k, 0, ((sp.Integer(1), start(k)),) if k < N_START else ()) for k in range(order + 1)]


def row_ref(k: int, h: int) -> list[RowTerm]:
    """Terms that stand for Y[k][h]; row 0 is the start state itself (so no row dependency)."""
    if h == 0:
        return [(sp.Integer(1), start(k))] if k < N_START else []
    return [(sp.Integer(1), (ROW, k, h))]


def scaled(terms: Iterable[RowTerm], factor: sp.Expr) -> list[RowTerm]:
    return [(factor if c is sp.S.One else factor * c, r) for c, r in terms]


def formula(name: str, params: Sequence[sp.Symbol], expr: sp.Expr) -> Any:
    """A named function of a few quantities with its definition ``expr`` over ``params``.

    A coefficient may apply one (e.g. a Lagrange weight at one row's node times): the rows
    of a long horizon then share one definition instead of each holding a copy, and their
    coefficients stay small. ``expand_formulas`` writes the definition out; ``dense``
    evaluates it numerically.
    """
    @functools.lru_cache(maxsize=1)
    def numeric() -> Any:  # lambdify prints the definition: only where `dense` evaluates one
        return sp.lambdify(list(params), expr, "math")

    return sp.Function(name, definition=sp.Lambda(tuple(params), expr),
                       _imp_=staticmethod(lambda *args: numeric()(*args)))


def apply(f: Any, args: Sequence[sp.Expr]) -> sp.Expr:
    """``f(*args)`` for a formula ``f`` and SymPy arguments, without SymPy's function machinery:
    a formula never evaluates, so the object is made directly, as ``Application`` would make it
    (``nargs`` any number). A long horizon applies formulas thousands of times.

    >>> x, y = sp.symbols("x y")
    >>> f = formula("f", (x, y), x * y)
    >>> apply(f, (y, 2 * x)) == f(y, 2 * x)
    True
    """
    obj = sp.Basic.__new__(f, *args)
    obj.nargs = sp.S.Naturals0
    return obj


def is_formula(e: Any) -> bool:
    """Whether ``e`` applies a formula (see ``formula``)."""
    return isinstance(e, AppliedUndef) and hasattr(type(e), "definition")


def expand_formulas(expr: sp.Expr) -> sp.Expr:
    """``expr`` with every applied formula replaced by its definition at its arguments."""
    def definition(x: sp.Expr, walk: Any) -> sp.Expr | None:
        if not is_formula(x):
            return None
        lam = type(x).definition
        return _substitute(lam.expr, dict(zip(lam.variables, map(walk, x.args))))

    return _rewrite(expr, definition)


def _substitute(e: sp.Expr, mapping: dict) -> sp.Expr:
    """xreplace, once per distinct subexpression: a definition is a DAG whose shared parts (the
    Lagrange weights' symmetric polynomials) xreplace would walk once per path."""
    return _rewrite(e, lambda x, walk: mapping.get(x))


def _rewrite(e: sp.Expr, rule: Any) -> sp.Expr:
    """``e`` with each subexpression x replaced by ``rule(x, walk)`` where that is not None (else
    rebuilt from its rewritten arguments), each distinct subexpression (by identity) once."""
    done: dict[int, sp.Expr] = {}

    def walk(x: sp.Expr) -> sp.Expr:
        key = id(x)
        if key not in done:
            new = rule(x, walk)
            done[key] = _rebuilt(x, walk) if new is None else new
        return done[key]

    return walk(e)


def _rebuilt(e: sp.Expr, fn: Any) -> sp.Expr:
    """``e`` with ``fn`` applied to its arguments (``e`` itself where none changes)."""
    if not e.args:
        return e
    args = tuple(fn(a) for a in e.args)
    return e if all(a is b for a, b in zip(args, e.args)) else e.func(*args)
