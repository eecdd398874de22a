"""CUDA: per-column values a fused kernel carries to its end kept in the thread's column of the
block's shared memory, read and written where used, in place of registers (codegen/targets.py
``cuda_shared_column``). A value ``name<t>`` becomes the slot ``MACRO(t)``, which the template
defines (kernel.cu.j2): the same value, stored and read back exactly. ``loop_live_in``
measures a column's loops, for the rule's criterion.
"""
from __future__ import annotations

import re
from typing import Any

import sympy as sp

from .statements import Bind, Def, For, Read, Statement, Store, Sym, Var, transform, walk


def in_shared_column(statements: list[Statement], name: str, macro: str) -> list[Statement]:
    """``statements`` with each value ``<name><t>`` (a variable, or a symbol of an expression) made
    the slot ``<macro>(t)``: its definition a store there, each use a read of it."""
    pattern = re.compile(re.escape(name) + r"(\d+)")

    def slot(found: str) -> Read | None:
        m = pattern.fullmatch(found)
        return Read(macro, (int(m.group(1)),)) if m else None

    def renamed(expr: sp.Expr) -> sp.Expr:
        subs = {s: sp.Symbol(f"{macro}({slot(s.name).args[0]})") for s in expr.free_symbols
                if isinstance(s, sp.Symbol) and slot(s.name)}
        return expr.xreplace(subs) if subs else expr

    def replace(node: Any) -> Any:
        if isinstance(node, Def) and isinstance(node.target, Var) and slot(node.target.name):
            return Store(slot(node.target.name), transform(node.value, replace), "=")
        if isinstance(node, Var) and slot(node.name):
            return slot(node.name)
        if isinstance(node, Sym):
            expr = renamed(node.expr)
            return node if expr is node.expr else Sym(expr)
        if isinstance(node, Bind):
            expr = renamed(node.sym.expr)
            return Bind(node.sym if expr is node.sym.expr else Sym(expr), transform(node.names, replace))
        return None

    return list(transform(tuple(statements), replace))


def _names(node: Any) -> set[str]:
    names = set()
    for n in walk(node):
        if isinstance(n, Var):
            names.add(n.name)
        elif isinstance(n, (Sym, Bind)):
            names |= {s.name for s in (n.expr if isinstance(n, Sym) else n.sym.expr).free_symbols}
    return names


def loop_live_in(statements: list[Statement]) -> int:
    """The most variables one of the column's loops reads that are defined before it: values
    live across its back edge, held in registers through every iteration."""
    defined: set[str] = set()
    most = 0
    for s in statements:
        if isinstance(s, For):
            most = max(most, len(_names(s.body) & defined))
            continue
        defined |= {n.target.name for n in walk(s) if isinstance(n, (Def, Store)) and isinstance(n.target, Var)}
    return most
