"""Statements → C lines, for the C and CUDA templates (codegen/statements.py has the data).

One printer class, two vocabularies: ``COLUMN`` prints a (batch, dof) column over the
scalar macros (``U``, ``S0``, ``Y0``, ``G0``, ``GU``, ``GS0``, ``ZERO``, type ``T``), the form
both templates run per column; ``lane_printer`` prints the same statements as one vector over
all dof lanes, for the C template's lane form (``VU``, ``VS0``, ..., ``VZERO``, type ``VT``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import sympy as sp
from sympy.printing.c import C99CodePrinter

from .renaming import renamed_text
from .statements import (Add, Bind, Call, Cast, Def, Fence, For, Literal, Mul, Paren, Read, Rel, RunEnd, RunTape, Shift,
                         Statement, Store, Strided, Sum, Sym, Term, Val, Var, Volatile)

INDENT = "    "


class _SymPrinter(C99CodePrinter):
    """C99 printer that writes small integer powers as products (no pow() in kernels)."""

    MAX, MIN, STEP = "TS_MAX", "TS_MIN", "TS_STEP"  # the templates' macros

    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.as_base_exp()
        if exp.is_Integer and 0 < abs(int(exp)) <= 8:
            prod = "*".join([self.parenthesize(base, 100)] * abs(int(exp)))
            if abs(int(exp)) > 1:
                prod = f"({prod})"
            return prod if exp > 0 else f"(1.0/{prod})"
        return super()._print_Pow(expr)


    def _print_Max(self, expr: sp.Max) -> str:
        """max(a, b) as the templates' TS_MAX (no <math.h>: parsing it costs the compiler time)."""
        first, *rest = expr.args
        out = self._print(first)
        for arg in rest:
            out = f"{self.MAX}({out}, {self._print(arg)})"
        return out

    def _print_DeadZone(self, expr: sp.Expr) -> str:
        """y − min(max(y, a), b) (codegen/costs.py DeadZone)."""
        y, a, b = (self._vector(x) for x in expr.args)
        return f"({y} - {self.MIN}({self.MAX}({y}, {a}), {b}))"

    def _vector(self, expr: sp.Expr) -> str:
        return self._print(expr)

    def _print_Heaviside(self, expr: sp.Heaviside) -> str:
        """The unit step, 0 at 0 (a cost's second derivative at a limit): TS_STEP(x) = x > 0."""
        return f"{self.STEP}({self._print(expr.args[0])})"


class _LaneSymPrinter(_SymPrinter):
    """The same over all dof lanes: max, min and the unit step as the lane form's VMAX, VMIN and VSTEP
    (GCC's vector extensions have no ?: in C), whose arguments are vectors: a number is broadcast
    (VZERO + n, folded by the compiler; adding VZERO to a vector is an instruction, as x + 0 is
    not x for x = -0)."""

    MAX, MIN, STEP = "VMAX", "VMIN", "VSTEP"

    def _print_Max(self, expr: sp.Max) -> str:
        first, *rest = (self._vector(a) for a in expr.args)
        for arg in rest:
            first = f"{self.MAX}({first}, {arg})"
        return first

    def _vector(self, expr: sp.Expr) -> str:
        return f"(VZERO + {self._print(expr)})" if expr.is_Number else self._print(expr)


_SYM_PRINTER = _SymPrinter()
_LANE_SYM_PRINTER = _LaneSymPrinter()


@functools.lru_cache(maxsize=1 << 16)  # a coefficient program's derivatives recur in its tangent and its reverse
def c_expr(expr: sp.Expr) -> str:
    """A SymPy expression as C (non-integer numbers with 17 significant digits)."""
    return _SYM_PRINTER.doprint(sp.Float(expr, 17) if expr.is_Number and not expr.is_Integer else expr)


@functools.lru_cache(maxsize=1 << 12)
def lane_expr(expr: sp.Expr) -> str:
    """``c_expr`` in the lane vocabulary (a cost term's expression over a row's dof lanes)."""
    return _LANE_SYM_PRINTER.doprint(sp.Float(expr, 17) if expr.is_Number and not expr.is_Integer else expr)


def _index(i: Any) -> str:
    """A position, slot or argument: ``Rel`` and ``Strided`` are written over the loop variable r."""
    if isinstance(i, Var):
        return i.name
    if isinstance(i, Rel):  # relative to the loop variable
        return "r" if i.rel == 0 else f"r + {i.rel}" if i.rel > 0 else f"r - {-i.rel}"
    if isinstance(i, Strided):
        start = i.start if isinstance(i.start, int) else f"({_index(i.start)})"
        return f"{i.slot} + {i.stride} * (r - {start})"
    if isinstance(i, Shift):  # over the knot variable of a loop nest
        knot = "kn" if i.scale == 1 else f"{i.scale} * kn"
        return knot if i.base == 0 else f"{knot} + {i.base}" if i.base > 0 else f"{knot} - {-i.base}"
    return str(i)


def lane_printer(names: frozenset[str]) -> "Printer":
    """The lane form's printer, where ``names`` are the input macros with a lane form (their table's,
    codegen/macros.py ``lane_names``): those, the output stores and tangent stores (``Y<k>``,
    ``TY<k>``) and the output gradient reads (``G<k>``) print with a ``V`` prefix."""
    def lane_macro(name: str) -> str:
        lane = name in names or (name.rstrip("0123456789") in ("Y", "G", "TY") and name[-1:].isdigit())
        return "V" + name if lane else name

    return _lane_printers.setdefault(names, Printer(lane_macro, "VT", "VZERO", vector=True))


_lane_printers: dict[frozenset[str], "Printer"] = {}


class Printer:
    """Prints statements with one vocabulary: ``macro`` renames macros, ``ctype`` the element type T;
    ``vector``: the lane form, where double precision is the vector VD (a cost's sums per dof) and a
    cast to it converts every lane (VDOUBLE)."""

    def __init__(self, macro: Callable[[str], str] = str, ctype: str = "T", zero: str = "ZERO", vector: bool = False):
        self.macro, self.element, self.zero, self.vector = macro, ctype, zero, vector
        self.sym = lane_expr if vector else c_expr

    def lines(self, statements: Iterable[Statement], indent: str = "") -> list[str]:
        out: list[str] = []
        for s in statements:
            if isinstance(s, For):
                v, last = s.var, _index(s.last)
                cond, advance = (f"{v} <= {last}", f"++{v}") if s.step > 0 else (f"{v} >= {last}", f"--{v}")
                if abs(s.step) > 1 and not s.shared:  # a loop over segments of rows (codegen/roll.py ``segmented``)
                    advance = f"{v} += {s.step}" if s.step > 0 else f"{v} -= {-s.step}"
                first = _index(s.first)
                if s.shared:  # the block's threads share the iterations (each template defines TS_THREAD/S)
                    stride = "" if s.step == 1 else f"{s.step} * "
                    first, advance = f"{first} + {stride}TS_THREAD", f"{v} += {stride}TS_THREADS"
                if not s.unroll:
                    out.append(f"{indent}TS_ROLLED")  # each template says what keeps a loop rolled
                out.append(f"{indent}for (int64_t {v} = {first}; {cond}; {advance}) {{")
                out += self.lines(s.body, indent + INDENT)
                out.append(f"{indent}}}")
            elif isinstance(s, RunEnd):
                if isinstance(s.at, int):
                    out += self.lines(s.body, indent) if s.holds() else []
                    continue
                at = _index(s.at)
                since = at if s.first == 0 else f"{at} - {s.first}"
                out.append(f"{indent}if (({since}) % {s.length} == {s.length - 1} || {at} == {s.last}) {{")
                out += self.lines(s.body, indent + INDENT)
                out.append(f"{indent}}}")
            else:
                out.append(indent + self.statement(s))
        return out

    def statement(self, s: Statement) -> str:
        if isinstance(s, Def):
            const = "const " if s.const else ""
            # an empty sum in double precision (a cost's sums) is that type's zero
            value = self._double_zero() if s.value == Sum(()) and s.ctype == "double" else self.expr(s.value)
            return f"{const}{self._type(s.ctype)} {self.expr(s.target)} = {value};"
        if isinstance(s, Store):
            return f"{self.expr(s.target)} {s.op} {self.expr(s.value)};"
        if isinstance(s, Call):
            args = [_index(a) for a in s.args]
            if s.value is not None:
                args.append(self.expr(s.value))
            return f"{self._name(s.macro, s.whole)}({', '.join(args)});"
        if isinstance(s, Fence):
            return "TS_FENCE();"
        if isinstance(s, RunTape):
            return f"{s.tape.macro}({', '.join(_index(a) for a in s.args)});"
        raise TypeError(f"not a statement: {s!r}")

    def _name(self, macro: str, whole: bool) -> str:
        """A macro's name; a row moved whole (codegen/whole.py) by its whole form, W before the
        name's number (``VYW0``, ``VGW1``: templates/kernel.c.j2), the lane form's only."""
        name = self.macro(macro)
        if not whole:
            return name
        assert self.vector, f"{macro}: a whole row in a scalar column"
        stem = name.rstrip("0123456789")
        return f"{stem}W{name[len(stem):]}"

    def _type(self, ctype: str) -> str:
        return self.element if ctype == "T" else "VD" if self.vector and ctype == "double" else ctype

    def _double_zero(self) -> str:
        return "VDZERO" if self.vector else "0.0"

    def expr(self, e: Any) -> str:
        if isinstance(e, Var):
            return e.name
        if isinstance(e, Val):
            return f"{e.prefix}{e.k}_{e.h}"
        if isinstance(e, Read):
            name = self._name(e.macro, e.whole)
            return f"{name}({', '.join(_index(a) for a in e.args)})" if e.args else name
        if isinstance(e, Sum):
            text = "".join(self._term(t) for t in e.terms)
            return (text[1:] if text.startswith("+") else text) if text else self.zero
        if isinstance(e, Add):
            return " + ".join(self.expr(p) for p in e.parts) if e.parts else "0.0"
        if isinstance(e, Mul):
            return f"{self.expr(e.a)}*{self.expr(e.b)}"
        if isinstance(e, Paren):
            return f"({self.expr(e.x)})"
        if isinstance(e, Volatile):
            return f"(*(volatile const {self.element}*)&({self.expr(e.x)}))"
        if isinstance(e, Cast):
            if self.vector:  # the lane form converts to double (a cost's sums per dof) only
                assert e.ctype == "double", f"no lane form of a cast to {e.ctype}"
                return f"VDOUBLE({self.expr(e.x)})"
            return f"({self._type(e.ctype)}){self.expr(e.x)}"
        if isinstance(e, Literal):
            return e.text
        if isinstance(e, Sym):
            text = None if e.like is None else renamed_text(self.sym(e.like[0]), e.like[1])
            return self.sym(e.expr) if text is None else text
        if isinstance(e, Bind):
            return self._bound(e)
        raise TypeError(f"not an expression: {e!r}")

    def _bound(self, e: Bind) -> str:
        """A bound expression's text with each placeholder replaced by its expression's (a value, a
        variable or a read: one operand each); printed afresh where a placeholder is not printed as
        itself."""
        names = tuple((name, self.expr(v)) for name, v in e.names)
        text = renamed_text(self.sym(e.sym.expr), names) if names else self.sym(e.sym.expr)
        if text is None:
            new = dict(names)
            expr = e.sym.expr
            text = self.sym(expr.xreplace({s: sp.Symbol(new[s.name]) for s in expr.free_symbols if s.name in new}))
        return text

    def _term(self, t: Term) -> str:
        operand = self.expr(t.operand)
        if t.factor is not None:
            return f"+{self.expr(t.factor)}*{operand}"
        return f"-{operand}" if t.negative else f"+{operand}"


COLUMN = Printer()
