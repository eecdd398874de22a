"""Cost terms lowered into the step (a spec's ``costs``): the forward that also sums each term
over rows and dof, and the backward that takes the cost's gradient to the inputs.

A term (kind, state) adds, at every row h of the state's output y and every dof, its kind's
pointwise expression (codegen/costs.py) with the weight ``weight_d · row_weight_h``. Per column
the forward accumulates each term in double precision (C float32 kernels: a nonnegative term's
rows in runs of ``FLOAT_RUN_ROWS`` in float first, ``run_rows``) and hands the column's sum to
``CPART(t, value)``; the template adds the columns of a trajectory in dof order (deterministic
sums). The backward recomputes the rows (it reads the inputs), then runs the operator's reverse
accumulation with each row's gradient ``G<k>(h)`` (where the output is written) plus
``Σ_t GCOST(t) · ∂cost_t/∂y``; the target of a squared position term gets ``∂cost/∂target``.
A recurrence's CUDA adjoint recomputes its rows in segments from checkpoints kept in a local array:
few values live at once, within a GPU thread's registers, at any horizon. Where its steps repeat,
its CUDA forward and adjoint are loops over them (``forward_rolled``, as a stencil's; ``rolled_adjoint``,
a reverse scan over segments), so their source and nvcc's time on it do not grow with the horizon; else
straight-line (``_recurrence``).
Only the states the spec writes are stored or read as gradients. A kind that is its weight
times the rest (``CostKind.weighted``) takes its per-dof weight once per column in both
directions (``total``, ``scales``), not on every row. A kind with a narrow form
(``CostKind.narrow``) has a second forward and adjoint in C, which a call runs where every dof's
parameters allow it (``narrow_check``); so has a table with row weights, for calls whose row weights
are all 1 (``unit_rows_check``: the runtime passes ones where none are given), without their
multiplies. C's variants are ``forms``.

C's columns take a row's terms whose coefficients are equal or opposite as one product
(``pairs``, ``paired_rows``): a central stencil's ``c·u[j+1] − c·u[j−1]`` is ``c·(u[j+1] − u[j−1])``,
one multiply where there were two, and rows of the same step that read the same difference (a
velocity's and a jerk's) compute it once (the compiler's CSE of the same text). The adjoint takes
such a group's gradient once per step, its rows' products summed (``Σ c·g``), then adds it to each
input of the group with its sign: the reverse of the same program.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections import defaultdict
from typing import Callable, Collection, Iterable

import sympy as sp

from . import costs as kinds
from .arguments import ArgumentTable
from .coefficients import Coefficients
from . import roll
from .operator import Operator, Ref, Row, action, is_action, is_row
from .references import References
from .spec import COST_KINDS
from .renaming import RowExpressions
from .statements import (Bind, Call, Cast, Def, For, Index, Mul, Paren, Read, Rel, RunEnd, Shift, Statement, Store, Sum,
                         Sym, Term, Val, Var, Volatile, bind, transform, walk)

STATES = ("position", "velocity", "acceleration", "jerk", "snap")
TARGET_REF = ("squared_position_target", 0)
#: a row's weight among the symbols a slope is built from (``CostTerms.slope``; in no kind's expression)
ROW_WEIGHT = sp.Symbol("row_weight")


@dataclasses.dataclass(frozen=True)
class Form:
    """What a C variant of a fused forward or adjoint may assume of a call's parameters: every dof
    allows the kinds' narrow forms (``narrow_check``), every row weight is 1 (``unit_rows_check``)."""

    narrow: bool = False
    unit_rows: bool = False

    @property
    def suffix(self) -> str:
        """The variant's batch function is ``<kernel><suffix>_batch``."""
        return "".join(f"_{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name))


def forms(table: ArgumentTable) -> list[Form]:
    """C's variants besides the general form, the most specific first (the entry point runs the first
    whose assumptions hold): each assumption the table's terms can use, and their combinations."""
    narrow = (True, False) if narrow_check(table)[1] else (False,)
    unit = (True, False) if unit_rows_check(table) else (False,)
    return [Form(n, w) for n in narrow for w in unit if n or w]


class CostTerms:
    """A table's cost terms with the symbols their expressions are printed with per column
    (``narrow``: each kind in its narrow form where it has one, codegen/costs.py ``CostKind.narrow``;
    ``unit_rows``: every row weight 1, left out)."""

    def __init__(self, table: ArgumentTable, narrow: bool = False, unit_rows: bool = False):
        self.table = table
        self.narrow = narrow
        self.unit_rows = unit_rows
        self.terms = [(t, kind, STATES.index(state)) for t, (kind, state) in enumerate(table.costs)]
        self.written = set(table.written)
        #: each term's expressions at its rows, built once and renamed for the others (codegen/renaming.py)
        self.rows = RowExpressions()

    def on(self, k: int) -> list[tuple[int, str]]:
        """The terms (t, kind) on output k."""
        return [(t, kind) for t, kind, kk in self.terms if kk == k]

    def loads(self) -> list[Statement]:
        """Each term's limits and margin at this column's dof, where its kind reads them (spec.COST_KINDS;
        its weight is a column input)."""
        lines: list[Statement] = []
        for t, kind, _ in self.terms:
            if "limit" in COST_KINDS[kind]:
                lines += [Def(Var(f"clo{t}"), Read(f"CLIM{t}", (0,))), Def(Var(f"chi{t}"), Read(f"CLIM{t}", (1,)))]
            if "margin" in COST_KINDS[kind]:
                lines.append(Def(Var(f"cmar{t}"), Read(f"CMAR{t}")))
        return lines

    def kind(self, kind: str) -> kinds.CostKind:
        """The form of a kind these terms print."""
        general = kinds.KINDS[kind]
        return general.narrow[1] if self.narrow and general.narrow else general

    def conditions(self) -> list[Sym]:
        """What the narrow forms need, at one dof."""
        return [Sym(kinds.KINDS[kind].narrow[0].xreplace(self._subs(t, kind, k, 0)))
                for t, kind, k in self.terms if kinds.KINDS[kind].narrow]

    def _subs(self, t: int, kind: str, k: int, h: int, per_dof: bool = True, prefix: str = "y") -> dict:
        """``per_dof``: the weight with its per-dof factor (else the row weight alone: ``value``);
        ``prefix``: the row value's (a recomputed row's: ``yr``)."""
        return self._symbols(t, kind, k, sp.Symbol(f"{prefix}{k}_{h}"), self.row_weight(t, h), per_dof)

    def _symbols(self, t: int, kind: str, k: int, y: sp.Symbol, row_weight: sp.Expr, per_dof: bool = True) -> dict:
        """The kind's symbols → term t's, with the row's value ``y`` and its row weight ``row_weight``."""
        target = sp.Symbol("ctgt") if (kind, STATES[k]) == ("squared", "position") and self.has_target else 0
        weight = sp.Symbol(f"cw{t}") if per_dof else 1
        return {kinds.Y: y, kinds.W: weight * row_weight,
                kinds.LOWER: sp.Symbol(f"clo{t}"), kinds.UPPER: sp.Symbol(f"chi{t}"),
                kinds.MARGIN: sp.Symbol(f"cmar{t}"), kinds.TARGET: target}

    def _at(self, t: int, k: int, at: Index, prefix: str) -> tuple[sp.Symbol, sp.Expr, dict]:
        """The placeholders of a row's value and row weight (``AT_Y``, ``AT_ROW_WEIGHT``; the weight 1
        with ``unit_rows``) and what they are bound to at row ``at`` (``Rel``: row-relative)."""
        if self.unit_rows:
            return AT_Y, sp.Integer(1), {AT_Y: Val(prefix, k, at)}
        return AT_Y, AT_ROW_WEIGHT, {AT_Y: Val(prefix, k, at), AT_ROW_WEIGHT: Read(f"CRW{t}", (at,))}

    def value_at(self, t: int, kind: str, k: int, at: Index, prefix: str = "y") -> Bind:
        """``value``, with the row's value and row weight as bound placeholders (codegen/statements.py
        ``Bind``): with ``at`` a ``Rel``, the same node at every row (roll.py's groups)."""
        kind_ = self.kind(kind)
        y, rw, names = self._at(t, k, at, prefix)
        return bind(_bound_value(kind_, tuple(self._symbols(t, kind, k, y, rw, not kind_.weighted).items())), names)

    def slope_at(self, t: int, kind: str, k: int, at: Index, wrt: sp.Symbol = kinds.Y, prefix: str = "y") -> Bind:
        """``slope``, with the row's value and row weight as bound placeholders (as ``value_at``)."""
        kind_ = self.kind(kind)
        y, rw, names = self._at(t, k, at, prefix)
        subs = tuple(self._symbols(t, kind, k, y, rw).items())
        return bind(_bound_slope(kind_, wrt, t, subs, rw), names)

    def row_weight(self, t: int, h: int) -> sp.Expr:
        """Term t's weight at row h: 1 where every row weight is (a product with 1 is exact: left out)."""
        return sp.Integer(1) if self.unit_rows else sp.Symbol(f"CRW{t}({h})")

    @property
    def has_target(self) -> bool:
        return any(a.name == TARGET_REF[0] for a in self.table.columns)

    def value(self, t: int, kind: str, k: int, h: int) -> Sym:
        """The term at row h; without its per-dof weight where the kind is w·f (``total`` applies it)."""
        kind_ = self.kind(kind)
        return self.rows(("value", t, kind_), self._subs(t, kind, k, h, per_dof=not kind_.weighted),
                         kind_.expression.xreplace)

    def total(self, t: int, kind: str) -> Statement:
        """A column's sum of term t: its rows' sum, times the per-dof weight where ``value`` left it out
        (once per column instead of once per row)."""
        acc = Var(f"cacc{t}")
        return Call("CPART", (t,), Mul(acc, Cast("double", Var(f"cw{t}"))) if self.kind(kind).weighted else acc)

    def slope(self, t: int, kind: str, k: int, h: int, wrt: sp.Symbol = kinds.Y, prefix: str = "y") -> Sym:
        """GCOST(t) · ∂(term at row h)/∂wrt; for a weighted kind, row weight × ``scales``' cgw<t> × the
        rest (no product of per-column factors repeated on every row). ``prefix``: as ``_subs``."""
        kind_ = self.kind(kind)
        subs = {**self._subs(t, kind, k, h, prefix=prefix), ROW_WEIGHT: self.row_weight(t, h)}
        if not kind_.weighted:
            return self.rows(("slope", t, kind_, wrt), subs,
                             lambda s: sp.Symbol(f"GCOST({t})") * _derivative(kind_, wrt).xreplace(s))
        return self.rows(("slope", t, kind_, wrt), subs,
                         lambda s: s[ROW_WEIGHT] * sp.Symbol(f"cgw{t}") * _rest(kind_, wrt).xreplace(s))

    def scales(self) -> list[Statement]:
        """The adjoint's per-column factor of each weighted term: GCOST(t) × its derivative's number ×
        the per-dof weight."""
        return [Def(Var(f"cgw{t}"), Sym(self.kind(kind).slope_factor * sp.Symbol(f"GCOST({t})") * sp.Symbol(f"cw{t}")))
                for t, kind, _ in self.terms if self.kind(kind).weighted]


#: the placeholders of a row's value and row weight in ``CostTerms.value_at`` and ``slope_at``
AT_Y, AT_ROW_WEIGHT = sp.Symbol("ts_y"), sp.Symbol("ts_rw")


@functools.lru_cache(maxsize=None)
def _bound_value(kind: kinds.CostKind, subs: tuple) -> sp.Expr:
    """A kind's expression under ``subs`` (built once per term and form)."""
    return kind.expression.xreplace(dict(subs))


@functools.lru_cache(maxsize=None)
def _bound_slope(kind: kinds.CostKind, wrt: sp.Symbol, t: int, subs: tuple, row_weight: sp.Expr) -> sp.Expr:
    """``CostTerms.slope``'s expression under ``subs``: GCOST(t) × the derivative, or for a weighted
    kind row weight × cgw<t> × the rest."""
    if not kind.weighted:
        return sp.Symbol(f"GCOST({t})") * _derivative(kind, wrt).xreplace(dict(subs))
    return row_weight * sp.Symbol(f"cgw{t}") * _rest(kind, wrt).xreplace(dict(subs))


@functools.lru_cache(maxsize=None)
def _derivative(kind: kinds.CostKind, wrt: sp.Symbol) -> sp.Expr:
    """d expression / d wrt (y: the kind's own ``derivative``)."""
    return kind.derivative if wrt is kinds.Y else sp.diff(kind.expression, wrt)


@functools.lru_cache(maxsize=None)
def _rest(kind: kinds.CostKind, wrt: sp.Symbol) -> sp.Expr:
    """A weighted kind's derivative without its weight and number (``CostKind.slope_factor``)."""
    rest = _derivative(kind, wrt) / (kinds.W * kind.slope_factor)
    rest = sp.simplify(rest) if rest.has(kinds.W) else rest
    assert not rest.has(kinds.W), f"{kind.name}: a weighted kind's derivative is w times a function of the rest"
    return rest


#: a row's terms as groups (``pairs``): a coefficient and the references it multiplies, each with
#: whether it is subtracted (the first never is)
Group = tuple[sp.Expr, tuple[tuple[Ref, bool], ...]]


def pairs(row: Row) -> list[Group]:
    """Row's terms grouped by the coefficient's magnitude, in the order of each group's first term: a
    group's references in reference order, its coefficient the first one's, the others added or
    subtracted (``c·(a − b)`` for ``c·a − c·b``). Where two rows read the same references with
    coefficients of the same magnitudes, their groups are the same text (one subtraction, shared)."""
    groups: list[tuple[sp.Expr, list[tuple[sp.Expr, Ref]]]] = []
    for c, ref in row.terms:
        same = next((g for g in groups if c == g[0] or c == -g[0]), None)
        if same is None:
            groups.append((c, [(c, ref)]))
        else:
            same[1].append((c, ref))
    out: list[Group] = []
    for _, terms in groups:
        terms = sorted(terms, key=lambda t: t[1])
        first = terms[0][0]
        out.append((first, tuple((ref, c != first) for c, ref in terms)))
    return out


def _group_operand(refs: References, group: tuple[tuple[Ref, bool], ...]):
    """A group's references as one operand: the reference, or ``(a − b + ...)``."""
    if len(group) == 1:
        return refs.value(group[0][0])
    return Paren(Sum(tuple(Term(None, refs.value(ref), negative=neg) for ref, neg in group)))


def paired_rows(op: Operator, coefs: Coefficients, refs: References) -> list[Statement]:
    """The rows as definitions (lower.py's ``_forward_lines``), each group of ``pairs`` one product."""
    return [Def(Val("y", row.k, row.h), Sum(tuple(coefs.term(c, _group_operand(refs, group)) for c, group in pairs(row))))
            for row in op.rows]


def _sym_reads(body: list[Statement]) -> set:
    """The values and variables the terms' expressions read (printed names in SymPy symbols), for
    the dead-code pass, which sees statement nodes only."""
    from .statements import walk

    names = {str(x) for n in walk(tuple(body)) if isinstance(n, Sym) for x in n.expr.free_symbols}
    out: set = set()
    for name in names:
        m = re.fullmatch(r"(yr?)(\d+)_(\d+)", name)
        out.add(Val(m.group(1), int(m.group(2)), int(m.group(3))) if m else Var(name))
    return out


def _last_rows(op: Operator, acc: dict, targets: list[bool]) -> dict:
    """The index of the last row that adds to each accumulated input (``targets``: the rows that add
    to the target's); inputs no row adds to are absent."""
    last = {}
    for i, row in enumerate(op.rows):
        last.update({ref: i for _, ref in row.terms if ref in acc})
        if targets[i] and TARGET_REF in acc:
            last[TARGET_REF] = i
    return last


#: C's fused stencil columns: the steps a row's definition is printed ahead of its uses
#: (``defined_ahead``), per kernel, as measured on the bench's spec (BENCHMARKS.md, issue 39, "rows
#: defined ahead"); a recurrence's rows keep their order
C_AHEAD = {"forward": 2, "adjoint": 1}


def defined_ahead(op: Operator, steps: int) -> list[tuple[int, int]]:
    """For each row, the rows whose definitions are printed just before its other statements, as
    ``(first, end)``: its own and, with ``steps`` > 0, every later row up to ``steps`` steps (h) ahead
    not printed yet. The definitions stay in row order (a row may read earlier ones); what moves is
    what uses a row (its store, cost terms, gradient), printed after the definitions of the next
    ``steps`` steps. The compiler keeps a straight-line column in about the printed order, so a row's
    chain (stencil, then its terms' dead zones and squares) then starts while earlier rows' terms
    are still in flight: C's fused columns ran faster by this (BENCHMARKS.md, issue 39, "rows defined
    ahead"). ``steps`` = 0: each row's definition just before its uses, as before."""
    spans, end = [], 0
    for i, row in enumerate(op.rows):
        first = end
        while end < len(op.rows) and (end <= i or steps > 0 and op.rows[end].h <= row.h + steps):
            end += 1
        spans.append((first, end))
    return spans


#: float32 kernels (itemsize 4): a nonnegative term adds runs of this many rows in float before each
#: run's sum goes into its double accumulator (``forward``'s ``run``). A run's rounding, at most
#: 15·2⁻²⁴ ≈ 8.9e-7 relative (first order), stays within torch.testing's float32 rtol (1.3e-6); runs
#: of 32 (H=32: the whole column) would not
FLOAT_RUN_ROWS = 16


def run_rows(itemsize: int) -> int:
    """The rows of a cost term's run for a kernel type of this many bytes: one in double (its sums are
    in double already), ``FLOAT_RUN_ROWS`` in float, where the conversion and the double add per row
    were most of a term's arithmetic."""
    return FLOAT_RUN_ROWS if itemsize < 8 else 1


def _term_rows(terms: CostTerms, op: Operator, run: int) -> Callable:
    """``add(t, kind, row value)`` → the statements that add one row of term t to its sums: straight into
    its double accumulator ``cacc<t>``, or, where the kind is nonnegative and ``run`` > 1, into a
    partial sum ``crun<t>`` in the kernel's type, added to ``cacc<t>`` once per run of ``run`` rows
    (and at the term's last row). The rows of a run are added left to right: the same bits on every
    call and thread count. Terms ≥ 0 do not cancel, so a run's sum is within (run − 1)·ε of
    its exact value (ε = 2⁻²⁴ in float32), before it is converted. A term's first run is assigned
    to ``cacc<t>``, not added to its zero: the same value (0 + x is x but for x = −0, which a sum of
    terms ≥ 0 is only where a weight is −0, and the trajectory's sum over dof, from +0, then gives
    +0 either way), one double add fewer per term."""
    n = {t: sum(row.k == k for row in op.rows) for t, _, k in terms.terms}
    seen: dict[int, int] = defaultdict(int)

    def add(t: int, kind: str, value: Sym) -> list[Statement]:
        i = seen[t]
        seen[t] += 1
        length = run if terms.kind(kind).nonnegative else 1
        first, last = i % length == 0, i % length == length - 1 or i == n[t] - 1
        acc, partial = Var(f"cacc{t}"), Var(f"crun{t}")
        if first and last:
            return [Store(acc, Cast("double", Paren(value)), "+=")]
        if last:
            return [Store(acc, Cast("double", Paren(Sum((Term(None, partial), Term(None, value))))),
                          "=" if i < length else "+=")]
        if not first:
            return [Store(partial, value, "+=")]
        return [Def(partial, value, const=False) if i == 0 else Store(partial, value, "=")]

    return add


def forward(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, rows: Callable,
            live: Callable, run: int = 1, form: Form = Form(), ahead: int = 0) -> list[Statement]:
    """The column: each row's value, its store where the state is written, each term's sum
    (``rows``: the operator's rows as definitions, ``live``: the dead-code pass, codegen/lower.py's;
    ``run``: rows a nonnegative term adds in the kernel's type before its double sum, ``_term_rows``;
    ``form``: what the parameters allow, valid where ``narrow_check`` and ``unit_rows_check`` hold;
    ``ahead``: steps a row's definition is printed before its store and terms, ``defined_ahead``)."""
    terms = CostTerms(table, form.narrow, form.unit_rows)
    add = _term_rows(terms, op, run)
    body = refs.loads(a.name for a in table.columns) + terms.loads()
    body += [Def(Var(f"cacc{t}"), Sum(()), ctype="double", const=False) for t, _, _ in terms.terms]
    lines = rows(op, coefs, refs)
    for row, (first, end) in zip(op.rows, defined_ahead(op, ahead)):
        body += lines[first:end]
        if row.k in terms.written:
            body.append(Call(f"Y{row.k}", (row.h,), Val("y", row.k, row.h)))
        for t, kind in terms.on(row.k):
            body += add(t, kind, terms.value(t, kind, row.k, row.h))
    body += [terms.total(t, kind) for t, kind, _ in terms.terms]
    return live(body, _sym_reads(body))


def narrow_check(table: ArgumentTable) -> tuple[list[Statement], list[Sym]]:
    """What a call's narrow forms need, for one dof: the loads of the parameters (limits and margins,
    which every trajectory shares) and the conditions; none where no kind has a narrow form."""
    terms = CostTerms(table)
    conditions = terms.conditions()
    loads = terms.loads()
    shared = {a.macro for a in table.parameters}
    assert all(d.value.macro in shared for d in loads), "a narrow form's condition reads per-call parameters only"
    return (loads, conditions) if conditions else ([], [])


def unit_rows_check(table: ArgumentTable) -> list:
    """The row weights (``[H]``, 1 where not given) whose every entry a call's ``Form.unit_rows``
    needs at 1; none without cost terms."""
    rows = [a for a in table.parameters if a.role == "cost_row_weight"]
    assert all(a.shape == ("H",) and a.default == "1" for a in rows), "row weights: [H], ones where not given"
    return rows


def adjoint(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, rows: Callable,
            live: Callable, checkpoints: int = 0, form: Form = Form(), paired: bool = False,
            ahead: int = 0) -> list[Statement]:
    """The column's gradients: the rows recomputed, each row's gradient from its output and the
    cost terms on it, then every differentiable input's store. No row of a stencil reads another,
    so each row's gradient goes into its inputs' accumulators at once (few values live: CUDA's
    registers); a recurrence's rows are accumulated in reverse, with ``checkpoints`` (the value's
    itemsize) segment by segment (``_recurrence``). ``form``: as ``forward``'s. ``paired`` (a stencil's,
    with ``rows`` as ``paired_rows``): each group of ``pairs`` of a step's rows (consecutive rows of
    the same h) takes its gradient once, after the step's last row, and adds it to its references.
    ``ahead``: as ``forward``'s, a stencil's rows (a recurrence's keep their order)."""
    terms = CostTerms(table, form.narrow, form.unit_rows)
    columns = [a.name for a in table.columns]
    inputs = refs.differentiable(op.n_actions, columns)
    body = refs.loads(columns) + terms.loads() + terms.scales()

    def gradient(row, prefix: str = "y") -> Def:
        parts = [Term(None, Read(f"G{row.k}", (row.h,)))] if row.k in terms.written else []
        parts += [Term(None, terms.slope(t, kind, row.k, row.h, prefix=prefix)) for t, kind in terms.on(row.k)]
        return Def(Val("g", row.k, row.h), Sum(tuple(parts)))

    def target_slopes(row, prefix: str = "y") -> list[Term]:
        return [Term(None, terms.slope(t, kind, row.k, row.h, kinds.TARGET, prefix)) for t, kind in terms.on(row.k)
                if kind == "squared" and row.k == 0 and terms.has_target]

    if all(not is_row(ref) for row in op.rows for _, ref in row.terms):
        acc = {ref: Var(f"a{refs.local(ref)}") for ref in inputs}
        body += [Def(v, Sum(()), const=False) for v in acc.values()]
        last = _last_rows(op, acc, [bool(target_slopes(row)) for row in op.rows])
        pending: dict[tuple, list[Term]] = {}  # a step's groups of references, with their rows' products
        step = 0  # the first row of the current step
        lines = rows(op, coefs, refs)
        for i, (row, (first, end)) in enumerate(zip(op.rows, defined_ahead(op, ahead))):
            body += lines[first:end] + [gradient(row)]
            g = Val("g", row.k, row.h)
            groups = pairs(row) if paired else [(c, ((ref, False),)) for c, ref in row.terms]
            for c, group in groups:
                if len(group) == 1:
                    body += [Store(acc[group[0][0]], Sum((coefs.term(c, g),)), "+=")] if group[0][0] in acc else []
                elif any(ref in acc for ref, _ in group):
                    pending.setdefault(group, []).append(coefs.term(c, g))
            body += [Store(acc[TARGET_REF], Sum((t,)), "+=") for t in target_slopes(row) if TARGET_REF in acc]
            if paired and i + 1 < len(op.rows) and op.rows[i + 1].h == row.h:
                continue  # the step goes on
            for n, (group, products) in enumerate(pending.items()):
                gp = Var(f"gp{i}_{n}")
                body.append(Def(gp, Sum(tuple(products))))
                body += [Store(acc[ref], Sum((Term(None, gp),)), "-=" if neg else "+=") for ref, neg in group if ref in acc]
            pending.clear()
            # an input's gradient is stored after the last row (step) that adds to it: a stencil's
            # accumulators are then live over a few rows each, not the whole column (CUDA's registers)
            body += [refs.gradient(ref, (Term(None, acc[ref]),)) for ref in acc if step <= last.get(ref, -1) <= i]
            step = i + 1
        body += [refs.gradient(ref, (Term(None, v),)) for ref, v in acc.items() if ref not in last]
        return live(body, _sym_reads(body))
    segments = _segments(op, checkpoints) if checkpoints else [range(len(op.rows))]
    body += _recurrence(op, coefs, refs, inputs, rows(op, coefs, refs), segments, gradient, target_slopes)
    return live(body, _sym_reads(body))


#: C's fused stencil columns with more rows than this are rolled (``forward_rolled``, ``adjoint_rolled``;
#: codegen/lower.py ``c_fused``); up to it they stay straight-line, in their tuned form: at B=400 the
#: faster there (the bench's spec at H=40: 0.73x the rolled time in float32, 0.91x in float64), and
#: gcc's time on them within 2.5 s. Past it the straight-line adjoint's lane body passed the lane limit
#: of the time, 1,000 lines (the bench's spec: 988 lines at H=40, 1,084 at 44), and ran the per-dof loop
#: (H=48: 1.8-1.9x the rolled time), and gcc's time grows faster than H (6 s at
#: H=48, 11 s at 64, 113 s at 128), where the rolled module's is the same at any H (BENCHMARKS.md,
#: issue 39, "Rolled fused stencil columns"). A B-spline's columns (``Blocks``) follow the same threshold:
#: up to it few spans repeat (degree + 4 knots roll), past it gcc's time on the straight-line columns
#: grows as a stencil's (BENCHMARKS.md, issue 39, "Rolled fused B-spline columns"). From 33 to 40 rows
#: rolled columns are slower at some shapes (position at B=4000, B-splines float32 at B=400), so it stays
#: (BENCHMARKS.md, issue 39, "C's rolled fused columns: jerk's adjoint segments in vector registers, ...")
C_ROLL_ABOVE_H = 40
#: C's fused recurrence columns (velocity, acceleration, jerk control) with more rows than this are
#: rolled (``forward_rolled``, ``rolled_adjoint``; codegen/lower.py ``c_fused``); up to it they stay
#: straight-line, in their tuned form, built within 2.5 s; past it gcc's time on the straight-line
#: module passes 3 s (about 3 s at H=48, 4-5 s at 64, over 100 s at 128), where the rolled module's
#: is under a second at any H, and the rolled columns, whose float32 forward adds the straight-line
#: form's float runs and whose adjoint's segments fit the vector registers (``C_SCAN_ROWS``), run about
#: as fast. From 33 to 40 rows the rolled columns are not as fast at every shape (jerk float32 at
#: B=4000, velocity float32 at H=33, B=4000), so it stays (BENCHMARKS.md, issue 39, "Rolled fused
#: recurrence columns in C", "C's rolled fused forwards: float32 terms in float runs", "C's rolled fused
#: columns: jerk's adjoint segments in vector registers, ...")
C_ROLL_RECURRENCE_ABOVE_H = 40
#: the most bytes of one level's checkpoints in C's rolled recurrence adjoints (``rolled_adjoint``): a
#: local array of the column on the thread's stack, so one level at every horizon the spec allows
C_CHECKPOINT_BYTES = 1 << 16
#: the row values a segment of C's rolled recurrence adjoints recomputes (``rolled_adjoint``'s ``segment_rows``):
#: CUDA's ``SCAN_REGISTERS`` count 4-byte registers (16 float32 rows, 8 float64), but the lane form's
#: values are vectors, one register each in either type, so C takes 8 in both. With 16, a float32 jerk
#: segment (4 steps of 4 rows) left the reverse loop short of the 32 vector registers: it spilled the
#: cost parameters it reads every step and reloaded them each iteration, and recomputed a longer chain
#: of dependent rows ahead of the reverse one (BENCHMARKS.md, issue 39, "C's rolled fused columns:
#: jerk's adjoint segments in vector registers, ...")
C_SCAN_ROWS = 8


def _steps(op: Operator) -> dict[int, list[Row]]:
    """The rows by step h, in the operator's order."""
    steps: dict[int, list[Row]] = defaultdict(list)
    for row in op.rows:
        steps[row.h].append(row)
    return steps


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How a rolled column groups its rows (codegen/roll.py's groups): per step h (``period`` 1: a
    stencil's), or per knot span (a B-spline's ``period`` rows per knot, the spans starting at row
    ``phase``), the group's number q its knot: a row's position ``Shift(h - period·q, period)``
    and an action's ``Shift(j - q, 1)``, printed over the knot variable kn in a loop over the
    interior spans, where every span reads its window of knots one further."""

    period: int = 1
    phase: int = 0

    def of(self, h: int) -> int:
        """The group of row h."""
        return (h - self.phase) // self.period

    def groups(self, op: Operator) -> dict[int, list[Row]]:
        """The rows by group, in the operator's order."""
        if self.period == 1:
            return _steps(op)
        groups: dict[int, list[Row]] = defaultdict(list)
        for row in op.rows:
            groups[self.of(row.h)].append(row)
        return groups

    def row(self, h: int, q: int) -> Index:
        """Row h's position relative to group q."""
        return Rel(h - q) if self.period == 1 else Shift(h - self.period * q, self.period)

    def ref(self, refs: References, ref: Ref, q: int):
        """A reference's value relative to group q."""
        return roll.relative(refs, ref, q) if self.period == 1 else self.at(refs.value(ref), q) if is_action(ref) \
            else refs.value(ref)

    def at(self, node: Read | Call, q: int) -> Read | Call:
        """An action's read or gradient store relative to group q."""
        if self.period == 1:
            return roll.at(node, q)
        return dataclasses.replace(node, args=(Shift(node.args[0] - q, 1),) + tuple(node.args[1:]))


def _relative_row(row: Row, coefs: Coefficients, refs: References, blocks: Blocks = Blocks(),
                  paired: bool = False) -> Def:
    """A row's definition with its positions relative to its group (codegen/roll.py's groups);
    ``paired``: each group of ``pairs`` one product, as ``paired_rows``."""
    q = blocks.of(row.h)
    if paired:
        value = Sum(tuple(coefs.term(c, blocks.ref(refs, group[0][0], q) if len(group) == 1 else Paren(Sum(tuple(
            Term(None, blocks.ref(refs, ref, q), negative=neg) for ref, neg in group)))) for c, group in pairs(row)))
    else:
        value = Sum(tuple(coefs.term(c, blocks.ref(refs, ref, q)) for c, ref in row.terms))
    return Def(Val("y", row.k, blocks.row(row.h, q)), value)


def forward_rolled(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, live: Callable,
                   form: Form = Form(), blocks: Blocks = Blocks(), run: int = 1,
                   paired: bool = False) -> list[Statement]:
    """A stencil's or recurrence's ``forward`` as groups of statements per step (``blocks``: per knot
    span) with group-relative positions (``CostTerms.value_at``), rendered by roll.py: the runs of
    equal groups (the interior) one loop each, the sums carried through it; the boundary groups
    straight-line. Its length does not grow with H. ``run``: as ``forward``'s (``_run_ends``; knot
    spans, whose rows a run crosses: ``_span_run_ends``). ``paired``: the rows as ``paired_rows``
    (C's: the straight-line form's arithmetic)."""
    terms = CostTerms(table, form.narrow, form.unit_rows)
    partial = {t for t, kind, _ in terms.terms if run > 1 and terms.kind(kind).nonnegative}
    spans = _span_run_ends(op, terms, partial, run) if blocks.period > 1 else {}
    head = refs.loads(a.name for a in table.columns) + terms.loads()
    head += [Def(Var(f"cacc{t}"), Sum(()), ctype="double", const=False) for t, _, _ in terms.terms]
    head += [Def(Var(f"crun{t}"), Sum(()), const=False) for t in sorted(partial)]
    groups = []
    for h, rows in blocks.groups(op).items():
        statements: list[Statement] = []
        for i, row in enumerate(rows):
            statements.append(_relative_row(row, coefs, refs, blocks, paired))
            at = blocks.row(row.h, h)
            y = Val("y", row.k, at)
            if row.k in terms.written:
                statements.append(Call(f"Y{row.k}", (at,), y))
            statements += [Store(Var(f"crun{t}"), terms.value_at(t, kind, row.k, at), "+=") if t in partial else
                           Store(Var(f"cacc{t}"), Cast("double", Paren(terms.value_at(t, kind, row.k, at))), "+=")
                           for t, kind in terms.on(row.k)]
            if i + 1 == len(rows) or rows[i + 1].h != row.h:  # a step's runs ended by one test
                ends = (dataclasses.replace(spans[r.k], at=at) for r in rows if r.h == row.h and r.k in spans)
                statements += _merged(ends)
        groups.append(roll.Group(h, statements))
    after = _run_ends(op, terms, partial, run) if blocks.period == 1 else {}
    body = head + roll.render(groups, after=after, period=run)
    body += [terms.total(t, kind) for t, kind, _ in terms.terms]
    return live(body, _sym_reads(body))


def _run_ends(op: Operator, terms: CostTerms, partial: set[int], run: int) -> dict[int, list[Statement]]:
    """Step h → what ends the runs of ``partial``'s terms at h: ``crun<t>``, the term's rows since its
    last run added in the kernel's type from 0, into its double sum, then 0 again. The runs are
    ``_term_rows``' (each ``run`` of a term's rows, and its last row), so are the additions: 0 + x is x
    (a sum of terms ≥ 0 is −0 only where a weight is), and the first run added to the double sum's 0
    as ``_term_rows`` assigns it; roll.py loops over blocks of ``run`` steps where the runs of every
    term end at the same steps (``roll._cut``)."""
    ends: dict[int, list[Statement]] = defaultdict(list)
    for t, kind, k in terms.terms:
        if t in partial:
            rows = [row for row in op.rows if row.k == k]
            for i, row in enumerate(rows):
                if i % run == run - 1 or i == len(rows) - 1:
                    ends[row.h] += [Store(Var(f"cacc{t}"), Cast("double", Paren(Var(f"crun{t}"))), "+="),
                                    Store(Var(f"crun{t}"), Sum(()))]
    return dict(ends)


def _span_run_ends(op: Operator, terms: CostTerms, partial: set[int], run: int) -> dict[int, RunEnd]:
    """Output k → what ends the runs of ``partial``'s terms on k after one of its rows, where groups are
    knot spans (``Blocks``): the runs (``_term_rows``', from the output's first row) cross the spans, so
    a span's row tests its position (``RunEnd``, its ``at`` the row's, set by the caller); the
    statements are ``_run_ends``'. An output whose rows are not consecutive has none: its terms'
    rows are left out of ``partial``, each added straight into its double sum."""
    out: dict[int, RunEnd] = {}
    for k in sorted({k for t, _, k in terms.terms if t in partial}):
        rows = sorted(row.h for row in op.rows if row.k == k)
        if rows != list(range(rows[0], rows[0] + len(rows))):
            partial -= {t for t, _ in terms.on(k)}
            continue
        body = [s for t, _ in terms.on(k) if t in partial for s in (
            Store(Var(f"cacc{t}"), Cast("double", Paren(Var(f"crun{t}"))), "+="), Store(Var(f"crun{t}"), Sum(())))]
        out[k] = RunEnd(None, rows[0], run, rows[-1], tuple(body))
    return out


def _merged(ends: Iterable[RunEnd]) -> list[RunEnd]:
    """``ends`` with those of the same test one, their bodies in order (each term's sums are its own)."""
    out: dict[tuple, RunEnd] = {}
    for end in ends:
        key = (end.at, end.first, end.length, end.last)
        out[key] = dataclasses.replace(out[key], body=out[key].body + end.body) if key in out else end
    return list(out.values())


def _action_partials(h: int, rows: list[Row], nonzero: set, readers: dict, coefs: Coefficients, refs: References,
                     window: int, blocks: Blocks = Blocks()) -> list[Statement]:
    """Step h's part of the actions' gradients: for each action its rows read (in action order), its
    partial sum ``ga<j - h + window>`` (row-relative: the same name at every step) = the partial of its
    previous reading step + this step's rows' coefficient × g, in row order; stored where the step is its
    last reader. A loop then carries one partial per action in flight, not every row's gradient.
    ``blocks``: h is a group of rows (a knot span's), as ``adjoint_rolled``'s."""
    products: dict[int, list[Term]] = defaultdict(list)
    for row in rows:
        for c, ref in row.terms if row.k in nonzero else ():
            if is_action(ref):
                products[ref[1]].append(coefs.term(c, Val("g", row.k, blocks.row(row.h, h))))
    out: list[Statement] = []
    for j in sorted(products):
        steps = [blocks.of(hh) for _, _, hh in readers[action(j)]]
        before = max((hh for hh in steps if hh < h), default=None)
        earlier = (Term(None, Val("ga", j - before + window, Rel(before - h))),) if before is not None else ()
        own = Val("ga", j - h + window, Rel(0))
        out.append(Def(own, Sum(earlier + tuple(products[j]))))
        if max(steps) == h:
            out.append(blocks.at(refs.gradient(action(j), (Term(None, own),)), h))
    return out


def _span_partials(h: int, rows: list[Row], nonzero: set, readers: dict, coefs: Coefficients, refs: References,
                   window: int, blocks: Blocks) -> dict[int, list[Statement]]:
    """``_action_partials`` of a knot span h, by row: after each row (its index in ``rows``), its terms
    added to the partial of every action it reads (``gi<k>_<j>``, row (k, h)'s, the span's last reader's the
    span's partial ``ga<j>``), the action's gradient stored after its last reading row. The terms and
    their order are ``_action_partials``' (the same bits), but a row's gradient g is dead once its row
    is done: the span's rows' g's are not all live at once (a float64 degree-3 span of 8 rows spilled)."""
    chain: dict[int, Val] = {}  # action j → its partial so far in this span
    last: dict[int, int] = {}  # action j → the span's last row that reads it
    for i, row in enumerate(rows):
        for _, ref in row.terms if row.k in nonzero else ():
            if is_action(ref):
                last[ref[1]] = i
    out: dict[int, list[Statement]] = defaultdict(list)
    for i, row in enumerate(rows):
        products: dict[int, list[Term]] = defaultdict(list)
        for c, ref in row.terms if row.k in nonzero else ():
            if is_action(ref):
                products[ref[1]].append(coefs.term(c, Val("g", row.k, blocks.row(row.h, h))))
        for j in sorted(products):
            if j in chain:
                earlier = (Term(None, chain[j]),)
            else:
                steps = [blocks.of(hh) for _, _, hh in readers[action(j)]]
                before = max((hh for hh in steps if hh < h), default=None)
                earlier = (Term(None, Val("ga", j - before + window, Rel(before - h))),) if before is not None else ()
            if last[j] > i:  # named by the row's output and position
                chain[j] = Val(f"gi{row.k}_", j - h + window, blocks.row(row.h, h))
                out[i].append(Def(chain[j], Sum(earlier + tuple(products[j]))))
                continue
            own = Val("ga", j - h + window, Rel(0))
            out[i].append(Def(own, Sum(earlier + tuple(products[j]))))
            if max(blocks.of(hh) for _, _, hh in readers[action(j)]) == h:
                out[i].append(blocks.at(refs.gradient(action(j), (Term(None, own),)), h))
    return out


def _column_partials(h: int, inputs: list, readers: dict, coefs: Coefficients, refs: References,
                     blocks: Blocks) -> list[Statement]:
    """Group h's part of the per-column inputs' gradients (the start state) where they are summed
    group by group (``adjoint_rolled``'s ``start_sums``; knot spans: ``_span_column_partials``): its
    readers' coefficient × g added to the input's sum, stored at its last reading group.
    A clamped B-spline's first spans all read the start state: gathered at the last reader, their
    g's were live together (spilled). The sums are defined in the column's head (``_column_sums``)."""
    out: list[Statement] = []
    for ref in inputs:
        if is_action(ref) or ref == TARGET_REF or not readers.get(ref):
            continue
        spans = sorted({blocks.of(hh) for _, _, hh in readers[ref]})
        if h not in spans:
            continue
        total = Var(f"a{refs.local(ref)}")
        part = Sum(tuple(coefs.term(c, Val("g", k, blocks.row(hh, h))) for c, k, hh in readers[ref]
                         if blocks.of(hh) == h))
        out.append(Store(total, part, "+="))
        if h == spans[-1]:
            out.append(refs.gradient(ref, (Term(None, total),)))
    return out


def _span_column_partials(h: int, rows: list[Row], inputs: list, readers: dict, coefs: Coefficients,
                          refs: References, blocks: Blocks) -> dict[int, list[Statement]]:
    """Group h's part of the per-column inputs' gradients (the start state) where groups are knot
    spans, by row (its index in ``rows``, as ``_span_partials``): its readers' coefficient × g summed
    row by row (``gc<k>_<i>``, row (k, h)'s partial of input i), the span's sum added to the input's
    after its last reading row, stored at its last reading group. A clamped B-spline's first spans
    all read the start state: gathered at the span's end, their g's were live together (spilled).
    The sums are defined in the column's head (``_column_sums``)."""
    out: dict[int, list[Statement]] = defaultdict(list)
    for n, ref in enumerate(inputs):
        if is_action(ref) or ref == TARGET_REF or not readers.get(ref):
            continue
        spans = sorted({blocks.of(hh) for _, _, hh in readers[ref]})
        if h not in spans:
            continue
        coef = {(k, hh): c for c, k, hh in readers[ref]}
        reading = [i for i, row in enumerate(rows) if (row.k, row.h) in coef]
        total = Var(f"a{refs.local(ref)}")
        for i in reading:
            row = rows[i]
            term = coefs.term(coef[row.k, row.h], Val("g", row.k, blocks.row(row.h, h)))
            out[i].append(Store(total, Sum((term,)), "+="))
            if i == reading[-1] and h == spans[-1]:
                out[i].append(refs.gradient(ref, (Term(None, total),)))
    return out


def volatile_reads(statements: list[Statement], macros: set[str]) -> list[Statement]:
    """``statements`` with each read of ``macros`` made where it is used (``Volatile``, CUDA's):
    a knot-span column reads the row weights of every term at each of its rows, which ptxas
    otherwise loads ahead, a span's or a straight-line stretch's at once, and keeps live (at the
    register cap, degree 3, 64 knots: 8 to 40 bytes spilled, in the first and last spans and, 4
    rows a span, in the loop), as the step coefficients (codegen/targets.py ``cuda_volatile_coefficients``)."""
    def volatile(node):
        return Volatile(node) if isinstance(node, Read) and node.macro in macros else None

    return list(transform(tuple(statements), volatile))


def loads_where_used(statements: list[Statement], loads: list[Statement]) -> list[Statement]:
    """``statements`` with each of ``loads`` (definitions among them, a column's inputs: ``References.loads``)
    moved to just before the first statement that reads it; the others keep their order. CUDA's
    B-spline adjoints (the start state read by the first spans only): at the register cap ptxas
    spilled 8 to 16 bytes in float64 (degree 4 and 5, 4 rows a span) with them loaded first. Its
    forwards keep them first: moved, float32's spills moved about (0 to 32 bytes at 16 knots)."""
    moved = {s.target: s for s in statements if s in loads}
    rest = [s for s in statements if s not in loads]
    out: list[Statement] = []
    for s in rest:
        names = _reads(s)
        out += [moved.pop(v) for v in list(moved) if v in names]
        out.append(s)
    return out + list(moved.values())


def inputs_where_used(statements: list[Statement], refs: References, table: ArgumentTable,
                      late: Collection[str]) -> list[Statement]:
    """A fused forward's ``statements`` with the column inputs it reads only at its end read where first
    used, through a volatile read (CUDA's), of the kinds in ``late``: "weights", each term's per-dof
    weight (``cw<t>``, read where the column's sum is scaled after its last row); "after_loop", the
    inputs whose first reader follows the column's first loop (a goal's state, read by the last spans).
    Loaded first, each held a register (two in float64) through the column, and ptxas, free to load
    them anywhere before, did so early: at the register cap that spilled (B-splines and a position
    stencil of many terms, BENCHMARKS.md "Fused forwards' late inputs read where used"). The same
    values, read later."""
    first = next((i for i, s in enumerate(statements) if isinstance(s, For)), len(statements))
    reads = [_reads(s) for s in statements]
    moved = []
    for a in table.columns:
        (load,) = refs.loads((a.name,))
        readers = [i for i, (s, r) in enumerate(zip(statements, reads)) if s != load and load.target in r]
        kind = "weights" if a.role == "cost_weight" else "after_loop" if readers and readers[0] > first else ""
        # (an optional input's macro is a conditional, not an lvalue a volatile read can take)
        if readers and not a.nullable and kind in late:
            moved.append(load)
    return volatile_reads(loads_where_used(statements, moved), {s.value.macro for s in moved})


def _reads(s: Statement) -> set:
    """The variables, values and symbols a statement reads."""
    return {n for n in walk(s) if isinstance(n, (Var, Val))} | _sym_reads([s])


def _column_sums(inputs: list, readers: dict, refs: References) -> list[Statement]:
    """The sums ``_column_partials`` adds to, from 0."""
    return [Def(Var(f"a{refs.local(ref)}"), Sum(()), const=False) for ref in inputs
            if not is_action(ref) and ref != TARGET_REF and readers.get(ref)]


def has_gradient(table: ArgumentTable) -> Callable[[Row], bool]:
    """Whether a row has a gradient (its output written, or a term on it): ``adjoint_rolled`` leaves
    the others out."""
    terms = CostTerms(table)
    return lambda row: row.k in terms.written or bool(terms.on(row.k))


def adjoint_rolled(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, live: Callable,
                   form: Form = Form(), blocks: Blocks = Blocks(), start_sums: bool = False) -> list[Statement]:
    """A stencil's ``adjoint`` as groups per step (``blocks``: per knot span) with group-relative
    positions rendered by roll.py (the interior one loop): each group recomputes its rows and their gradients g (output gradient plus the
    terms' slopes, ``CostTerms.slope_at``), then adds coefficient × g to the partial sum of each action
    its rows read (``_action_partials``: the loop carries one partial per action in flight; carrying
    the last steps' g instead, to gather each action's terms at its last reader, spilled float64
    order-4 adjoints far more), stored at the action's last reader. The per-column inputs (the start
    state), read by the first rows only, gather their terms at their last reader, or with
    ``start_sums`` (always where groups are knot spans) are summed group by group
    (``_column_partials``): CUDA's float64 wide stencils of order 4 (central, accuracy 8) kept the
    first steps' g live to their last reader and spilled at the register cap. The target's
    gradient is summed row by row in one accumulator. Every sum has its terms in one fixed order
    (the same bits for any number of threads)."""
    terms = CostTerms(table, form.narrow, form.unit_rows)
    columns = [a.name for a in table.columns]
    inputs = refs.differentiable(op.n_actions, columns)
    target = Var(f"a{refs.local(TARGET_REF)}") if TARGET_REF in inputs else None
    head = refs.loads(columns) + terms.loads() + terms.scales()
    head += [Def(target, Sum(()), const=False)] if target else []
    # rows whose gradient is 0 (no output gradient, no term) add nothing: left out of the sums
    gradient = has_gradient(table)
    nonzero = {row.k for row in op.rows if gradient(row)}
    readers: dict[tuple, list[tuple[sp.Expr, int, int]]] = defaultdict(list)
    for row in op.rows:
        for c, ref in row.terms:
            if row.k in nonzero:
                readers[ref].append((c, row.k, row.h))
    window = max((blocks.of(row.h) - ref[1] for row in op.rows for _, ref in row.terms if is_action(ref)), default=0)
    summed = start_sums or blocks.period > 1
    head += _column_sums(inputs, readers, refs) if summed else []
    done_at: dict[int, list[tuple]] = defaultdict(list)  # group h → the inputs whose last reader is in h
    for ref in inputs:
        if readers.get(ref):
            done_at[blocks.of(max(h for _, _, h in readers[ref]))].append(ref)
    groups = []
    for h, rows in blocks.groups(op).items():
        statements: list[Statement] = []
        by_row: dict[int, list[Statement]] = defaultdict(list)
        if blocks.period > 1:
            for part in (_span_partials(h, rows, nonzero, readers, coefs, refs, window, blocks),
                         _span_column_partials(h, rows, inputs, readers, coefs, refs, blocks)):
                for i, lines in part.items():
                    by_row[i] += lines
        for i, row in enumerate(rows):
            if row.k not in nonzero:
                continue
            statements.append(_relative_row(row, coefs, refs, blocks))
            at = blocks.row(row.h, h)
            parts = [Term(None, Read(f"G{row.k}", (at,)))] if row.k in terms.written else []
            parts += [Term(None, terms.slope_at(t, kind, row.k, at)) for t, kind in terms.on(row.k)]
            statements.append(Def(Val("g", row.k, at), Sum(tuple(parts))))
            if target and row.k == 0:
                statements += [Store(target, Sum((Term(None, terms.slope_at(t, kind, 0, at, kinds.TARGET)),)), "+=")
                               for t, kind in terms.on(0) if kind == "squared"]
            statements += by_row.get(i, [])
        if blocks.period == 1:
            statements += _action_partials(h, rows, nonzero, readers, coefs, refs, window, blocks)
            if summed:
                statements += _column_partials(h, inputs, readers, coefs, refs, blocks)
        for ref in done_at.get(h, []):
            if not is_action(ref) and not summed:
                gathered = tuple(coefs.term(c, Val("g", k, blocks.row(hh, h))) for c, k, hh in readers[ref])
                statements.append(refs.gradient(ref, gathered))
        groups.append(roll.Group(h, statements))
    tail = [refs.gradient(ref, ()) for ref in inputs if not readers.get(ref) and ref != TARGET_REF]
    tail += [refs.gradient(TARGET_REF, (Term(None, target),))] if target else []
    body = head + roll.render(groups, tail)
    return live(body, _sym_reads(body))


#: the registers one segment's recomputed rows take (``_segments``): with the checkpoints in the
#: thread's local array, the rest of the 128 go to the cost parameters, addresses and the reverse's
#: values (ptxas at the cap: 24 kept float64 jerk, acceleration and jerk-with-target columns to H=64
#: without spills, where 16 to 20 left 4 to 12 bytes on some)
SEGMENT_REGISTERS = 24
#: the registers one segment of the rolled reverse scan's rows take (``rolled_adjoint``): its loop
#: bodies leave fewer to them than a straight-line column does (ptxas at the cap: 24 left 8 to 16
#: bytes of spills on float64 velocity, acceleration and jerk adjoints with a target at H=256, 16 none)
SCAN_REGISTERS = 16
#: the most bytes of checkpoints in the local array (``_segments``): a per-element kernel's stack
#: frame stays within 1 KB, with room for what else ptxas puts there
CHECKPOINT_BYTES = 768


def _segments(op: Operator, itemsize: int) -> list[range]:
    """The recurrence's rows in consecutive segments of ``SEGMENT_REGISTERS`` registers' worth of
    rows (``itemsize`` bytes a value, 4 a register), or the shortest longer ones whose checkpoints
    fit ``CHECKPOINT_BYTES`` (long horizons: fewer boundaries, fewer checkpoints). The rows a later
    segment reads from an earlier one are checkpoints in memory (``_checkpoints``), so one segment's
    rows are what the recomputation keeps live; every row is recomputed once but the last segment's."""
    def of(size: int) -> list[range]:
        return [range(i, min(i + size, len(op.rows))) for i in range(0, len(op.rows), size)]

    size = max(1, SEGMENT_REGISTERS * 4 // itemsize)
    while size < len(op.rows) and len(_checkpoints(op, of(size))) * itemsize > CHECKPOINT_BYTES:
        size += 1
    return of(size)


def _checkpoints(op: Operator, segments: list[range]) -> dict[int, int]:
    """The rows that a recomputed segment (every one but the last) reads from an earlier segment,
    each with its slot in the column's checkpoint array (``TS_CK``), in row order."""
    index = {(row.k, row.h): i for i, row in enumerate(op.rows)}
    segment_of = {i: n for n, segment in enumerate(segments) for i in segment}
    read = {index[ref[1:]] for n, segment in enumerate(segments[:-1]) for i in segment
            for _, ref in op.rows[i].terms if is_row(ref) and segment_of[index[ref[1:]]] < n}
    return {i: slot for slot, i in enumerate(sorted(read))}


def _recurrence(op: Operator, coefs: Coefficients, refs: References, inputs: list, lines: list[Statement],
                segments: list[range], gradient: Callable, target_slopes: Callable) -> list[Statement]:
    """A recurrence's column gradients: every row forward, then segment by segment from the last, each
    earlier segment's rows again from the values before it (``yr<k>_<h>``, its actions read again:
    ``R<U>(j)`` after ``TS_REREAD``), and their reverse accumulation, each row's gradient (and its
    term of the target's, summed from the last row) taken just before its own total. The rows that
    later segments read (the checkpoints) are stored in the first pass to the column's local array
    (``TS_CK``) and read from it there, so one segment's rows are live at once, not every row's
    gradient at the turn (CUDA's registers); with one segment nothing is recomputed or stored.
    Each sum has the same terms in the same order whatever the segments."""
    slots = _checkpoints(op, segments)
    body = [Call("TS_CHECKPOINTS", (len(slots),))] if slots else []
    for i, line in enumerate(lines):
        body.append(line)
        if i in slots:  # stored as soon as computed: not live in a register until its segment's turn
            body.append(Store(Read("TS_CK", (slots[i],)), Val("y", op.rows[i].k, op.rows[i].h)))
    checkpoint = {(op.rows[i].k, op.rows[i].h): slot for i, slot in slots.items()}
    target, started = Var(f"a{refs.local(TARGET_REF)}") if TARGET_REF in inputs else None, False
    first = {}  # each input's first reading row: the last to add to its gradient in reverse
    for i, row in enumerate(op.rows):
        first.update({ref: i for _, ref in row.terms if ref not in first and ref in inputs})
    contributions: dict = defaultdict(list)
    action = refs.action.macro
    for n, segment in reversed(list(enumerate(segments))):
        prefix = "y" if n == len(segments) - 1 else "yr"  # the last segment's rows are at hand
        if prefix == "yr":
            own = {(op.rows[i].k, op.rows[i].h) for i in segment}

            def again(x):
                if isinstance(x, Val) and x.prefix == "y" and (x.k, x.h) in own:
                    return Val("yr", x.k, x.h)
                if isinstance(x, Val) and x.prefix == "y" and (x.k, x.h) in checkpoint:
                    return Read("TS_CK", (checkpoint[x.k, x.h],))
                return Read("R" + action, x.args) if isinstance(x, Read) and x.macro == action else None

            body += [Call("TS_REREAD")] + [transform(lines[i], again) for i in segment]
        for i in reversed(segment):
            row = op.rows[i]
            body.append(gradient(row, prefix))
            # the target's gradient added up with the rows' own (the same values and row weights)
            for t in target_slopes(row, prefix) if target else ():
                body.append(Store(target, Sum((t,)), "+=") if started else Def(target, Sum((t,)), const=False))
                started = True
            yb = Val("yb", row.k, row.h)
            body.append(Def(yb, Sum((Term(None, Val("g", row.k, row.h)),
                                     *contributions.pop(("y", row.k, row.h), [])))))
            for c, ref in row.terms:
                contributions[ref].append(coefs.term(c, yb))
            # an input's gradient is stored once its last term is in: its terms are then not live to the end
            body += [refs.gradient(ref, tuple(contributions.pop(ref))) for ref in inputs if first.get(ref) == i]
    if target:
        body.append(refs.gradient(TARGET_REF, (Term(None, target),) if started else ()))
    return body + [refs.gradient(ref, ()) for ref in inputs if ref not in first and ref != TARGET_REF]


# -- a recurrence's adjoint rolled (codegen/roll.py ``segmented``): CUDA's at every horizon ------
def rolled_adjoint(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, live: Callable,
                   itemsize: int, form: Form = Form(), budget: int | None = None,
                   reread: bool = True, segment_rows: int | None = None) -> list[Statement] | None:
    """``adjoint`` of a recurrence as a reverse scan over segments of steps (codegen/roll.py
    ``segmented``): a first loop runs the steps forward and keeps each segment's incoming values
    (checkpoints) in the column's local array (``TS_CK``); a second loop, from the last segment,
    recomputes a segment's rows from its checkpoint and runs their reverse accumulation, the row
    adjoints that earlier steps read carried from one segment to the next. The steps before and
    after the repeating ones are straight-line. Each sum has ``_recurrence``'s terms in its order,
    whatever the segments (FMA contraction aside, the straight-line column's bits). None where fewer
    than two segments repeat. ``form``: what a call's parameters allow (C's variants); ``budget``: the
    most bytes of one level's checkpoints (None: ``CHECKPOINT_BYTES`` as it is at the call, CUDA's stack; C's,
    ``C_CHECKPOINT_BYTES``);
    ``reread``: the actions of the steps before the scan read again through ``R<U>`` (CUDA's registers);
    ``segment_rows``: the row values a segment recomputes (None: ``SCAN_REGISTERS``' worth; C's ``C_SCAN_ROWS``)."""
    steps = list(_steps(op).values())
    if [row for rows in steps for row in rows] != list(op.rows) or any(rows[0].h != h for h, rows in enumerate(steps)):
        return None  # (a step's rows not consecutive: its groups would reorder the column)
    terms = CostTerms(table, form.narrow, form.unit_rows)
    columns = [a.name for a in table.columns]
    inputs = refs.differentiable(op.n_actions, columns)
    target = Var(f"a{refs.local(TARGET_REF)}") if TARGET_REF in inputs else None
    readers: dict = defaultdict(list)  # each reference's reading rows, the last row first
    first: dict = {}  # each input's first reading row: where its gradient is complete
    for i, row in enumerate(op.rows):
        first.update({ref: i for _, ref in row.terms if ref not in first and ref in inputs})
    for row in reversed(op.rows):
        for c, ref in row.terms:
            readers[ref].append((c, row.k, row.h))
    index = {(row.k, row.h): i for i, row in enumerate(op.rows)}

    def gathered(ref: tuple, h: int) -> tuple[Term, ...]:
        return tuple(coefs.term(c, Val("yb", k, Rel(hh - h))) for c, k, hh in readers[ref])

    reverse = []
    for h, rows in enumerate(steps):
        statements: list[Statement] = []
        for row in reversed(rows):
            parts = [Term(None, Read(f"G{row.k}", (Rel(0),)))] if row.k in terms.written else []
            parts += [Term(None, terms.slope_at(t, kind, row.k, Rel(0))) for t, kind in terms.on(row.k)]
            statements.append(Def(Val("g", row.k, Rel(0)), Sum(tuple(parts))))
            if target is not None and row.k == 0:
                statements += [Store(target, Sum((Term(None, terms.slope_at(t, kind, 0, Rel(0), kinds.TARGET)),)), "+=")
                               for t, kind in terms.on(0) if kind == "squared"]
            statements.append(Def(Val("yb", row.k, Rel(0)),
                                  Sum((Term(None, Val("g", row.k, Rel(0))), *gathered(("y", row.k, row.h), h)))))
            for ref in inputs:
                if first.get(ref) == index[(row.k, row.h)]:
                    store = refs.gradient(ref, gathered(ref, h))
                    statements.append(roll.at(store, h) if store.args else store)
        reverse.append(roll.Group(h, statements))
    values = [roll.Group(h, [_relative_row(row, coefs, refs) for row in rows]) for h, rows in enumerate(steps)]
    action = refs.action.macro

    def again(x):  # a row computed again before the scan's first steps: as ``_recurrence``'s
        if isinstance(x, Val) and x.prefix == "y":
            return Val("yr", x.k, x.h)
        return Read("R" + action, x.args) if reread and isinstance(x, Read) and x.macro == action else None

    segment_rows = SCAN_REGISTERS * 4 // itemsize if segment_rows is None else segment_rows
    budget = CHECKPOINT_BYTES if budget is None else budget
    scan = roll.segmented(values, reverse, itemsize, segment_rows, budget, again)
    if scan is None:
        return None
    body = refs.loads(columns) + terms.loads() + terms.scales() + _started(scan, target)
    if target is not None:
        body.append(refs.gradient(TARGET_REF, (Term(None, target),)))
    body += [refs.gradient(ref, ()) for ref in inputs if ref not in first and ref != TARGET_REF]
    return live(body, _sym_reads(body))


def _started(body: list[Statement], target: Var | None) -> list[Statement]:
    """``body`` with the target gradient's first addition its definition where it is straight-line,
    else the definition at 0 before the loop that adds first."""
    if target is None:
        return body
    for i, s in enumerate(body):
        if isinstance(s, Store) and s.target == target:
            return body[:i] + [Def(target, s.value, const=False)] + body[i + 1:]
        if isinstance(s, For) and any(isinstance(n, Store) and n.target == target for n in walk(s.body)):
            return body[:i] + [Def(target, Sum(()), const=False)] + body[i:]
    return [Def(target, Sum(()), const=False)] + body
