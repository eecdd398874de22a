"""Rolling an integration recurrence into a loop over the horizon.

An integrator's rows repeat: row h reads row h-1 (and the action h-1) with the same
coefficients (uniform dt) or with coefficients that advance through the table by a fixed
stride (per-step dt). Emitted straight-line, a column body grows with H, and so does the C
compiler's time on it (superlinearly for vector code). Here each row h becomes a *group* of
statements whose references are relative to h; a run of equal groups is emitted once, as a
loop, with the values that later rows read carried in variables from one iteration to the
next. The adjoint runs the same way backwards (a reverse scan). Groups that do not repeat
(the first rows, the last ones) stay straight-line, so the generated body's length no longer
depends on the horizon.

Statements are data until rendered: ``Def`` declares ``<prefix><k>_<h>`` (a value of row h),
``Call`` writes through a macro (``Y<k>(h, v)``, ``GU(j, v)``, ``GS<m>(v)``). Operands are
``("val", prefix, k, m)`` (that value m rows away), ``("u", rel)`` (``U(h+rel)``),
``("s", m)`` (start entry) and ``("g", k)`` (``G<k>(h)``).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Optional, Union

import sympy as sp

from .operator import Operator

MIN_ROLL = 4  # shorter runs of equal groups stay straight-line

Operand = tuple
Term = tuple[sp.Expr, Operand]


@dataclasses.dataclass(frozen=True)
class Def:
    """``const T <prefix><k>_<h> = Σ terms;`` a value of the group's row."""

    prefix: str
    k: int
    terms: tuple[Term, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """``<macro>(position, Σ terms);`` a store (output, action gradient, start gradient)."""

    macro: str
    rel: Optional[int]  # the row or action written, relative to the group's h; None: no position
    terms: tuple[Term, ...]


Statement = Union[Def, Call]


@dataclasses.dataclass
class Group:
    """The statements of one row h, with references relative to h."""

    h: int
    statements: list[Statement]


class NotRollable(Exception):
    """A rolled rendering would read a value no statement defines (the caller goes straight-line)."""


def forward_groups(op: Operator) -> list[Group]:
    """Forward: each row's value, then its store, grouped by row h in evaluation order."""
    groups: dict[int, Group] = {}
    for row in op.rows:
        terms = tuple((c, _relative(ref, row.h, "y")) for c, ref in row.terms)
        groups.setdefault(row.h, Group(row.h, [])).statements += [
            Def("y", row.k, terms), Call(f"Y{row.k}", 0, ((sp.Integer(1), ("val", "y", row.k, 0)),))]
    return list(groups.values())


def adjoint_groups(op: Operator) -> tuple[list[Group], list[Statement]]:
    """Adjoint (reverse accumulation): groups from the last row h down; within a group the
    rows' total adjoints yb<k> in reverse order, then the action gradients this group
    completes. The tail: actions no row reads, and the start-state gradients."""
    readers: dict[tuple, list[tuple[sp.Expr, int, int]]] = defaultdict(list)  # ref → (coef, k, h) of its readers
    for row in op.rows:
        for c, ref in row.terms:
            readers[ref].append((c, row.k, row.h))
    by_h: dict[int, list] = defaultdict(list)
    for row in op.rows:
        by_h[row.h].append(row)
    done_at: dict[int, list[int]] = defaultdict(list)  # row h → actions whose last reader is at h
    for j in range(op.n_actions):
        if readers[("u", j)]:
            done_at[min(h for _, _, h in readers[("u", j)])].append(j)
    groups = []
    for h in sorted(by_h, reverse=True):
        statements: list[Statement] = []
        for row in reversed(by_h[h]):
            terms = [(sp.Integer(1), ("g", row.k))]
            terms += [(c, ("val", "yb", k, hh - h)) for c, k, hh in readers[("y", row.k, h)]]
            statements.append(Def("yb", row.k, tuple(terms)))
        for j in done_at[h]:
            statements.append(Call("GU", j - h, tuple((c, ("val", "yb", k, hh - h)) for c, k, hh in readers[("u", j)])))
        groups.append(Group(h, statements))
    # the tail is rendered at h = 0, so its positions and references are absolute
    tail: list[Statement] = [Call("GU", j, ()) for j in range(op.n_actions) if not readers[("u", j)]]
    tail += [Call(f"GS{m}", None, tuple((c, ("val", "yb", k, hh)) for c, k, hh in readers[("s", m)])) for m in range(4)]
    return groups, tail


def _operand(operand: Operand, row: Callable[[int], str], value: Callable[[str, int, int], str]) -> str:
    """An operand as C: ``row(rel)`` writes a row or action position, ``value(prefix, k, m)`` a value."""
    kind = operand[0]
    if kind == "u":
        return f"U({row(operand[1])})"
    if kind == "s":
        return f"s{operand[1]}"
    if kind == "g":
        return f"G{operand[1]}({row(0)})"
    return value(*operand[1:])


def _carry(prefix: str, k: int, m: int, first: int) -> str:
    """The variable holding <prefix><k> of m rows back, in the loop that starts at row ``first``
    (a body can hold several loops, each with its own carries)."""
    return f"{prefix}{k}_p{m}_{first}"


def _offset(rel: int) -> str:
    """The loop variable plus a constant, as C: r, r + 2, r - 1."""
    return "r" if rel == 0 else f"r + {rel}" if rel > 0 else f"r - {-rel}"


def _relative(ref: tuple, h: int, prefix: str) -> Operand:
    if ref[0] == "u":
        return ("u", ref[1] - h)
    if ref[0] == "s":
        return ("s", ref[1])
    return ("val", prefix, ref[1], ref[2] - h)


class Renderer:
    """Statements → C lines, straight-line at a row h or rolled over a loop variable r.

    ``term(coef, operand)`` writes one signed product, ``table(index, operand)`` one with a
    table coefficient given by a C index expression, ``slot(coef)`` a coefficient's table slot
    (None for ±1), and ``sum_(parts)`` the sum of products.
    """

    def __init__(self, term: Callable[[sp.Expr, str], str], table: Callable[[str, str], str],
                 slot: Callable[[sp.Expr], Optional[int]], sum_: Callable[[list[str]], str]):
        self.term, self.table, self.slot, self.sum = term, table, slot, sum_

    # -- signatures: what must be equal for groups to share one loop body ------------------
    def shape(self, group: Group) -> tuple:
        return tuple(self._shape(s) for s in group.statements)

    def _shape(self, s: Statement) -> Statement:
        """The statement with its table coefficients blanked (their slots may advance along a run)."""
        return dataclasses.replace(s, terms=tuple((c if self.slot(c) is None else None, o) for c, o in s.terms))

    def slots(self, group: Group) -> tuple:
        return tuple(self.slot(c) for s in group.statements for c, _ in s.terms if self.slot(c) is not None)

    # -- rendering ---------------------------------------------------------------------------
    def straight(self, group: Group, defined: set[str]) -> list[str]:
        lines = []
        for s in group.statements:
            parts = [self.term(c, self._absolute(o, group.h, defined)) for c, o in s.terms]
            if isinstance(s, Def):
                name = f"{s.prefix}{s.k}_{group.h}"
                lines.append(f"const T {name} = {self.sum(parts)};")
                defined.add(name)
            else:
                lines.append(self._call(s.macro, None if s.rel is None else str(group.h + s.rel), parts))
        return lines

    def _call(self, macro: str, where: Optional[str], parts: list[str]) -> str:
        value = self.sum(parts)
        return f"{macro}({value});" if where is None else f"{macro}({where}, {value});"

    def _absolute(self, operand: Operand, h: int, defined: set[str]) -> str:
        def value(p: str, k: int, m: int) -> str:
            name = f"{p}{k}_{h + m}"
            if name not in defined:
                raise NotRollable(name)
            return name

        return _operand(operand, lambda rel: str(h + rel), value)

    def rolled(self, run: list[Group], step: int, defined: set[str]) -> list[str]:
        """One loop for a run of equal groups (rows run[0].h, run[0].h + step, ...)."""
        first, last = run[0].h, run[-1].h
        slots0, slots1 = self.slots(run[0]), self.slots(run[1])
        stride = next((b - a for a, b in zip(slots0, slots1)), 0) * step  # per unit of h
        carried: dict[tuple[str, int], int] = {}  # (prefix, k) → depth
        for s in run[0].statements:
            for _, o in s.terms:
                if o[0] == "val" and o[3] != 0:
                    carried[(o[1], o[2])] = max(carried.get((o[1], o[2]), 0), abs(o[3]))
        lines = []
        own = {(s.prefix, s.k) for s in run[0].statements if isinstance(s, Def)}
        if not set(carried) <= own:
            raise NotRollable("a carried value is not defined in every row")
        for (p, k), depth in carried.items():
            for m in range(1, depth + 1):
                source = f"{p}{k}_{first - step * m}"
                if source not in defined:
                    raise NotRollable(source)
                lines.append(f"T {_carry(p, k, m, first)} = {source};")  # not const: updated every iteration
        cond, advance = (f"r <= {last}", "++r") if step > 0 else (f"r >= {last}", "--r")
        lines.append(f"for (int64_t r = {first}; {cond}; {advance}) {{")
        slot_iter = iter(slots0)
        for s in run[0].statements:
            parts = []
            for c, o in s.terms:
                text = self._in_loop(o, step, first)
                if self.slot(c) is None:
                    parts.append(self.term(c, text))
                else:
                    slot = next(slot_iter)
                    index = str(slot) if stride == 0 else f"{slot} + {stride} * (r - {first})"
                    parts.append(self.table(index, text))
            if isinstance(s, Def):
                lines.append(f"    const T {s.prefix}{s.k}_c = {self.sum(parts)};")
            else:
                lines.append("    " + self._call(s.macro, None if s.rel is None else _offset(s.rel), parts))
        for (p, k), depth in carried.items():
            for m in range(depth, 1, -1):
                lines.append(f"    {_carry(p, k, m, first)} = {_carry(p, k, m - 1, first)};")
            lines.append(f"    {_carry(p, k, 1, first)} = {p}{k}_c;")
        lines.append("}")
        for (p, k), depth in carried.items():  # the last rows' values, by the names later rows read
            for m in range(1, depth + 1):
                name = f"{p}{k}_{last - step * (m - 1)}"
                lines.append(f"const T {name} = {_carry(p, k, m, first)};")
                defined.add(name)
        return lines

    @staticmethod
    def _in_loop(operand: Operand, step: int, first: int) -> str:
        def value(p: str, k: int, m: int) -> str:
            if m * step > 0:
                raise NotRollable(f"{p}{k} reads a later row")
            return f"{p}{k}_c" if m == 0 else _carry(p, k, abs(m), first)

        return _operand(operand, _offset, value)

    def render(self, groups: list[Group], tail: list[Statement] = ()) -> list[str]:
        """Runs of at least MIN_ROLL equal groups as loops, everything else straight-line; all
        straight-line if a loop would leave a later read undefined."""
        try:
            return self._render(groups, tail, roll=True)
        except NotRollable:
            return self._render(groups, tail, roll=False)

    def _render(self, groups: list[Group], tail: list[Statement], roll: bool) -> list[str]:
        defined: set[str] = set()
        lines: list[str] = []
        i = 0
        while i < len(groups):
            j = self._run_end(groups, i) if roll else i + 1
            if j - i >= MIN_ROLL:
                lines += self.rolled(groups[i:j], groups[i + 1].h - groups[i].h, defined)
            else:
                j = i + 1
                lines += self.straight(groups[i], defined)
            i = j
        return lines + self.straight(Group(0, list(tail)), defined)

    def _run_end(self, groups: list[Group], i: int) -> int:
        """End of the run of groups equal to groups[i] (consecutive rows, slots advancing evenly)."""
        shape = self.shape(groups[i])
        step, stride = None, None
        j = i + 1
        while j < len(groups) and self.shape(groups[j]) == shape:
            dh = groups[j].h - groups[j - 1].h
            steps = {b - a for a, b in zip(self.slots(groups[j - 1]), self.slots(groups[j]))}
            if abs(dh) != 1 or (step is not None and dh != step) or len(steps) > 1:
                break
            s = next(iter(steps), 0)
            if stride is not None and s != stride:
                break
            step, stride = dh, s
            j += 1
        return j
