"""CUDA's straight-line column statements with each input read once, where it is first needed.

A wide stencil's boundary rows read the same inputs in many statements. As written, each
statement reads them again (``G4(7)`` in five gradient stores, ``DU(1)`` in eight tangents): nvcc
either keeps a value from its first statement to its last, or, for a read under a null check
(``(du ? du[...] : 0)``), loads it again for every statement and hoists those loads; either way
the column needed more registers than the per-element limit and spilled at the cap (order 4,
per-step dt: adjoints 130-255 registers, tangents 24-32 bytes of spills). Here:

- ``in_read_order``: a run of gradient stores, each a sum of output-gradient reads (times table
  coefficients), becomes one accumulator per sum (per parenthesised partial sum of a long one)
  and the reads run once each, in an order every sum's terms keep; each value is added to the
  sums that use it right after its load, and a store follows the last read its sum needs. What
  is live is the sums under way and one value.
- ``loaded_once``: an input several statements read as a term's operand is loaded into a local
  right before the first of them.

Each sum adds the same terms in the same order: results are bit for bit those of the statements
as written where the compiler fuses no multiply-add (gcc on the host, contracting, picks its
fused multiply-adds differently for the two texts).
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Iterator, Optional, Union

from .statements import Call, Def, For, Paren, Read, Statement, Store, Sum, Term, Var, transform, walk

#: what a sum's term multiplies: an input's read at a fixed position, or a local
Key = Union[Read, Var]


def _value(key: Key) -> Var:
    """The local a read is loaded into (``G4(7)`` → ``g4_7``, ``DU(3)`` → ``du_3``), a local itself."""
    return key if isinstance(key, Var) else Var(key.macro.lower() + "".join(f"_{a}" for a in key.args))


def _fixed(term: Term) -> bool:
    """A term whose operand is a read at a fixed position (an input's value, not a local)."""
    return isinstance(term.operand, Read) and bool(term.operand.args) and all(
        isinstance(a, int) for a in term.operand.args)


def _partials(value: Sum) -> Optional[list[tuple[Term, ...]]]:
    """The sums a gradient store adds in turn: its terms (one sum), or each parenthesised partial
    sum of them; None where the value has any other form or a term is not a coefficient (or 1)
    times an output gradient's read or a local (a span loop's sum, which no statement of a run
    changes)."""
    if not isinstance(value, Sum) or not value.terms:
        return None
    if all(isinstance(t.operand, Paren) and t.factor is None and not t.negative for t in value.terms):
        parts = [t.operand.x.terms if isinstance(t.operand.x, Sum) else () for t in value.terms]
    else:
        parts = [value.terms]
    leaf = lambda t: (t.factor is None or isinstance(t.factor, Read)) and (
        isinstance(t.operand, Var) or _fixed(t) and t.operand.macro.startswith("G"))
    if not all(p and all(leaf(t) for t in p) for p in parts):
        return None
    return parts


def _topological(after: dict[Key, list[Key]], before: dict[Key, int]) -> list[Key]:
    """The reads in some order that keeps every ``after`` edge (shorter where there is a cycle)."""
    count = dict(before)
    ready = [key for key, n in count.items() if n == 0]
    out: list[Key] = []
    while ready:
        key = ready.pop()
        out.append(key)
        for nxt in after[key]:
            count[nxt] -= 1
            if count[nxt] == 0:
                ready.append(nxt)
    return out


def _order(sums: list[tuple[Term, ...]]) -> Optional[list[Key]]:
    """Every read once, each sum's reads in its order; None where two sums order some reads
    differently or a sum reads a value twice. The sums that share reads (a group: the stores of
    one boundary) one group after another, in the order of their first stores; of a group's reads
    that may come next, the one that starts the fewest sums less those it completes, then the one
    that most reads must follow, then the one used first (few sums under way at once)."""
    after: dict[Key, list[Key]] = {}
    before: dict[Key, int] = {}
    users: dict[Key, list[int]] = {}
    for n, terms in enumerate(sums):
        keys = [t.operand for t in terms]
        if len(set(keys)) != len(keys):
            return None
        for key in keys:
            users.setdefault(key, []).append(n)
            after.setdefault(key, [])
            before.setdefault(key, 0)
        for a, b in zip(keys, keys[1:]):
            if b not in after[a]:
                after[a].append(b)
                before[b] += 1
    some = _topological(after, before)
    if len(some) != len(users):
        return None
    height: dict[Key, int] = {}  # the most reads that must follow a read
    for key in reversed(some):
        height[key] = max((height[n] + 1 for n in after[key]), default=0)
    first = {key: i for i, key in enumerate(users)}
    group = _groups(sums, users)
    left = [len(terms) for terms in sums]

    def cost(key: Key) -> tuple[int, int, int, int]:
        starts = sum(1 for n in users[key] if left[n] == len(sums[n]))
        ends = sum(1 for n in users[key] if left[n] == 1)
        return group[users[key][0]], starts - ends, -height[key], first[key]

    ready = [key for key, n in before.items() if n == 0]
    order: list[Key] = []
    while ready:
        key = min(ready, key=cost)
        ready.remove(key)
        order.append(key)
        for n in users[key]:
            left[n] -= 1
        for nxt in after[key]:
            before[nxt] -= 1
            if before[nxt] == 0:
                ready.append(nxt)
    return order


def _groups(sums: list[tuple[Term, ...]], users: dict[Key, list[int]]) -> list[int]:
    """Each sum's group: the first sum of those it is connected to by shared reads."""
    group = list(range(len(sums)))

    def root(n: int) -> int:
        while group[n] != n:
            n = group[n]
        return n

    for ns in users.values():
        for n in ns[1:]:
            a, b = sorted((root(ns[0]), root(n)))
            group[b] = a
    return [root(n) for n in range(len(sums))]


def _untaken(value: Var, taken: set[str]) -> Var:
    """``value``, or where its name is taken ``<name>_r1``, ``<name>_r2``, ...: the first that is not."""
    names = itertools.chain([value.name], (f"{value.name}_r{n}" for n in itertools.count(1)))
    return Var(next(name for name in names if name not in taken))


def _accumulated(stores: list[Call], loaded: dict[Key, Var], fresh: Iterator[Var],
                 taken: set[str]) -> Optional[list[Statement]]:
    """The stores as accumulations in read order, or None where they cannot be (``_partials``,
    ``_order``); ``loaded``: the reads earlier runs loaded, by their locals (read from them;
    updated), ``fresh``: the sums' names, ``taken``: the names of the column's loaded locals (a read
    loaded again after a loop takes a new one; updated)."""
    shapes = [_partials(s.value) for s in stores]
    if any(p is None for p in shapes):
        return None
    sums = [terms for parts in shapes for terms in parts]
    order = _order(sums)
    if order is None:
        return None
    names = [next(fresh) for _ in sums]
    owner = [i for i, parts in enumerate(shapes) for _ in parts]
    firsts = [sum(map(len, shapes[:i])) for i in range(len(shapes))]
    users: dict[Key, list[tuple[int, Term]]] = {}
    for n, terms in enumerate(sums):
        for t in terms:
            users.setdefault(t.operand, []).append((n, t))
    left = [len(terms) for terms in sums]
    unfinished = [len(parts) for parts in shapes]
    out: list[Statement] = []
    for key in order:
        value = loaded.get(key, _value(key))
        if isinstance(key, Read) and key not in loaded:
            value = _untaken(value, taken)
            out.append(Def(value, key))
            loaded[key] = value
            taken.add(value.name)
        for n, t in users[key]:
            term = Sum((Term(t.factor, value, t.negative),))
            # a sum starts from its first term (not from 0: 0 + -0 is +0)
            out.append(Def(names[n], term, const=False) if left[n] == len(sums[n]) else Store(names[n], term, "+="))
            left[n] -= 1
            if left[n] == 0:
                i = owner[n]
                unfinished[i] -= 1
                if unfinished[i] == 0:
                    parts = names[firsts[i]: firsts[i] + len(shapes[i])]
                    out.append(Call(stores[i].macro, stores[i].args, Sum(tuple(Term(None, v) for v in parts))))
    return out


def in_read_order(lines: list[Statement]) -> list[Statement]:
    """``lines`` with each run of consecutive gradient stores (``G...(args, sum)``) whose sums add
    output-gradient reads only as accumulations in read order (``_accumulated``); a run that
    cannot be, and every other statement, as they are. A run reads the values earlier runs loaded
    from their locals, except across a loop: there it loads them again. A B-spline adjoint with 2
    rows a span stores its start state's gradients on both sides of its knots' loop, from the first
    rows' output gradients: loaded once, before the loop, they were live through it and spilled
    at the register cap (float64, 32 knots: 8 to 196 bytes)."""
    out: list[Statement] = []
    run: list[Call] = []
    loaded: dict[Key, Var] = {}
    taken: set[str] = set()
    fresh = (Var(f"gsum{n}") for n in itertools.count())

    def flush() -> None:
        out.extend(_accumulated(run, loaded, fresh, taken) or run)
        run.clear()

    for line in lines:
        if isinstance(line, Call) and line.macro.startswith("G") and _partials(line.value) is not None:
            run.append(line)
        else:
            flush()
            out.append(line)
            if isinstance(line, For):
                loaded.clear()
    flush()
    return out


def _operand_reads(line: Statement) -> list[Key]:
    """The fixed-position reads a statement uses as terms' operands, in order, each once."""
    return list(dict.fromkeys(n.operand for n in walk(line) if isinstance(n, Term) and _fixed(n)))


def loaded_once(lines: list[Statement]) -> list[Statement]:
    """``lines`` with every fixed-position read that two or more of its statements (loops aside)
    use as a term's operand loaded into a local right before the first of them, and read from
    it."""
    counts = Counter(key for line in lines if not isinstance(line, For) for key in _operand_reads(line))
    shared = {key for key, n in counts.items() if n > 1}

    def local(node: object) -> Optional[Term]:
        if isinstance(node, Term) and _fixed(node) and node.operand in shared:
            return Term(node.factor, _value(node.operand), node.negative)
        return None

    out: list[Statement] = []
    loaded: set[Key] = set()
    for line in lines:
        if not isinstance(line, For):
            new = [key for key in _operand_reads(line) if key in shared and key not in loaded]
            out += [Def(_value(key), key) for key in new]
            loaded.update(new)
            line = transform(line, local)
        out.append(line)
    return out
