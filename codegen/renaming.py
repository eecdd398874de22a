"""One expression at many rows, evaluated by SymPy and printed once (a fused step's cost terms).

A cost term's expression is substituted at every row of its state, where only a few symbols differ
from row to row (the row's value ``y<k>_<h>``, its row weight). SymPy evaluates each substitution
again (a bound term's two ``Max`` each compare their arguments) and prints each result again: most
of a fused step's code generation. ``RowExpressions`` builds the first row's expression and renames
its symbols for the others, where that is what SymPy would build: the renamed symbols keep their
order against every other symbol of the expression (SymPy orders a sum's or product's arguments,
and prints them, by name), so the renamed tree, rebuilt without evaluation, is the one the
substitution gives, and its C text is the first row's with the names replaced (``renamed_text``,
which the printer uses through ``Sym.like``). Elsewhere it builds the expression as asked.

>>> y1, y2, c = sp.symbols("y0_1 y0_2 c0")
>>> rows = RowExpressions()
>>> build = lambda s: sp.Max(0, s["y"] - s["c"]) ** 2
>>> first, second = rows("bound", {"y": y1, "c": c}, build), rows("bound", {"y": y2, "c": c}, build)
>>> second.expr == build({"y": y2, "c": c}), second.like == (first.expr, (("y0_1", "y0_2"),))
(True, True)
"""
from __future__ import annotations

import re
from typing import Any, Callable, Hashable, Mapping, Optional

import sympy as sp

from .statements import Sym


def renaming(a: Any, b: Any) -> Optional[dict[sp.Symbol, sp.Symbol]]:
    """The symbols of ``a`` to rename (each to a symbol of the same kind and assumptions) to get
    ``b``; None where ``b`` is not ``a`` renamed."""
    if a == b:
        return {}
    if not isinstance(a, sp.Basic) or not isinstance(b, sp.Basic):
        return None
    if isinstance(a, sp.Symbol) and isinstance(b, sp.Symbol):
        return {a: b} if type(a) is type(b) is sp.Symbol and a.assumptions0 == b.assumptions0 else None
    if type(a) is not type(b) or not a.args or len(a.args) != len(b.args):
        return None
    out: dict[sp.Symbol, sp.Symbol] = {}
    for x, y in zip(a.args, b.args):
        part = renaming(x, y)
        if part is None or any(out.get(k, v) != v for k, v in part.items()):
            return None
        out.update(part)
    return out


def keeps_order(expr: sp.Expr, names: Mapping[sp.Symbol, sp.Symbol]) -> bool:
    """Whether renaming ``expr``'s symbols by ``names`` keeps every pair of their names in the same
    order (so it is one to one, and no new name is one the expression keeps)."""
    symbols = sorted(expr.free_symbols, key=lambda s: s.name)
    new = [names.get(s, s).name for s in symbols]
    return all(type(s) is sp.Symbol for s in symbols) and all(p < q for p, q in zip(new, new[1:]))


def renamed(expr: sp.Expr, names: Mapping[sp.Symbol, sp.Symbol]) -> sp.Expr:
    """``expr`` with its symbols renamed, every node rebuilt as it is (not evaluated again)."""
    if not expr.args:
        return names.get(expr, expr)
    args = tuple(renamed(a, names) for a in expr.args)
    return expr if all(a is b for a, b in zip(args, expr.args)) else expr.func(*args, evaluate=False)


#: a symbol's name printed in C: not part of a longer identifier
_EDGES = r"(?<![A-Za-z0-9_])({})(?![A-Za-z0-9_])"


def renamed_text(text: str, names: tuple[tuple[str, str], ...]) -> Optional[str]:
    """A printed expression's text with its symbols' names replaced (each an identifier of its
    own there); None where some name is not printed as itself (the caller prints the expression)."""
    pattern = re.compile(_EDGES.format("|".join(re.escape(old) for old, _ in names)))
    found = {m.group(1) for m in pattern.finditer(text)}
    if len(found) != len(names):
        return None
    new = dict(names)
    return pattern.sub(lambda m: new[m.group(1)], text)


class RowExpressions:
    """``Sym(build(subs))`` for many rows: per ``key`` (what ``build`` computes from ``subs``
    alone), the first row's expression built, the others' renamed from it where their ``subs``
    differ from the first's only by symbols renamed in order (``keeps_order``)."""

    def __init__(self) -> None:
        self.first: dict[Hashable, tuple[dict, sp.Expr]] = {}

    def __call__(self, key: Hashable, subs: dict, build: Callable[[dict], sp.Expr]) -> Sym:
        if key not in self.first:
            self.first[key] = subs, build(subs)
            return Sym(self.first[key][1])
        first, expr = self.first[key]
        names: Optional[dict] = {} if first.keys() == subs.keys() else None
        for k, v in subs.items() if names is not None else ():
            part = renaming(first[k], v)
            if part is None or any(names.get(s, t) != t for s, t in part.items()):
                names = None
                break
            names.update(part)
        if names is None or not keeps_order(expr, names):
            return Sym(build(subs))
        used = {s: t for s, t in names.items() if s != t and s in expr.free_symbols}
        try:
            value = renamed(expr, used)
        except TypeError:  # a node whose class takes no ``evaluate``
            return Sym(build(subs))
        return Sym(value, like=(expr, tuple((s.name, t.name) for s, t in used.items()))) if used else Sym(expr)
