"""An operator's references as lowered statements, from the argument table's rows.

A reference ``(argument, row)`` (codegen/operator.py) names a row of an input argument. How a
kernel reads it, its tangent and its gradient follow from the argument's table row
(codegen/arguments.py) alone, so an input a table adds needs nothing here:

- the action (the input whose rows follow the layout) is read where it is used: macro
  ``<stem>(j)``, tangent ``D<stem>(j)``, gradient store ``G<stem>(j, value)`` (``U``, ``DU``, ``GU``);
- an input of one row of D per trajectory (the start and goal states, ...) is read once per
  column into a local named by its stem (``s0 = S0;``), its tangent into ``t<local>``
  (``ts0 = DS0;``), and its gradient stored by ``G<stem>(value)`` (``GS0``); the templates
  define those macros from the same rows (the row an index picks, a missing optional input
  read as zero, a missing gradient not stored);
- an earlier output row ``("y", k, h)`` is the row's value ``y<k>_<h>`` (tangent ``ty<k>_<h>``).

>>> from tensorstep.codegen.arguments import table
>>> from tensorstep.codegen.spec import KernelSpec
>>> from tensorstep.codegen.printer import COLUMN
>>> refs = References(table(KernelSpec(horizon=4, dof=2)))
>>> COLUMN.lines(refs.loads(("p0", "v0")))
['const T s0 = S0;', 'const T s1 = S1;']
>>> COLUMN.expr(refs.value(("u", 2))), COLUMN.expr(refs.value(("a0", 0), tangent=True))
('U(2)', 'ts2')
>>> COLUMN.statement(refs.gradient(("v0", 0), ()))
'GS1(ZERO);'
"""
from __future__ import annotations

from typing import Iterable

from .arguments import Argument, ArgumentTable
from .operator import Ref, is_action, is_row
from .statements import Call, Def, Read, Statement, Sum, Term, Val, Var


class References:
    """Statement nodes for the references of an operator over one argument table."""

    def __init__(self, table: ArgumentTable):
        self.action = table.action
        self.columns: dict[str, Argument] = {a.name: a for a in table.columns}
        c_names = {a.c_name for a in table.inputs} | {a.grad_name for a in table.inputs}
        for a in self.columns.values():
            if a.macro.lower() in c_names or "t" + a.macro.lower() in c_names:
                raise ValueError(f"{a.name}: its macro stem {a.macro!r} names a local ({a.macro.lower()}) that is "
                                 "also a C parameter; give the row a stem whose lower case is no parameter's name")

    def _column(self, ref: Ref) -> Argument:
        try:
            return self.columns[ref[0]]
        except KeyError:
            known = ", ".join([self.action.name, *self.columns])
            raise ValueError(f"the operator reads {ref[0]!r}, which its argument table does not have as an input "
                             f"of the kernel's dtype (inputs: {known})") from None

    def local(self, ref: Ref) -> str:
        """A short name for a reference, unique among the operator's inputs (``u3``, ``s0``, ``e1``)."""
        if is_action(ref):
            return f"{self.action.macro.lower()}{ref[1]}"
        return self._column(ref).macro.lower()

    def value(self, ref: Ref, tangent: bool = False) -> Read | Var | Val:
        """A reference's value (its tangent with ``tangent``): ``U(3)``, ``s1``, ``y2_5``."""
        prefix = "t" if tangent else ""
        if is_row(ref):
            return Val(f"{prefix}y", ref[1], ref[2])
        if is_action(ref):  # read at the point of use: keeps register pressure flat in long bodies
            return Read(("D" if tangent else "") + self.action.macro, (ref[1],))
        return Var(prefix + self._column(ref).macro.lower())

    def loads(self, names: Iterable[str], tangent: bool = False) -> list[Statement]:
        """The per-column inputs ``names``, each read once per column (then their tangents)."""
        args = [self._column((name, 0)) for name in names]
        lines: list[Statement] = [Def(Var(a.macro.lower()), Read(a.macro)) for a in args]
        if tangent:
            lines += [Def(Var("t" + a.macro.lower()), Read("D" + a.macro)) for a in args]
        return lines

    def gradient(self, ref: Ref, parts: tuple[Term, ...]) -> Call:
        """The store of an input's gradient: ``GU(j, value)``, ``GS0(value)``, ..."""
        if is_action(ref):
            return Call("G" + self.action.macro, (ref[1],), Sum(parts))
        return Call("G" + self._column(ref).macro, (), Sum(parts))

    def has_gradient(self, ref: Ref) -> bool:
        """Whether the adjoint writes a gradient for this input reference."""
        return is_action(ref) or self._column(ref).differentiable

    def differentiable(self, n_actions: int, columns: Iterable[str]) -> list[Ref]:
        """The input references an adjoint writes a gradient for: the actions' rows, then the
        per-column inputs whose table rows are differentiable."""
        return [(self.action.name, j) for j in range(n_actions)] + [
            (name, 0) for name in columns if self._column((name, 0)).differentiable]
