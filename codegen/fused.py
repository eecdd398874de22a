"""Cost terms lowered into the step (a spec's ``costs``): the forward that also sums each term
over rows and dof, and the backward that takes the cost's gradient to the inputs.

A term (kind, state) adds, at every row h of the state's output y and every dof, its kind's
pointwise expression (codegen/costs.py) with the weight ``weight_d · row_weight_h``. Per column
the forward accumulates each term in double precision and hands the column's sum to ``CPART(t,
value)``; the template adds the columns of a trajectory in dof order (deterministic sums). The
backward recomputes the rows (it reads the inputs), then runs the operator's reverse
accumulation with each row's gradient ``G<k>(h)`` (where the output is written) plus
``Σ_t GCOST(t) · ∂cost_t/∂y``; the target of a squared position term gets ``∂cost/∂target``.
Only the states the spec writes are stored or read as gradients. A kind that is its weight
times the rest (``CostKind.weighted``) takes its per-dof weight once per column in both
directions (``total``, ``scales``), not on every row.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import sympy as sp

from . import costs as kinds
from .arguments import ArgumentTable
from .coefficients import Coefficients
from .operator import Operator, is_row
from .references import References
from .statements import Call, Cast, Def, Mul, Paren, Read, Statement, Store, Sum, Sym, Term, Val, Var

STATES = ("position", "velocity", "acceleration", "jerk", "snap")
TARGET_REF = ("squared_position_target", 0)


class CostTerms:
    """A table's cost terms with the symbols their expressions are printed with per column."""

    def __init__(self, table: ArgumentTable):
        self.table = table
        self.terms = [(t, kind, STATES.index(state)) for t, (kind, state) in enumerate(table.costs)]
        self.written = set(table.written)

    def on(self, k: int) -> list[tuple[int, str]]:
        """The terms (t, kind) on output k."""
        return [(t, kind) for t, kind, kk in self.terms if kk == k]

    def loads(self) -> list[Statement]:
        """Each bound term's limits and margin at this column's dof (its weight is a column input)."""
        lines: list[Statement] = []
        for t, kind, _ in self.terms:
            if kind == "bound":
                lines += [Def(Var(f"clo{t}"), Read(f"CLIM{t}", (0,))), Def(Var(f"chi{t}"), Read(f"CLIM{t}", (1,))),
                          Def(Var(f"cmar{t}"), Read(f"CMAR{t}"))]
        return lines

    def _subs(self, t: int, kind: str, k: int, h: int, per_dof: bool = True) -> dict:
        """``per_dof``: the weight with its per-dof factor (else the row weight alone: ``value``)."""
        target = sp.Symbol("ctgt") if (kind, STATES[k]) == ("squared", "position") and self.has_target else 0
        weight = sp.Symbol(f"cw{t}") if per_dof else 1
        return {kinds.Y: sp.Symbol(f"y{k}_{h}"), kinds.W: weight * sp.Symbol(f"CRW{t}({h})"),
                kinds.LOWER: sp.Symbol(f"clo{t}"), kinds.UPPER: sp.Symbol(f"chi{t}"),
                kinds.MARGIN: sp.Symbol(f"cmar{t}"), kinds.TARGET: target}

    @property
    def has_target(self) -> bool:
        return any(a.name == TARGET_REF[0] for a in self.table.columns)

    def value(self, t: int, kind: str, k: int, h: int) -> Sym:
        """The term at row h; without its per-dof weight where the kind is w·f (``total`` applies it)."""
        kind_ = kinds.KINDS[kind]
        return Sym(kind_.expression.xreplace(self._subs(t, kind, k, h, per_dof=not kind_.weighted)))

    def total(self, t: int, kind: str) -> Statement:
        """A column's sum of term t: its rows' sum, times the per-dof weight where ``value`` left it out
        (once per column instead of once per row)."""
        acc = Var(f"cacc{t}")
        return Call("CPART", (t,), Mul(acc, Cast("double", Var(f"cw{t}"))) if kinds.KINDS[kind].weighted else acc)

    def slope(self, t: int, kind: str, k: int, h: int, wrt: sp.Symbol = kinds.Y) -> Sym:
        """GCOST(t) · ∂(term at row h)/∂wrt; for a weighted kind, row weight × ``scales``' cgw<t> × the
        rest (no product of per-column factors repeated on every row)."""
        kind_ = kinds.KINDS[kind]
        expr = kind_.derivative if wrt is kinds.Y else sp.diff(kind_.expression, wrt)
        if not kind_.weighted:
            return Sym(sp.Symbol(f"GCOST({t})") * expr.xreplace(self._subs(t, kind, k, h)))
        rest = expr / (kinds.W * kind_.slope_factor)
        rest = sp.simplify(rest) if rest.has(kinds.W) else rest
        assert not rest.has(kinds.W), f"{kind}: a weighted kind's derivative is w times a function of the rest"
        return Sym(sp.Symbol(f"CRW{t}({h})") * sp.Symbol(f"cgw{t}") * rest.xreplace(self._subs(t, kind, k, h)))

    def scales(self) -> list[Statement]:
        """The adjoint's per-column factor of each weighted term: GCOST(t) × its derivative's number ×
        the per-dof weight."""
        return [Def(Var(f"cgw{t}"), Sym(kinds.KINDS[kind].slope_factor * sp.Symbol(f"GCOST({t})") * sp.Symbol(f"cw{t}")))
                for t, kind, _ in self.terms if kinds.KINDS[kind].weighted]


def _sym_reads(body: list[Statement]) -> set:
    """The values and variables the terms' expressions read (printed names in SymPy symbols), for
    the dead-code pass, which sees statement nodes only."""
    from .statements import walk

    names = {str(x) for n in walk(tuple(body)) if isinstance(n, Sym) for x in n.expr.free_symbols}
    out: set = set()
    for name in names:
        m = re.fullmatch(r"y(\d+)_(\d+)", name)
        out.add(Val("y", int(m.group(1)), int(m.group(2))) if m else Var(name))
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


def forward(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, rows: Callable,
            live: Callable) -> list[Statement]:
    """The column: each row's value, its store where the state is written, each term's sum
    (``rows``: the operator's rows as definitions, ``live``: the dead-code pass, codegen/lower.py's)."""
    terms = CostTerms(table)
    body = refs.loads(a.name for a in table.columns) + terms.loads()
    body += [Def(Var(f"cacc{t}"), Sum(()), ctype="double", const=False) for t, _, _ in terms.terms]
    for line, row in zip(rows(op, coefs, refs), op.rows):
        body.append(line)
        if row.k in terms.written:
            body.append(Call(f"Y{row.k}", (row.h,), Val("y", row.k, row.h)))
        for t, kind in terms.on(row.k):
            body.append(Store(Var(f"cacc{t}"), Cast("double", Paren(terms.value(t, kind, row.k, row.h))), "+="))
    body += [terms.total(t, kind) for t, kind, _ in terms.terms]
    return live(body, _sym_reads(body))


def adjoint(op: Operator, coefs: Coefficients, refs: References, table: ArgumentTable, rows: Callable,
            live: Callable) -> list[Statement]:
    """The column's gradients: the rows recomputed, each row's gradient from its output and the
    cost terms on it, then every differentiable input's store. No row of a stencil reads another,
    so each row's gradient goes into its inputs' accumulators at once (few values live: CUDA's
    registers); a recurrence's rows are accumulated in reverse."""
    terms = CostTerms(table)
    columns = [a.name for a in table.columns]
    inputs = refs.differentiable(op.n_actions, columns)
    body = refs.loads(columns) + terms.loads() + terms.scales()

    def gradient(row) -> Def:
        parts = [Term(None, Read(f"G{row.k}", (row.h,)))] if row.k in terms.written else []
        parts += [Term(None, terms.slope(t, kind, row.k, row.h)) for t, kind in terms.on(row.k)]
        return Def(Val("g", row.k, row.h), Sum(tuple(parts)))

    def target_slopes(row) -> list[Term]:
        return [Term(None, terms.slope(t, kind, row.k, row.h, kinds.TARGET)) for t, kind in terms.on(row.k)
                if kind == "squared" and row.k == 0 and terms.has_target]

    if all(not is_row(ref) for row in op.rows for _, ref in row.terms):
        acc = {ref: Var(f"a{refs.local(ref)}") for ref in inputs}
        body += [Def(v, Sum(()), const=False) for v in acc.values()]
        last = _last_rows(op, acc, [bool(target_slopes(row)) for row in op.rows])
        for i, (line, row) in enumerate(zip(rows(op, coefs, refs), op.rows)):
            body += [line, gradient(row)]
            g = Val("g", row.k, row.h)
            body += [Store(acc[ref], Sum((coefs.term(c, g),)), "+=") for c, ref in row.terms if ref in acc]
            body += [Store(acc[TARGET_REF], Sum((t,)), "+=") for t in target_slopes(row) if TARGET_REF in acc]
            # an input's gradient is stored after the last row that adds to it: a stencil's
            # accumulators are then live over a few rows each, not the whole column (CUDA's registers)
            body += [refs.gradient(ref, (Term(None, acc[ref]),)) for ref in acc if last.get(ref) == i]
        body += [refs.gradient(ref, (Term(None, v),)) for ref, v in acc.items() if ref not in last]
        return live(body, _sym_reads(body))
    body += rows(op, coefs, refs)
    contributions: dict = defaultdict(list)
    for row in op.rows:
        body.append(gradient(row))
        contributions[TARGET_REF] += target_slopes(row)
    for row in reversed(op.rows):
        own = ("y", row.k, row.h)
        body.append(Def(Val("yb", row.k, row.h), Sum((Term(None, Val("g", row.k, row.h)), *contributions.pop(own, [])))))
        for c, ref in row.terms:
            contributions[ref].append(coefs.term(c, Val("yb", row.k, row.h)))
    body += [refs.gradient(ref, tuple(contributions.get(ref, []))) for ref in inputs]
    return live(body, _sym_reads(body))
