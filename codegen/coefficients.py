"""The step coefficients of an operator: table slots C(q) and the double-precision programs
that fill the table from dt and differentiate it (as statements, codegen/statements.py)."""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import sympy as sp

from .operator import Operator
from .statements import Add, Cast, Def, Mul, Paren, Read, Statement, Store, Sym, Term, Var

ONE, MINUS_ONE = sp.Integer(1), sp.Integer(-1)


def table_term(index: Any, operand: Any) -> Term:
    """'+C(index)*operand': coefficients are read from the table, not held one local each
    (which makes compile time superlinear in the horizon)."""
    return Term(Read("C", (index,)), operand)


def _double(name: str, value: Any) -> Def:
    return Def(Var(name), value, "double")


def _derivative(e: sp.Expr, a: sp.Symbol, seed: str) -> Mul:
    """'(∂e/∂a)*seed'."""
    return Mul(Paren(Sym(sp.diff(e, a))), Var(seed))


class Coefficients:
    """Gives each coefficient expression a slot C(q) and turns them into a double-precision program.

    The program is a list of small assignments (chunked CSE keeps it linear in the
    horizon). Its derivatives are taken line by line: forward mode for dt_jvp, reverse
    mode for dt_vjp, so no large expression is ever differentiated symbolically.
    """

    CHUNK = 48

    def __init__(self, op: Operator):
        self.dt_syms = op.dt_symbols
        self.base = list(op.program)
        self._varying = set(self.dt_syms) | {s for s, _ in self.base}
        self.names: dict[sp.Expr, int] = {}
        for coef in op.coefficients():  # fixed slots, shared by every kernel of the operator
            self.index(coef)

    def varies(self, expr: sp.Expr) -> bool:
        """Whether a coefficient depends on dt (directly or through program quantities)."""
        return bool(expr.free_symbols & self._varying)

    def index(self, expr: sp.Expr) -> int:
        """Slot of a coefficient in the kernel's coefficient table."""
        if expr not in self.names:
            self.names[expr] = len(self.names)
        return self.names[expr]

    def term(self, coef: sp.Expr, operand: Any) -> Term:
        """A signed product 'coef*operand' (units inlined, other coefficients from the table)."""
        if coef == ONE:
            return Term(None, operand)
        if coef == MINUS_ONE:
            return Term(None, operand, negative=True)
        return table_term(self.index(coef), operand)

    @functools.cached_property
    def lines(self) -> list[tuple[sp.Symbol, sp.Expr]]:
        """Assignments computing k<q> (the value of C(q)) from the dt symbols."""
        exprs = list(self.names)
        temps = sp.numbered_symbols("t")
        lines: list[tuple[sp.Symbol, sp.Expr]] = list(self.base)
        for lo in range(0, len(exprs), self.CHUNK):
            chunk = exprs[lo : lo + self.CHUNK]
            subs, reduced = sp.cse(chunk, symbols=temps, optimizations=None)
            lines += subs
            lines += [(sp.Symbol(f"k{lo + i}"), r) for i, r in enumerate(reduced)]
        return lines

    def _inputs(self, tangent: bool = False) -> list[Statement]:
        lines = [_double(str(s), Cast("double", Read("DT", (i,)))) for i, s in enumerate(self.dt_syms)]
        if tangent:
            lines += [_double(f"d_{s}", Cast("double", Read("DDT", (i,)))) for i, s in enumerate(self.dt_syms)]
        return lines

    def _casts(self, table: str, source: str) -> list[Statement]:
        return [Store(Read(table, (q,)), Cast("T", Paren(Var(f"{source}{q}")))) for q in range(len(self.names))]

    def preamble(self) -> list[Statement]:
        """Statements filling the coefficient table C(q) (type T); each value is stored as soon
        as it is computed, so no more than one CSE chunk is live at a time."""
        lines = self._inputs()
        for s, e in self.lines:
            if s.name.startswith("k"):
                lines.append(Store(Read("C", (int(s.name[1:]),)), Cast("T", Paren(Sym(e)))))
            else:
                lines.append(_double(str(s), Sym(e)))
        return lines

    def tangent_preamble(self) -> list[Statement]:
        """The table C(q) and the dt-tangents CD(q) = Σ_m ∂C(q)/∂dt_m · ddt_m (forward mode)."""
        lines = self._inputs(tangent=True)
        for s, e in self.lines:
            lines.append(_double(str(s), Sym(e)))
            parts = tuple(_derivative(e, a, f"d_{a}") for a in sorted(e.free_symbols, key=str))
            lines.append(_double(f"d_{s}", Add(parts)))
        return lines + self._casts("C", "k") + self._casts("CD", "d_k")

    def reverse_program(self) -> list[Statement]:
        """gdt from GC(q) = ∂L/∂c<q> by reverse accumulation over the program's lines."""
        program = self.lines
        lines = self._inputs() + [_double(str(s), Sym(e)) for s, e in program]
        contributions: dict[str, list] = defaultdict(list)
        for q in range(len(self.names)):
            contributions[f"k{q}"].append(Read("GC", (q,)))
        for s, e in reversed(program):
            parts = contributions.pop(str(s), [])
            if not parts:
                continue
            lines.append(_double(f"b_{s}", Add(tuple(parts))))
            for a in e.free_symbols:
                contributions[str(a)].append(_derivative(e, a, f"b_{s}"))
        for i, sym in enumerate(self.dt_syms):
            lines.append(Store(Read("GDT", (i,)), Add(tuple(contributions.get(str(sym), [])))))
        return lines
