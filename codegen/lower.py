"""Lowering: Operator → C statements for the four kernels (forward, adjoint, dt_vjp, dt_jvp).

The statement lists are target-neutral C: the C and CUDA templates wrap the same text
in their own loops. Body code uses these macros, defined by each template:
``U(j)`` action j, ``S<m>`` start entry m, ``Y<k>(h, value)`` output store, ``G<k>(h)``
incoming gradient (0 when absent), ``DU(j)``/``DS<m>`` input tangents, ``TY<k>(h, value)``
output tangent store, ``GU(j, value)``/``GS<m>(value)`` adjoint stores, ``ZERO``, ``ACC(m)``
the dt-gradient accumulator. ``to_lanes`` renames a column body for the C template's
all-dof vector form (every value one masked vector over the dof lanes). For integrators the
lane form gets the column with its repeating rows rolled into a loop (codegen/roll.py).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections import defaultdict

import sympy as sp
from sympy.printing.c import C99CodePrinter

from . import roll
from .operator import Operator, Ref

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
class Loop:
    """Rows [start, stop) that share one translation-invariant statement: emitted as a loop.

    For the C 'bhd' layout the loop runs over the flattened (row, dof) index, which is
    contiguous, so it vectorises at full width. ``guard`` names a pointer that must be
    non-null for the loop to run (absent gradients skip their loop).
    """

    start: int
    stop: int
    lines: list[str]
    guard: str = ""
    row_dependent: bool = False  # coefficients change with the row (per-step dt): loop over r

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.stop)


@dataclasses.dataclass
class KernelCode:
    """Preamble (double-precision coefficient math, once per call), interior loops, per-column body."""

    preamble: list[str]
    body: list[str]
    loops: list[Loop] = dataclasses.field(default_factory=list)


def table_term(index: str, operand: str) -> str:
    """'+C(index)*operand': coefficients are read from the table, not held one local each
    (which makes compile time superlinear in the horizon)."""
    return f"+C({index})*{operand}"


class _Coefficients:
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

    def term(self, coef: sp.Expr, operand: str) -> str:
        """A signed product 'coef*operand' (units inlined, other coefficients from the table)."""
        if coef == ONE:
            return f"+{operand}"
        if coef == MINUS_ONE:
            return f"-{operand}"
        return table_term(str(self.index(coef)), operand)

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

    def _inputs(self, tangent: bool = False) -> list[str]:
        lines = [f"const double {s} = (double)DT({i});" for i, s in enumerate(self.dt_syms)]
        if tangent:
            lines += [f"const double d_{s} = (double)DDT({i});" for i, s in enumerate(self.dt_syms)]
        return lines

    def _casts(self, table: str, source: str) -> list[str]:
        return [f"{table}({q}) = (T)({source}{q});" for q in range(len(self.names))]

    def preamble(self) -> list[str]:
        """Statements filling the coefficient table C(q) (type T); each value is stored as soon
        as it is computed, so no more than one CSE chunk is live at a time."""
        lines = self._inputs()
        for s, e in self.lines:
            if s.name.startswith("k"):
                lines.append(f"C({s.name[1:]}) = (T)({c_expr(e)});")
            else:
                lines.append(f"const double {s} = {c_expr(e)};")
        return lines

    def tangent_preamble(self) -> list[str]:
        """The table C(q) and the dt-tangents CD(q) = Σ_m ∂C(q)/∂dt_m · ddt_m (forward mode)."""
        lines = self._inputs(tangent=True)
        for s, e in self.lines:
            lines.append(f"const double {s} = {c_expr(e)};")
            parts = [f"({c_expr(sp.diff(e, a))})*d_{a}" for a in sorted(e.free_symbols, key=str)]
            lines.append(f"const double d_{s} = {' + '.join(parts) if parts else '0.0'};")
        return lines + self._casts("C", "k") + self._casts("CD", "d_k")

    def reverse_program(self) -> list[str]:
        """gdt from GC(q) = ∂L/∂c<q> by reverse accumulation over the program's lines."""
        program = self.lines
        lines = self._inputs() + [f"const double {s} = {c_expr(e)};" for s, e in program]
        contributions: dict[str, list[str]] = defaultdict(list)
        for q in range(len(self.names)):
            contributions[f"k{q}"].append(f"GC({q})")
        for s, e in reversed(program):
            parts = contributions.pop(str(s), [])
            if not parts:
                continue
            lines.append(f"const double b_{s} = {' + '.join(parts)};")
            for a in e.free_symbols:
                contributions[str(a)].append(f"({c_expr(sp.diff(e, a))})*b_{s}")
        for i, sym in enumerate(self.dt_syms):
            parts = contributions.get(str(sym), [])
            lines.append(f"GDT({i}) = {' + '.join(parts) if parts else '0.0'};")
        return lines


_LANE_NAMES = re.compile(r"\b(const T|U|S[0-3]|Y\d+|G\d+|GU|GS[0-3]|ZERO)\b")


def to_lanes(lines: list[str]) -> list[str]:
    """A forward or adjoint column body with every value a vector over all dof lanes: the same
    statements, over the C template's lane macros (VU, VS0, VY0, ..., type VT)."""
    return [_LANE_NAMES.sub(lambda m: "const VT" if m.group(1) == "const T" else "V" + m.group(1),
                            "VT " + line[2:] if line.startswith("T ") else line)  # a loop's carried value
            for line in lines]


def _sum(parts: list[str]) -> str:
    if not parts:
        return "ZERO"
    text = "".join(parts)
    return text[1:] if text.startswith("+") else text


def _var(ref: Ref, prefix: str = "") -> str:
    """SSA name of a ref's value (forward: u3, s1, y2_5; with prefix 't' its tangent)."""
    if ref[0] == "u":  # read at the point of use: keeps register pressure flat in long bodies
        return f"{'DU' if prefix else 'U'}({ref[1]})"
    if ref[0] == "s":
        return f"{prefix}s{ref[1]}"
    return f"{prefix}y{ref[1]}_{ref[2]}"


def _loads(tangent: bool = False) -> list[str]:
    lines = [f"const T s{m} = S{m};" for m in range(4)]
    if tangent:
        lines += [f"const T ts{m} = DS{m};" for m in range(4)]
    return lines


def _forward_lines(op: Operator, coefs: _Coefficients) -> list[str]:
    """One SSA assignment per row, in evaluation order (stores are added by the caller)."""
    return [f"const T y{row.k}_{row.h} = {_sum([coefs.term(c, _var(r)) for c, r in row.terms])};" for row in op.rows]


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


MIN_LOOP = 3  # shorter runs of identical rows stay straight-line

# A row's terms as loop material: a shape (offsets and unit coefficients, same along a run)
# and the coefficient-table slot of every other coefficient (advancing by one stride per row).
Shape = tuple
Slots = tuple


def _runs(rows: dict[int, tuple[Shape, Slots] | None]) -> list[tuple[int, int, Shape, Slots, int]]:
    """Maximal runs [start, stop) of consecutive indices with one shape whose slots advance by a
    constant stride (0 for uniform dt, where rows share coefficients)."""
    runs = []
    index = sorted(rows)
    i = 0
    while i < len(index):
        if rows[index[i]] is None:
            i += 1
            continue
        shape, slots0 = rows[index[i]]
        stride, j = None, i
        while j + 1 < len(index) and index[j + 1] == index[j] + 1 and rows[index[j + 1]] is not None:
            nxt_shape, nxt_slots = rows[index[j + 1]]
            if nxt_shape != shape:
                break
            steps = {b - a for a, b in zip(rows[index[j]][1], nxt_slots) if a is not None}
            if len(steps) > 1 or (stride is not None and steps and steps != {stride}):
                break
            stride = next(iter(steps), 0) if stride is None else stride
            j += 1
        if j - i + 1 >= MIN_LOOP:
            runs.append((index[i], index[j] + 1, shape, slots0, stride or 0))
        i = j + 1
    return runs


def _is_stencil(op: Operator) -> bool:
    """No row reads another row: every output is a direct combination of the inputs."""
    return all(ref[0] != "y" for row in op.rows for _, ref in row.terms)


def _coefficient(coefs: _Coefficients, coef: sp.Expr) -> tuple[sp.Expr | None, int | None]:
    """(unit, None) for ±1, (None, slot) for table coefficients: a loop's shape keeps the units,
    its slots advance along the run."""
    return (coef, None) if coef in (ONE, MINUS_ONE) else (None, coefs.index(coef))


def _loop_term(coefs: _Coefficients, unit: sp.Expr | None, slot: int | None, stride: int, start: int,
               operand: str) -> str:
    if unit is not None:
        return coefs.term(unit, operand)
    return table_term(str(slot) if stride == 0 else f"{slot} + {stride} * (r - {start})", operand)


def _forward_loops(op: Operator, coefs: _Coefficients) -> tuple[list[Loop], set[tuple[int, int]]]:
    """Interior rows whose terms are the same up to a shift in the action index."""
    loops, covered = [], set()
    if not _is_stencil(op):
        return loops, covered
    for k in range(op.n_outputs):
        rows = {}
        for row in op.rows:
            if row.k == k and row.h > 0:
                if not row.terms or any(ref[0] != "u" for _, ref in row.terms):
                    rows[row.h] = None
                    continue
                parts = [(ref[1] - row.h, *_coefficient(coefs, c)) for c, ref in row.terms]
                rows[row.h] = (tuple((rel, lit) for rel, lit, _ in parts), tuple(slot for _, _, slot in parts))
        for start, stop, shape, slots, stride in _runs(rows):
            value = _sum([_loop_term(coefs, lit, slot, stride, start, f"SU({rel})") for (rel, lit), slot in zip(shape, slots)])
            loops.append(Loop(start, stop, [f"SY{k} = {value};"], row_dependent=stride != 0))
            covered.update((k, h) for h in range(start, stop))
    return loops, covered


def _adjoint_loops(op: Operator, coefs: _Coefficients) -> tuple[list[Loop], set[int]]:
    """Interior actions whose gradient gathers the same shifted output gradients."""
    loops: list[Loop] = []
    covered: set[int] = set()
    if not _is_stencil(op):
        return loops, covered
    gathers: dict[int, list[tuple]] = defaultdict(list)
    for row in op.rows:
        for c, ref in row.terms:
            if ref[0] == "u":
                gathers[ref[1]].append((row.k, row.h - ref[1], *_coefficient(coefs, c)))
    rows = {}
    for j in range(op.n_actions):
        parts = sorted(gathers[j], key=lambda t: (t[0], t[1]))
        rows[j] = (tuple((k, rel, lit) for k, rel, lit, _ in parts), tuple(slot for *_, slot in parts)) if parts else None
    for start, stop, shape, slots, stride in _runs(rows):
        dependent = stride != 0
        loops.append(Loop(start, stop, ["SGU = (T)0;"], row_dependent=dependent))
        for k in sorted({kk for kk, _, _ in shape}):
            value = _sum([_loop_term(coefs, lit, slot, stride, start, f"SG{k}({rel})")
                          for (kk, rel, lit), slot in zip(shape, slots) if kk == k])
            loops.append(Loop(start, stop, [f"SGU += {value};"], guard=f"g{k}", row_dependent=dependent))
        covered.update(range(start, stop))
    return loops, covered


TABLE_CALL = ["COEFFICIENTS(dt_in, coef);"]  # the shared table function (templates define it)


def _renderer(coefs: _Coefficients) -> roll.Renderer:
    return roll.Renderer(coefs.term, table_term, lambda c: None if c in (ONE, MINUS_ONE) else coefs.index(c), _sum)


def _forward(op: Operator, coefs: _Coefficients) -> KernelCode:
    loops, covered = _forward_loops(op, coefs)
    body = _loads()
    for line, row in zip(_forward_lines(op, coefs), op.rows):
        if (row.k, row.h) not in covered:
            body += [line, f"Y{row.k}({row.h}, y{row.k}_{row.h});"]
    return KernelCode(TABLE_CALL, body, loops)


def _adjoint(op: Operator, coefs: _Coefficients) -> KernelCode:
    loops, covered = _adjoint_loops(op, coefs)
    lines, contributions = _adjoint_lines(op, coefs)
    lines += [f"GU({j}, {_sum(contributions.get(('u', j), []))});" for j in range(op.n_actions) if j not in covered]
    lines += [f"GS{m}({_sum(contributions.get(('s', m), []))});" for m in range(4)]
    return KernelCode(TABLE_CALL, lines, loops)


def _dt_vjp(op: Operator, coefs: _Coefficients) -> KernelCode:
    """GC(q) += Σ yb_row · value over the uses of each dt-dependent coefficient (summed over
    columns); dt_vjp_finish then maps GC to the dt gradient through the coefficient program."""
    body = _loads() + _forward_lines(op, coefs)
    adjoint, _ = _adjoint_lines(op, coefs)
    body += adjoint
    uses: dict[int, list[str]] = defaultdict(list)
    for row in op.rows:
        for c, ref in row.terms:
            if coefs.varies(c):
                uses[coefs.index(c)].append(f"yb{row.k}_{row.h}*{_var(ref)}")
    body += [f"ACC({q}) += (double)({' + '.join(parts)});" for q, parts in uses.items()]
    return KernelCode(TABLE_CALL, body)


def _dt_jvp(op: Operator, coefs: _Coefficients) -> KernelCode:
    """Tangent: ty = Σ (ċ · value + c · tangent), ċ = Σ_m ∂c/∂dt_m · ddt_m."""
    body = _loads(tangent=True) + _forward_lines(op, coefs)
    for row in op.rows:
        parts = []
        for c, ref in row.terms:
            if coefs.varies(c):
                parts.append(f"+CD({coefs.index(c)})*{_var(ref)}")
            parts.append(coefs.term(c, _var(ref, "t")))
        body.append(f"const T ty{row.k}_{row.h} = {_sum(parts)};")
        body.append(f"TY{row.k}({row.h}, ty{row.k}_{row.h});")
    return KernelCode(coefs.tangent_preamble(), body)


class LoweredOperator:
    """The statements of an operator's kernels, each lowered on first use."""

    def __init__(self, op: Operator):
        self.op = op
        self.coefs = _Coefficients(op)
        self.n_dt = len(op.dt_symbols)
        self.n_coefficients = max(1, len(self.coefs.names))

    @functools.cached_property
    def table(self) -> list[str]:
        """Statements of the shared function that fills the coefficient table from dt."""
        return self.coefs.preamble()

    @functools.cached_property
    def forward(self) -> KernelCode:
        return _forward(self.op, self.coefs)

    @functools.cached_property
    def adjoint(self) -> KernelCode:
        return _adjoint(self.op, self.coefs)

    # The forward and adjoint columns of an integrator with the recurrence's repeating rows as one
    # loop (None for stencils), for the C lane form at long horizons: their length does not grow
    # with H. The per-dof form keeps the straight-line body, which GCC vectorises across the
    # dof; with an inner loop over rows it no longer does.
    @functools.cached_property
    def forward_rolled(self) -> list[str] | None:
        return None if _is_stencil(self.op) else _loads() + _renderer(self.coefs).render(roll.forward_groups(self.op))

    @functools.cached_property
    def adjoint_rolled(self) -> list[str] | None:
        return None if _is_stencil(self.op) else _renderer(self.coefs).render(*roll.adjoint_groups(self.op))

    @functools.cached_property
    def dt_vjp(self) -> KernelCode:
        return _dt_vjp(self.op, self.coefs)

    @functools.cached_property
    def dt_vjp_finish(self) -> KernelCode:
        return KernelCode([], self.coefs.reverse_program())

    @functools.cached_property
    def dt_jvp(self) -> KernelCode:
        return _dt_jvp(self.op, self.coefs)


def lower(op: Operator) -> LoweredOperator:
    """Lower an operator; each kernel's statements are produced when first asked for."""
    return LoweredOperator(op)
