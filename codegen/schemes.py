"""Builders: KernelSpec → Operator rows (docs/semantics.md). Each scheme is data fed to one IR."""
from __future__ import annotations

import functools
import math
from typing import Callable

import sympy as sp

from .builders import register
from .arguments import table
from .operator import (N_GOAL, N_START, Operator, Row, RowTerm, action, apply, combine, dt_symbols, formula, goal, reads,
                       row_ref, scaled, start, start_rows, step_durations)
from .spec import KernelSpec
from .stencils import lagrange_weights, stencil_offsets, uniform_weights


@register(KernelSpec)
def build_operator(spec: KernelSpec) -> Operator:
    """Derive the operator of a native spec."""
    syms = dt_symbols(spec.horizon, spec.dt)
    if spec.control == "position":
        goal = spec.end == "goal"
        points = PositionPoints(spec.horizon, step_durations(syms, spec.horizon), goal)
        rows = position_rows(spec, syms, points)
        return Operator(spec.horizon, spec.order, spec.n_actions, syms, rows, points.program, reads(table(spec)))
    rows = integration_rows(spec, syms)
    return Operator(spec.horizon, spec.order, spec.n_actions, syms, rows, inputs=reads(table(spec)))


# ---- position control: finite differences over points q_j ------------------------------------

class PositionPoints:
    """The points q_j of position control, with their times relative to any row.

    q_0 = p0, q_h = u_{h-1} for 1 ≤ h ≤ H-1, Taylor ghosts before the start, the last
    point held after the end. With a goal (end="goal"): q_{H-1} = gp and Taylor ghosts of
    the goal state after the end, symmetric to the start's.
    """

    def __init__(self, horizon: int, durations: list[sp.Expr], goal: bool = False):
        self.H = horizon
        self.dts = durations
        self._negated = [-d for d in durations]  # negated once: a sum of them is built directly
        # A sum of distinct durations (or of their negations) is made in SymPy's own order of its
        # terms, found once here, without Add's sorting: a long horizon makes thousands of them.
        distinct = len(set(durations)) == len(durations)
        self._rank = {t: i for terms in ((durations, self._negated) if distinct else ())
                      for i, t in enumerate(sorted(terms, key=functools.cmp_to_key(sp.Basic.compare)))}
        self.goal = goal
        self.program: list[tuple[sp.Symbol, sp.Expr]] = []
        self._named: dict[tuple[int, int], sp.Symbol] = {}

    def time_symbol(self, j: int, h: int) -> sp.Expr:
        """t_j - t_h as a named program quantity (0 for the row's own point)."""
        if j == h:
            return sp.Integer(0)
        if (j, h) not in self._named:
            sym = sp.Symbol(f"x{j}_{h}".replace("-", "m"))
            self.program.append((sym, self.time(j, h)))
            self._named[(j, h)] = sym
        return self._named[(j, h)]

    def weights(self, node_times: list[sp.Expr], derivative: int) -> list[sp.Expr]:
        """Lagrange weights at one row's node times, each a formula (codegen/operator.formula)
        applied to the row's nonzero node times: derived once per shape, so the rows of a long
        horizon cost little each, and rows whose node times are shifted quantities have
        coefficients that codegen/coefficients.py recognises as one template."""
        zeros = tuple(i for i, x in enumerate(node_times) if x == 0)
        args = [x for i, x in enumerate(node_times) if i not in zeros]
        return [w if w.is_Number else apply(w, args) for w in _weight_formulas(len(node_times), derivative, zeros)]

    def value(self, j: int) -> list[RowTerm]:
        last = self.H - 1
        if self.goal and j >= last:  # q_{H-1+k} = gp + Σ_m (k·dt_{H-1})^m/m! · (gv, ga, gj)_m
            t = (j - last) * self.dts[last]
            return [(sp.Integer(1), goal(0))] if j == last else \
                [(t**m / math.factorial(m), goal(m)) for m in range(N_GOAL)]
        if j > last:
            j = last
        if j > 0:
            return [(sp.Integer(1), action(j - 1))]
        if j == 0:
            return [(sp.Integer(1), start(0))]
        t = j * self.dts[0]
        return [(t**m / math.factorial(m), start(m)) for m in range(N_START)]

    def time(self, j: int, h: int) -> sp.Expr:
        """t_j - t_h, built as a short sum of step durations (no O(H) cancellation)."""
        last = self.H - 1
        extra = sp.Integer(0)
        if j > last:
            extra = (j - last) * self.dts[last]
            j = last
        if j < 0:
            extra = j * self.dts[0]
            j = 0
        terms = self.dts[h + 1 : j + 1] if j >= h else self._negated[j + 1 : h + 1]
        if extra == 0 and len(terms) > 1 and self._rank:
            return sp.Add._from_args(sorted(terms, key=self._rank.__getitem__))
        return sp.Add(extra, *terms)


def stencil_points(spec: KernelSpec, k: int, h: int) -> list[int]:
    """Point indices of derivative k at row h (one-sided near the end when asked)."""
    a = spec.accuracy[k - 1]
    points = [h + o for o in stencil_offsets(k, a, spec.difference)]
    if spec.end == "one_sided" and points[-1] > spec.horizon - 1:
        n = k + a
        points = list(range(spec.horizon - n, spec.horizon))
    return points


def stencil_row(k: int, h: int, weights: list[sp.Expr], values: list[list[RowTerm]]) -> Row:
    """Row Y[k][h] = Σ_i w_i · value_i (values are linear combinations of refs)."""
    terms: list[RowTerm] = []
    for w, value in zip(weights, values):
        terms += scaled(value, w)
    return Row(k, h, combine(terms))


@functools.lru_cache(maxsize=None)
def _weight_formulas(n: int, derivative: int, zeros: tuple[int, ...]) -> tuple:
    """The Lagrange weights over n node times (0 at ``zeros``) as formulas of the others (a
    weight that is a constant stays a number)."""
    node_times = [sp.Integer(0) if i in zeros else sp.Symbol(f"x{i}") for i in range(n)]
    params = [x for x in node_times if x != 0]
    tag = "".join("0" if x == 0 else "x" for x in node_times)
    return tuple(w if w.is_Number else formula(f"lagrange_{tag}_d{derivative}_w{i}", params, w)
                 for i, w in enumerate(lagrange_weights(node_times, derivative)))


def position_rows(spec: KernelSpec, syms: tuple[sp.Symbol, ...], pts: PositionPoints) -> list[Row]:
    H = spec.horizon
    rows = start_rows(spec.order)
    for h in range(1, H):
        if pts.goal and h == H - 1:  # row H-1 is the goal state as given (snap 0), as row 0 is the start
            rows += [Row(k, h, ((sp.Integer(1), goal(k)),) if k < N_GOAL else ()) for k in range(spec.order + 1)]
            continue
        rows.append(Row(0, h, tuple(pts.value(h))))
        for k in range(1, spec.order + 1):
            points = stencil_points(spec, k, h)
            if spec.dt != "per_step":
                base = uniform_weights(tuple(j - h for j in points), k)
                weights = [w / syms[0] ** k for w in base]
            else:
                weights = pts.weights([pts.time_symbol(j, h) for j in points], k)
            rows.append(stencil_row(k, h, weights, [pts.value(j) for j in points]))
    return rows


# ---- integration control: recurrences ----------------------------------------------------------

Integrator = Callable[[int, int, int, sp.Expr], list[RowTerm]]


def semi_implicit_euler(k: int, c: int, h: int, dt: sp.Expr) -> list[RowTerm]:
    """Y_k[h] = Y_k[h-1] + dt_h · Y_{k+1}[h] (applied from the action downwards)."""
    return row_ref(k, h - 1) + scaled(row_ref(k + 1, h), dt)


def exact_hold(k: int, c: int, h: int, dt: sp.Expr) -> list[RowTerm]:
    """Exact polynomial integral with the action (derivative c) held over the step."""
    terms: list[RowTerm] = []
    for m in range(c - k):
        terms += scaled(row_ref(k + m, h - 1), dt**m / math.factorial(m))
    return terms + scaled(row_ref(c, h), dt ** (c - k) / math.factorial(c - k))


INTEGRATORS: dict[str, Integrator] = {"semi_implicit_euler": semi_implicit_euler, "exact": exact_hold}


def backward_difference(k: int, h: int, dt: sp.Expr) -> list[RowTerm]:
    """Y_k[h] = (Y_{k-1}[h] - Y_{k-1}[h-1]) / dt_h for derivatives above the action."""
    return scaled(row_ref(k - 1, h), 1 / dt) + scaled(row_ref(k - 1, h - 1), -1 / dt)


def integration_rows(spec: KernelSpec, syms: tuple[sp.Symbol, ...]) -> list[Row]:
    c = spec.control_order
    integrate = INTEGRATORS[spec.integrator]
    dts = step_durations(syms, spec.horizon)
    rows = start_rows(spec.order)
    for h in range(1, spec.horizon):
        rows.append(Row(c, h, ((sp.Integer(1), action(h - 1)),)))
        for k in range(c - 1, -1, -1):
            rows.append(Row(k, h, combine(integrate(k, c, h, dts[h]))))
        for k in range(c + 1, spec.order + 1):
            rows.append(Row(k, h, combine(backward_difference(k, h, dts[h]))))
    return rows
