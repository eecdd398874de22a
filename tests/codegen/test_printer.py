"""codegen/printer.py: one set of statements, printed as a scalar column and as dof lanes.

The expected lines are written out by hand (the macros each template defines)."""
from __future__ import annotations

from tensorstep.codegen.printer import COLUMN, lane_printer
from tensorstep.codegen.statements import Call, Def, For, Read, Rel, Store, Strided, Sum, Term, Val, Var

STATEMENTS = [
    Def(Var("s0"), Read("S0")),
    Def(Val("y", 0, 3), Sum((Term(None, Read("U", (2,))), Term(Read("C", (1,)), Val("y", 0, 2)),
                             Term(None, Var("s0"), negative=True)))),
    Call("Y0", (3,), Val("y", 0, 3)),
    Def(Var("yb1_p1_4"), Val("yb", 1, 4), const=False),
    For(4, 2, -1, (
        Def(Var("yb1_c"), Sum((Term(None, Read("G1", (Rel(0),))),
                               Term(Read("C", (Strided(5, -2, 4),)), Var("yb1_p1_4"))))),
        Call("GU", (Rel(-1),), Var("yb1_c")),
        Store(Var("yb1_p1_4"), Var("yb1_c")),
    )),
    Call("GS1", (), Sum(())),
]


def test_column_vocabulary():
    assert COLUMN.lines(STATEMENTS) == [
        "const T s0 = S0;",
        "const T y0_3 = U(2)+C(1)*y0_2-s0;",
        "Y0(3, y0_3);",
        "T yb1_p1_4 = yb1_4;",
        "for (int64_t r = 4; r >= 2; --r) {",
        "    const T yb1_c = G1(r)+C(5 + -2 * (r - 4))*yb1_p1_4;",
        "    GU(r - 1, yb1_c);",
        "    yb1_p1_4 = yb1_c;",
        "}",
        "GS1(ZERO);",
    ]


def test_lane_vocabulary_renames_values_not_coefficients():
    """The input macros given (a table's: codegen/macros.py lane_names) and the output stores and
    gradient reads take the lane form; coefficients and other macros do not."""
    lanes = lane_printer(frozenset({"U", "GU", "S0", "GS1"}))
    assert lanes.lines(STATEMENTS) == [
        "const VT s0 = VS0;",
        "const VT y0_3 = VU(2)+C(1)*y0_2-s0;",
        "VY0(3, y0_3);",
        "VT yb1_p1_4 = yb1_4;",
        "for (int64_t r = 4; r >= 2; --r) {",
        "    const VT yb1_c = VG1(r)+C(5 + -2 * (r - 4))*yb1_p1_4;",
        "    VGU(r - 1, yb1_c);",
        "    yb1_p1_4 = yb1_c;",
        "}",
        "VGS1(VZERO);",
    ]
