"""Kernel statements as data: what codegen/lower.py builds, codegen/roll.py rolls and
codegen/printer.py prints (as a scalar column, or as one vector over all dof lanes).

Expressions are frozen dataclasses, so statements compare and hash by value (roll.py
compares the statements of rows to find repeating ones). Positions are ints, or ``Rel``
offsets from a row that is not fixed yet: a group's row before it is placed, or the loop
variable ``r`` once rolled.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Union

import sympy as sp


@dataclasses.dataclass(frozen=True)
class Rel:
    """A row or action position relative to the current one (printed as ``r``, ``r + 2``, ``r - 1``)."""

    rel: int


@dataclasses.dataclass(frozen=True)
class Strided:
    """A coefficient-table slot that advances by ``stride`` per loop row from row ``start``."""

    slot: int
    stride: int
    start: int


@dataclasses.dataclass(frozen=True)
class Shift:
    """A position in a loop over knots: ``base`` (an int) advanced by ``scale`` per knot, printed
    over the knot variable ``kn`` (``kn + 3``: an action; ``4 * kn + 25``: a row)."""

    base: int
    scale: int


Index = Union[int, Rel, Strided, Shift, None]  # None: a blanked slot (roll.py's row shapes)


@dataclasses.dataclass(frozen=True)
class Var:
    """A local variable by name (``s0``, ``dt0``, ``y0_c``, a loop's carried value)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Val:
    """The value ``<prefix><k>_<h>`` of row h (``y``: output, ``yb``: its adjoint, ``g``: its
    incoming gradient, ``ty``: its tangent)."""

    prefix: str
    k: int
    h: Union[int, Rel]


@dataclasses.dataclass(frozen=True)
class Read:
    """A macro read: ``U(3)``, ``G0(h)``, ``C(q)``; without args the bare name (``S0``, ``SGU``).
    ``whole``: the lane form loads the row as a whole vector where that stays inside the trajectory's
    rows (codegen/whole.py)."""

    macro: str
    args: tuple[Index, ...] = ()
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class Literal:
    """A numeric literal as written (``0``, ``0.0``)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Sym:
    """A SymPy expression of the double-precision coefficient program. ``like``: where ``expr`` is
    another expression with some symbols renamed, (that expression, ((name, new name), ...)), which a
    printer may print once for all its renamings (codegen/renaming.py); not part of the value."""

    expr: sp.Expr
    like: Optional[tuple] = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Bind:
    """A SymPy expression over placeholder symbols, each bound to a statement expression: ``names``
    holds (placeholder, expression) pairs, e.g. a cost term over ``("ts_y", Val("y", 0, Rel(0)))``
    and ``("ts_rw", Read("CRW0", (Rel(0),)))``. The bound expressions carry positions as any
    statement's do, so one expression at every row is one node with ``Rel`` positions (roll.py's
    groups compare equal), which ``place`` fixes at a row and roll.py runs in a loop. Printed as
    the expression's text with each placeholder replaced by its expression's (codegen/printer.py)."""

    sym: Sym
    names: tuple[tuple[str, Any], ...]


def bind(expr: sp.Expr, names: dict[sp.Symbol, Any]) -> "Bind":
    """``expr`` with its placeholders bound (those it does not use left out)."""
    used = expr.free_symbols
    return Bind(Sym(expr), tuple((s.name, v) for s, v in names.items() if s in used))


@dataclasses.dataclass(frozen=True)
class Term:
    """One signed product of a column sum: ``+factor*operand``, ``+operand`` or ``-operand``."""

    factor: Optional[Read]  # a coefficient-table read, or None for a unit coefficient
    operand: Any
    negative: bool = False


@dataclasses.dataclass(frozen=True)
class Sum:
    """A column sum of terms (the empty sum is the macro ``ZERO``)."""

    terms: tuple[Term, ...]


@dataclasses.dataclass(frozen=True)
class Add:
    """A double-precision sum ``a + b + ...`` (the empty sum is ``0.0``)."""

    parts: tuple


@dataclasses.dataclass(frozen=True)
class Mul:
    """``a*b``."""

    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class Paren:
    """``(x)``."""

    x: Any


@dataclasses.dataclass(frozen=True)
class Cast:
    """``(ctype)x``; ctype ``T`` is the kernel's element type."""

    ctype: str
    x: Any


@dataclasses.dataclass(frozen=True)
class Volatile:
    """A read made where it is used: ``(*(volatile const T*)&(x))`` (``x`` a read, an lvalue),
    which the compiler neither hoists nor merges."""

    x: Read


Expr = Union[Var, Val, Read, Literal, Sym, Bind, Sum, Add, Mul, Paren, Cast, Volatile]


@dataclasses.dataclass(frozen=True)
class Def:
    """``const T target = value;`` (``T target = value;`` when not const: a loop's carried value)."""

    target: Union[Var, Val]
    value: Expr
    ctype: str = "T"
    const: bool = True


@dataclasses.dataclass(frozen=True)
class Store:
    """``target = value;`` or ``target += value;`` (a macro lvalue or a carried variable)."""

    target: Union[Read, Var]
    value: Expr
    op: str = "="


@dataclasses.dataclass(frozen=True)
class Call:
    """``macro(args..., value);``: a store through a macro (``Y0(h, v)``, ``GS1(v)``). ``whole``: the
    lane form stores the row as a whole vector where that stays inside the trajectory's rows
    (codegen/whole.py)."""

    macro: str
    args: tuple[Union[Index, Var], ...] = ()
    value: Optional[Expr] = None
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class For:
    """A loop over rows ``r`` (or ``var``) from ``first`` to ``last`` inclusive, by ``step`` (+1 or -1).
    ``shared``: its iterations are independent, and the threads of a block share them (thread t of
    n runs first + step·t, step·n apart: TS_THREAD and TS_THREADS, which each template defines; a
    step above 1 then leaves rows between for other loops)."""

    first: Union[int, Shift, Var]  # a Var: an expression over outer loop variables, printed as is
    last: Union[int, Shift]
    step: int
    body: tuple
    unroll: bool = True  # False: kept rolled (printed after ``TS_ROLLED``, which each template defines; nvcc unrolls short loops)
    var: str = "r"  # the loop variable (``kn``: a loop over knots around loops over rows)
    shared: bool = False


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """``body`` after row ``at`` where that row ends a run of ``length`` rows counted from row ``first``
    (``(at - first) % length == length - 1``) or is row ``last``: in a loop over knot spans a test of
    the row's position, placed at a row (an int) the body or nothing (codegen/fused.py ``forward_rolled``)."""

    at: Index
    first: int
    length: int
    last: int
    body: tuple

    def holds(self) -> bool:
        """Whether the placed row ends a run."""
        assert isinstance(self.at, int), "a position in a loop: tested where it runs"
        return (self.at - self.first) % self.length == self.length - 1 or self.at == self.last


@dataclasses.dataclass(frozen=True)
class RunTape:
    """Runs a program kept as data (a codegen/tape.py Tape, or a loop over a codegen/monomials.py
    table): printed as the macro each template defines for it, called with ``args`` (a row
    tape's rows: first, last, step)."""

    tape: Any
    args: tuple = ()

    def __hash__(self) -> int:
        return hash(self.tape.name)


@dataclasses.dataclass(frozen=True)
class Fence:
    """``TS_FENCE();``: where ptxas schedules nothing across (CUDA's: a trap predicated on the block
    size being 0, in inline PTX, which ptxas turns into a branch and NVVM sees as straight-line code;
    codegen/fences.py)."""


Statement = Union[Def, Store, Call, For, RunEnd, RunTape, Fence]


def transform(node: Any, fn: Callable[[Any], Any]) -> Any:
    """``node`` rebuilt top-down: where ``fn`` returns a value other than None, that replaces
    the (sub)node; else the node's fields (or a tuple's items) are transformed in turn."""
    out = fn(node)
    if out is not None:
        return out
    if isinstance(node, tuple):
        return tuple(transform(x, fn) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, (Sym, RunTape, type)):
        return dataclasses.replace(node, **{f.name: transform(getattr(node, f.name), fn)
                                            for f in dataclasses.fields(node)})
    return node


def walk(node: Any) -> Iterator[Any]:
    """Every node under ``node`` (itself included), in field order (depth first, one stack: a
    fused column's statements are walked several times, a nested generator per node was most of it)."""
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, tuple):
            stack.extend(reversed(node))
        else:
            stack.extend(getattr(node, name) for name in _walked_fields(type(node)))


@functools.lru_cache(maxsize=None)
def _walked_fields(cls: type) -> tuple[str, ...]:
    """The fields ``walk`` enters of a node of this class, last first: a statement's or expression's,
    none of a SymPy expression's, a tape's or anything else."""
    if not dataclasses.is_dataclass(cls) or issubclass(cls, (Sym, RunTape)):
        return ()
    return tuple(f.name for f in reversed(dataclasses.fields(cls)))


def place(node: Any, h: int) -> Any:
    """``node`` at row h: every ``Rel`` position becomes absolute; a ``Shift`` too, with h its knot."""
    return transform(node, lambda n: h + n.rel if isinstance(n, Rel) else n.base + n.scale * h if isinstance(n, Shift)
                     else None)

