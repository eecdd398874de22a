"""Lowering: Operator → C statements for the four kernels (forward, adjoint, dt_vjp, dt_jvp).

The statement lists are target-neutral C: the C and CUDA templates wrap the same text
in their own loops. Body code uses these macros, defined by each template:
``U(j)`` action j, ``S<m>`` start entry m, ``Y<k>(h)`` output, ``G<k>(h)`` incoming gradient
(0 when absent), ``DU(j)``/``DS<m>`` input tangents, ``TY<k>(h)`` output tangent,
``GU(j)``/``GS<m>(value)`` adjoint stores, ``ACC(m)`` the dt-gradient accumulator.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import sympy as sp
from sympy.printing.c import C99CodePrinter

from .operator import Operator, Ref, Row

ONE, MINUS_ONE = sp.Integer(1), sp.Integer(-1)


class _Printer(C99CodePrinter):
    """C99 printer that writes small integer powers as products (no pow() in kernels)."""

    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.as_base_exp()
        if exp.is_Integer and 0 < abs(int(exp)) <= 8:
            prod = "*".join([self.parenthesize(base, 100)] * abs(int(exp)))
            if abs(int(exp)) > 1:
                prod = f"({prod})"
            return prod if exp > 0 else f"(1.0/{prod})"
        return super()._print_Pow(expr)


_PRINTER = _Printer()


def c_expr(expr: sp.Expr) -> str:
    return _PRINTER.doprint(sp.Float(expr, 17) if expr.is_Number and not expr.is_Integer else expr)


@dataclasses.dataclass
class KernelCode:
    """Preamble (double-precision coefficient math, once per call) and per-column body."""

    preamble: list[str]
    body: list[str]


@dataclasses.dataclass
class LoweredOperator:
    forward: KernelCode
    adjoint: KernelCode
    dt_vjp: KernelCode
    dt_jvp: KernelCode
    n_dt: int


class _Coefficients:
    """Names coefficient expressions (c<q>) and emits their CSE'd double-precision preamble."""

    def __init__(self, dt_syms: tuple[sp.Symbol, ...], ddt_syms: tuple[sp.Symbol, ...] = ()):
        self.dt_syms, self.ddt_syms = dt_syms, ddt_syms
        self.names: dict[sp.Expr, str] = {}

    def name(self, expr: sp.Expr) -> str:
        if expr not in self.names:
            self.names[expr] = f"c{len(self.names)}"
        return self.names[expr]

    def term(self, coef: sp.Expr, operand: str) -> str:
        """A signed product 'coef*operand' (units inlined)."""
        if coef == ONE:
            return f"+{operand}"
        if coef == MINUS_ONE:
            return f"-{operand}"
        return f"+{self.name(coef)}*{operand}"

    def preamble(self) -> list[str]:
        lines = [f"const double {s} = (double)DT({i});" for i, s in enumerate(self.dt_syms)]
        lines += [f"const double {s} = (double)DDT({i});" for i, s in enumerate(self.ddt_syms)]
        exprs = list(self.names)
        if not exprs:
            return lines
        subs, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("t"), optimizations=None)
        lines += [f"const double {s} = {c_expr(e)};" for s, e in subs]
        lines += [f"const T {self.names[e]} = (T)({c_expr(r)});" for e, r in zip(exprs, reduced)]
        return lines


def _sum(parts: list[str]) -> str:
    if not parts:
        return "(T)0"
    text = "".join(parts)
    return text[1:] if text.startswith("+") else text


def _var(ref: Ref, prefix: str = "") -> str:
    """SSA name of a ref's value (forward: u3, s1, y2_5; with prefix 't' its tangent)."""
    if ref[0] == "u":
        return f"{prefix}u{ref[1]}"
    if ref[0] == "s":
        return f"{prefix}s{ref[1]}"
    return f"{prefix}y{ref[1]}_{ref[2]}"


def _loads(op: Operator, tangent: bool = False) -> list[str]:
    lines = [f"const T u{j} = U({j});" for j in range(op.n_actions)]
    lines += [f"const T s{m} = S{m};" for m in range(4)]
    if tangent:
        lines += [f"const T tu{j} = DU({j});" for j in range(op.n_actions)]
        lines += [f"const T ts{m} = DS{m};" for m in range(4)]
    return lines


def _forward_lines(op: Operator, coefs: _Coefficients, store: bool) -> list[str]:
    lines = []
    for row in op.rows:
        value = _sum([coefs.term(c, _var(r)) for c, r in row.terms])
        lines.append(f"const T y{row.k}_{row.h} = {value};")
        if store:
            lines.append(f"Y{row.k}({row.h}) = y{row.k}_{row.h};")
    return lines


def _adjoint_lines(op: Operator, coefs: _Coefficients) -> tuple[list[str], dict[Ref, list[str]]]:
    """Reverse accumulation: total adjoints yb<k>_<h> of rows, then contributions to inputs."""
    lines = [f"const T g{r.k}_{r.h} = G{r.k}({r.h});" for r in op.rows]
    contributions: dict[Ref, list[str]] = defaultdict(list)
    for row in reversed(op.rows):
        own = ("y", row.k, row.h)
        parts = [f"+g{row.k}_{row.h}"] + contributions.pop(own, [])
        lines.append(f"const T yb{row.k}_{row.h} = {_sum(parts)};")
        for c, ref in row.terms:
            contributions[ref].append(coefs.term(c, f"yb{row.k}_{row.h}"))
    return lines, contributions


def _forward(op: Operator) -> KernelCode:
    coefs = _Coefficients(op.dt_symbols)
    body = _loads(op) + _forward_lines(op, coefs, store=True)
    return KernelCode(coefs.preamble(), body)


def _adjoint(op: Operator) -> KernelCode:
    coefs = _Coefficients(op.dt_symbols)
    lines, contributions = _adjoint_lines(op, coefs)
    lines += [f"GU({j}, {_sum(contributions.get(('u', j), []))});" for j in range(op.n_actions)]
    lines += [f"GS{m}({_sum(contributions.get(('s', m), []))});" for m in range(4)]
    return KernelCode(coefs.preamble(), lines)


def _dt_vjp(op: Operator) -> KernelCode:
    """ACC(m) += Σ_rows yb_row · Σ_terms ∂coef/∂dt_m · value (values from a forward recompute)."""
    coefs = _Coefficients(op.dt_symbols)
    body = _loads(op) + _forward_lines(op, coefs, store=False)
    adjoint, _ = _adjoint_lines(op, coefs)
    body += adjoint
    per_param: dict[int, list[str]] = defaultdict(list)
    index = {s: i for i, s in enumerate(op.dt_symbols)}
    for row in op.rows:
        by_param: dict[int, list[str]] = defaultdict(list)
        for c, ref in row.terms:
            for sym in sorted(c.free_symbols & set(index), key=index.get):
                by_param[index[sym]].append(coefs.term(sp.diff(c, sym), _var(ref)))
        for m, parts in by_param.items():
            per_param[m].append(f"yb{row.k}_{row.h}*({_sum(parts)})")
    for m in sorted(per_param):
        body.append(f"ACC({m}) += (double)({' + '.join(per_param[m])});")
    return KernelCode(coefs.preamble(), body)


def _dt_jvp(op: Operator) -> KernelCode:
    """Tangent: ty = Σ (ċ · value + c · tangent), ċ = Σ_m ∂c/∂dt_m · ddt_m."""
    ddt = tuple(sp.Symbol(f"d{s.name}") for s in op.dt_symbols)
    coefs = _Coefficients(op.dt_symbols, ddt)
    body = _loads(op, tangent=True) + _forward_lines(op, coefs, store=False)
    for row in op.rows:
        parts = []
        for c, ref in row.terms:
            cdot = sum((sp.diff(c, s) * d for s, d in zip(op.dt_symbols, ddt)), sp.Integer(0))
            if cdot != 0:
                parts.append(coefs.term(cdot, _var(ref)))
            parts.append(coefs.term(c, _var(ref, "t")))
        body.append(f"const T ty{row.k}_{row.h} = {_sum(parts)};")
        body.append(f"TY{row.k}({row.h}) = ty{row.k}_{row.h};")
    return KernelCode(coefs.preamble(), body)


def lower(op: Operator) -> LoweredOperator:
    """Lower an operator to the statements of its four kernels."""
    return LoweredOperator(_forward(op), _adjoint(op), _dt_vjp(op), _dt_jvp(op), len(op.dt_symbols))
