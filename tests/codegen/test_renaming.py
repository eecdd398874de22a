"""codegen/renaming.py: a cost term's expressions at many rows, built once and renamed.

Each renamed expression is checked against SymPy's own substitution at that row (equal as
expressions), and its printed C text (column and dof lanes) against printing that substitution
(the same text); where a renaming would change the symbols' order, the expression is built as asked."""
from __future__ import annotations

import pytest
import sympy as sp

from tensorstep.codegen import costs as kinds
from tensorstep.codegen.printer import COLUMN, lane_printer
from tensorstep.codegen.renaming import RowExpressions, keeps_order, renamed_text, renaming
from tensorstep.codegen.statements import Sym

LANES = lane_printer(frozenset())


def _subs(t: int, k: int, h: int, rows: bool = True, prefix: str = "y") -> dict:
    """A term's symbols at row h, named as codegen/fused.py names them."""
    weight = sp.Symbol(f"cw{t}") * (sp.Symbol(f"CRW{t}({h})") if rows else 1)
    return {kinds.Y: sp.Symbol(f"{prefix}{k}_{h}"), kinds.W: weight, kinds.LOWER: sp.Symbol(f"clo{t}"),
            kinds.UPPER: sp.Symbol(f"chi{t}"), kinds.MARGIN: sp.Symbol(f"cmar{t}"), kinds.TARGET: sp.Symbol("ctgt")}


def _expressions() -> list[sp.Expr]:
    out = []
    for kind in kinds.KINDS.values():
        for form in (kind, kind.narrow[1] if kind.narrow else kind):
            out += [form.expression, form.derivative, sp.diff(form.expression, kinds.TARGET)]
    return out


@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("i", range(len(_expressions())))
def test_each_row_is_the_substitution_printed_the_same(i, rows):
    expr = _expressions()[i]
    build = expr.xreplace
    made = RowExpressions()
    renamed_rows = 0
    for prefix, h in [("y", h) for h in (1, 2, 9, 10, 31, 100)] + [("yr", 3), ("yr", 12)]:
        subs = _subs(2, 1, h, rows, prefix)
        sym = made(("term",), subs, build)
        direct = build(subs)
        assert sym.expr == direct
        for printer in (COLUMN, LANES):
            assert printer.expr(sym) == printer.expr(Sym(direct))
        renamed_rows += sym.like is not None
    assert renamed_rows >= (6 if rows else 0) or not expr.has(kinds.Y)


def test_a_renaming_that_changes_the_order_builds_the_expression():
    """y0_1 sorts after a0 and b0 (so x = y0_1 - b0 prints b0 first); a renaming to a00 would put
    it between them: SymPy orders that sum differently, and the expression is built again."""
    a, b = sp.symbols("a0 b0")
    build = lambda s: sp.Max(0, s["y"] - s["b"]) * s["a"]
    made = RowExpressions()
    made("k", {"y": sp.Symbol("y0_1"), "a": a, "b": b}, build)
    same_order = made("k", {"y": sp.Symbol("y0_2"), "a": a, "b": b}, build)
    other_order = made("k", {"y": sp.Symbol("a00"), "a": a, "b": b}, build)
    assert same_order.like is not None and other_order.like is None
    assert other_order.expr == build({"y": sp.Symbol("a00"), "a": a, "b": b})
    assert COLUMN.expr(other_order) == "a0*TS_MAX(0, a00 - b0)"


def test_only_renamings_of_symbols_in_order():
    x, y, z = sp.symbols("x y z")
    assert renaming(x + 2 * y, x + 2 * z) == {y: z}
    assert renaming(x + y, x * y) is None  # another tree
    assert renaming(x + y, x + 3) is None  # a symbol to a number
    assert renaming(sp.Max(x, y), sp.Max(z, z)) is None  # two symbols to one
    assert renaming(x, sp.Symbol("x", real=True)) is None  # other assumptions
    assert keeps_order(x + y, {x: sp.Symbol("w")}) and not keeps_order(x + y, {x: z})


def test_renamed_text_replaces_whole_names_only():
    assert renamed_text("y0_1*CRW0(1) + y0_10", (("y0_1", "y0_2"), ("CRW0(1)", "CRW0(2)"))) == \
        "y0_2*CRW0(2) + y0_10"
    assert renamed_text("y0_10 + 1", (("y0_1", "y0_2"),)) is None  # not printed as itself
