"""Rolling an integration recurrence into a loop over the horizon.

An integrator's rows repeat: row h reads row h-1 (and the action h-1) with the same
coefficients (uniform dt) or with coefficients that advance through the table by a fixed
stride (per-step dt). Emitted straight-line, a column body grows with H, and so does the C
compiler's time on it (superlinearly for vector code). Here each row h becomes a *group* of
statements whose positions are relative to h; a run of equal groups is emitted once, as a
loop, with the values that later rows read carried in variables from one iteration to the
next. The adjoint runs the same way backwards (a reverse scan). Groups that do not repeat
(the first rows, the last ones) stay straight-line, so the generated body's length no longer
depends on the horizon.

A group holds the shared statements (codegen/statements.py) with ``Rel`` positions: in
``U(Rel(-1))``, in a store ``Y0(Rel(0), v)`` and in the row of a value ``Val("yb", k, Rel(1))``.
Straight-line, ``place`` fixes them at the group's row; in a loop, positions print as
offsets from the loop variable r and values become the loop's own and carried variables.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from operator import itemgetter
from typing import Any, Callable, Iterable, Mapping

import sympy as sp

from .operator import Operator, action, is_action, is_row
from .references import References
from .runs import NEXT, run_at, shared
from .statements import (Add, Call, Cast, Def, For, Mul, Paren, Read, Rel, Shift, Statement, Store, Strided, Sum, Term,
                         Val, Var, place, transform, walk)

MIN_ROLL = 4  # shorter runs of equal groups stay straight-line

TermOf = Callable[[sp.Expr, Any], Term]  # a coefficient times an operand (codegen/coefficients.py)


@dataclasses.dataclass
class Group:
    """The statements of one row h, with positions relative to h."""

    h: int
    statements: list[Statement]


class NotRollable(Exception):
    """A rolled rendering would read a value no statement defines (the caller goes straight-line)."""


def _relative(refs: References, ref: tuple, h: int, tangent: bool = False) -> Any:
    """A reference's value (its tangent with ``tangent``) with positions relative to row h."""
    if is_row(ref):
        return Val("ty" if tangent else "y", ref[1], Rel(ref[2] - h))
    if is_action(ref):
        return _at(refs.value(ref, tangent), h)
    return refs.value(ref, tangent)


def _at(node: Read | Call, h: int) -> Read | Call:
    """An action's read or gradient store with its row relative to row h."""
    return dataclasses.replace(node, args=(Rel(node.args[0] - h),) + tuple(node.args[1:]))


#: a reference's value relative to a row, and an action's read or store at a row-relative position
relative, at = _relative, _at


def forward_groups(op: Operator, refs: References, term: TermOf) -> list[Group]:
    """Forward: each row's value, then its store, grouped by row h in evaluation order."""
    groups: dict[int, Group] = {}
    for row in op.rows:
        value = Sum(tuple(term(c, _relative(refs, ref, row.h)) for c, ref in row.terms))
        own = Val("y", row.k, Rel(0))
        groups.setdefault(row.h, Group(row.h, [])).statements += [Def(own, value), Call(f"Y{row.k}", (Rel(0),), own)]
    return list(groups.values())


def tangent_groups(op: Operator, refs: References, term: TermOf,
                   tangent: Callable[[sp.Expr, Any, Any], list[Term]]) -> list[Group]:
    """dt_jvp: each row's value and its tangent ``tangent(coef, value, value's tangent)`` summed
    over its terms, then the tangent's store, grouped by row h in evaluation order."""
    groups: dict[int, Group] = {}
    for row in op.rows:
        value = Sum(tuple(term(c, _relative(refs, ref, row.h)) for c, ref in row.terms))
        dot = Sum(tuple(t for c, ref in row.terms
                        for t in tangent(c, _relative(refs, ref, row.h), _relative(refs, ref, row.h, tangent=True))))
        own, tan = Val("y", row.k, Rel(0)), Val("ty", row.k, Rel(0))
        groups.setdefault(row.h, Group(row.h, [])).statements += [Def(own, value), Def(tan, dot),
                                                                  Call(f"TY{row.k}", (Rel(0),), tan)]
    return list(groups.values())


def _readers(op: Operator) -> dict[tuple, list[tuple[sp.Expr, int, int]]]:
    """ref → (coef, k, h) of the rows that read it."""
    readers: dict[tuple, list[tuple[sp.Expr, int, int]]] = defaultdict(list)
    for row in op.rows:
        for c, ref in row.terms:
            readers[ref].append((c, row.k, row.h))
    return readers


def _reverse_groups(op: Operator, term: TermOf, readers: dict[tuple, list[tuple[sp.Expr, int, int]]],
                    after: Callable[[int, list, Callable], list[Statement]]
                    ) -> tuple[list[Group], Callable[[tuple, int], Sum]]:
    """Groups of reverse accumulation, from the last row h down: within a group the rows' total
    adjoints yb<k> in reverse order, then ``after(h, rows, gather)``'s statements; and ``gather``:
    ``gather(ref, h)`` is the sum of a ref's readers' coefficients times their adjoints."""
    by_h: dict[int, list] = defaultdict(list)
    for row in op.rows:
        by_h[row.h].append(row)

    def gather(ref: tuple, h: int) -> Sum:
        return Sum(tuple(term(c, Val("yb", k, Rel(hh - h))) for c, k, hh in readers[ref]))

    groups = []
    for h in sorted(by_h, reverse=True):
        statements: list[Statement] = []
        for row in reversed(by_h[h]):
            own = Sum((Term(None, Read(f"G{row.k}", (Rel(0),))),) + gather(("y", row.k, h), h).terms)
            statements.append(Def(Val("yb", row.k, Rel(0)), own))
        groups.append(Group(h, statements + after(h, by_h[h], gather)))
    return groups, gather


def adjoint_groups(op: Operator, refs: References, term: TermOf) -> tuple[list[Group], list[Statement]]:
    """Adjoint (reverse accumulation): groups from the last row h down; within a group the
    rows' total adjoints yb<k> in reverse order, then the action gradients this group
    completes. The tail: actions no row reads, and the gradients of the per-column inputs."""
    readers = _readers(op)
    done_at: dict[int, list[int]] = defaultdict(list)  # row h → actions whose last reader is at h
    for j in range(op.n_actions):
        if readers.get(action(j)):
            done_at[min(h for _, _, h in readers[action(j)])].append(j)

    def actions(h: int, rows: list, gather: Callable) -> list[Statement]:
        return [_at(refs.gradient(action(j), gather(action(j), h).terms), h) for j in done_at.get(h, [])]

    groups, gather = _reverse_groups(op, term, readers, actions)
    # the tail is placed at h = 0, so its positions are absolute
    tail: list[Statement] = [_at(refs.gradient(action(j), ()), 0) for j in range(op.n_actions)
                             if not readers.get(action(j))]
    tail += [refs.gradient(ref, gather(ref, 0).terms) for ref in refs.differentiable(0, op.columns)]
    return groups, tail


def _value(refs: References, ref: tuple, h: int) -> Any:
    """A ref's forward value, relative to row h: an input, or an earlier row as the forward wrote
    it (``YV<k>``, read from its output)."""
    if is_row(ref):
        return Read(f"YV{ref[1]}", (Rel(ref[2] - h),))
    return _relative(refs, ref, h)


def dt_vjp_groups(op: Operator, refs: References, term: TermOf, slot: Callable[[sp.Expr], int | None]) -> list[Group]:
    """dt_vjp: the adjoint's reverse sweep, where each group then adds, for every dt-dependent
    coefficient of its rows (``slot(coef)``: its table slot, None for the others), the sum of
    row adjoint times the value the coefficient multiplies to ``ACC(slot)``. Values are read
    from the forward's outputs, so nothing is recomputed and only a few adjoints are live."""
    def uses(h: int, rows: list, gather: Callable) -> list[Statement]:
        parts: dict[int, list] = defaultdict(list)
        for row in rows:
            for c, ref in row.terms:
                q = slot(c)
                if q is not None:
                    parts[q].append(Mul(Val("yb", row.k, Rel(0)), _value(refs, ref, h)))
        return [Store(Read("ACC", (q,)), Cast("double", Paren(Add(tuple(p)))), "+=") for q, p in parts.items()]
    return _reverse_groups(op, term, _readers(op), uses)[0]


def _carry(prefix: str, k: int, m: int, first: int) -> Var:
    """The variable holding <prefix><k> of m rows back, in the loop that starts at row ``first``
    (a body can hold several loops, each with its own carries)."""
    return Var(f"{prefix}{k}_p{m}_{first}")


def _name(v: Val) -> str:
    return f"{v.prefix}{v.k}_{v.h}"


# -- signatures: what must be equal for groups to share one loop body ------------------------
def _is_slot(n: Any) -> bool:
    """A read of the coefficient table (C), of its dt tangent (CD) or of dt_vjp's accumulator (ACC)
    at a fixed slot."""
    return isinstance(n, Read) and n.macro in ("C", "CD", "ACC") and isinstance(n.args[0], int)


def shape(group: Group) -> tuple:
    """The statements with their table coefficients blanked (their slots may advance along a run)."""
    return transform(tuple(group.statements), lambda n: Read(n.macro, (None,)) if _is_slot(n) else None)


def slots(group: Group) -> tuple:
    """The table slots the group's statements read, in order."""
    return tuple(n.args[0] for n in walk(tuple(group.statements)) if _is_slot(n))


# -- rolling ---------------------------------------------------------------------------------
def straight(group: Group, defined: set[str]) -> list[Statement]:
    """The group at its row; every value it reads must be defined already."""
    out = []
    for s in group.statements:
        s = place(s, group.h)
        reads = s.value if isinstance(s, Def) else s
        missing = [_name(v) for v in walk(reads) if isinstance(v, Val) and _name(v) not in defined]
        if missing:
            raise NotRollable(missing[0])
        if isinstance(s, Def):
            defined.add(_name(s.target))
        out.append(s)
    return out


def rolled(run: list[Group], step: int, defined: set[str]) -> list[Statement]:
    """One loop for a run of equal groups (rows run[0].h, run[0].h + step, ...)."""
    first, last = run[0].h, run[-1].h
    slots0, slots1 = slots(run[0]), slots(run[1])
    stride = next((b - a for a, b in zip(slots0, slots1)), 0) * step  # per unit of h
    carried: dict[tuple[str, int], int] = {}  # (prefix, k) → depth
    for s in run[0].statements:
        for v in walk(s.value if isinstance(s, (Def, Store, Call)) else s):
            if isinstance(v, Val) and isinstance(v.h, Rel) and v.h.rel != 0:
                carried[(v.prefix, v.k)] = max(carried.get((v.prefix, v.k), 0), abs(v.h.rel))
    own = {(s.target.prefix, s.target.k) for s in run[0].statements if isinstance(s, Def)}
    if not set(carried) <= own:
        raise NotRollable("a carried value is not defined in every row")
    # a group per knot span (codegen/fused.py ``Blocks``): its rows' positions advance by the span's
    # rows per iteration (``Shift``, printed over the knot variable kn), its rows' values are its own
    knots = any(isinstance(n, Shift) for n in walk(tuple(run[0].statements)))
    spanned = {(s.target.prefix, s.target.k, s.target.h) for s in run[0].statements
               if isinstance(s, Def) and isinstance(s.target, Val) and isinstance(s.target.h, Shift)}
    out: list[Statement] = []
    for (p, k), depth in carried.items():
        for m in range(1, depth + 1):
            source = Val(p, k, first - step * m)
            if _name(source) not in defined:
                raise NotRollable(_name(source))
            out.append(Def(_carry(p, k, m, first), source, const=False))  # updated every iteration

    def in_loop(n: Any) -> Any:
        if isinstance(n, Val) and isinstance(n.h, Shift):
            if (n.prefix, n.k, n.h) not in spanned:
                raise NotRollable(f"{n.prefix}{n.k} reads another span's row")
            return Var(f"{n.prefix}{n.k}_c{n.h.base}")
        if isinstance(n, Val):
            if n.h.rel * step > 0:
                raise NotRollable(f"{n.prefix}{n.k} reads a later row")
            return Var(f"{n.prefix}{n.k}_c") if n.h.rel == 0 else _carry(n.prefix, n.k, abs(n.h.rel), first)
        if _is_slot(n) and stride != 0:
            if knots:
                raise NotRollable("table slots advancing over knots")
            return Read(n.macro, (Strided(n.args[0], stride, first),))
        return None

    body = [transform(s, in_loop) for s in run[0].statements]
    for (p, k), depth in carried.items():
        body += [Store(_carry(p, k, m, first), _carry(p, k, m - 1, first)) for m in range(depth, 1, -1)]
        body.append(Store(_carry(p, k, 1, first), Var(f"{p}{k}_c")))
    out.append(For(first, last, step, tuple(body), var="kn" if knots else "r"))
    for (p, k), depth in carried.items():  # the last rows' values, by the names later rows read
        for m in range(1, depth + 1):
            value = Val(p, k, last - step * (m - 1))
            out.append(Def(value, _carry(p, k, m, first)))
            defined.add(_name(value))
    return out


def longest_stretch(statements: Iterable[Statement], lines: Callable[[list[Statement]], list[str]]) -> int:
    """The printed lines (``lines``) of the longest stretch of ``statements`` outside their loops, each
    loop's body counted as stretches of its own: a rolled column's first groups, its loop's body and its
    last groups are separate blocks to the compiler, however long the column is in all."""
    longest, stretch = 0, []
    for s in statements:
        if isinstance(s, For):
            longest = max(longest, len(lines(stretch)), longest_stretch(s.body, lines))
            stretch = []
        else:
            stretch.append(s)
    return max(longest, len(lines(stretch)))


def render(groups: list[Group], tail: list[Statement] = (), after: Mapping[int, list[Statement]] = {},
           period: int = 0) -> list[Statement]:
    """Runs of at least MIN_ROLL equal groups as loops, everything else straight-line; all
    straight-line if a loop would leave a later read undefined. ``after``: statements that follow
    group h's (the same at every row of a loop they fall in), a loop cut there (``_cut``, blocks of
    ``period`` rows where they come every ``period`` rows)."""
    try:
        return _render(groups, tail, roll=True, after=after, period=period)
    except NotRollable:
        return _render(groups, tail, roll=False, after=after, period=period)


def _render(groups: list[Group], tail: list[Statement], roll: bool, after: Mapping[int, list[Statement]],
            period: int) -> list[Statement]:
    defined: set[str] = set()
    out: list[Statement] = []
    items = [(shape(g), (g.h, *slots(g))) for g in groups] if roll else []  # a group's shape and fields
    i = 0
    while i < len(groups):
        j = run_at(items, i, key=itemgetter(0), fields=itemgetter(1), admits=_rows).stop if roll else i + 1
        if j - i >= MIN_ROLL:
            loop = rolled(groups[i:j], groups[i + 1].h - groups[i].h, defined)
            out += [piece for s in loop for piece in (_cut(s, after, period) if isinstance(s, For) else [s])]
        else:  # a short run's first group: the next one may begin a longer run
            j = i + 1
            out += straight(groups[i], defined) + list(after.get(groups[i].h, ()))
        i = j
    return out + straight(Group(0, list(tail)), defined)


def _cut(loop: For, after: Mapping[int, list[Statement]], period: int) -> list[Statement]:
    """A loop over consecutive rows with ``after``'s statements after the rows it has them for. Where
    those rows come every ``period`` rows with the same statements (runs of rows, ``period`` long,
    the first and a last one at the loop's end shorter), one loop over the runs (``rs``: a run's
    first row), each the loop over its rows, then the statements; rows after the last such row one
    more loop. Else the loop cut at each such row."""
    cuts = [h for h in sorted(after) if isinstance(loop.first, int) and loop.first <= h <= loop.last]
    if not cuts or loop.step != 1:
        assert not cuts, "statements after rows in a loop that runs down"
        return [loop]
    piece = lambda first, last: dataclasses.replace(loop, first=first, last=last)
    steps = [b - a for a, b in zip(cuts, cuts[1:])]
    short = bool(steps) and steps[-1] < period and cuts[-1] == loop.last  # a last run cut short by the loop's end
    uniform = period > 1 and cuts[0] - loop.first < period and all(d == period for d in steps[:-1 if short else None]) \
        and all(after[h] == after[cuts[0]] for h in cuts)
    if not uniform:
        out: list[Statement] = []
        start = loop.first
        for h in cuts:
            out += [piece(start, h), *after[h]]
            start = h + 1
        return out + ([piece(start, loop.last)] if start <= loop.last else [])
    start = cuts[0] - period + 1  # the first run's first row, before the loop's where it is cut short
    first = Var("rs") if start == loop.first else Var(f"rs > {loop.first} ? rs : {loop.first}")
    last = Var(f"(rs + {period - 1} < {loop.last} ? rs + {period - 1} : {loop.last})") if short \
        else Var(f"rs + {period - 1}")
    rows = piece(first, last)
    outer = For(start, (cuts[-2] if short else cuts[-1] - period) + 1, period, (rows, *after[cuts[0]]), unroll=False,
                var="rs")
    return [outer] + ([piece(cuts[-1] + 1, loop.last)] if cuts[-1] < loop.last else [])


def _rows(stride: tuple[int, ...]) -> bool:
    """Groups that can share a loop: consecutive rows, up or down, with every table slot at one stride."""
    return abs(stride[0]) == NEXT and shared(stride[1:])


# -- a reverse scan over segments (a fused recurrence's adjoint, codegen/fused.py) -------------
#: fewest segments the loops of ``segmented`` run; fewer: the caller keeps its straight-line form
MIN_SEGMENTS = 2
#: segments a block of the two-level scan holds (``segmented``, where one level's checkpoints would
#: pass the budget): the stack then holds a checkpoint a block and one a segment of the block
BLOCK_SEGMENTS = 8


def _block(length: int, size: int, checkpoint: int, budget: int) -> int | None:
    """The steps a checkpoint of ``segmented``'s first loop covers for a run of ``length`` steps in
    segments of ``size`` (``checkpoint`` bytes a segment's): ``size`` where one level's checkpoints
    fit ``budget``, else the fewest steps a block of two levels whose array fits it (the blocks', one
    for the segments before them, one block's segments'), None where none does."""
    if (length // size) * checkpoint <= budget:
        return size
    block = size * BLOCK_SEGMENTS
    while length // block >= 1:
        n = length // block
        if (((length - n * block) // size > 0) + n + block // size) * checkpoint <= budget:
            return block
        block += size
    return None


def _plan(length: int, size: int, longest: int, checkpoint: int, budget: int) -> tuple[int, int | None]:
    """The segments' steps and ``_block``'s steps a checkpoint for a run of ``length`` steps: one level
    where segments of ``size`` to ``longest`` steps (the most whose recomputed rows fit a segment's
    registers) fit ``budget``, the shortest such; else ``_block``'s at ``size``. Two levels run the
    blocks' steps forward once more (their rows recomputed, their inputs read again) to save
    checkpoints that longer segments save as well, for registers only."""
    one = next((s for s in range(size, longest + 1) if _block(length, s, checkpoint, budget) == s), None)
    return (one, one) if one is not None else (size, _block(length, size, checkpoint, budget))


def _defines_row(s: Statement) -> bool:
    return isinstance(s, Def) and isinstance(s.target, Val) and s.target.prefix == "y"


def _reads_inputs_only(s: Def) -> bool:
    """A row whose value reads no other row and no table slot: the same read at any step."""
    return not any(isinstance(n, Val) or _is_slot(n) for n in walk(s.value))


def _needed(values: list[Statement], reverse: list[Statement]) -> tuple[set[int], dict[int, int]]:
    """Of a step's rows (``values``' definitions), those its reverse accumulation reads, with the
    rows their values read in turn (a step's rows as every step's); and, of those, the rows read
    from earlier steps, each with the most steps back it is read (the segment's checkpoint)."""
    defs = {s.target.k: s for s in values if _defines_row(s)}
    needed = {v.k for v in walk(tuple(reverse)) if isinstance(v, Val) and v.prefix == "y"}
    todo, back = list(needed), {}
    while todo:
        for v in walk(defs[k].value) if (k := todo.pop()) in defs else ():
            if isinstance(v, Val) and v.prefix == "y":
                if v.h.rel < 0:
                    back[v.k] = max(back.get(v.k, 0), -v.h.rel)
                if v.k not in needed:
                    needed.add(v.k)
                    todo.append(v.k)
    return needed, back


def segmented(values: list[Group], reverse: list[Group], itemsize: int, rows: int, budget: int,
              again: Callable[[Any], Any]) -> list[Statement] | None:
    """A reverse accumulation whose rows' values are recomputed segment by segment. ``values[h]``:
    step h's row definitions (``y``, reading earlier steps at ``Rel`` < 0), ``reverse[h]``: its
    reverse accumulation (reading its own rows' values at ``Rel(0)`` and later steps' adjoints
    ``yb`` at ``Rel`` > 0). The longest run of steps whose groups repeat is cut, from its end, into
    segments of about ``rows`` row values (a segment's, held at once in registers). A first loop
    runs the steps forward and stores each segment's incoming values (its checkpoint, ``TS_CK``);
    a second, from the last segment, loads them, recomputes the segment's rows (straight-line)
    and runs their reverse accumulation, the adjoints that the segment before reads carried.
    A checkpoint holds the carried values a recomputed segment reads (its reverse accumulation's
    rows and the rows those read, ``_needed``), but for rows that read only inputs (an action):
    those are read again. Where the checkpoints would pass ``budget`` bytes (``itemsize`` a value),
    longer segments first, while a segment's recomputed rows stay within ``rows`` (``_plan``); else
    two levels: blocks of ``BLOCK_SEGMENTS`` or more segments (the segments before them one shorter
    block), the first loop keeping a checkpoint a block, the second recomputing a block's segment
    checkpoints before its segments (one more forward pass); where no block fits either, longer
    segments (``_block``).
    Steps before the run are straight-line in both passes (the second time through ``again``,
    which renames their values and rereads their inputs), steps after it too. Every statement is
    a group's, in the order of the straight-line column. None where fewer than ``MIN_SEGMENTS``
    segments repeat, or the groups read values this does not carry."""
    steps = len(values)
    if steps != len(reverse) or any(g.h != h for h, g in enumerate(values)):
        return None
    items = [(shape(Group(h, v.statements + r.statements)), (h, *slots(v), *slots(r)))
             for h, (v, r) in enumerate(zip(values, reverse))]
    best, i = None, 0
    while i < steps:
        run = run_at(items, i, key=itemgetter(0), fields=itemgetter(1), admits=_rows)
        best = run if best is None or len(run) > len(best) else best
        i = run.stop
    first, last = best.start, best.stop - 1
    stride = best.stride[1] if len(best.stride) > 1 else 0
    back: dict[int, int] = {}  # y<k> read m steps back
    ahead: dict[int, int] = {}  # yb<k> read m steps ahead
    for v in walk(tuple(values[first].statements)):
        if isinstance(v, Val) and v.prefix == "y" and v.h.rel < 0:
            back[v.k] = max(back.get(v.k, 0), -v.h.rel)
    for v in walk(tuple(reverse[first].statements)):
        if isinstance(v, Val) and v.h.rel != 0:
            if v.prefix != "yb" or v.h.rel < 0:
                return None
            ahead[v.k] = max(ahead.get(v.k, 0), v.h.rel)
    per_step = sum(isinstance(s, Def) for s in values[first].statements)
    size = max(1, rows // max(1, per_step), *back.values(), *ahead.values())
    carried = [(k, m) for k in sorted(back) for m in range(1, back[k] + 1)]
    # the checkpoints: of the values carried, those a recomputed segment reads (the others the first
    # loop carries to the steps after the run only)
    needed, reads_back = _needed(values[first].statements, reverse[first].statements)
    recomputed = sum(_defines_row(s) and s.target.k in needed for s in values[first].statements)
    inputs = {s.target.k: s for s in values[first].statements if _defines_row(s) and _reads_inputs_only(s)}
    again_read = [(k, m) for k in sorted(reads_back) if k in inputs for m in range(1, reads_back[k] + 1)]
    kept = [(k, m) for k in sorted(reads_back) if k not in inputs for m in range(1, reads_back[k] + 1)]
    adjoints = [(k, m) for k in sorted(ahead) for m in range(1, ahead[k] + 1)]
    length = last - first + 1
    size, block = _plan(length, size, max(size, rows // max(1, recomputed)), len(kept) * itemsize, budget)
    while block is None and size < length // MIN_SEGMENTS:  # longer segments: fewer checkpoints
        size += 1
        block = _block(length, size, len(kept) * itemsize, budget)
    if block is None:
        return None
    n = length // block if block > size else 0  # blocks of the two-level scan, at the run's end
    single = (length - n * block) // size  # segments before them
    lead = bool(n and single)  # two levels: the segments before the blocks one more (shorter) block
    start = last + 1 - n * block - single * size  # the first segment's first step
    if n * block // size + single < MIN_SEGMENTS or start - max(back.values(), default=0) < 0 \
            or last + max(ahead.values(), default=0) >= steps:
        return None
    blocks = start + single * size  # the first block's first step

    def in_segment(group: Group, i: int, outside: str, own: str = "s") -> list[Statement]:
        """Step ``start + i``'s group at position i of the segment that starts at row r: its values
        as the segment's locals (``_<own><i>``), those of the segment before as ``_<outside><m>``,
        those of the one after as ``_n<m>``; its table slots advancing with r."""
        def fn(node: Any) -> Any:
            if isinstance(node, Val):
                p = node.h.rel + i
                tag = f"{own}{p}" if 0 <= p < size else f"{outside}{-p}" if p < 0 else f"n{p - size}"
                return Var(f"{node.prefix}{node.k}_{tag}")
            if _is_slot(node) and stride:
                return Read(node.macro, (Strided(node.args[0], stride, start),))
            return Rel(node.rel + i) if isinstance(node, Rel) else None
        return [transform(s, fn) for s in group.statements]

    # the checkpoint array: the single segments' (with two levels, their one checkpoint), the
    # blocks', then a block's segments'
    firsts = 1 if lead else single
    bases = (0, firsts * len(kept), (firsts + n) * len(kept))

    def checkpoint(j: int, var: str, origin: Any, every: int, base: int) -> Read:
        """Checkpoint value j of the segment (or block) that starts at ``var``, counted from ``origin``."""
        return Read("TS_CK", (Var(f"{base} + {len(kept)} * (({var} - {origin}) / {every}) + {j}"),))

    held = lambda k, m: Var(f"y{k}_m{m}")  # the values the next segment reads, carried forward
    keep = lambda var, origin, every, base: [Store(checkpoint(j, var, origin, every, base), held(k, m))
                                             for j, (k, m) in enumerate(kept)]
    # a segment's values: every row in the first loop, the rows a recomputation needs again
    used = lambda group: Group(group.h, [s for s in group.statements if not _defines_row(s) or s.target.k in needed])
    forward = [s for i in range(size) for s in in_segment(values[start + i], i, "m", "f")]
    forward += [Store(held(k, m), Var(f"y{k}_f{size - m}")) for k, m in carried]
    # a row that reads only inputs (an action) is read again m steps back, not kept
    read_back = lambda k, m: in_segment(Group(first, [inputs[k]]), -m, "q")[0].value
    forward_again = [Store(held(k, m), read_back(k, m)) for k, m in again_read]
    forward_again += [s for i in range(size) for s in in_segment(used(values[start + i]), i, "m", "f")]
    forward_again += [Store(held(k, m), Var(f"y{k}_f{size - m}")) for k, m in kept]

    def segment(origin: Any, base: int) -> list[Statement]:
        """A segment's values from its checkpoint, then its reverse accumulation."""
        out = [Def(Var(f"y{k}_q{m}"), checkpoint(j, "r", origin, size, base)) for j, (k, m) in enumerate(kept)]
        out += [Def(Var(f"y{k}_q{m}"), read_back(k, m)) for k, m in again_read]
        out += [s for i in range(size) for s in in_segment(used(values[start + i]), i, "q")]
        out += [s for i in reversed(range(size)) for s in in_segment(reverse[start + i], i, "q")]
        return out + [Store(Var(f"yb{k}_n{m - 1}"), Var(f"yb{k}_s{m - 1}")) for k, m in adjoints]

    inner = lambda *statements: For(Var("rs"), Var(f"rs + {block - size}"), size, tuple(statements), unroll=False)
    out: list[Statement] = [Call("TS_CHECKPOINTS", (bases[2] + (block // size if n else 0) * len(kept),))] \
        if kept else []
    out += [place(s, h) for h in range(start) for s in values[h].statements]
    out += [Def(held(k, m), Val("y", k, start - m), const=False) for k, m in carried]
    at_start = [Store(Read("TS_CK", (j,)), held(k, m)) for j, (k, m) in enumerate(kept)]
    if single:
        out += at_start if lead else []
        out.append(For(start, blocks - size, size, tuple(([] if lead else keep("r", start, size, bases[0])) + forward),
                       unroll=False))
    if n:
        out.append(For(blocks, last + 1 - block, block, (*keep("rs", blocks, block, bases[1]), inner(*forward)),
                       unroll=False, var="rs"))
    out += [Def(Val("y", k, last + 1 - m), held(k, m)) for k, m in carried]
    out += [place(s, h) for h in range(last + 1, steps) for s in values[h].statements]
    out += [place(s, h) for h in reversed(range(last + 1, steps)) for s in reverse[h].statements]
    out += [Def(Var(f"yb{k}_n{m - 1}"), Val("yb", k, last + m), const=False) for k, m in adjoints]
    if n:  # a block: its checkpoint, its segments' checkpoints recomputed, then its segments from the last
        load = [Store(held(k, m), checkpoint(j, "rs", blocks, block, bases[1])) for j, (k, m) in enumerate(kept)]
        again_ = For(Var(f"rs + {block - size}"), Var("rs"), -size, tuple(segment("rs", bases[2])), unroll=False)
        out.append(For(last + 1 - block, blocks, -block, (*load, inner(*keep("r", "rs", size, bases[2]), *forward_again),
                                                           again_), unroll=False, var="rs"))
    if lead:  # as a block: its segments' checkpoints recomputed from its own, then its segments
        out += [Store(held(k, m), Read("TS_CK", (j,))) for j, (k, m) in enumerate(kept)]
        out.append(For(start, blocks - size, size, tuple(keep("r", start, size, bases[2]) + forward_again),
                       unroll=False))
    if single:
        out.append(For(blocks - size, start, -size, tuple(segment(start, bases[2] if lead else bases[0])),
                       unroll=False))
    out += [Def(Val("yb", k, start + m - 1), Var(f"yb{k}_n{m - 1}")) for k, m in adjoints]
    if start:
        out.append(Call("TS_REREAD"))
        out += [transform(place(s, h), again) for h in range(start) for s in values[h].statements]
        out += [transform(place(s, h), again) for h in reversed(range(start)) for s in reverse[h].statements]
    return out
