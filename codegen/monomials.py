"""A coefficient table whose every slot is one monomial c·dt^p of a single duration dt, kept as
data: the arrays of c and p, and three small loops that read them.

With a dt per trajectory the coefficient programs run once per trajectory, inside the kernels.
Compiled as straight-line code, a long one (a B-spline's weights: thousands of slots) cost gcc
tens of seconds; a tape (codegen/tape.py) costs more per trajectory than that code, since every
instruction is dispatched. But one duration makes every slot a constant times a power of it
(a difference weight over dt^k, an integration step's dt^k/k!), so the table is

    C(q)  = c[q]·dt^p[q]
    CD(q) = c[q]·p[q]·dt^(p[q]-1)·ddt                 (its tangent)
    gdt   = Σ_q GC(q)·c[q]·p[q]·dt^(p[q]-1)          (the dt gradient from the slots' gradients)

each a loop over the slots with the powers of dt computed once. The compiler's work no longer
grows with the table, and the loops are as fast as the code they replace.

>>> import sympy as sp
>>> dt = sp.Symbol("dt", positive=True)
>>> m = of([dt, dt**2 / 2, 3 / dt**2, sp.Integer(1)], dt)
>>> m.factors, m.powers
((1.0, 0.5, 3.0, 1.0), (1, 2, -2, 0))
>>> m.lowest, m.highest, m.width
(-2, 2, 5)
>>> of([dt + 1], dt) is None  # not one monomial: the program stays code
True
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import sympy as sp

PROGRAMS = ("value", "tangent", "reverse")
#: with GCC, tables of at most this many powers pick each slot's power from two vector registers
#: (a permute per four slots, where a gather per slot cost more than the straight-line code)
SHUFFLE_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class Monomials:
    """Slot q of the table holds ``factors[q]·dt^powers[q]``."""

    factors: tuple[float, ...]
    powers: tuple[int, ...]

    @functools.cached_property  # read once per slot by the template
    def lowest(self) -> int:
        return min(self.powers)

    @functools.cached_property
    def highest(self) -> int:
        return max(self.powers)

    @property
    def width(self) -> int:
        """How many powers of dt the table uses (the loops pick from registers where at most
        SHUFFLE_WIDTH)."""
        return self.highest - self.lowest + 1

    def program(self, name: str) -> "MonomialLoop":
        if name not in PROGRAMS:
            raise ValueError(f"program={name!r} is invalid: allowed {', '.join(PROGRAMS)}")
        return MonomialLoop(name)


@dataclasses.dataclass(frozen=True)
class MonomialLoop:
    """One of the loops over a Monomials table, run where its program was (RunTape prints it as
    ``macro``, which codegen/templates/_monomials.j2 defines)."""

    name: str

    @property
    def macro(self) -> str:
        return f"TS_MONOMIALS_{self.name.upper()}"


def monomial(expr: sp.Expr, dt: sp.Symbol) -> tuple[float, int] | None:
    """(c, p) with ``expr == c·dt^p`` for a rational c and an integer p, else None."""
    c, p = sp.sympify(expr).as_coeff_exponent(dt)
    if not (c.is_Rational and p.is_Integer):
        return None
    return float(c), int(p)


def of(values: Sequence[sp.Expr], dt: sp.Symbol) -> Monomials | None:
    """The table of ``values`` (slot q holds values[q]) as monomials of ``dt``, or None where any
    value is not one."""
    distinct = {v: monomial(v, dt) for v in set(values)}  # copies of a slot repeat its value
    terms = [distinct[v] for v in values]
    if not terms or any(t is None for t in terms):
        return None
    return Monomials(tuple(c for c, _ in terms), tuple(p for _, p in terms))
