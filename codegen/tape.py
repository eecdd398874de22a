"""A straight-line double-precision program as data: a tape of two-operand instructions that one
small loop of the kernel reads, so the compiler's work no longer grows with the program.

The once-per-call coefficient programs (codegen/coefficients.py) are straight-line for the rows
that do not repeat (boundaries, a B-spline's weights): one line per weight. Compiled, a long one
cost seconds of gcc and minutes of nvcc. As a tape it is an array of instructions
``r[dst] = op(r[a], r[b], c)`` over a register file of doubles; loads read dt, its tangent or the
coefficient gradients, stores write the table, its tangents or the dt gradient.

Stages: ``build`` turns the program's statements into instructions (value numbering shares
repeated subexpressions, sums and products become balanced trees; a formula's definition is
built over its arguments' nodes), adds the dt derivatives where asked (forward mode for the
tangent tape, reverse mode for the gradient's: each operation's rule, applied to the graph),
drops what reaches no store, places each instruction in a level (after all its operands: a
level's instructions are independent, so a GPU block runs a level with all its threads, one
barrier per level), and gives registers (one is reused from the level after its last read on,
so no level reads a register another instruction of that level writes). The CPU runs the levels
in turn.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import defaultdict
from typing import Any, NamedTuple, Sequence

import sympy as sp

from .operator import is_formula
from .statements import Add, Cast, Def, Literal, Mul, Paren, Read, Rel, Statement, Store, Sym, Var

#: operation → (code, the C statement that runs it over the register file ts_r and the instruction o)
OPS: dict[str, tuple[int, str]] = {
    "dt": (0, "ts_r[o.dst] = (double)DT(o.a);"),
    "ddt": (1, "ts_r[o.dst] = (double)DDT(o.a);"),
    "gc": (2, "ts_r[o.dst] = GC(o.a);"),
    "const": (3, "ts_r[o.dst] = o.c;"),
    "add": (4, "ts_r[o.dst] = ts_r[o.a] + ts_r[o.b];"),
    "sub": (5, "ts_r[o.dst] = ts_r[o.a] - ts_r[o.b];"),
    "mul": (6, "ts_r[o.dst] = ts_r[o.a] * ts_r[o.b];"),
    "div": (7, "ts_r[o.dst] = ts_r[o.a] / ts_r[o.b];"),
    "addc": (8, "ts_r[o.dst] = ts_r[o.a] + o.c;"),
    "mulc": (9, "ts_r[o.dst] = ts_r[o.a] * o.c;"),
    "rdivc": (10, "ts_r[o.dst] = o.c / ts_r[o.a];"),
    "rsubc": (11, "ts_r[o.dst] = o.c - ts_r[o.a];"),
    "neg": (12, "ts_r[o.dst] = -ts_r[o.a];"),
    "powc": (13, "ts_r[o.dst] = pow(ts_r[o.a], o.c);"),  # the C template includes <math.h> for it
    "C": (14, "C(o.a) = (T)(ts_r[o.b] * o.c);"),  # stores scale by c (1 for a plain store)
    "CD": (15, "CD(o.a) = (T)(ts_r[o.b] * o.c);"),
    "GDT": (16, "GDT(o.a) = ts_r[o.b] * o.c;"),
}
#: a row tape's loads and stores, relative to its row ts_row (dt, its tangent, the dt gradient) or
#: the row's first slot ts_slot (the coefficients, their tangents and gradients); the dt gradient
#: is added to (the rows of a run add to the same durations')
ROW_INDEX = {"dt": "ts_row", "ddt": "ts_row", "gc": "ts_slot", "C": "ts_slot", "CD": "ts_slot", "GDT": "ts_row"}
ROW_OPS: dict[str, tuple[int, str]] = {
    op: (code, statement.replace("(o.a)", f"({ROW_INDEX[op]} + o.a)").replace(") = ts_r", ") += ts_r")
         if op in ROW_INDEX else statement) for op, (code, statement) in OPS.items()}
#: instructions per level at most (see _levels)
LEVEL_WIDTH = 1024
#: a row tape's: a warp's lanes run a level (narrower levels hold fewer registers)
ROW_LEVEL_WIDTH = 32
LOADS = {"DT": "dt", "DDT": "ddt", "GC": "gc"}
STORES = ("C", "CD", "GDT")


class Instruction(NamedTuple):  # (a tuple: tens of thousands are made per tape)
    op: str
    dst: int  # register written (-1 for a store)
    a: int  # register read, or a load's / store's index
    b: int  # register read (a store's value), else 0
    c: float  # constant operand, else 0

    def c_initializer(self) -> str:
        return f"{{{OPS[self.op][0]},{self.dst},{self.a},{self.b},{c_double(self.c)}}}"


def c_double(x: float) -> str:
    """A double literal that reads back exactly (repr is the shortest such)."""
    return "0" if x == 0 else repr(float(x))


@dataclasses.dataclass(frozen=True)
class Tape:
    """A straight-line program as instructions in level order (``levels[i]``..``levels[i+1]`` is
    level i) over ``registers`` doubles."""

    name: str
    instructions: tuple[Instruction, ...]
    levels: tuple[int, ...]
    registers: int
    #: a row tape's (lo, width, first): it runs once per row r of a run of rows (codegen/coefficients.py
    #: RowRun), its loads DT(r + a), DDT(r + a) and GC(s + a), its stores C(s + a), CD(s + a) and
    #: GDT(r + a) += (s = lo + width·(r - first), the row's first slot)
    row: tuple[int, int, int] | None = None

    @property
    def program(self) -> str:
        """The program the tape is part of: "value", "tangent" or "reverse" (a row tape's too)."""
        return self.name.split("_", 1)[0]

    @property
    def statements(self) -> dict[str, tuple[int, str]]:
        """Each operation's code and C statement (relative to the row for a row tape)."""
        return ROW_OPS if self.row else OPS

    @property
    def ops(self) -> list[str]:
        """The operations the tape uses (each kernel's loop handles only these)."""
        used = {i.op for i in self.instructions}
        return [op for op in OPS if op in used]

    @property
    def macro(self) -> str:
        """The macro each template defines to run this tape where its program was."""
        return f"TS_TAPE_{self.name.upper()}"

    def c_rows(self, per_row: int = 8) -> list[str]:
        """The instructions as C initializers, ``per_row`` to a line (tens of thousands: joined
        here, not one template call each).

        >>> load = Instruction("dt", 0, 3, 0, 0.0)
        >>> half = Instruction("mulc", 1, 0, 0, 0.5)
        >>> store = Instruction("C", -1, 5, 1, 1.0)
        >>> Tape("value", (load, half, store), (0, 3), 2).c_rows(per_row=2)
        ['{0,0,3,0,0},{9,1,0,0,0.5},', '{14,-1,5,1,1.0},']
        """
        items = [f"{i.c_initializer()}," for i in self.instructions]
        return ["".join(items[k : k + per_row]) for k in range(0, len(items), per_row)]


class _Node(NamedTuple):  # value numbering hashes one per operation made: a tuple hashes fastest
    op: str
    args: tuple[int, ...]  # operand nodes
    index: int = 0  # a load's or store's index
    c: float = 0.0


class _Builder:
    """Instructions as a graph of value-numbered nodes, from statements."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.numbers: dict[_Node, int] = {}
        self.env: dict[str, int] = {}  # local variable → node
        self.memory: dict[tuple[str, int], int] = {}  # (table, slot) → the node stored there
        self.stores: dict[tuple[str, int], int] = {}  # (table, slot) → its store node (the last one)
        self.symbols: dict[sp.Expr, int] = {}
        #: a derivative node's place in the program: just after the value node it differentiates
        #: (its own number would put it after the whole value program, every value held till then)
        self.rank: dict[int, float] = {}

    def copy(self) -> "_Builder":
        """A builder that extends this graph without changing it (the statements' scope is closed)."""
        other = _Builder()
        other.nodes, other.numbers = list(self.nodes), dict(self.numbers)
        other.stores, other.rank = dict(self.stores), dict(self.rank)
        return other

    def node(self, op: str, args: tuple[int, ...] = (), index: int = 0, c: float = 0.0) -> int:
        n = _Node(op, args, index, float(c))
        if n not in self.numbers:
            self.numbers[n] = len(self.nodes)
            self.nodes.append(n)
        return self.numbers[n]

    def const(self, value: float) -> int:
        return self.node("const", c=value)

    def constant(self, n: int) -> float | None:
        node = self.nodes[n]
        return node.c if node.op == "const" else None

    # arithmetic with constants folded into the instruction
    def add(self, a: int, b: int) -> int:
        ca, cb = self.constant(a), self.constant(b)
        if ca is not None and cb is not None:
            return self.const(ca + cb)
        if ca is not None:
            a, b, ca, cb = b, a, cb, ca
        if cb is not None:
            return a if cb == 0 else self.node("addc", (a,), c=cb)
        return self.node("add", tuple(sorted((a, b))))

    def sub(self, a: int, b: int) -> int:
        ca, cb = self.constant(a), self.constant(b)
        if ca is not None and cb is not None:
            return self.const(ca - cb)
        if cb is not None:
            return a if cb == 0 else self.node("addc", (a,), c=-cb)
        if ca is not None:
            return self.neg(b) if ca == 0 else self.node("rsubc", (b,), c=ca)
        return self.node("sub", (a, b))

    def neg(self, a: int) -> int:
        ca = self.constant(a)
        return self.const(-ca) if ca is not None else self.node("neg", (a,))

    def mul(self, a: int, b: int) -> int:
        ca, cb = self.constant(a), self.constant(b)
        if ca is not None and cb is not None:
            return self.const(ca * cb)
        if ca is not None:
            a, b, ca, cb = b, a, cb, ca
        if cb is not None:
            return a if cb == 1 else self.neg(a) if cb == -1 else self.node("mulc", (a,), c=cb)
        return self.node("mul", tuple(sorted((a, b))))

    def div(self, a: int, b: int) -> int:
        ca = self.constant(a)
        if ca is not None:
            return self.node("rdivc", (b,), c=ca)
        return self.node("div", (a, b))

    def product(self, factors: list[int]) -> int:
        """A balanced product (depth log n: fewer levels)."""
        while len(factors) > 1:
            factors = [self.mul(*factors[i:i + 2]) if i + 1 < len(factors) else factors[i]
                       for i in range(0, len(factors), 2)]
        return factors[0] if factors else self.const(1.0)

    def signed_sum(self, terms: list[tuple[int, bool]]) -> int:
        """A balanced sum of (node, negative) terms."""
        if not terms:
            return self.const(0.0)
        while len(terms) > 1:
            paired = []
            for i in range(0, len(terms), 2):
                if i + 1 == len(terms):
                    paired.append(terms[i])
                    continue
                (a, na), (b, nb) = terms[i], terms[i + 1]
                if na == nb:
                    paired.append((self.add(a, b), na))
                else:
                    paired.append((self.sub(b, a) if na else self.sub(a, b), False))
            terms = paired
        n, negative = terms[0]
        return self.neg(n) if negative else n

    def power(self, base: int, n: int) -> int:
        """base**n for an integer n >= 1 by squaring."""
        result, square = None, base
        while n:
            if n & 1:
                result = square if result is None else self.mul(result, square)
            n >>= 1
            if n:
                square = self.mul(square, square)
        assert result is not None
        return result

    def sympy(self, e: sp.Expr) -> int:
        if e in self.symbols:
            return self.symbols[e]
        n = self._sympy(e)
        self.symbols[e] = n
        return n

    def _sympy(self, e: sp.Expr) -> int:
        if e.is_Symbol:
            try:
                return self.env[e.name]
            except KeyError:
                raise ValueError(f"tape: {e.name} is used before it is defined") from None
        if e.is_Number:
            return self.const(float(e))
        if is_formula(e):
            return self._formula(e)
        if e.is_Add:
            constant, terms = _sum_parts(e)
            total = self.signed_sum([(self.sympy(t), negative) for t, negative in terms])
            return self.add(total, self.const(constant)) if constant else total
        if e.is_Mul or e.is_Pow:
            c, factors = _product_parts(e)
            numerator, denominator = [], []
            for base, exponent, integer in factors:
                if not integer:
                    numerator.append(self.node("powc", (self.sympy(base),), c=exponent))
                else:
                    (numerator if exponent > 0 else denominator).append(self.power(self.sympy(base), abs(exponent)))
            if not numerator and denominator:
                return self.node("rdivc", (self.product(denominator),), c=c)
            value = self.product(numerator)
            if denominator:
                value = self.div(value, self.product(denominator))
            return self.mul(value, self.const(c))
        raise NotImplementedError(f"tape: {type(e).__name__} ({e}) is not an operation of the tape")

    def _formula(self, e: Any) -> int:
        """A formula (codegen/operator.formula) applied: its definition's graph over the nodes of its
        arguments, each distinct subexpression once (no SymPy expression is built or expanded)."""
        definition = type(e).definition
        args = [self.sympy(a) for a in e.args]
        outer = self.env, self.symbols
        self.env, self.symbols = {v.name: n for v, n in zip(definition.variables, args)}, {}
        try:
            return self.sympy(definition.expr)
        finally:
            self.env, self.symbols = outer

    def expr(self, x: Any) -> int:
        """A node computing one statement expression."""
        if isinstance(x, Sym):
            return self.sympy(x.expr)
        if isinstance(x, (Cast, Paren)):
            return self.expr(x.x)
        if isinstance(x, Var):
            return self.env[x.name]
        if isinstance(x, Literal):
            return self.const(float(x.text))
        if isinstance(x, Add):
            return self.signed_sum([(self.expr(p), False) for p in x.parts])
        if isinstance(x, Mul):
            return self.mul(self.expr(x.a), self.expr(x.b))
        if isinstance(x, Read) and x.macro in LOADS:  # (a row tape's loads: relative to its row)
            index = x.args[0].rel if isinstance(x.args[0], Rel) else int(x.args[0])
            return self.node(LOADS[x.macro], index=index)
        if isinstance(x, Read) and x.macro in STORES:  # a slot the program stored before (a copy)
            return self.memory[(x.macro, int(x.args[0]))]
        raise NotImplementedError(f"tape: the expression {x!r}")

    def statement(self, s: Statement) -> None:
        if isinstance(s, Def) and isinstance(s.target, Var) and s.ctype == "double":
            value = self.expr(s.value)
            if s.target.name in self.env:  # defined again: expressions naming it mean something else now
                self.symbols.clear()
            self.env[s.target.name] = value
        elif isinstance(s, Store) and isinstance(s.target, Read) and s.target.macro in STORES and s.op == "=":
            key = (s.target.macro, int(s.target.args[0]))
            value = self.expr(s.value)
            self.memory[key] = value
            self.stores[key] = self.node(key[0], (value,), index=key[1], c=1.0)
        else:
            raise NotImplementedError(f"tape: the statement {s!r}")


# A formula's definition is walked once per application (over other argument nodes): its SymPy
# structure is read once per subexpression, here, not once per walk.
@functools.lru_cache(maxsize=1 << 16)
def _sum_parts(e: sp.Expr) -> tuple[float, tuple[tuple[sp.Expr, bool], ...]]:
    """A sum as its constant and its other terms, each positive with a flag for its sign."""
    constant, rest = e.as_coeff_Add()
    terms = []
    for t in sp.Add.make_args(rest):
        coeff, _ = t.as_coeff_Mul()
        negative = bool(coeff.is_negative)
        terms.append((-t if negative else t, negative))
    return float(constant), tuple(terms)


@functools.lru_cache(maxsize=1 << 16)
def _product_parts(e: sp.Expr) -> tuple[float, tuple[tuple[sp.Expr, Any, bool], ...]]:
    """A product (or power) as its constant factor and its factors (base, exponent, whether the
    exponent is a nonzero integer; else a float for pow)."""
    coeff, rest = e.as_coeff_Mul()
    factors = []
    for f in sp.Mul.make_args(rest):
        base, exp = f.as_base_exp()
        if exp.is_Integer and exp != 0:
            factors.append((base, int(exp), True))
        elif exp.is_Number:
            factors.append((base, float(exp), False))
        else:
            raise NotImplementedError(f"tape: the power {f} (a constant exponent is needed)")
    return float(coeff), tuple(factors)


def graph(statements: Sequence[Statement]) -> _Builder:
    """The value-numbered graph of a straight-line program (double-precision locals, loads of
    DT/DDT/GC, stores to C/CD/GDT): what ``build`` makes each of a program's tapes from."""
    b = _Builder()
    for s in statements:
        b.statement(s)
    return b


def build(name: str, program: Sequence[Statement] | _Builder, mode: str = "value", n_dt: int = 0,
          row: tuple[int, int, int] | None = None) -> Tape:
    """The tape of a straight-line program, given as statements or as their ``graph`` (which is
    left as it is, for the program's other tapes). ``mode`` "tangent" also stores each C slot's
    dt tangent CD (forward mode over the program's graph); "reverse" stores, instead of the
    table, GDT(i) for every i < ``n_dt`` from the table's gradient GC (reverse mode). The
    derivatives are taken here, node by node, so a long program is differentiated without SymPy.

    ``row`` (lo, width, first): the program of one row of a run of rows (``Tape.row``), over its
    window of durations DT(Rel(o)) and its slots C(i); "reverse" then adds to GDT(o) for each
    duration o of the window that has a gradient, and levels are a warp's width."""
    if mode not in ("value", "tangent", "reverse"):
        raise ValueError(f"mode={mode!r} is invalid: allowed 'value', 'tangent', 'reverse'")
    b = program.copy() if isinstance(program, _Builder) else graph(program)
    if mode == "tangent":
        _tangent(b)
    elif mode == "reverse":
        indices = sorted({n.index for n in b.nodes if n.op == "dt"}) if row else range(n_dt)
        _reverse(b, indices, accumulate=row is not None)
    nodes = b.nodes
    roots = _fuse_scaled_stores(nodes, sorted(b.stores.values()))
    live = _reached(nodes, roots)
    users: dict[int, list[int]] = defaultdict(list)
    for n in live:
        for a in nodes[n].args:
            users[a].append(n)
    level = _levels(nodes, live, users, b.rank, ROW_LEVEL_WIDTH if row else LEVEL_WIDTH)
    return dataclasses.replace(_allocate(name, nodes, live, level, users), row=row)


def _sum(b: _Builder, x: int | None, y: int | None, negative: bool = False) -> int | None:
    """x + y (x - y when ``negative``), None standing for zero."""
    if y is None:
        return x
    if x is None:
        return b.neg(y) if negative else y
    return b.sub(x, y) if negative else b.add(x, y)


def _power_derivative(b: _Builder, node: _Node) -> int:
    """d(a**c)/da = c·a**(c-1)."""
    (a,) = node.args
    lower = node.c - 1
    power = b.const(1.0) if lower == 0 else a if lower == 1 else b.node("powc", (a,), c=lower)
    return b.mul(power, b.const(node.c))


def _tangent(b: _Builder) -> None:
    """Forward mode: every value node's tangent from its operands' (a load of DT(i) has DDT(i)),
    and a store CD(q) beside each store C(q) (0 where the value does not depend on dt)."""
    t: dict[int, int] = {}  # node → its tangent (absent: zero)
    for n in range(len(b.nodes)):  # the value graph; the nodes made here come after it
        made = len(b.nodes)
        node = b.nodes[n]
        op, args = node.op, node.args
        ta = t.get(args[0]) if args else None
        tb = t.get(args[1]) if len(args) > 1 else None
        if op == "dt":
            d = b.node("ddt", index=node.index)
        elif op in ("add", "sub"):
            d = _sum(b, ta, tb, negative=op == "sub")
        elif op == "mul":
            d = _sum(b, None if ta is None else b.mul(ta, args[1]), None if tb is None else b.mul(args[0], tb))
        elif op == "div":  # (ta - n·tb) / b
            top = _sum(b, ta, None if tb is None else b.mul(n, tb), negative=True)
            d = None if top is None else b.div(top, args[1])
        elif ta is None:
            d = None
        elif op == "addc":
            d = ta
        elif op == "mulc":
            d = b.mul(ta, b.const(node.c))
        elif op in ("neg", "rsubc"):
            d = b.neg(ta)
        elif op == "rdivc":  # d(c/a) = -(c/a)/a · da
            d = b.neg(b.div(b.mul(n, ta), args[0]))
        elif op == "powc":
            d = b.mul(ta, _power_derivative(b, node))
        else:  # stores
            d = None
        if d is not None:
            t[n] = d
        b.rank.update((m, n + 0.5) for m in range(made, len(b.nodes)))
    zero = b.const(0.0)  # (a node no store reads is dropped)
    for (table, q), s in list(b.stores.items()):
        if table == "C":
            b.stores[("CD", q)] = b.node("CD", (t.get(b.nodes[s].args[0], zero),), index=q, c=1.0)


def _reverse(b: _Builder, indices: Sequence[int], accumulate: bool = False) -> None:
    """Reverse mode: the adjoint of every value node from its users', seeded by GC(q) at each
    store C(q); the stores become GDT(i) = the adjoint of the load of DT(i), for every i of
    ``indices`` (``accumulate``: only those with a gradient, which the stores add)."""
    n_value = len(b.nodes)
    adjoint: dict[int, list[tuple[int, bool]]] = defaultdict(list)  # node → signed parts
    for (table, q), s in b.stores.items():
        if table == "C":
            store = b.nodes[s]
            seed = b.node("gc", index=q)
            adjoint[store.args[0]].append((seed if store.c == 1 else b.mul(seed, b.const(store.c)), False))
    gdt: dict[int, int] = {}
    for n in range(n_value - 1, -1, -1):  # users before operands: creation order is topological
        if n not in adjoint:
            continue
        g = b.signed_sum(adjoint.pop(n))
        node = b.nodes[n]
        op, args = node.op, node.args
        if op == "dt":
            gdt[node.index] = g
        elif op in ("add", "sub"):
            adjoint[args[0]].append((g, False))
            adjoint[args[1]].append((g, op == "sub"))
        elif op == "mul":
            adjoint[args[0]].append((b.mul(g, args[1]), False))
            adjoint[args[1]].append((b.mul(g, args[0]), False))
        elif op == "div":  # d(a/b) = da/b - (a/b)/b · db
            quotient = b.div(g, args[1])
            adjoint[args[0]].append((quotient, False))
            adjoint[args[1]].append((b.mul(quotient, n), True))
        elif op == "addc":
            adjoint[args[0]].append((g, False))
        elif op == "mulc":
            adjoint[args[0]].append((b.mul(g, b.const(node.c)), False))
        elif op in ("neg", "rsubc"):
            adjoint[args[0]].append((g, True))
        elif op == "rdivc":
            adjoint[args[0]].append((b.div(b.mul(g, n), args[0]), True))
        elif op == "powc":
            adjoint[args[0]].append((b.mul(g, _power_derivative(b, node)), False))
    zero = b.const(0.0)
    b.stores = {("GDT", i): b.node("GDT", (gdt.get(i, zero),), index=i, c=1.0)
                for i in indices if not accumulate or i in gdt}


def _fuse_scaled_stores(nodes: list[_Node], stores: list[int]) -> list[int]:
    """Stores of a constant multiple x·c (or -x) that only stores read become stores of x scaled
    by c, and stores of a constant k stores of a register holding 1 scaled by k (most of a
    B-spline's weights are c·dt^k: one instruction each instead of two)."""
    readers: dict[int, set[str]] = defaultdict(set)
    for n in _reached(nodes, stores):
        for a in nodes[n].args:
            readers[a].add("store" if nodes[n].op in STORES else "value")
    one: list[int] = []  # the register holding 1, made when first needed
    fused = []
    for s in stores:
        store, value = nodes[s], nodes[nodes[s].args[0]]
        only_stored = readers[store.args[0]] == {"store"}
        if value.op in ("mulc", "neg") and only_stored:
            scale, args = (value.c if value.op == "mulc" else -1.0), value.args
        elif value.op == "const" and only_stored:
            if not one:
                nodes.append(_Node("const", (), 0, 1.0))
                one.append(len(nodes) - 1)
            scale, args = value.c, (one[0],)
        else:
            fused.append(s)
            continue
        nodes.append(_Node(store.op, args, store.index, store.c * scale))
        fused.append(len(nodes) - 1)
    return fused


def _reached(nodes: list[_Node], roots: list[int]) -> list[int]:
    """The nodes the stores need, in creation order (operands before users)."""
    need = set(roots)
    for n in range(len(nodes) - 1, -1, -1):
        if n in need:
            need.update(nodes[n].args)
    return sorted(need)


def _levels(nodes: list[_Node], live: list[int], users: dict[int, list[int]],
            rank: dict[int, float], width: int = LEVEL_WIDTH) -> dict[int, int]:
    """Each node's level, after all its operands': at most ``width`` instructions per level
    (a wider level would only hold more registers: a block runs it a few hundred at a time), in
    the program's order (``rank`` where a node has one); loads and constants one level before
    their first user (their registers are not held from the start)."""
    def priority(n: int) -> tuple[bool, float]:  # stores first (they free registers), then program order
        return nodes[n].op not in STORES, rank.get(n, n)

    waiting = {n: sum(1 for a in nodes[n].args if nodes[a].args) for n in live if nodes[n].args}
    ready = [(priority(n), n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    level: dict[int, int] = {}
    current = 0
    while ready:
        current += 1
        placed = [heapq.heappop(ready)[1] for _ in range(min(width, len(ready)))]
        for n in placed:
            level[n] = current
        for n in placed:
            for u in users[n]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, (priority(u), u))
    for n in live:
        if not nodes[n].args:
            level[n] = min(level[u] for u in users[n]) - 1
    return level


_CODES = {op: code for op, (code, _) in OPS.items()}
_LOAD_OPS = frozenset(LOADS.values())


def _allocate(name: str, nodes: list[_Node], live: list[int], level: dict[int, int],
              users: dict[int, list[int]]) -> Tape:
    """Registers by level: a register is free again from the level after its value's last read."""
    # a level's instructions in any order: grouped by operation, so the CPU's branch predictor
    # guesses the loop's switch, and a GPU warp's threads take one branch of it
    order = sorted(live, key=lambda n: (level[n], _CODES[nodes[n].op], n))
    releases: dict[int, list[int]] = defaultdict(list)  # level → nodes whose register frees after it
    for n in live:
        if nodes[n].op not in STORES:
            readers = users[n]
            releases[max([level[u] for u in readers]) if readers else level[n]].append(n)
    register: dict[int, int] = {}
    free: list[int] = []
    size = 0
    instructions, levels = [], []
    current = None
    pop, push = heapq.heappop, heapq.heappush
    for n in order:
        at = level[n]
        if at != current:
            for lv in range(-1 if current is None else current, at):  # levels before n's
                for m in releases.pop(lv, ()):
                    push(free, register[m])
            current = at
            levels.append(len(instructions))
        op, args, index, c = nodes[n]
        if op in STORES:
            instructions.append(Instruction(op, -1, index, register[args[0]], c))
            continue
        if free:
            r = register[n] = pop(free)
        else:
            r = register[n] = size
            size += 1
        if op in _LOAD_OPS:
            a, b = index, (register[args[1]] if len(args) > 1 else 0)
        else:
            a = register[args[0]] if args else 0
            b = register[args[1]] if len(args) > 1 else 0
        instructions.append(Instruction(op, r, a, b, c))
    levels.append(len(instructions))
    return Tape(name, tuple(instructions), tuple(levels), max(size, 1))
