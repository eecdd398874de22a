"""The step coefficients of an operator: table slots C(q) and the double-precision programs
that fill the table from dt and differentiate it (as statements, codegen/statements.py).

With a duration per step, every row has coefficients of its own, but interior rows repeat:
row h's coefficients are row h-1's with every dt_i read as dt_{i+1}. Such a run of rows is
found from the operator (each row's coefficients rewritten relative to the row must be the
same), derived once as a template over a window of durations DT(r + o), and emitted as one
loop over the rows r; the other rows (the boundaries) stay straight-line. So the programs,
their derivatives and the compiler's work on them are linear in the horizon. A long
straight-line part (wide boundaries) runs as a tape (codegen/tape.py), data the compiler does
not work on. With one duration (uniform, or one per trajectory) every slot is a monomial c·dt^p
and the programs are loops over the table's monomials (codegen/monomials.py) on every target.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from collections import defaultdict
from typing import Any, Iterable, Sequence

import sympy as sp
from sympy.core.function import AppliedUndef

from . import monomials, tape
from .operator import Operator, expand_formulas, is_formula
from .runs import NEXT, runs
from .statements import (Add, Call, Cast, Def, For, Literal, Mul, Paren, Read, Rel, RunTape, Statement, Store, Strided,
                         Sym, Term, Var, transform)

ONE, MINUS_ONE = sp.Integer(1), sp.Integer(-1)
#: after it, a CUDA block's threads see what the others stored (nothing in C)
BARRIER = Call("TS_BARRIER")
MIN_ROWS = 4  # shorter runs of repeating rows stay straight-line
#: straight-line programs of more lines run as tapes (codegen/tape.py)
TAPE_ABOVE_LINES = 200
#: on CUDA a run's rows of longer value programs (a stencil's Lagrange weights; an integrator's are
#: a few lines) run their programs as row tapes (codegen/tape.py ``Tape.row``): as code, a row's
#: values stay live until their tangents or adjoints read them (hundreds of registers, spills);
#: C runs them as code (compiled, several times faster than a tape)
ROW_TAPE_ABOVE_LINES = 16
#: value-tape instructions per line of CSE'd program, for a per-step stencil's boundary weights
#: (2.3–2.7 over the per-step stencils up to H=64: the tape splits sums and products in two)
TAPE_INSTRUCTIONS_PER_LINE = 2.25

Line = tuple  # (symbol, expression): one assignment of a double-precision program
_name = operator.attrgetter("name")  # a symbol's sort key (str() of a symbol is its name, printed: slower)


def table_term(index: Any, operand: Any) -> Term:
    """'+C(index)*operand': coefficients are read from the table, not held one local each
    (which makes compile time superlinear in the horizon)."""
    return Term(Read("C", (index,)), operand)


def _double(name: str, value: Any) -> Def:
    return Def(Var(name), value, "double")


@functools.lru_cache(maxsize=1 << 16)  # the tangent and the reverse program take the same derivatives
def partial(e: sp.Expr, a: sp.Symbol) -> sp.Expr:
    """∂e/∂a, as sp.diff gives it, for the sums, products and constant powers of a program's lines
    (other expressions: sp.diff). sp.diff's general machinery (Derivative objects, assumption
    queries, the Leibniz rule over every factor) costs about ten times more on them."""
    if e == a:
        return ONE
    if a not in e.free_symbols:
        return sp.S.Zero
    if e.is_Add:
        return sp.Add(*[partial(t, a) for t in e.args])
    if e.is_Mul:
        f = e.args
        return sp.Add(*[sp.Mul(*f[:i], partial(x, a), *f[i + 1:]) for i, x in enumerate(f) if a in x.free_symbols])
    if e.is_Pow and a not in e.exp.free_symbols:
        return e * (partial(e.base, a) * e.exp / e.base)
    return sp.diff(e, a)


def _derivative(e: sp.Expr, a: sp.Symbol, seed: str) -> Mul:
    """'(∂e/∂a)*seed'."""
    return Mul(Paren(Sym(partial(e, a))), Var(seed))


def _cse(exprs: Sequence[sp.Expr], temps: Iterable[sp.Symbol], names: Sequence[str], chunk: int) -> list[Line]:
    """Short assignments computing each expression into the symbol of the same position in
    ``names`` (chunked CSE: no more than one chunk's temporaries live at a time)."""
    lines: list[Line] = []
    for lo in range(0, len(exprs), chunk):
        subs, reduced = sp.cse(list(exprs[lo : lo + chunk]), symbols=temps, optimizations=None)
        lines += subs
        lines += [(sp.Symbol(n), r) for n, r in zip(names[lo : lo + chunk], reduced)]
    return lines


def _tangent(lines: Sequence[Line]) -> list[Statement]:
    """Forward mode: each line's value and its tangent d_<s> from the tangents of its inputs."""
    out: list[Statement] = []
    for s, e in lines:
        out.append(_double(str(s), Sym(e)))
        parts = tuple(_derivative(e, a, f"d_{a}") for a in sorted(e.free_symbols, key=_name))
        out.append(_double(f"d_{s}", Add(parts)))
    return out


def _reverse(lines: Sequence[Line], seeds: dict[str, list]) -> tuple[list[Statement], dict[str, list]]:
    """Reverse mode over ``lines`` from the adjoint parts ``seeds`` (symbol name → parts): the
    statements and the adjoint parts left for the program's inputs."""
    out: list[Statement] = []
    contributions: dict[str, list] = defaultdict(list, {k: list(v) for k, v in seeds.items()})
    for s, e in reversed(lines):
        parts = contributions.pop(str(s), [])
        if not parts or not e.free_symbols:  # a constant line passes nothing on
            continue
        out.append(_double(f"b_{s}", Add(tuple(parts))))
        for a in sorted(e.free_symbols, key=_name):  # a fixed order: the same source in every process
            contributions[str(a)].append(_derivative(e, a, f"b_{s}"))
    return out, contributions


@dataclasses.dataclass(frozen=True)
class RowRun:
    """Rows first..last whose coefficients are one template shifted along the durations: row r
    fills slots ``lo + width·(r - first) + i`` from the durations DT(r + o) of ``window``."""

    first: int
    last: int
    lo: int
    width: int
    window: tuple[tuple[int, sp.Symbol], ...]  # (offset o, the symbol that reads DT(r + o))
    program: tuple[Line, ...]  # the template's quantities (e.g. node times), in dependency order
    exprs: tuple[sp.Expr, ...]  # coefficient i of the row, over window and program symbols

    def slot(self, i: int) -> Strided:
        return Strided(self.lo + i, self.width, self.first)

    @functools.cached_property
    def lines(self) -> list[Line]:
        """The template's program and its coefficients kr<i>, as short assignments."""
        names = [f"kr{i}" for i in range(len(self.exprs))]
        return list(self.program) + _cse(self.exprs, sp.numbered_symbols("tr"), names, len(self.exprs) or 1)

    def inputs(self, tangent: bool = False) -> list[Statement]:
        lines = [_double(str(s), Cast("double", Read("DT", (Rel(o),)))) for o, s in self.window]
        if tangent:
            lines += [_double(f"d_{s}", Cast("double", Read("DDT", (Rel(o),)))) for o, s in self.window]
        return lines

    def statements(self) -> list[Statement]:
        """The row's value program as statements relative to the row (its window's DT(r + o), its
        slots C(i)): what its row tape is built from."""
        lines: list[Statement] = [_double(str(s), Cast("double", Read("DT", (Rel(o),)))) for o, s in self.window]
        for s, e in self.lines:
            if s.name.startswith("kr"):
                lines.append(Store(Read("C", (int(s.name[2:]),)), Cast("T", Paren(Sym(e)))))
            else:
                lines.append(_double(str(s), Sym(e)))
        return lines

    def tape(self, program: str, name: str) -> tape.Tape:
        """The row's ``program`` ("value", "tangent", "reverse") as a row tape (codegen/tape.py
        ``Tape.row``), which runs every row of the run."""
        return tape.build(name, self.statements(), program, row=(self.lo, self.width, self.first))

    def loop(self, body: list[Statement]) -> For:
        """The rows, each independent of the others: a CUDA block's threads share them."""
        return For(self.first, self.last, 1, tuple(body), shared=True)

    def phases(self, body: list[Statement]) -> list[Statement]:
        """The rows of a reverse program, which add to the gradients of their windows' durations:
        in phases, rows ``span`` apart in each (the window's span), so no two rows of a phase add to
        the same duration's and a block's threads share a phase's rows; a barrier after each."""
        span = self.span
        if span == 1:  # a row adds to its own duration's alone: one phase
            return [self.loop(body), BARRIER]
        rows = For(Var(f"{self.first} + ph"), self.last, span, tuple(body), shared=True)
        return [For(0, span - 1, 1, (rows, BARRIER), unroll=False, var="ph")]

    @property
    def span(self) -> int:
        """Rows this far apart add to no duration's gradient in common (``phases``)."""
        offsets = [o for o, _ in self.window]
        return max(offsets) - min(offsets) + 1 if offsets else 1

    def tape_phases(self, row_tape: tape.Tape) -> list[Statement]:
        """``phases`` with each phase's rows run by the row tape (its macro shares them among a
        block's warps, each running a row's levels with its lanes)."""
        if self.span == 1:
            return [RunTape(row_tape, (self.first, self.last, 1)), BARRIER]
        rows = RunTape(row_tape, (Var(f"{self.first} + ph"), self.last, self.span))
        return [For(0, self.span - 1, 1, (rows, BARRIER), unroll=False, var="ph")]


class _Relative:
    """Coefficients rewritten relative to their row h: dt_{h+o} becomes the window symbol of
    offset o, a program quantity the template quantity with the same relative definition."""

    def __init__(self, op: Operator):
        self.dt_index = {s: i for i, s in enumerate(op.dt_symbols)}
        self.program = dict(op.program)
        self.window: dict[int, sp.Symbol] = {}
        self.quantity: dict[tuple[sp.Symbol, int], sp.Symbol] = {}
        self.defined: dict[sp.Expr, sp.Symbol] = {}  # relative definition → template quantity
        self.by_shape: dict[frozenset, sp.Symbol] = {}  # a sum of durations' relative terms → the same
        self.lines: list[Line] = []  # the template quantities in definition order

    def _symbol(self, s: sp.Symbol, h: int) -> sp.Symbol:
        if s in self.dt_index:
            o = self.dt_index[s] - h
            if o not in self.window:
                self.window[o] = sp.Symbol(f"dtr_{o}".replace("-", "m"), positive=True)
            return self.window[o]
        if (s, h) not in self.quantity:
            shape = self._shape(self.program[s], h)
            if shape is None or shape not in self.by_shape:
                e = self.expr(self.program[s], h)
                if e not in self.defined:
                    self.defined[e] = sp.Symbol(f"xr{len(self.defined)}")
                    self.lines.append((self.defined[e], e))
                if shape is not None:
                    self.by_shape[shape] = self.defined[e]
            self.quantity[(s, h)] = self.defined[e] if shape is None else self.by_shape[shape]
        return self.quantity[(s, h)]

    def _shape(self, e: sp.Expr, h: int) -> frozenset | None:
        """A sum of constant multiples of durations (a time between two points) as its terms'
        (multiple, offset from h): equal shapes have equal relative definitions, which a long
        horizon's rows then share without each building its own (None for any other quantity)."""
        terms = []
        for a in e.args if e.is_Add else (e,):
            c, x = (a.args if a.is_Mul and len(a.args) == 2 and a.args[0].is_Number else (1, a))
            if x not in self.dt_index:
                return None
            terms.append((c, self.dt_index[x] - h))
        return frozenset(terms)

    def expr(self, e: sp.Expr, h: int) -> sp.Expr:
        return e.xreplace({s: self._symbol(s, h) for s in sorted(e.free_symbols, key=_name)})

    def key(self, e: sp.Expr, h: int) -> Any:
        """What ``expr`` compares by, without building it where ``e`` applies a formula to
        quantities (a Lagrange weight at a row's node times): the formula and its relative
        arguments. The quantities are named in ``expr``'s order."""
        if not (is_formula(e) and all(a.is_Symbol for a in e.args)):
            return self.expr(e, h)
        relative = {s: self._symbol(s, h) for s in sorted(set(e.args), key=_name)}
        return e.func, tuple(relative[a] for a in e.args)

    def program_of(self, exprs: Sequence[sp.Expr]) -> tuple[Line, ...]:
        """The template quantities the expressions use, in definition order."""
        return tuple(_used(self.lines, exprs))


def _used(program: Sequence[Line], exprs: Sequence[sp.Expr]) -> list[Line]:
    """The lines of ``program`` the expressions use, directly or through later lines, in order."""
    need = set().union(*(e.free_symbols for e in exprs)) if exprs else set()
    for s, e in reversed(program):
        if s in need:
            need |= e.free_symbols
    return [(s, e) for s, e in program if s in need]


def _rows_of(op: Operator, names: dict[sp.Expr, int], varies: Any) -> dict[int, list[int]]:
    """row h → the dt-dependent slots first used by row h's outputs (contiguous, ascending)."""
    new: dict[int, list[int]] = defaultdict(list)
    seen: set[int] = set()
    for row in op.rows:
        for coef, _ in row.terms:
            q = names.get(coef)
            if q is not None and q not in seen:
                seen.add(q)
                if varies(coef):
                    new[row.h].append(q)
    return new


def find_runs(op: Operator, names: dict[sp.Expr, int], varies: Any) -> list[RowRun]:
    """Runs of at least MIN_ROWS consecutive rows whose coefficients are the previous row's with
    every duration shifted by one step (only with a duration per step)."""
    if len(op.dt_symbols) < 2:
        return []
    by_row = _rows_of(op, names, varies)
    exprs = {q: e for e, q in names.items()}
    rel = _Relative(op)
    signature = {h: tuple(rel.key(exprs[q], h) for q in qs) for h, qs in by_row.items() if qs}

    def shape(h: int) -> tuple | None:  # row h's template, when its slots are consecutive (a loop fills them)
        qs = by_row[h]
        return signature[h] if qs == list(range(qs[0], qs[0] + len(qs))) else None

    def follows(stride: tuple[int, ...]) -> bool:  # the next row, its slots the next ones (a row's width further)
        return stride[0] == NEXT and set(stride[1:]) == {len(stride) - 1}

    found = []
    rows = sorted(signature)
    for run in runs(rows, key=shape, fields=lambda h: (h, *by_row[h]), min_length=MIN_ROWS, admits=follows):
        first, last = rows[run.start], rows[run.stop - 1]
        template = tuple(expand_formulas(rel.expr(exprs[q], first)) for q in by_row[first])
        program = rel.program_of(template)
        used = set().union(*(e.free_symbols for e in template), *(e.free_symbols for _, e in program))
        window = tuple(sorted((o, s) for o, s in rel.window.items() if s in used))
        found.append(RowRun(first, last, by_row[first][0], len(template), window, program, template))
    return found


def _find(items: list, values: tuple) -> int | None:
    """The first position where ``values`` occur in ``items`` consecutively, or None."""
    n = len(values)
    for i in range(len(items) - n + 1):
        if items[i] == values[0] and tuple(items[i : i + n]) == values:
            return i
    return None


def _overlap(items: list, values: tuple) -> int:
    """The longest tail of ``items`` that is a head of ``values``."""
    for n in range(min(len(items), len(values) - 1), 0, -1):
        if tuple(items[-n:]) == values[:n]:
            return n
    return 0


def _tangent_copy(copy: Statement) -> Statement:
    """The tangent of a copy statement (or loop of them): CD(x) = CD(y) for C(x) = C(y), 0 for a constant."""
    def fn(n: Any) -> Any:
        if isinstance(n, Read) and n.macro == "C":
            return Read("CD", n.args)
        if isinstance(n, Cast) and n.ctype == "T" and isinstance(n.x, Paren) and isinstance(n.x.x, Sym):
            return Cast("T", Literal("0"))
        return None
    return transform(copy, fn)


def _after_barrier(copies: list[Statement]) -> list[Statement]:
    """Loops of copies, which read slots other threads of a CUDA block stored, shared by its threads."""
    return [BARRIER, *(dataclasses.replace(c, shared=True) for c in copies)] if copies else []


class Coefficients:
    """Gives each coefficient expression a slot C(q) and turns them into a double-precision program.

    The program is a list of small assignments (chunked CSE keeps it linear in the
    horizon), with repeating rows as loops (``runs``). Its derivatives are taken line by
    line: forward mode for dt_jvp, reverse mode for dt_vjp, so no large expression is ever
    differentiated symbolically. A long straight-line part is a tape (``tape``), differentiated
    on the tape; with formulas it is built from them directly (``formula_lines``), never CSE'd.
    """

    CHUNK = 48

    def __init__(self, op: Operator):
        self._tapes: dict[str, tape.Tape] = {}
        self._row_tapes: dict[str, dict[int, tape.Tape]] = {}
        self.dt_syms = op.dt_symbols
        self.base = list(op.program)
        self._varying = set(self.dt_syms) | {s for s, _ in self.base}
        self.names: dict[sp.Expr, int] = {}
        self.copies: list[sp.Expr] = []  # slot len(names) + i holds copies[i] (see block)
        self._blocks: dict[tuple[sp.Expr, ...], int] = {}
        self._codes: dict[sp.Expr, int] = {}  # a number per copied value: blocks are searched by them
        self._copy_codes: list[int] = []  # the copies' numbers
        self._copy_programs: dict[tuple[bool, int], tuple] = {}  # see _copy_program
        for coef in op.coefficients():  # fixed slots, shared by every kernel of the operator
            self.index(coef)
        self.runs = find_runs(op, self.names, self.varies)

    @property
    def size(self) -> int:
        """Entries of the table: the coefficients' slots, then the blocks of copies."""
        return len(self.names) + len(self.copies)

    def block(self, values: tuple[sp.Expr, ...]) -> int:
        """The first of consecutive slots holding ``values`` in that order (one block per
        sequence; coefficients are copied from their slots, constants such as 0 written): a loop
        whose rows read coefficients scattered over the table reads them at a constant stride.
        Only the forward table (``preamble``) fills them. A sequence the copies already hold in
        consecutive slots (e.g. the tail of a longer span's weights) is read there, and one whose
        head ends them is appended only in part."""
        if values not in self._blocks:
            codes = tuple(self._codes.setdefault(v, len(self._codes)) for v in values)
            at = _find(self._copy_codes, codes)
            if at is None:
                at = len(self.copies) - _overlap(self._copy_codes, codes)
                self.copies += values[len(self.copies) - at:]
                self._copy_codes += codes[len(self._copy_codes) - at:]
            self._blocks[values] = len(self.names) + at
        return self._blocks[values]

    def value(self, q: int) -> sp.Expr:
        """The expression table slot q holds (a coefficient, or a block's copy)."""
        n = len(self.names)
        return self.copies[q - n] if q >= n else self._exprs[q]

    def source(self, q: int) -> int | None:
        """The slot whose value slot q holds: q itself, a copy's source slot, None for a constant.
        dt_vjp_finish adds a copy's gradient to its source's where that is a straight-line slot
        (``straight``): copies of a run's slots have no gradient there."""
        return q if q < len(self.names) else self.names.get(self.copies[q - len(self.names)])

    @functools.cached_property
    def _exprs(self) -> list[sp.Expr]:
        return list(self.names)

    def varies(self, expr: sp.Expr) -> bool:
        """Whether a coefficient depends on dt (directly or through program quantities)."""
        return bool(expr.free_symbols & self._varying)

    def index(self, expr: sp.Expr) -> int:
        """Slot of a coefficient in the kernel's coefficient table."""
        if expr not in self.names:
            assert not self.copies, f"coefficient {expr} named after the blocks of copies"
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
    def straight(self) -> list[int]:
        """The slots the straight-line program fills (those of no run)."""
        rolled = {run.lo + i for run in self.runs for i in range(run.width * (run.last - run.first + 1))}
        return [q for q in range(len(self.names)) if q not in rolled]

    @functools.cached_property
    def lines(self) -> list[Line]:
        """Assignments computing k<q> (the value of C(q)) for the straight-line slots."""
        exprs = list(self.names)
        chosen = [expand_formulas(exprs[q]) for q in self.straight]
        base = _used(self.base, chosen) if self.runs else self.base  # with runs: what the straight slots use
        return list(base) + _cse(chosen, sp.numbered_symbols("t"), [f"k{q}" for q in self.straight], self.CHUNK)

    @functools.cached_property
    def formula_lines(self) -> list[Line]:
        """The straight-line slots' program as the operator gives it, without CSE: the quantities
        the slots use, then one line per slot, formulas unapplied (a tape builds their definitions
        once per distinct subexpression: tape._Builder._formula)."""
        chosen = [self._exprs[q] for q in self.straight]
        base = _used(self.base, chosen) if self.runs else self.base
        return list(base) + [(sp.Symbol(f"k{q}"), e) for q, e in zip(self.straight, chosen)]

    @functools.cached_property
    def long(self) -> bool:
        """Whether the straight-line parts of the programs are long enough to run as tapes (on
        CUDA a block's threads share a run of a tape)."""
        return self.straight_size > TAPE_ABOVE_LINES

    @functools.cached_property
    def straight_size(self) -> float:
        """The straight-line program's length in lines after CSE, or what decides ``long`` the
        same way without the CSE: with formulas (the Lagrange weights of a duration per step),
        whose expansion and CSE would cost seconds, an estimate from the value tape, which is
        built without them; with more slots than the limit, the slots (a line each at least)."""
        if self.has_formulas:
            return len(self.tape("value").instructions) / TAPE_INSTRUCTIONS_PER_LINE
        if len(self.straight) > TAPE_ABOVE_LINES:  # a line per slot at least: long without the CSE (seconds
            return len(self.straight)               # over a B-spline's thousands of weights)
        return len(self.lines)

    @functools.cached_property
    def has_formulas(self) -> bool:
        """Whether the straight-line slots apply formulas (codegen/operator.formula). Their tapes are
        then built from ``formula_lines``; other programs' from ``lines``, whose CSE is cheap."""
        return any(is_formula(a) for _, e in self.formula_lines for a in e.atoms(AppliedUndef))

    @functools.cached_property
    def monomials(self) -> monomials.Monomials | None:
        """With one duration (uniform, or one per trajectory), the table as data: every slot one
        monomial of that dt (codegen/monomials.py; None with a duration per step, or where a slot
        is not one)."""
        if len(self.dt_syms) != 1:
            return None
        return monomials.of([expand_formulas(self.value(q)) for q in range(self.size)], self.dt_syms[0])

    @functools.cached_property
    def form(self) -> str:
        """The programs' form, 'monomials', 'tape' or 'code', as every target runs them
        (codegen/targets.py ``coefficient_form``)."""
        from .targets import coefficient_form  # (targets is import-light: it never imports this module)
        return coefficient_form(self)

    def _monomial(self, name: str) -> list[Statement] | None:
        """The program as a loop over the monomial table, where that is the form."""
        return [RunTape(self.monomials.program(name))] if self.form == "monomials" else None

    @property
    def taped(self) -> bool:
        """Whether the programs' straight-line parts are tapes (a duration per step, long)."""
        return self.form == "tape"

    @functools.cached_property
    def _graph(self) -> Any:
        """The value program's graph, which each tape extends (tape.graph)."""
        return tape.graph(self._straight_values(taped=True))

    def tape(self, name: str) -> tape.Tape:
        """The tape of program ``name``: "value" (the table's straight-line slots and their
        copies), "tangent" (those and their dt tangents), "reverse" (the dt gradient from theirs).
        All three come from the value program; the tape takes the derivatives (tape.build)."""
        if name not in self._tapes:
            if name not in ("value", "tangent", "reverse"):
                raise ValueError(f"tape {name!r} is invalid: allowed 'value', 'tangent', 'reverse'")
            self._tapes[name] = tape.build(name, self._graph, name, len(self.dt_syms))
        return self._tapes[name]

    def _inputs(self, tangent: bool = False) -> list[Statement]:
        lines = [_double(str(s), Cast("double", Read("DT", (i,)))) for i, s in enumerate(self.dt_syms)]
        if tangent:
            lines += [_double(f"d_{s}", Cast("double", Read("DDT", (i,)))) for i, s in enumerate(self.dt_syms)]
        return lines

    def _used_inputs(self, tangent: bool = False, program: Sequence[Line] | None = None) -> list[Statement]:
        """The reads of dt of the straight-line ``program`` (default: ``lines``; with runs, only
        the durations it uses)."""
        lines = self._inputs(tangent)
        if not self.runs:
            return lines
        used = {str(a) for _, e in (self.lines if program is None else program) for a in e.free_symbols}
        return [s for s in lines if s.target.name.removeprefix("d_") in used]

    def preamble(self, as_tapes: bool = False) -> list[Statement]:
        """Statements filling the coefficient table C(q) (type T); each value is stored as soon
        as it is computed, so no more than one CSE chunk is live at a time. ``as_tapes`` (CUDA's
        choice): the straight-line part and long rows as tapes (``taped_for``, ``row_tapes``)."""
        taped = self.taped_for(as_tapes)
        if (program := self._monomial("value")) is not None:
            return program
        straight = [RunTape(self.tape("value"))] if taped else self._straight_values(taped)
        loops: list[Statement] = []
        tapes = self.row_tapes("value") if as_tapes else {}
        for k, run in enumerate(self.runs):
            if k in tapes:  # a block's warps share the rows; the next row tape reuses their registers
                loops += [RunTape(tapes[k], (run.first, run.last, 1)), BARRIER]
                continue
            body = run.inputs()
            for s, e in run.lines:
                if s.name.startswith("kr"):
                    body.append(Store(Read("C", (run.slot(int(s.name[2:])),)), Cast("T", Paren(Sym(e)))))
                else:
                    body.append(_double(str(s), Sym(e)))
            loops.append(run.loop(body))
        return straight + loops + _after_barrier(self._copy_program(taped)[1])

    def _straight_values(self, taped: bool) -> list[Statement]:
        """The straight-line part of the table's program: its slots, and the copies of them and
        of constants that are not loops."""
        program = self.formula_lines if taped and self.has_formulas else self.lines
        lines = self._used_inputs(program=program)
        singles = dict(self._copy_program(taped)[0])  # (taken from below: the program's own copy)
        for s, e in program:
            if s.name.startswith("k"):
                q = int(s.name[1:])
                lines.append(Store(Read("C", (q,)), Cast("T", Paren(Sym(e)))))
                lines += singles.pop(q, [])  # next to the value: none held until later (CUDA registers)
            else:
                lines.append(_double(str(s), Sym(e)))
        return lines + [line for copies in singles.values() for line in copies]  # of constants

    def _copy_program(self, taped: bool) -> tuple[dict[Any, list[Statement]], list[Statement]]:
        """The blocks of copies: a loop per piece of MIN_ROWS or more whose sources advance by a
        constant stride (or repeat a constant), kept rolled; single stores for the rest, by source
        slot (straight-line slots, stored next to them) or None (constants). With tapes, every
        piece read from straight-line slots or constants is single stores (tape instructions). render.py keeps a long
        program's loops last. nvcc's front end is superlinear in a function's stores (thousands of
        single copies took it seconds) and in unrolled loops. Made once per form (the table, its
        graph and its tangent all read it) for the copies there are (blocks are only appended)."""
        key = (taped, len(self.copies))
        if key not in self._copy_programs:
            self._copy_programs[key] = self._make_copy_program(taped)
        return self._copy_programs[key]

    def _make_copy_program(self, taped: bool) -> tuple[dict[Any, list[Statement]], list[Statement]]:
        sources = [self.names.get(v, v) for v in self.copies]  # a slot, or a constant's value
        straight = set(self.straight)
        singles: dict[Any, list[Statement]] = defaultdict(list)  # by source slot (None: a constant)
        loops: list[Statement] = []
        # pieces: slots at a constant stride, or one constant repeated
        for run in runs(sources, key=lambda s: ("slot",) if isinstance(s, int) else ("constant", s),
                        fields=lambda s: (s,) if isinstance(s, int) else ()):
            i, j = run.start, run.stop
            first, head = len(self.names) + i, sources[i]
            from_straight = all(not isinstance(s, int) or s in straight for s in sources[i:j])
            if from_straight and (j - i < MIN_ROWS or taped):  # a tape's stores cost no compile time
                for m, s in enumerate(sources[i:j]):
                    singles[s if isinstance(s, int) else None].append(
                        Store(Read("C", (first + m,)), Read("C", (s,)) if isinstance(s, int) else Cast("T", Paren(Sym(s)))))
            else:
                value = (Read("C", (Strided(head, run.stride[0], first) if j > i + 1 else head,))
                         if isinstance(head, int) else Cast("T", Paren(Sym(head))))
                loops.append(For(first, first + j - i - 1, 1, (Store(Read("C", (Rel(0),)), value),), unroll=False))
        return singles, loops

    def tangent_preamble(self, as_tapes: bool = False) -> list[Statement]:
        """The table C(q) and the dt-tangents CD(q) = Σ_m ∂C(q)/∂dt_m · ddt_m (forward mode);
        ``as_tapes`` as in ``preamble``."""
        taped = self.taped_for(as_tapes)
        if (program := self._monomial("tangent")) is not None:
            return program
        singles, copy_loops = self._copy_program(taped)  # the blocks of copies and their tangents (span loops read them)
        if taped:
            lines: list[Statement] = [RunTape(self.tape("tangent"))]
        else:
            lines = self._used_inputs(tangent=True) + _tangent(self.lines)
            for table, source in (("C", "k"), ("CD", "d_k")):
                lines += [Store(Read(table, (q,)), Cast("T", Paren(Var(f"{source}{q}")))) for q in self.straight]
            lines += [c for copies in singles.values() for copy in copies for c in (copy, _tangent_copy(copy))]
        tapes = self.row_tapes("tangent") if as_tapes else {}
        for k, run in enumerate(self.runs):
            if k in tapes:
                lines += [RunTape(tapes[k], (run.first, run.last, 1)), BARRIER]
                continue
            body = run.inputs(tangent=True) + _tangent(run.lines)
            for table, source in (("C", "kr"), ("CD", "d_kr")):
                body += [Store(Read(table, (run.slot(i),)), Cast("T", Paren(Var(f"{source}{i}"))))
                         for i in range(run.width)]
            lines.append(run.loop(body))
        return lines + _after_barrier([c for copy in copy_loops for c in (copy, _tangent_copy(copy))])

    def reverse_program(self, as_tapes: bool = False) -> list[Statement]:
        """gdt from GC(q) = ∂L/∂c<q> by reverse accumulation over the program's lines: the
        straight-line part sets every GDT(i), each run's loop adds its rows' parts (``as_tapes``
        as in ``preamble``)."""
        taped = self.taped_for(as_tapes)
        if (program := self._monomial("reverse")) is not None:
            return program
        lines = [RunTape(self.tape("reverse"))] if taped else self._straight_reverse()
        tapes = self.row_tapes("reverse") if as_tapes else {}
        for k, run in enumerate(self.runs):
            if k in tapes:
                lines += [BARRIER, *run.tape_phases(tapes[k])]
                continue
            body = run.inputs() + [_double(str(s), Sym(e)) for s, e in run.lines]
            adjoint, contributions = _reverse(run.lines, {f"kr{i}": [Read("GC", (run.slot(i),))]
                                                          for i in range(run.width)})
            body += adjoint
            body += [Store(Read("GDT", (Rel(o),)), Add(tuple(contributions[str(s)])), "+=")
                     for o, s in run.window if contributions.get(str(s))]
            lines += [BARRIER, *run.phases(body)]
        return lines

    def taped_for(self, as_tapes: bool) -> bool:
        """Whether the straight-line parts run as tapes: where long (``taped``), and with
        ``as_tapes`` (CUDA's choice) wherever a dt per step has them: as code, the thread that runs
        them holds their values (a stencil's boundary weights: 255 registers, spills)."""
        return self.taped or (as_tapes and self.form == "code" and bool(self.straight))

    def row_tapes(self, program: str) -> dict[int, tape.Tape]:
        """The row tapes of ``program`` ("value", "tangent", "reverse") by run (its position in
        ``runs``): the runs of long rows (``ROW_TAPE_ABOVE_LINES``); the others run as code. None
        in the form "rows", whose table a CUDA per-element kernel's block computes (a few lines a row)."""
        if program not in self._row_tapes:
            long = [k for k, run in enumerate(self.runs) if len(run.lines) > ROW_TAPE_ABOVE_LINES and self.form != "rows"]
            self._row_tapes[program] = {k: self.runs[k].tape(program, f"{program}_rows{i}") for i, k in enumerate(long)}
        return self._row_tapes[program]

    def _straight_reverse(self) -> list[Statement]:
        """GDT(i) for every duration from the straight-line slots' gradients GC(q), and those of
        the copies of them (a copy's gradient is its source's; constants pass none on)."""
        program = self.lines
        lines = self._used_inputs() + [_double(str(s), Sym(e)) for s, e in program]
        copied: dict[int, list] = defaultdict(list)
        for q in range(len(self.names), self.size):
            copied[self.source(q)].append(Read("GC", (q,)))
        adjoint, contributions = _reverse(program, {f"k{q}": [Read("GC", (q,)), *copied[q]] for q in self.straight})
        lines += adjoint
        for i, sym in enumerate(self.dt_syms):
            lines.append(Store(Read("GDT", (i,)), Add(tuple(contributions.get(str(sym), [])))))
        return lines
