"""Lowering: Operator → statements (codegen/statements.py) for the four kernels (forward,
adjoint, dt_vjp, dt_jvp).

The statements are target-neutral: codegen/printer.py prints them, and the C and CUDA
templates wrap the same text in their own loops. Body code uses these macros, defined by
each template:
``U(j)`` action j, ``S<m>`` start entry m, ``E<m>`` goal entry m (end="goal"), ``Y<k>(h, value)`` output store, ``G<k>(h)``
incoming gradient (0 when absent), ``DU(j)``/``DS<m>``/``DE<m>`` input tangents, ``TY<k>(h, value)``
output tangent store, ``GU(j, value)``/``GS<m>(value)``/``GE<m>(value)`` adjoint stores, ``ZERO``, ``ACC(m)``
the dt-gradient accumulator, ``TS_ROLLED`` before a loop that must stay rolled; a fused recurrence's CUDA
adjoint reads its actions again through ``RU(j)`` after ``TS_REREAD()`` (codegen/fused.py). The C template's all-dof vector form prints the forward and
adjoint columns with the lane vocabulary (``printer.lane_printer``); for integrators it gets the
column with its repeating rows rolled into a loop (codegen/roll.py).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict
from typing import Any, Callable, Collection, Iterable

import sympy as sp

from . import fused, roll
from .coefficients import MINUS_ONE, ONE, Coefficients, table_term
from .arguments import ArgumentTable
from .operator import Operator, Ref, Row, action, is_action, is_row
from .printer import COLUMN
from .references import References
from .runs import NEXT, runs, shared
from .statements import (Add, Call, Cast, Def, For, Literal, Mul, Paren, Read, Rel, Shift, Statement, Store, Strided,
                         Sum, Term, Val, Var, transform, walk)


@dataclasses.dataclass
class Loop:
    """Loop indices [start, stop) that share one translation-invariant statement: emitted as a loop.

    Index r reads actions r + rel and output row r·scale + offset: scale is the operator's
    period (rows per action shift; 1 for one row per action, s for s rows per B-spline span).
    For the C 'bhd' layout a loop with scale 1 and offset 0 runs over the flattened (row, dof)
    index, which is contiguous, so it vectorises at full width. ``guard`` names a pointer that must be
    non-null for the loop to run (absent gradients skip their loop).
    """

    start: int
    stop: int
    statements: list[Statement]
    guard: str = ""
    row_dependent: bool = False  # coefficients change with the row (per-step dt): loop over r
    scale: int = 1  # loop index r addresses output row r·scale + offset (and action r)
    offset: int = 0
    init: list[Statement] = dataclasses.field(default_factory=list)  # before the loop: its local sums
    finish: list[Statement] = dataclasses.field(default_factory=list)  # after it: each sum added once

    @property
    def row(self) -> str:
        """The output row of loop index r, as C text."""
        return "r" if (self.scale, self.offset) == (1, 0) else f"(r * {self.scale} + {self.offset})"

    @property
    def key(self) -> tuple[int, int, str, tuple[str, ...]]:
        """Loops with one key share their index range and rows: the CUDA template fuses them. A loop
        with local sums keeps a pass of its own (fused, all their sums would be live at once:
        registers)."""
        return (self.start, self.stop, self.row, tuple(self.init_lines))

    @property
    def by_row(self) -> bool:
        """The (row, dof) index is not one contiguous range: the C 'bhd' form loops over r, then d."""
        return self.row_dependent or self.row != "r"

    @functools.cached_property
    def lines(self) -> list[str]:
        """The loop body as the templates print it."""
        return COLUMN.lines(self.statements)

    @functools.cached_property
    def init_lines(self) -> list[str]:
        return COLUMN.lines(self.init)

    @functools.cached_property
    def finish_lines(self) -> list[str]:
        return COLUMN.lines(self.finish)


@dataclasses.dataclass
class KernelCode:
    """Setup (double-precision coefficient math, once per call), interior loops, per-column
    statements; ``preamble`` and ``body`` are their column-form text, which the templates print."""

    setup: list[Statement]
    statements: list[Statement]
    loops: list[Loop] = dataclasses.field(default_factory=list)

    @functools.cached_property
    def preamble(self) -> list[str]:
        return COLUMN.lines(self.setup)

    @functools.cached_property
    def body(self) -> list[str]:
        return COLUMN.lines(self.statements)


def _forward_lines(op: Operator, coefs: Coefficients, refs: References) -> list[Statement]:
    """One SSA assignment per row, in evaluation order (stores are added by the caller)."""
    return [Def(Val("y", row.k, row.h), Sum(tuple(coefs.term(c, refs.value(r)) for c, r in row.terms)))
            for row in op.rows]


def _adjoint_lines(op: Operator, coefs: Coefficients, skip: frozenset = frozenset()
                   ) -> tuple[list[Statement], dict[Ref, list[Term]]]:
    """Reverse accumulation: total adjoints yb<k>_<h> of rows, then contributions to inputs (none
    from the rows in ``skip``, whose contributions span loops gather)."""
    lines: list[Statement] = [Def(Val("g", r.k, r.h), Read(f"G{r.k}", (r.h,))) for r in op.rows]
    contributions: dict[Ref, list[Term]] = defaultdict(list)
    for row in reversed(op.rows):
        own = ("y", row.k, row.h)
        parts = [Term(None, Val("g", row.k, row.h))] + contributions.pop(own, [])
        lines.append(Def(Val("yb", row.k, row.h), Sum(tuple(parts))))
        for c, ref in (() if (row.k, row.h) in skip else row.terms):
            contributions[ref].append(coefs.term(c, Val("yb", row.k, row.h)))
    return lines, contributions


MIN_LOOP = 3  # shorter runs of identical rows stay straight-line
ZERO = sp.Integer(0)  # the weight of an input a row of a span loop does not read
ZERO_T = Cast("T", Literal("0"))  # a gathered gradient's start

# A row's terms as loop material: a shape (offsets and unit coefficients, same along a run)
# and the coefficient-table slot of every other coefficient (advancing by one stride per row).
Shape = tuple
Slots = tuple


def _runs(rows: dict[int, tuple[Shape, Slots] | None]) -> list[tuple[int, int, Shape, Slots, int]]:
    """Maximal runs [start, stop) of MIN_LOOP or more consecutive indices with one shape whose slots
    advance by one stride (0 for uniform dt, where rows share coefficients): (start, stop, shape,
    first slots, stride)."""
    index = sorted(rows)
    found = runs(index, key=lambda h: None if rows[h] is None else rows[h][0],
                 fields=lambda h: (h, *(slot for slot in rows[h][1] if slot is not None)),
                 min_length=MIN_LOOP, admits=lambda stride: stride[0] == NEXT and shared(stride[1:]))
    return [(index[run.start], index[run.stop - 1] + 1, *rows[index[run.start]],
             next(iter(run.stride[1:]), 0))  # the slots' one stride
            for run in found]


def _is_stencil(op: Operator) -> bool:
    """No row reads another row: every output is a direct combination of the inputs."""
    return all(not is_row(ref) for row in op.rows for _, ref in row.terms)


def _coefficient(coefs: Coefficients, coef: sp.Expr) -> tuple[sp.Expr | None, int | None]:
    """(unit, None) for ±1, (None, slot) for table coefficients: a loop's shape keeps the units,
    its slots advance along the run."""
    return (coef, None) if coef in (ONE, MINUS_ONE) else (None, coefs.index(coef))


def _stencil_rows(op: Operator, coefs: Coefficients, k: int, p: int = 1) -> dict[int, tuple[Shape, Slots] | None]:
    """Output k's rows as loop material: each term's action offset (from h div p, p the period),
    unit coefficient and whether it depends on dt (the shape), and its table slot (None for units)."""
    rows: dict[int, tuple[Shape, Slots] | None] = {}
    for row in op.rows:
        if row.k == k and row.h > 0:
            if not row.terms or any(not is_action(ref) for _, ref in row.terms):
                rows[row.h] = None
                continue
            parts = [(ref[1] - row.h // p, *_coefficient(coefs, c), coefs.varies(c)) for c, ref in row.terms]
            rows[row.h] = (tuple((rel, lit, v) for rel, lit, _, v in parts), tuple(slot for _, _, slot, _ in parts))
    return rows


def _period(op: Operator) -> int:
    """Output rows per action shift: the most common distance between the rows (of one output)
    where the first action read advances by one (1 when none do; the smallest on a tie)."""
    first: dict[tuple[int, int], int] = {}
    for row in op.rows:
        actions = [ref[1] for _, ref in row.terms if is_action(ref)]
        if actions:
            first[(row.k, row.h)] = min(actions)
    advances = sorted((k, h) for (k, h), j in first.items() if first.get((k, h - 1)) == j - 1)
    gaps = Counter(h1 - h0 for (k0, h0), (k1, h1) in zip(advances, advances[1:]) if k0 == k1)
    return min(gaps, key=lambda p: (-gaps[p], p)) if gaps else 1


def _stencil_loops(op: Operator, coefs: Coefficients, statement: Callable) -> tuple[list[Loop], set[tuple[int, int]]]:
    """Interior rows whose terms are the same up to a shift in the action index, one loop per run,
    output and phase: with period p (codegen rows h and h + p read actions shifted by one), loop
    index r = h div p covers the rows of phase h mod p. ``statement(k, terms)`` gives the loop's
    statements and guard from the run's terms (rel, unit, varies, slot index)."""
    loops, covered = [], set()
    if not _is_stencil(op):
        return loops, covered
    p = _period(op)
    for k in range(op.n_outputs):
        phases: dict[int, dict[int, tuple[Shape, Slots] | None]] = defaultdict(dict)
        for h, material in _stencil_rows(op, coefs, k, p).items():
            phases[h % p][h // p] = material
        for phase, rows in sorted(phases.items()):
            for start, stop, shape, slots, stride in _runs(rows):
                terms = [(rel, lit, v, _slot(slot, stride, start)) for (rel, lit, v), slot in zip(shape, slots)]
                statements, guard = statement(k, terms)
                loops.append(Loop(start, stop, statements, guard, row_dependent=stride != 0, scale=p, offset=phase))
                covered.update((k, r * p + phase) for r in range(start, stop))
    return loops, covered


def _slot(slot: int | None, stride: int, start: int) -> int | Strided | None:
    """A loop term's table slot: fixed (stride 0, uniform dt) or advancing with the loop index."""
    return None if slot is None else slot if stride == 0 else Strided(slot, stride, start)


def _term(coefs: Coefficients, lit: sp.Expr | None, slot: Any, operand: Any) -> Term:
    return coefs.term(lit, operand) if lit is not None else table_term(slot, operand)


def _forward_loops(op: Operator, coefs: Coefficients) -> tuple[list[Loop], set[tuple[int, int]]]:
    """Forward: Y<k> of the loop's row from the shifted actions."""
    def statement(k: int, terms: list) -> tuple[list[Statement], str]:
        value = Sum(tuple(_term(coefs, lit, slot, Read("SU", (rel,))) for rel, lit, _, slot in terms))
        return [Store(Read(f"SY{k}"), value)], ""
    return _stencil_loops(op, coefs, statement)


def _dt_jvp_loops(op: Operator, coefs: Coefficients) -> tuple[list[Loop], set[tuple[int, int]]]:
    """dt_jvp: the tangent of Y<k> at the loop's row, Σ ċ·u + c·du."""
    def statement(k: int, terms: list) -> tuple[list[Statement], str]:
        parts = []
        for rel, lit, varies, slot in terms:
            if varies:
                parts.append(Term(Read("CD", (slot,)), Read("SU", (rel,))))
            parts.append(_term(coefs, lit, slot, Read("SDU", (rel,))))
        return [Store(Read(f"STY{k}"), Sum(tuple(parts)))], ""
    return _stencil_loops(op, coefs, statement)


def _dt_vjp_loops(op: Operator, coefs: Coefficients) -> tuple[list[Loop], set[tuple[int, int]]]:
    """dt_vjp: each dt-dependent coefficient of the loop's row gathers g<k>·u (a stencil's row
    adjoints are its incoming gradients). Rows without one need no loop."""
    def statement(k: int, terms: list) -> tuple[list[Statement], str]:
        return [Store(Read("ACC", (slot,)), Cast("double", Paren(Mul(Read(f"SG{k}", (0,)), Read("SU", (rel,))))), "+=")
                for rel, _, varies, slot in terms if varies], f"g{k}"
    loops, covered = _stencil_loops(op, coefs, statement)
    return [_local_sums(loop, i) for i, loop in enumerate(loops) if loop.statements], covered


def _local_sums(loop: Loop, number: int) -> Loop:
    """A loop whose accumulator slots are fixed (rows share their coefficients) sums into double
    locals, each added to ACC once after the loop (see ``_sum_locally``)."""
    statements, init, finish = _sum_locally(loop.statements, lambda q: f"acc{number}_{q}")
    return dataclasses.replace(loop, statements=statements, init=init, finish=finish)


def _sum_locally(statements: list[Statement], name: Callable[[int], str]
                 ) -> tuple[list[Statement], list[Statement], list[Statement]]:
    """``ACC(q) += v`` at a fixed slot q (uniform dt: the rows share their coefficients) becomes
    ``v`` summed into a double local ``name(q)``: the statements, the locals' definitions (before)
    and their additions to ACC (after), so each slot costs one ACC statement, which on CUDA is a
    block-wide reduction. Slots that advance with the row (per-step dt) stay ACC statements."""
    sums: dict[int, Var] = {}

    def local(n: Any) -> Any:
        if isinstance(n, Store) and isinstance(n.target, Read) and n.target.macro == "ACC" \
                and isinstance(n.target.args[0], int):
            q = n.target.args[0]
            return Store(sums.setdefault(q, Var(name(q))), n.value, "+=")
        return None

    statements = [transform(s, local) for s in statements]
    return (statements, [Def(v, Literal("0.0"), "double", const=False) for v in sums.values()],
            [Store(Read("ACC", (q,)), v, "+=") for q, v in sums.items()])


def _adjoint_loops(op: Operator, coefs: Coefficients) -> tuple[list[Loop], set[int]]:
    """Interior actions whose gradient gathers the same shifted output gradients: action j reads
    rows j·p + rel (p the operator's period)."""
    loops: list[Loop] = []
    covered: set[int] = set()
    if not _is_stencil(op):
        return loops, covered
    p = _period(op)
    gathers: dict[int, list[tuple]] = defaultdict(list)
    for row in op.rows:
        for c, ref in row.terms:
            if is_action(ref):
                gathers[ref[1]].append((row.k, row.h - ref[1] * p, *_coefficient(coefs, c)))
    rows = {}
    for j in range(op.n_actions):
        parts = sorted(gathers[j], key=lambda t: (t[0], t[1]))
        rows[j] = (tuple((k, rel, lit) for k, rel, lit, _ in parts), tuple(slot for *_, slot in parts)) if parts else None
    for start, stop, shape, slots, stride in _runs(rows):
        dependent = stride != 0
        loops.append(Loop(start, stop, [Store(Read("SGU"), ZERO_T)], row_dependent=dependent, scale=p))
        for k in sorted({kk for kk, _, _ in shape}):
            value = Sum(tuple(_term(coefs, lit, _slot(slot, stride, start), Read(f"SG{k}", (rel,)))
                              for (kk, rel, lit), slot in zip(shape, slots) if kk == k))
            loops.append(Loop(start, stop, [Store(Read("SGU"), value, "+=")], guard=f"g{k}", row_dependent=dependent,
                              scale=p))
        covered.update(range(start, stop))
    return loops, covered


def fused_gathers(loops: list[Loop]) -> list[Loop]:
    """Consecutive loops over the same rows that gather into one target (an action's gradient:
    zeroed, then a pass per output gradient) as one pass storing the sum of all their terms, for
    C: the target is written once instead of read and written in every pass. Their guards go: in
    C an absent output gradient reads zeros (the template's zero block). Loops that store
    different outputs stay apart (one pass per output stream was faster in C)."""
    fused: list[Loop] = []
    for loop in loops:
        last = fused[-1] if fused else None
        if (last is not None and last.key == loop.key and last.row_dependent == loop.row_dependent
                and _gather(last) and _gather(loop) and loop.statements[0].op == "+="
                and last.statements[0].target == loop.statements[0].target):
            total, added = last.statements[0], loop.statements[0]
            terms = (() if total.value == ZERO_T else total.value.terms) + added.value.terms
            fused[-1] = dataclasses.replace(last, statements=[Store(total.target, Sum(terms))], guard="")
        else:
            fused.append(loop)
    return fused


def _gather(loop: Loop) -> bool:
    """One store of a column sum (or of zero) into the loop's target."""
    return (len(loop.statements) == 1 and isinstance(loop.statements[0], Store) and not loop.init
            and (loop.statements[0].value == ZERO_T or isinstance(loop.statements[0].value, Sum)))


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows [start, stop) of output k that read the same inputs: one loop over the rows.
    ``terms``: (ref, unit, slot), the unit coefficient or None, and the table slot (fixed,
    ``Strided``, or None for units). A span of a knot loop (``nest`` ≥ 0) is the template at its
    first knot, repeated ``repeat`` more times ``period`` rows and one action further; its action
    refs are ``Shift`` positions, its slots are the same at every knot."""

    k: int
    start: int
    stop: int
    terms: tuple[tuple[Ref, Any, Any], ...]
    nest: int = -1
    repeat: int = 0
    period: int = 0

    @property
    def rows(self) -> list[int] | range:
        """The rows it covers (a knot loop's span: at every knot)."""
        if self.nest < 0:
            return range(self.start, self.stop)
        return [h + self.period * kn for kn in range(self.repeat + 1) for h in range(self.start, self.stop)]


Rows = dict  # (output, row) → {ref: coefficient}
#: Fewer repeating blocks stay a loop per span: nvcc's time grows little with them, and a loop over
#: knots costs registers (n=10, s=25, 6 blocks: forward 32 → 40, adjoint 40 → 56, float32).
MIN_KNOTS = 8


def _shifted(terms: dict[Ref, sp.Expr], by: int = 1) -> dict[Ref, sp.Expr]:
    """A row's terms with every action index moved ``by`` (the other inputs stay)."""
    return {action(ref[1] + by) if is_action(ref) else ref: c for ref, c in terms.items()}


def _by_output(rows: Rows) -> dict[int, dict[int, dict[Ref, sp.Expr]]]:
    """Rows by output: output → row → terms, rows in order."""
    by_output: dict[int, dict[int, dict[Ref, sp.Expr]]] = defaultdict(dict)
    for (k, h), terms in sorted(rows.items()):
        by_output[k][h] = terms
    return by_output


def _run_span(coefs: Coefficients, k: int, by_row: dict[int, dict[Ref, sp.Expr]], start: int, stop: int,
              refs: Iterable[Ref]) -> Span:
    """The span of output k's rows [start, stop) over the inputs ``refs`` (weight 0 where a row reads one not)."""
    return Span(k, start, stop, tuple((ref, *_sequence(coefs, [by_row[h].get(ref, ZERO) for h in range(start, stop)],
                                                       start)) for ref in refs))


def _knot_runs(rows: Rows, p: int) -> list[tuple[int, int]]:
    """Runs of row blocks [p·q + b, p·q + b + p) (all outputs) that repeat the block before them
    with every action one further and the same weights: (first row of the first block, repeats),
    at least MIN_KNOTS blocks, for the phase b that covers most rows (on a tie, the fewest loops
    and single rows in a block)."""
    last = max(h for _, h in rows)
    best: list[tuple[int, int]] = []
    loops = 0  # of the best phase's first blocks: fewer, shorter bodies
    for b in range(p):
        # block q as seen from its first row, with its actions as offsets from the q-th
        blocks = [{(k, h - p * q - b): _shifted(terms, -q) for (k, h), terms in rows.items()
                   if p * q + b <= h < p * q + b + p} for q in range((last - b) // p + 1)]
        found = [(p * run.start + b, len(run) - 1)
                 for run in runs(blocks, key=lambda block: block, min_length=MIN_KNOTS)]
        count = sum(_loop_count(rows, first, p) for first, _ in found)
        if (sum(n for _, n in found), -count) > (sum(n for _, n in best), -loops):
            best, loops = found, count
    return best


def _knot_phase(op: Operator, p: int) -> int:
    """The first row b (below p) of the knot spans [p·q + b, p·q + b + p) that repeat the span before
    them one action further in the longest runs (roll.py's ``MIN_ROLL`` spans or more; the first b
    on a tie): a fused B-spline's rolled columns group their rows by these spans (``fused.Blocks``)."""
    rows: Rows = {(row.k, row.h): {ref: c for c, ref in row.terms} for row in op.rows}
    best, phase = -1, 0
    for b in range(p):
        repeated = _repeated_spans(rows, p, b)
        if repeated > best:
            best, phase = repeated, b
    return phase


def _repeated_spans(rows: Rows, p: int, b: int) -> int:
    """The spans [p·q + b, p·q + b + p) of ``rows`` in runs of ``roll.MIN_ROLL`` or more that each
    repeat the span before them one action further."""
    last = max(h for _, h in rows)
    blocks = [{(k, h - p * q - b): _shifted(terms, -q) for (k, h), terms in rows.items()
               if p * q + b <= h < p * q + b + p} for q in range(-1, (last - b) // p + 1)]
    return sum(len(run) for run in runs(blocks, key=lambda block: block, min_length=roll.MIN_ROLL))


def _knot_loop_possible(op: Operator, p: int, b: int, kept: Callable[[Row], bool]) -> bool:
    """Whether a rolled column grouped by the spans from row b (``fused.Blocks``) can hold a loop over
    knots, counted on the operator's rows (cheap) before the column is built: its groups are equal
    only where the rows they hold (``kept``) are, so without ``roll.MIN_ROLL`` equal spans of those
    rows in a row, ``roll.render`` leaves every group straight-line."""
    rows: Rows = {(row.k, row.h): {ref: c for c, ref in row.terms} for row in op.rows if kept(row)}
    return bool(rows) and _repeated_spans(rows, p, b) > 0


def _loop_count(rows: Rows, first: int, p: int) -> int:
    """The loops and single rows of a knot loop's body: its first block's row runs and other rows."""
    count = 0
    for by_row in _by_output({key: terms for key, terms in rows.items() if first <= key[1] < first + p}).values():
        runs = _row_runs(by_row)
        count += len(runs) + len(by_row) - sum(stop - start for start, stop, _ in runs)
    return count


def _carried(rows: Rows, first: int, repeat: int, p: int) -> bool:
    """Whether a knot loop's adjoint can carry the gradients of its actions in a window that moves
    along with it: rows before it read no action past its first knot's, rows after it none that
    it finishes (the first of each knot's)."""
    inside = range(first, first + p * (repeat + 1))
    actions = {ref[1] for (k, h), terms in rows.items() if first <= h < first + p for ref in terms if is_action(ref)}
    if not actions:
        return True
    lo, hi = min(actions), max(actions)
    for (k, h), terms in rows.items():
        read = [ref[1] for ref in terms if is_action(ref)]
        if h < inside.start and any(j > hi for j in read) or h >= inside.stop and any(j <= lo + repeat for j in read):
            return False
    return True


def _row_runs(by_row: dict[int, dict[Ref, sp.Expr]]) -> list[tuple[int, int, dict[Ref, sp.Expr]]]:
    """Runs [start, stop) of consecutive rows that read fixed inputs (a row may read fewer:
    coefficient 0 there), with MIN_LOOP rows or more that read every input of the run. Not the
    equal-shape runs of codegen/runs.py: a row joins when its inputs are a subset of the first
    row's, and the run is kept by how many rows read them all."""
    runs = []
    index = sorted(by_row)
    i = 0
    while i < len(index):
        refs, j = by_row[index[i]], i
        if i + 1 < len(index) and index[i + 1] == index[i] + 1 and set(refs) < set(by_row[index[i + 1]]):
            i += 1  # a row reading fewer inputs than the next one ends the run before, if any
            continue
        while j + 1 < len(index) and index[j + 1] == index[j] + 1:
            nxt = by_row[index[j + 1]]
            if not set(nxt) <= set(refs) or (not nxt) != (not refs):  # rows of zeros loop apart
                break
            j += 1
        if sum(len(by_row[h]) == len(refs) for h in index[i : j + 1]) >= MIN_LOOP:  # mostly full rows
            runs.append((index[i], index[j] + 1, refs))
        i = j + 1
    return runs


def _spans(op: Operator, coefs: Coefficients, covered: set[tuple[int, int]], knots: bool = False) -> list[Span]:
    """A stencil's runs of consecutive rows of one output, outside ``covered``, that read fixed
    inputs (a row may read fewer: coefficient 0 there) with coefficients varying along the run
    (e.g. a B-spline span: s rows on one window of knots and the start state, weighted by the
    basis at each row's phase, some weights vanishing at some phases). Runs with MIN_LOOP rows
    or more that read every input of the run. With ``knots`` (period p > 1), blocks of p rows that
    repeat the block before them one action further (a B-spline's interior spans) are one loop
    over knots (``_knot_runs``), given by its first block's spans (``_nest_spans``)."""
    if not _is_stencil(op):
        return []
    rows: Rows = {(row.k, row.h): {ref: c for c, ref in row.terms} for row in op.rows if (row.k, row.h) not in covered}
    spans: list[Span] = []
    p = _period(op)
    for nest, (first, repeat) in enumerate(_knot_runs(rows, p) if knots and p > 1 and rows else []):
        if not _carried(rows, first, repeat, p):
            continue
        block = {key: terms for key, terms in rows.items() if first <= key[1] < first + p}
        spans += _nest_spans(coefs, block, Span(-1, first, first, (), nest, repeat, p))
        for kn in range(repeat + 1):
            for k, h in block:
                del rows[(k, h + p * kn)]
    for k, by_row in sorted(_by_output(rows).items()):
        spans += [_run_span(coefs, k, by_row, start, stop, refs) for start, stop, refs in _row_runs(by_row)]
    return spans


def _nest_spans(coefs: Coefficients, block: Rows, nest: Span) -> list[Span]:
    """The spans of a knot loop's first block (``nest`` gives the loop's fields): an output with
    a row at each of the block's rows is one span over them all (weight 0 where a row reads less:
    the loop's weights change with the row, not with the knot, so nvcc hoists none out of the
    loop over knots); other outputs' runs of rows as ``_spans`` finds them, each other row a
    span of one row."""
    knot = lambda ref: action(Shift(ref[1], 1)) if is_action(ref) else ref
    spans = []
    for k, by_row in sorted(_by_output(block).items()):
        whole = len(by_row) == nest.period and any(by_row.values())
        every = {ref: None for terms in by_row.values() for ref in terms}  # in order of first use
        for start, stop, refs in [(min(by_row), max(by_row) + 1, every)] if whole else _row_runs(by_row):
            terms = tuple((knot(ref), *_sequence(coefs, [by_row[h].get(ref, ZERO) for h in range(start, stop)],
                                                 Shift(start, nest.period))) for ref in refs)
            spans.append(dataclasses.replace(nest, k=k, start=start, stop=stop, terms=terms))
            for h in range(start, stop):
                del by_row[h]
        for h, terms in by_row.items():
            spans.append(dataclasses.replace(nest, k=k, start=h, stop=h + 1, terms=tuple(
                (knot(ref), *_coefficient(coefs, c)) for ref, c in terms.items())))
    return spans


def _sequence(coefs: Coefficients, values: list[sp.Expr], start: int | Shift) -> tuple[sp.Expr | None, int | Strided | None]:
    """(unit, None) for a term whose coefficient is the same unit on every row, else (None, its
    table slot at loop index ``start`` + i, values[i]): fixed, advancing by a constant stride,
    or else a block of copies in that order."""
    if values[0] in (ONE, MINUS_ONE) and len(set(values)) == 1:
        return values[0], None
    if all(v in coefs.names for v in values):
        slots = [coefs.index(v) for v in values]
        steps = {b - a for a, b in zip(slots, slots[1:])}
        if len(steps) == 1:
            return None, _slot(slots[0], steps.pop(), start)
    return None, Strided(coefs.block(tuple(values)), 1, start)


@dataclasses.dataclass
class _SharedLoop:
    """Spans that share one loop: over their common rows, or (``nest`` ≥ 0) over the knots of a
    knot loop, around the loops of its first block's spans."""

    spans: list[Span]

    @property
    def nest(self) -> int:
        return self.spans[0].nest

    @property
    def key(self) -> tuple[int, int]:
        """Its first (output, row): where the columns place it."""
        start = min(span.start for span in self.spans)
        return min(span.k for span in self.spans if span.start == start), start

    def loop(self, body: Callable[[Span], list[Statement]], tail: tuple[Statement, ...] = ()) -> For | None:
        """The loop (None if ``body`` gives no statements); ``tail`` ends each knot of a knot loop."""
        if self.nest < 0:
            return _row_loop(self.spans, body)
        first = self.spans[0]
        inner: list[Statement] = []
        rows: dict[tuple[int, int], list[Span]] = defaultdict(list)
        for span in self.spans:
            if span.stop - span.start > 1:
                rows[(span.start, span.stop)].append(span)
        for _, group in sorted(rows.items()):
            inner += [loop for loop in [_row_loop(group, body, first.period)] if loop]
        for span in self.spans:
            if span.stop - span.start == 1:  # its row at every knot
                row = lambda n: Shift(span.start + n.rel, first.period) if isinstance(n, Rel) else None
                inner += [transform(s, row) for s in body(span)]
        if not inner:
            return None
        return For(0, first.repeat, 1, tuple(inner) + tuple(tail), unroll=False, var="kn")


def _row_loop(spans: list[Span], body: Callable[[Span], list[Statement]], period: int = 0) -> For | None:
    """The loop over the rows of spans with one row range (``period``: shifted by the knot)."""
    statements = [s for span in spans for s in body(span)]
    if not statements:
        return None
    first, last = spans[0].start, spans[0].stop - 1
    if period:
        first, last = Shift(first, period), Shift(last, period)
    return For(first, last, 1, tuple(statements), unroll=False)


def _groups(spans: list[Span]) -> list[list[Span]]:
    """The spans of one loop each (of one row range, or of one knot loop), in row order. A
    knot loop's spans over several rows loop together as other spans do (over rows shifted by
    the knot)."""
    groups: dict[tuple, list[Span]] = defaultdict(list)
    for span in spans:
        groups[(span.start, span.stop) if span.nest < 0 else (span.nest,)].append(span)
    return sorted(groups.values(), key=lambda g: (min(s.start for s in g), min(s.stop for s in g)))


def _span_loops(spans: list[Span], body: Callable[[Span], list[Statement]]) -> dict[tuple[int, int], For]:
    """One loop per row range (the spans of all outputs over the same rows share it), or per knot
    loop, keyed by its first (output, row), in row order: ``body(span)`` gives a span's
    statements for row r (a knot loop's spans: over actions ``Shift``ed by the knot ``kn``). Loops
    stay rolled (CUDA: unrolled short loops hold every row's loads in registers)."""
    loops = {}
    for group in _groups(spans):
        shared = _SharedLoop(group)
        loop = shared.loop(body)
        if loop is not None:
            loops[shared.key] = loop
    return loops


def _span_forward(coefs: Coefficients, refs: References, spans: list[Span]) -> dict[tuple[int, int], For]:
    """Forward span loops: Y<k>(r) from the span's fixed inputs."""
    return _span_loops(spans, lambda span: [Call(f"Y{span.k}", (Rel(0),), Sum(tuple(
        _term(coefs, lit, slot, refs.value(ref)) for ref, lit, slot in span.terms)))])


def _span_adjoint(coefs: Coefficients, refs: References, spans: list[Span], wanted: Callable[[Ref], bool],
                  finish: Callable[[Ref, Var], Statement],
                  early: Callable[[Ref], list[Term]] = lambda ref: []) -> tuple[list[Statement], set[Ref]]:
    """Adjoint span loops: each input the spans read (of those ``wanted``) gathers the rows'
    gradients times their coefficients in an accumulator a<ref>, defined before its first loop
    and given to ``finish`` (its gradient's store) after its last, so few are live at once.
    A knot loop's actions are a window of accumulators that moves with the knot: each knot
    finishes its first action's and shifts the others down. The window starts from the
    accumulators before the loop and ``early(ref)``, the parts of its first actions that are
    not span rows (``_carried``: no row after the loop reads an action it finishes)."""
    shared_loops = [_SharedLoop(group) for group in _groups(spans)]
    last: dict[Ref, int] = {}
    for i, shared in enumerate(shared_loops):
        for span in shared.spans:
            for ref, _, _ in span.terms:
                if wanted(ref):
                    for kn in range(span.repeat + 1):
                        last[(ref[0], ref[1].base + kn) if isinstance(ref[1], Shift) else ref] = i
    sums: dict[Ref, Var] = {}  # the accumulator of each ref's partial sum, in order of first use
    lines: list[Statement] = []
    done: set[Ref] = set()
    for i, shared in enumerate(shared_loops):
        new: list[Ref] = []

        def acc(ref: Ref) -> Var:
            if ref not in sums:
                sums[ref] = Var(f"a{refs.local(ref)}")
                new.append(ref)
            return sums[ref]

        def gather(span: Span, target: Callable[[Ref], Var] = acc) -> list[Statement]:
            return [Store(target(ref), Sum((_term(coefs, lit, slot, Read(f"G{span.k}", (Rel(0),))),)), "+=")
                    for ref, lit, slot in span.terms if wanted(ref)]

        actions = sorted({ref[1].base for span in shared.spans for ref, _, _ in span.terms
                          if isinstance(ref[1], Shift) and wanted(ref)}) if shared.nest >= 0 else []
        if not actions:  # no loop over knots, or one that reads no action whose gradient is wanted
            loop = shared.loop(gather)
            lines += [Def(sums[ref], Sum(()), const=False) for ref in new]
        else:
            lo, repeat = actions[0], shared.spans[0].repeat
            window = [Var(f"a{shared.nest}k{m}") for m in range(actions[-1] - lo + 1)]
            for m, var in enumerate(window):
                ref = action(lo + m)
                carried = (Term(None, sums.pop(ref)),) if ref in sums else ()
                lines.append(Def(var, Sum(carried + tuple(early(ref))), const=False))
            tail = (finish(action(Shift(lo, 1)), window[0]), *[Store(a, b) for a, b in zip(window, window[1:])],
                    Store(window[-1], Sum(())))
            loop = shared.loop(lambda span: gather(span, lambda ref: window[ref[1].base - lo]
                                                 if isinstance(ref[1], Shift) else acc(ref)), tail)
            lines += [Def(sums[ref], Sum(()), const=False) for ref in new]
            done |= {action(lo + kn) for kn in range(repeat + 1)}
            sums.update({action(lo + repeat + 1 + m): var for m, var in enumerate(window[:-1])})
        if loop is not None:
            lines.append(loop)
        finished = [ref for ref in sums if last.get(ref) == i and ref not in done]
        lines += [finish(ref, sums[ref]) for ref in finished]
        done.update(finished)
    return lines, done


def _leftover_spans(op: Operator, coefs: Coefficients, done: set[tuple[int, int]]) -> list[Span]:
    """With a period above 1, runs of MIN_LOOP or more consecutive rows of one output that neither
    interior loops nor spans cover (``done``): rows where some of a span's weights vanish, so each
    reads other inputs. A loop over the union of their inputs, weight 0 where a row reads none
    (blocks of copies). The dt kernels loop over them (on CUDA their straight-line rows took 166
    registers, B-spline degree 4, s=4)."""
    if _period(op) == 1 or not _is_stencil(op):
        return []
    rows: Rows = {(row.k, row.h): {ref: c for c, ref in row.terms} for row in op.rows
                  if (row.k, row.h) not in done and row.terms}
    spans = []
    for k, by_row in sorted(_by_output(rows).items()):
        index = sorted(by_row)
        for run in runs(index, key=lambda h: k, fields=lambda h: (h,), min_length=MIN_LOOP,
                        admits=lambda stride: stride == (NEXT,)):
            rows_of_run = index[run.start : run.stop]
            refs = dict.fromkeys(ref for h in rows_of_run for ref in by_row[h])
            spans.append(_run_span(coefs, k, by_row, rows_of_run[0], rows_of_run[-1] + 1, refs))
    return spans


def _covered(spans: Iterable[Span]) -> set[tuple[int, int]]:
    """The (output, row)s that span loops cover."""
    return {(span.k, h) for span in spans for h in span.rows}


def _table_slots(slot: int | Strided, span: Span) -> list[int]:
    """The table slots a span term reads over the span's rows (a knot loop's span: the same at every knot)."""
    if isinstance(slot, int):
        return [slot]
    start = slot.start.base if isinstance(slot.start, Shift) else slot.start
    return [slot.slot + slot.stride * (r - start) for r in range(span.start, span.stop)]


def _dt_spans(coefs: Coefficients, spans: list[Span]) -> list[Span]:
    """The spans the dt kernels loop over: those whose blocks copy straight-line slots or constants
    (dt_vjp_finish gives a copy's gradient to its source's there). Other spans' rows stay straight-line."""
    straight = set(coefs.straight)
    return [span for span in spans if all(coefs.source(q) in straight or coefs.source(q) in (None, q)
                                          for _, lit, slot in span.terms if lit is None
                                          for q in _table_slots(slot, span))]


def _span_varies(coefs: Coefficients, span: Span, slot: int | Strided) -> bool:
    """Whether a span term's coefficient depends on dt on any of its rows."""
    return any(coefs.varies(coefs.value(q)) for q in _table_slots(slot, span))


def _span_tangent(coefs: Coefficients, refs: References, span: Span) -> list[Statement]:
    """dt_jvp's span loop body: TY<k>(r) = Σ ċ·value + c·tangent over the span's fixed inputs."""
    parts: list[Term] = []
    for ref, lit, slot in span.terms:
        if lit is None and _span_varies(coefs, span, slot):
            parts.append(Term(Read("CD", (slot,)), refs.value(ref)))
        parts.append(_term(coefs, lit, slot, refs.value(ref, tangent=True)))
    return [Call(f"TY{span.k}", (Rel(0),), Sum(tuple(parts)))]


def _span_products(coefs: Coefficients, refs: References, span: Span) -> list[Statement]:
    """dt_vjp's span loop body: each dt-dependent coefficient of row r gathers G<k>(r)·value."""
    return [Store(Read("ACC", (slot,)), Cast("double", Paren(Mul(Read(f"G{span.k}", (Rel(0),)), refs.value(ref)))), "+=")
            for ref, lit, slot in span.terms if lit is None and _span_varies(coefs, span, slot)]


TABLE_CALL = [Call("COEFFICIENTS", (Var("dt_in"), Var("coef")))]  # the shared table function (templates define it)


def _spans_only(op: Operator) -> bool:
    """Whether span loops cover every row, with no interior loops (which loop over the knots, one
    per phase and output, p of them, and the adjoint's gather p rows a term per action): whenever
    p > 1. On CUDA the gathers and short interior loops took 130-250 registers, the span loops
    32-96; in C the interior loops took gcc seconds at 8-12 rows per span and ran 1.4-4x slower
    (docs/benchmarks-history.md, twelfth session)."""
    return _period(op) > 1


#: cycles until a column sum's next partial sum is ready: an FMA for a term with a coefficient,
#: an add for a unit one (the ordering below only compares them)
FMA_LATENCY, ADD_LATENCY = 4, 3
#: terms per partial sum, and partial sums at most, when a sum's leading terms are ready together
CHAIN_TERMS, MAX_CHAINS = 8, 4


def _chains(terms: list[Term]) -> list[Term]:
    """Terms whose operands are ready together, as up to MAX_CHAINS parenthesised partial sums
    of consecutive terms: each is a chain of its own, so a long sum is not one chain of
    dependent FMAs (a B-spline gradient's 20-30 terms; docs/benchmarks-history.md, twenty-first
    session)."""
    n = min(MAX_CHAINS, len(terms) // CHAIN_TERMS)
    if n < 2:
        return terms
    size = -(-len(terms) // n)
    return [Term(None, Paren(Sum(tuple(terms[i:i + size])))) for i in range(0, len(terms), size)]


def _shallow_first(statements: list[Statement]) -> list[Statement]:
    """Each straight-line column sum with its terms in order of when their operands are ready
    (the latency of the chain of sums that computes them), earliest first: a sum is evaluated
    left to right, so a recurrence's carried value then comes last and costs its chain one add.
    ``g1_30 + yb1_31 + C(0)*yb0_30`` put an add and an FMA on semi-implicit Euler's adjoint
    chain, ``g1_30 + C(0)*yb0_30 + yb1_31`` puts one add (docs/benchmarks-history.md,
    seventeenth session, item 8). Stable: a sum of loads keeps its order (as partial sums when it
    is long: ``_chains``); loops are left as they are."""
    ready: dict[Any, int] = {}

    def operand(term: Term) -> int:
        return max((ready.get(n, 0) for n in walk(term.operand) if isinstance(n, (Val, Var))), default=0)

    def ordered(value: Sum) -> tuple[Sum, int]:
        terms = sorted(((operand(t), t) for t in value.terms), key=lambda pair: pair[0])
        at = 0
        for i, (when, t) in enumerate(terms):
            step = FMA_LATENCY if t.factor is not None else ADD_LATENCY if i else 0
            at = max(at, when) + step
        together = sum(1 for when, _ in terms if when == terms[0][0]) if terms else 0
        chained = _chains([t for _, t in terms[:together]]) + [t for _, t in terms[together:]]
        return Sum(tuple(chained)), at

    out: list[Statement] = []
    for s in statements:
        if isinstance(s, Def) and isinstance(s.value, Sum):
            value, ready[s.target] = ordered(s.value)
            s = dataclasses.replace(s, value=value)
        elif isinstance(s, Call) and isinstance(s.value, Sum):
            s = dataclasses.replace(s, value=ordered(s.value)[0])
        out.append(s)
    return out


def _forward(op: Operator, coefs: Coefficients, refs: References, spans: list[Span], only: bool) -> KernelCode:
    """``only``: span loops cover every row (no interior loops)."""
    loops, covered = ([], set()) if only else _forward_loops(op, coefs)
    straight = covered | _covered(spans)
    span_loops = _span_forward(coefs, refs, spans)
    body = refs.loads(op.columns)
    for line, row in zip(_forward_lines(op, coefs, refs), op.rows):
        if (row.k, row.h) in span_loops:
            body.append(span_loops[(row.k, row.h)])
        if (row.k, row.h) not in straight:
            body += [line, Call(f"Y{row.k}", (row.h,), Val("y", row.k, row.h))]
    return KernelCode(TABLE_CALL, _shallow_first(body), loops)


def _adjoint(op: Operator, coefs: Coefficients, refs: References, spans: list[Span], only: bool,
             reads: bool = False) -> KernelCode:
    """``reads`` (stencils only): each row's gradient is its incoming one, read where it is used
    rather than held in a local for the whole body (CUDA: fewer registers). Span loops (over
    every row, interior rows also read boundary actions) gather the gradients of the inputs the
    interior loops leave (all with ``only``)."""
    loops, covered = ([], set()) if only else _adjoint_loops(op, coefs)
    spanned = frozenset((span.k, h) for span in spans for h in span.rows)
    if reads:
        lines, contributions = [], defaultdict(list)
        for row in reversed(op.rows):
            for c, ref in (() if (row.k, row.h) in spanned else row.terms):
                contributions[ref].append(coefs.term(c, Read(f"G{row.k}", (row.h,))))
    else:
        lines, contributions = _adjoint_lines(op, coefs, spanned)
    gathered, done = _span_adjoint(coefs, refs, spans, lambda ref: refs.has_gradient(ref) and not (
                                       is_action(ref) and ref[1] in covered),
                                   lambda ref, acc: refs.gradient(ref, (*contributions.get(ref, []), Term(None, acc))),
                                   lambda ref: contributions.pop(ref, []))
    lines += gathered
    inputs = [ref for ref in refs.differentiable(op.n_actions, op.columns) if not (is_action(ref) and ref[1] in covered)]
    lines += [refs.gradient(ref, tuple(contributions.get(ref, []))) for ref in inputs if ref not in done]
    lines = _shallow_first(lines)
    return KernelCode(TABLE_CALL, _live(lines) if covered or spans else lines, loops)


def _reads(line: Statement) -> set:
    """The values and variables a statement reads (a loop: those its body reads)."""
    if isinstance(line, For):
        return set().union(*map(_reads, line.body))
    return {n for n in walk(line.value if isinstance(line, Def) else line) if isinstance(n, (Val, Var))}


def _live(lines: list[Statement], used: set = frozenset()) -> list[Statement]:
    """``lines`` without the definitions that no later line reads (the gradients of rows whose
    actions the loops gather): the column body then grows with the rows the loops leave. In a
    loop's body a definition is live if the loop reads it anywhere (an iteration reads the
    values the one before carried) or later lines do."""
    used = set(used)
    kept: list[Statement] = []
    for line in reversed(lines):
        if isinstance(line, Def) and line.target not in used:
            continue
        if isinstance(line, For):
            line = dataclasses.replace(line, body=tuple(_live(list(line.body), used | _reads(line))))
        kept.append(line)
        used |= _reads(line)
    return kept[::-1]


def _gradient_load(line: Statement) -> bool:
    """``const T g1_5 = G1(5);``: an output gradient's row loaded into a local."""
    return (isinstance(line, Def) and isinstance(line.value, Read) and line.value.macro[:1] == "G"
            and line.value.macro[1:].isdigit())


def loaded_where_used(lines: list[Statement]) -> list[Statement]:
    """``lines`` with each output gradient's load moved to just before the first line that reads
    it (loads no line reads first, as written); the other lines keep their order, so each value
    is the same arithmetic. A column whose rows are in cache then starts its sweep at once; where
    they come from memory, loading them all first (as written) keeps more loads in flight."""
    loads = {line.target: line for line in lines if _gradient_load(line)}
    rest = [line for line in lines if not _gradient_load(line)]
    read = set().union(*map(_reads, rest)) if rest else set()
    out = [load for target, load in loads.items() if target not in read]
    for line in rest:
        out += [loads.pop(v) for v in sorted(_reads(line) & loads.keys(), key=list(loads).index)]
        out.append(line)
    return out


def _dt_vjp(op: Operator, coefs: Coefficients, refs: References, spans: list[Span] = (), only: bool = False
            ) -> KernelCode:
    """GC(q) += Σ yb_row · value over the uses of each dt-dependent coefficient (summed over
    columns); dt_vjp_finish then maps GC to the dt gradient through the coefficient program.
    A stencil's interior rows accumulate in loops (none with ``only``), its spans' rows in span
    loops, whose fixed slots sum in double locals added once after the loop. A stencil's yb_row
    is its incoming gradient, read where it is used (nothing held across the body: few registers
    at any horizon). An integrator's is the rolled reverse sweep of ``_integrator_dt_vjp``."""
    if not _is_stencil(op):
        return _integrator_dt_vjp(op, coefs, refs)
    loops, covered = ([], set()) if only else _dt_vjp_loops(op, coefs)
    spans = _dt_spans(coefs, list(spans))
    covered = covered | _covered(spans)
    body = refs.loads(op.columns)
    for (k, start), loop in _span_loops(spans, functools.partial(_span_products, coefs, refs)).items():
        statements, init, finish = _sum_locally(list(loop.body), lambda q: f"acc{k}_{start}_{q}")
        body += [*init, dataclasses.replace(loop, body=tuple(statements)), *finish]
    # one statement per coefficient and ACC_ROWS rows, so the values a statement reads are shared
    # with the other coefficients of its rows only (one statement over all rows kept every value loaded)
    uses: dict[tuple[int, int], list[Mul]] = defaultdict(list)
    for i, row in enumerate(op.rows):
        if (row.k, row.h) in covered:
            continue
        for c, ref in row.terms:
            if coefs.varies(c):
                uses[(i // ACC_ROWS, coefs.index(c))].append(Mul(Read(f"G{row.k}", (row.h,)), refs.value(ref)))
    body += _accumulations([(q, tuple(parts)) for (_, q), parts in uses.items()])
    return KernelCode(TABLE_CALL, body, loops)


def _accumulation(q: int | Strided, parts: tuple) -> Store:
    return Store(Read("ACC", (q,)), Cast("double", Paren(Add(parts))), "+=")


def _accumulations(sums: list[tuple[int, tuple]]) -> list[Statement]:
    """``ACC(q) += (double)(Σ parts)`` for each slot, in order; a run of at least MIN_LOOP single
    products ``G<k>(h)·U(j)`` with one gradient read, whose slot and action both advance by one,
    is a loop over those actions. A per-step dt gives every row slots of its own, so its boundary
    rows are such runs (row h's coefficients times U(0..h-1)); gcc's time on a wide stencil's
    dt_vjp was mostly those statements (docs/benchmarks-history.md, seventeenth session, item
    1)."""
    out: list[Statement] = []
    done = 0
    for run in runs(sums, key=_gradient_read, fields=lambda sum_: (sum_[0], sum_[1][0].b.args[0]),
                    min_length=MIN_LOOP, admits=lambda stride: stride == (NEXT, NEXT)):
        out += [_accumulation(q, parts) for q, parts in sums[done : run.start]]
        (q, (first,)), (_, (last,)) = sums[run.start], sums[run.stop - 1]
        j = first.b.args[0]
        value = (Mul(first.a, Read("U", (Rel(0),))),)
        out.append(For(j, last.b.args[0], NEXT, (_accumulation(Strided(q, NEXT, j), value),)))
        done = run.stop
    return out + [_accumulation(q, parts) for q, parts in sums[done:]]


def _gradient_read(sum_: tuple[int, tuple]) -> Read | None:
    """The gradient read G<k>(h) of a sum that is one product ``G<k>(h)·U(j)`` (j fixed), else None."""
    parts = sum_[1]
    product = parts[0] if len(parts) == 1 else None
    if (isinstance(product, Mul) and isinstance(product.b, Read) and product.b.macro == "U"
            and isinstance(product.b.args[0], int)):
        return product.a
    return None


def _integrator_dt_vjp(op: Operator, coefs: Coefficients, refs: References) -> KernelCode:
    """A recurrence's dt_vjp as the adjoint's reverse sweep, rolled into loops over the rows
    (codegen/roll.py): the values the dt-dependent coefficients multiply are read from the
    forward's outputs (``YV<k>``, the launcher runs the forward first), so the column holds a
    few row adjoints at any horizon and the source does not grow with it. A slot that stays
    fixed along the rows (uniform dt) is summed in a local double and added to ``ACC`` once,
    after the loops: on CUDA each ``ACC`` statement is a block-wide reduction."""
    slot = lambda c: coefs.index(c) if coefs.varies(c) else None
    statements, init, finish = _sum_locally(refs.loads(op.columns) + roll.render(roll.dt_vjp_groups(op, refs, coefs.term, slot)),
                                            lambda q: f"acc{q}")
    return KernelCode(TABLE_CALL, _live(init + statements + finish))


def _tangent_terms(coefs: Coefficients, c: sp.Expr, value: Any, tangent: Any) -> list[Term]:
    """The tangent of c·value: ċ·value (when c depends on dt) + c·tangent."""
    return ([Term(Read("CD", (coefs.index(c),)), value)] if coefs.varies(c) else []) + [coefs.term(c, tangent)]


ACC_ROWS = 16
#: A recurrence's dt_jvp column with more rows than this is rolled even with uniform dt (its
#: straight-line form, one value and one tangent per row, took gcc over 3 s at H=256); shorter
#: ones stay straight-line, which gcc vectorises across the dof.
ROLL_DT_JVP_ROWS = 256


def _dt_jvp(op: Operator, coefs: Coefficients, refs: References, spans: list[Span] = (), only: bool = False
            ) -> KernelCode:
    """Tangent: ty = Σ (ċ · value + c · tangent), ċ = Σ_m ∂c/∂dt_m · ddt_m. A stencil's interior
    rows are loops (none with ``only``), its spans' rows span loops; each other row's tangent
    follows its value (rows are in evaluation order), so only a few rows' values are live at once."""
    # a recurrence with per-step coefficients, or a long one: rolled
    if not _is_stencil(op) and (coefs.runs or len(op.rows) > ROLL_DT_JVP_ROWS):
        return KernelCode(coefs.tangent_preamble(), refs.loads(op.columns, tangent=True) + roll.render(
            roll.tangent_groups(op, refs, coefs.term, functools.partial(_tangent_terms, coefs))))
    loops, covered = ([], set()) if only else _dt_jvp_loops(op, coefs)
    spans = _dt_spans(coefs, list(spans))
    covered = covered | _covered(spans)
    span_loops = _span_loops(spans, functools.partial(_span_tangent, coefs, refs))
    body = refs.loads(op.columns, tangent=True)
    for line, row in zip(_forward_lines(op, coefs, refs), op.rows):
        if (row.k, row.h) in span_loops:
            body.append(span_loops[(row.k, row.h)])
        if (row.k, row.h) in covered:
            continue
        body.append(line)
        parts = tuple(t for c, ref in row.terms
                      for t in _tangent_terms(coefs, c, refs.value(ref), refs.value(ref, tangent=True)))
        body.append(Def(Val("ty", row.k, row.h), Sum(parts)))
        body.append(Call(f"TY{row.k}", (row.h,), Val("ty", row.k, row.h)))
    # a stencil's rows read no row: only their tangents are used (gcc and nvcc warned of the values)
    return KernelCode(coefs.tangent_preamble(), _live(body) if _is_stencil(op) else body, loops)


class AsTapes:
    """What runs the coefficient programs, their straight-line parts and runs of long rows as tapes
    (codegen/coefficients.py ``Coefficients.taped_for``, ``row_tapes``; CUDA's): the table's lines,
    dt_jvp (its preamble the tangent program), dt_vjp_finish (the reverse program); each the
    operator's own where it has nothing more to run as a tape."""

    def __init__(self, code: "LoweredOperator"):
        self.code = code
        coefs = code.coefs
        self.same = coefs.taped_for(True) == coefs.taped and not coefs.row_tapes("value")

    @functools.cached_property
    def coefficient_lines(self) -> list[str]:
        return self.code.coefficient_lines if self.same else COLUMN.lines(self.code.coefs.preamble(as_tapes=True))

    @functools.cached_property
    def dt_jvp(self) -> KernelCode:
        if self.same:
            return self.code.dt_jvp
        return dataclasses.replace(self.code.dt_jvp, setup=self.code.coefs.tangent_preamble(as_tapes=True))

    @functools.cached_property
    def dt_vjp_finish(self) -> KernelCode:
        return self.code.dt_vjp_finish if self.same else KernelCode([], self.code.coefs.reverse_program(as_tapes=True))


class LoweredOperator:
    """The statements of an operator's kernels, each lowered on first use."""

    def __init__(self, op: Operator, table: ArgumentTable):
        self.op = op
        self.arguments = table
        self.refs = References(table)
        self.coefs = Coefficients(op)
        self.n_dt = len(op.dt_symbols)
        #: cost terms, or only some outputs written: the forward and adjoint of codegen/fused.py
        self.fused = table.fused
        # the span loops first: their blocks of copies are part of the table every kernel sizes
        self.only = _spans_only(op) and not self.fused
        if self.fused:  # no interior loops or spans (rolled fused columns group their steps: fused.forward_rolled, ...)
            interior, forward, adjoint = set(), [], []
        elif self.only:  # every kernel, C and CUDA: span loops, the interior spans one loop over the knots
            interior: set = set()
            forward = adjoint = _spans(op, self.coefs, interior, knots=True)
        else:  # interior loops; the forward's span loops over the rows they leave
            interior = _forward_loops(op, self.coefs)[1]
            forward, adjoint = _spans(op, self.coefs, interior), _spans(op, self.coefs, set())
        self.spans = {"forward": forward, "adjoint": adjoint,
                      "dt": forward + _leftover_spans(op, self.coefs, _covered(forward) | interior)}
        self.n_coefficients = max(1, self.coefs.size)
        self._c_fused: dict[tuple[str, int, fused.Form], KernelCode] = {}

    @functools.cached_property
    def coefficient_lines(self) -> list[str]:
        """Lines of the shared function that fills the coefficient table from dt."""
        return COLUMN.lines(self.coefs.preamble())

    @functools.cached_property
    def as_tapes(self) -> AsTapes:
        """The once-per-call programs with their straight-line parts and long rows as tapes (CUDA's)."""
        return AsTapes(self)

    @functools.cached_property
    def forward(self) -> KernelCode:
        if self.fused:
            if not _is_stencil(self.op):  # a recurrence's steps one loop (a stencil's: ``fused_rolled``)
                return KernelCode(TABLE_CALL, fused.forward_rolled(self.op, self.coefs, self.refs, self.arguments,
                                                                   _live))
            return KernelCode(TABLE_CALL, fused.forward(self.op, self.coefs, self.refs, self.arguments,
                                                        _forward_lines, _live))
        return _forward(self.op, self.coefs, self.refs, self.spans["forward"], self.only)

    def fused_forms(self) -> list[fused.Form]:
        """The forms a fused step's C entry point may run (codegen/fused.py ``forms``)."""
        return fused.forms(self.arguments)

    def c_fused(self, kernel: str, itemsize: int, form: fused.Form = fused.Form()) -> KernelCode:
        """C's form of a fused forward or adjoint: a float32 forward's cost rows added in runs in float,
        the rows' terms with coefficients of the same magnitude one product (codegen/fused.py ``pairs``),
        a stencil's rows defined ahead of their uses (``defined_ahead``, ``C_AHEAD``);
        ``form``: what a call's parameters allow (codegen/fused.py ``run_rows``, ``Form``). Past
        ``fused.C_ROLL_ABOVE_H`` rows a stencil's are rolled instead (``fused_rolled``: the forward's
        float runs and paired rows as here, the adjoint with a partial sum per action), as gcc's time on
        the straight-line columns grows with H; past ``fused.C_ROLL_RECURRENCE_ABOVE_H`` a recurrence's
        (``c_recurrence_rolled``)."""
        run = fused.run_rows(itemsize) if kernel == "forward" else 1
        past = self.op.horizon > fused.C_ROLL_ABOVE_H
        rolled = self.fused_rolled(kernel, form, run=run, paired=True) if past else None
        if rolled is not None:
            return rolled
        if self.op.horizon > fused.C_ROLL_RECURRENCE_ABOVE_H and self.c_recurrence_rolled(kernel, itemsize, form):
            return self.c_recurrence_rolled(kernel, itemsize, form)
        key = (kernel, run, form)
        if key not in self._c_fused:
            stencil = _is_stencil(self.op)
            extra = {"run": run} if kernel == "forward" else {"paired": stencil}
            build = fused.forward if kernel == "forward" else fused.adjoint
            self._c_fused[key] = KernelCode(TABLE_CALL, build(self.op, self.coefs, self.refs, self.arguments,
                                                              fused.paired_rows, _live, form=form,
                                                              ahead=fused.C_AHEAD[kernel] if stencil else 0, **extra))
        return self._c_fused[key]

    def fused_rolled(self, kernel: str, form: fused.Form = fused.Form(), start_sums: bool = False, run: int = 1,
                     paired: bool = False) -> KernelCode | None:
        """A fused stencil's forward or adjoint with its interior steps rolled into a loop
        (codegen/fused.py ``forward_rolled``, ``adjoint_rolled``): a column whose length does not
        grow with H; a B-spline's interior knot spans one loop over the knots (``fused.Blocks``,
        from the phase whose spans repeat most: ``_knot_phase``); None for recurrences, unfused
        steps and B-splines with too few equal spans for a loop (their straight-line columns stay).
        ``form``: what a call's parameters allow (C's variants, ``c_fused``); ``start_sums``: the
        adjoint's start-state gradients summed step by step (``fused.adjoint_rolled``; CUDA's);
        ``run``, ``paired``: a forward's float runs (C's float32, ``fused.run_rows``) and rows as
        paired products (C's)."""
        if not self.fused or not _is_stencil(self.op):
            return None
        cache = self.__dict__.setdefault("_fused_rolled", {})
        start_sums = start_sums and kernel == "adjoint"
        run, paired = (run, paired) if kernel == "forward" else (1, False)
        extra = {"start_sums": True} if start_sums else {"run": run, "paired": paired} if kernel == "forward" else {}
        key = (kernel, form, start_sums, run, paired)
        if key not in cache:
            build = fused.forward_rolled if kernel == "forward" else fused.adjoint_rolled
            p = _period(self.op)
            blocks = fused.Blocks() if p == 1 else fused.Blocks(p, _knot_phase(self.op, p))
            # the adjoint's groups hold the rows with a gradient (fused.adjoint_rolled's ``nonzero``)
            kept = (lambda row: True) if kernel == "forward" else fused.has_gradient(self.arguments)
            if p > 1 and not _knot_loop_possible(self.op, p, blocks.phase, kept):
                cache[key] = None  # (not built: no loop would form)
                return None
            statements = build(self.op, self.coefs, self.refs, self.arguments, _live, form=form, blocks=blocks,
                               **extra)
            # a B-spline with too few knots for a loop keeps its straight-line columns
            rolled = p == 1 or any(isinstance(s, For) for s in statements)
            cache[key] = KernelCode(TABLE_CALL, statements) if rolled else None
        return cache[key]

    def cuda_fused_rolled(self, kernel: str) -> KernelCode | None:
        """CUDA's ``fused_rolled`` (the start state's gradients summed step by step): a B-spline's
        columns read the row weights where they use them (codegen/fused.py ``volatile_reads``), its
        adjoint each column input just before its first use (``loads_where_used``); a stencil's as
        ``fused_rolled``'s."""
        code = self.fused_rolled(kernel, start_sums=True)
        if code is None or _period(self.op) == 1:
            return code
        weights = {a.macro for a in self.arguments.parameters if a.role == "cost_row_weight"}
        statements = code.statements
        if kernel == "adjoint":
            statements = fused.loads_where_used(statements, self.refs.loads(a.name for a in self.arguments.columns))
        return dataclasses.replace(code, statements=fused.volatile_reads(statements, weights))

    def inputs_where_used(self, code: KernelCode, late: Collection[str]) -> KernelCode:
        """A fused forward's ``code`` with the inputs it reads only at its end (of the kinds ``late``)
        read where first used (CUDA's: codegen/fused.py ``inputs_where_used``)."""
        return dataclasses.replace(code, statements=fused.inputs_where_used(code.statements, self.refs,
                                                                             self.arguments, late))

    def c_recurrence_rolled(self, kernel: str, itemsize: int, form: fused.Form = fused.Form()) -> KernelCode | None:
        """A fused recurrence's C forward or adjoint with its repeating steps as loops, as CUDA's: the
        forward one loop over the steps (codegen/fused.py ``forward_rolled``), the adjoint a reverse scan
        over segments from checkpoints in a local array of the column (``rolled_adjoint``, one level
        within ``C_CHECKPOINT_BYTES``); None for stencils, unfused steps and where no two segments repeat."""
        if not self.fused or _is_stencil(self.op):
            return None
        cache = self.__dict__.setdefault("_c_recurrence_rolled", {})
        if (kernel, itemsize, form) not in cache:
            if kernel == "forward":
                statements = fused.forward_rolled(self.op, self.coefs, self.refs, self.arguments, _live, form=form,
                                                  run=fused.run_rows(itemsize), paired=True)
            else:
                statements = fused.rolled_adjoint(self.op, self.coefs, self.refs, self.arguments, _live, itemsize,
                                                  form, fused.C_CHECKPOINT_BYTES, reread=False,
                                                  segment_rows=fused.C_SCAN_ROWS)
            cache[kernel, itemsize, form] = KernelCode(TABLE_CALL, statements) if statements else None
        return cache[kernel, itemsize, form]

    @functools.cached_property
    def adjoint(self) -> KernelCode:
        if self.fused:
            return KernelCode(TABLE_CALL, fused.adjoint(self.op, self.coefs, self.refs, self.arguments,
                                                        _forward_lines, _live))
        return _adjoint(self.op, self.coefs, self.refs, self.spans["adjoint"], self.only)

    def adjoint_checkpointed(self, itemsize: int) -> KernelCode | None:
        """A fused recurrence's adjoint recomputing its rows segment by segment from checkpoints, for
        CUDA's registers: a reverse scan over segments where its steps repeat (codegen/fused.py
        ``rolled_adjoint``), else straight-line (``_recurrence``); ``itemsize`` sizes its segments.
        None for stencils and unfused steps."""
        if not self.fused or _is_stencil(self.op):
            return None
        cache = self.__dict__.setdefault("_checkpointed", {})
        if itemsize not in cache:
            rolled = fused.rolled_adjoint(self.op, self.coefs, self.refs, self.arguments, _live, itemsize)
            cache[itemsize] = KernelCode(TABLE_CALL, rolled or fused.adjoint(
                self.op, self.coefs, self.refs, self.arguments, _forward_lines, _live, checkpoints=itemsize))
        return cache[itemsize]

    @functools.cached_property
    def gathered_adjoint(self) -> KernelCode:
        """The adjoint with each run of actions gathered in one pass over the output gradients
        (``fused_gathers``), for C; the adjoint itself where nothing fuses (an integrator's), so
        its column text, which the lane form also measures, is printed once."""
        loops = fused_gathers(self.adjoint.loops)
        return self.adjoint if len(loops) == len(self.adjoint.loops) else dataclasses.replace(self.adjoint, loops=loops)

    @functools.cached_property
    def adjoint_loaded_late(self) -> KernelCode | None:
        """A recurrence's plain adjoint (C's, ``gathered_adjoint``) with each output gradient loaded
        where it is first used (``loaded_where_used``), for a thread's small share of the batch
        (codegen/render.py ``late_loads``); None for stencils, whose columns carry nothing, and
        fused steps."""
        if self.fused or _is_stencil(self.op):
            return None
        adjoint = self.gathered_adjoint
        return dataclasses.replace(adjoint, statements=loaded_where_used(adjoint.statements))

    @functools.cached_property
    def stencil(self) -> bool:
        """No row reads another row (position control): nothing is carried along a column."""
        return _is_stencil(self.op)

    @functools.cached_property
    def adjoint_reads(self) -> KernelCode | None:
        """A stencil's adjoint reading each output gradient where it is used (None for integrators),
        for CUDA: span loops only where the period is above 1 (see _spans_only)."""
        if not _is_stencil(self.op) or self.fused:
            return None
        return _adjoint(self.op, self.coefs, self.refs, self.spans["adjoint"], self.only, reads=True)

    # The forward and adjoint columns of an integrator with the recurrence's repeating rows as one
    # loop (None for stencils), for the C lane form at long horizons: their length does not grow
    # with H. The per-dof form keeps the straight-line body, which GCC vectorises across the
    # dof; with an inner loop over rows it no longer does.
    @functools.cached_property
    def forward_rolled(self) -> list[Statement] | None:
        return None if _is_stencil(self.op) or self.fused else self.refs.loads(self.op.columns) + roll.render(
            roll.forward_groups(self.op, self.refs, self.coefs.term))

    @functools.cached_property
    def adjoint_rolled(self) -> list[Statement] | None:
        return None if _is_stencil(self.op) or self.fused else roll.render(
            *roll.adjoint_groups(self.op, self.refs, self.coefs.term))

    @functools.cached_property
    def dt_vjp(self) -> KernelCode:
        return _dt_vjp(self.op, self.coefs, self.refs, self.spans["dt"], self.only)

    @functools.cached_property
    def dt_vjp_finish(self) -> KernelCode:
        return KernelCode([], self.coefs.reverse_program())

    @functools.cached_property
    def dt_jvp(self) -> KernelCode:
        return _dt_jvp(self.op, self.coefs, self.refs, self.spans["dt"], self.only)


def lower(op: Operator, table: ArgumentTable) -> LoweredOperator:
    """Lower an operator over its spec's argument table; each kernel's statements are produced when
    first asked for."""
    return LoweredOperator(op, table)
