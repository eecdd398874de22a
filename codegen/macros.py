"""The kernels' per-argument C macros and lines, written from the argument table's rows.

The lowered statements (codegen/references.py) read an input of one row of D per trajectory
(a start or goal entry, or any input a table adds) through its stem: ``S0`` its value,
``DS0`` its tangent, ``GS0(v)`` its gradient store. Here each row becomes those definitions,
for the scalar column form (both templates) and the C template's lane form, together with the
row an index picks per trajectory (``srow = idx ? idx[b] : b``) and the column bases. Nothing
names an argument by hand: the templates print these lines.

>>> from tensorstep.codegen.arguments import table
>>> from tensorstep.codegen.spec import KernelSpec
>>> t = table(KernelSpec(horizon=4, dof=2))
>>> column(t)[:1] + column(t)[3:6]
['#define S0 p0[so]', '#define S3 (j0 ? j0[so] : (T)0)', '#define DS0 (dp0 ? dp0[so] : (T)0)', '#define GS0(v) do { if (gp0) gp0[bo] = (v); } while (0)']
>>> rows(t), bases(t)
(['const int64_t srow = idx ? idx[b] : b;'], ['const int64_t so = srow * D_ + (d); (void)so;'])
"""
from __future__ import annotations

from . import abi
from .arguments import Argument, ArgumentTable


def _row(index: Argument) -> str:
    return index.stem + "row"


def _read(a: Argument, at: str, zero: str = "(T)0", load: str = "{p}[{at}]") -> str:
    value = load.format(p=a.c_name, at=at)
    return f"({a.c_name} ? {value} : {zero})" if a.nullable and not a.filled else value


def column(table: ArgumentTable) -> list[str]:
    """Value, tangent and gradient-store macros of the per-column inputs, for one (batch, dof) column:
    a missing optional input reads 0, a missing tangent 0, a missing gradient is not stored."""
    lines = [f"#define {a.macro} {_read(a, table.base(a))}" for a in table.columns]
    for a in table.columns:
        at = table.base(a)
        if a.differentiable:
            lines.append(f"#define D{a.macro} ({a.tangent_name} ? {a.tangent_name}[{at}] : (T)0)")
            lines.append(f"#define G{a.macro}(v) do {{ if ({a.grad_name}) {a.grad_name}[bo] = (v); }} while (0)")
    return lines


def parameters(table: ArgumentTable) -> list[str]:
    """Macros of the inputs every trajectory shares: a per-dof value ``<stem>`` ([D]), the i-th of R
    values per dof ``<stem>(i)`` ([R, D]), a per-row value ``<stem>(h)`` ([H]); an optional one
    missing reads its row's default."""
    lines = []
    for a in table.parameters:
        if a.shape == ("D",):
            lines.append(f"#define {a.macro} {_read(a, 'd', f'(T){a.default}')}")
        elif len(a.shape) == 2 and a.shape[1] == "D":
            lines.append(f"#define {a.macro}(i) {_read(a, '(i) * D_ + d', f'(T){a.default}')}")
        elif a.shape == ("H",):
            lines.append(f"#define {a.macro}(h) {_read(a, '(h)', f'(T){a.default}')}")
        else:
            raise ValueError(f"{a.name}: no kernel macro for an input of shape {a.shape}")
    return lines


def lanes(table: ArgumentTable) -> list[str]:
    """The same inputs' value and gradient-store macros in the C lane form (all dof of a row at once)."""
    lines = [f"#define V{a.macro} {_read(a, table.base(a), 'VZERO', 'VLOAD({p} + {at})')}" for a in table.columns]
    lines += [f"#define VG{a.macro}(v) do {{ if ({a.grad_name}) VSTORE({a.grad_name} + bo, (v)); }} while (0)"
              for a in table.columns if a.differentiable]
    return lines


def lane_parameters(table: ArgumentTable) -> list[str]:
    """The per-dof parameters (``parameters``' [D] and [R, D]) in the C lane form: a row of D at once
    (a per-row one stays a scalar, which the vector operations broadcast)."""
    lines = []
    for a in _per_dof(table):
        default = f"VZERO + (T){a.default}"
        if a.shape == ("D",):
            lines.append(f"#define V{a.macro} {_read(a, '', default, 'VLOAD({p})')}")
        else:
            lines.append(f"#define V{a.macro}(i) {_read(a, '(i) * D_', default, 'VLOAD({p} + {at})')}")
    return lines


def _per_dof(table: ArgumentTable) -> list[Argument]:
    return [a for a in table.parameters if a.shape[-1] == "D"]


def zero_tangents(table: ArgumentTable) -> list[str]:
    """C dt_jvp: each input tangent read from a per-batch-element base (``tangent_bases``) that points
    at zeros when the tangent is missing, so the loads stay unconditional and vectorise."""
    lines = []
    for a in table.columns:
        lines += [f"#undef D{a.macro}", f"#define D{a.macro} {_tangent_base(a)}[{_tangent_at(table, a)}]"]
    return lines


def lane_zero_tangents(table: ArgumentTable) -> list[str]:
    """``zero_tangents`` in the C lane form."""
    return [f"#define VD{a.macro} VLOAD({_tangent_base(a)} + ({_tangent_at(table, a)}))" for a in table.columns]


def _tangent_at(table: ArgumentTable, a: Argument) -> str:
    return f"{table.base(a)} - {_base_row(table, a)} * D_"


def _tangent_base(a: Argument) -> str:
    return f"d{a.macro.lower()}b"


def _base_row(table: ArgumentTable, a: Argument) -> str:
    return _row(table.input(a.group)) if a.group else "b"


def tangent_bases(table: ArgumentTable, restrict: str = "restrict") -> list[str]:
    """The per-batch-element tangent bases of ``zero_tangents`` (``ts_zero_state``: D zeros)."""
    return [f"const T* {restrict} {_tangent_base(a)} = {a.tangent_name} ? {a.tangent_name} + "
            f"{_base_row(table, a)} * D_ : ts_zero_state;" for a in table.columns]


def rows(table: ArgumentTable) -> list[str]:
    """Each index's row of batch element b: the entry it gives, or b without one."""
    return [f"const int64_t {_row(i)} = {i.c_name} ? {i.c_name}[b] : b;" for i in _used(table)]


def null_indices(table: ArgumentTable, null: str = "NULL") -> list[str]:
    """The adjoint takes no index (its gradients are one row per trajectory; the runtime adds them
    onto the picked rows): each index is a null pointer there, so its row is b."""
    return [f"const int64_t* {i.c_name} = {null};" for i in _used(table)]


def bases(table: ArgumentTable) -> list[str]:
    """The column base of each index's row (``so = srow * D_ + d``; some kernels read none)."""
    return [f"const int64_t {i.stem}o = {_row(i)} * D_ + (d); (void){i.stem}o;" for i in _used(table)]


def _used(table: ArgumentTable) -> list[Argument]:
    """The index rows some per-column input is picked by."""
    groups = {a.group for a in table.columns}
    return [i for i in table.indices if i.name in groups]


def lane_names(table: ArgumentTable) -> frozenset[str]:
    """The column macros that have a lane form (``V`` + name): the action's, the per-column inputs', the
    per-dof parameters' and, with cost terms, the store of a term's sums per dof (``CPART``); a fused
    step's, its checkpoint array (``TS_CHECKPOINTS``, ``TS_CK``: codegen/fused.py ``rolled_adjoint``)."""
    names = {table.action.macro, "D" + table.action.macro, "G" + table.action.macro}
    for a in table.columns:
        names |= {a.macro, "D" + a.macro, "G" + a.macro}
    names |= {a.macro for a in _per_dof(table)}
    names |= {"TS_CHECKPOINTS", "TS_CK"} if table.fused else set()
    return frozenset(names | ({"CPART"} if table.costs else set()))


def _stride(base: str) -> str:
    """The element distance from trajectory b's row to trajectory b1's at a column base (``pair_bases``)."""
    return base + "_s"


def pair_bases(table: ArgumentTable) -> list[str]:
    """The paired lane form's second trajectory b1 (b itself where b is the last): each index's row of b1
    and, per column base, the distance from b's row to b1's (0 where b1 is b)."""
    lines = [f"const int64_t {_row(i)}_1 = {i.c_name} ? {i.c_name}[b1] : b1;" for i in _used(table)]
    lines += [f"const int64_t {_stride(i.stem + 'o')} = ({_row(i)}_1 - {_row(i)}) * D_;" for i in _used(table)]
    lines += [f"const int64_t {_stride('uo')} = (b1 - b) * U_SB, {_stride('yo')} = (b1 - b) * Y_SB, "
              f"{_stride('bo')} = (b1 - b) * D_;"]
    return lines


def prefetches(table: ArgumentTable, kernel: str) -> list[str]:
    """A C forward's or adjoint's requests for trajectory ``@``'s rows, ahead of their loads and stores:
    every row the kernel is passed (codegen/abi.py ``arguments``). Those it reads: the actions and each
    per-trajectory input (the row its index picks, if given; a missing optional one skipped), which a
    forward and a fused adjoint read, and each output's gradient (adjoint; a missing one skipped).
    Those it writes, asked for to be written: each output's row (forward) and each input's gradient row
    (a plain adjoint; a missing one skipped). A fused adjoint's gradient rows are not: there that was
    slower (BENCHMARKS.md, "The fused C kernels at B=40000: rows asked for ahead"; in a plain adjoint,
    which reads only the output gradients, it was the larger part of the gain: "The plain step's C
    kernels at B=40000: rows asked for ahead"). templates/kernel.c.j2 replaces ``@`` with the
    trajectory. Each row is whole lines but maybe its last, which the next trajectory's row begins. The
    paired adjoint (codegen/render.py ``paired``), which runs on shares whose rows stay in cache, asks
    for none."""
    return [f"{f'if ({p}) ' if nullable else ''}TS_PREFETCH_ROW{write}({p} + {at}, {n});"
            for p, at, n, nullable, write in _prefetch_rows(table, kernel)]


def prefetch_elements(table: ArgumentTable, kernel: str) -> str:
    """The elements of one trajectory's rows that ``prefetches`` asks for (each optional one counted):
    what the batch function's gate counts (templates/kernel.c.j2)."""
    return " + ".join(n for _, _, n, _, _ in _prefetch_rows(table, kernel))


def _prefetch_rows(table: ArgumentTable, kernel: str) -> list[tuple[str, str, str, bool, str]]:
    """(pointer, offset of row ``@``, elements, optional, "" or "_WRITE") of each row ``prefetches`` asks for."""
    passed = {name for _, name in abi.arguments(kernel, table)}
    rows = [(table.action.c_name, "(@) * U_SB", "U_SB", False, "")]
    for a in table.columns:
        index = table.input(a.group).c_name if a.group else ""
        row = f"({index} ? {index}[@] : (@))" if index else "(@)"
        rows.append((a.c_name, f"{row} * D_", "D_", a.nullable and not a.filled, ""))
    for a in table.outputs:
        stride = "T_" if a.role == "cost" else "Y_SB"
        rows.append((a.grad_name, f"(@) * {stride}", stride, True, ""))
        rows.append((a.c_name, f"(@) * {stride}", stride, False, "_WRITE"))
    if not table.fused:  # the adjoint's own rows: one per trajectory, the runtime sums an index's
        for a in table.differentiable:
            stride = "U_SB" if a is table.action else "D_"
            rows.append((a.grad_name, f"(@) * {stride}", stride, a is not table.action, "_WRITE"))
    return [row for row in rows if row[0] in passed]


def lane_pairs(table: ArgumentTable, outputs: int) -> list[tuple[str, str]]:
    """(name, definition) of each macro the paired lane form defines over its own (two trajectories a
    vector: b in the lower lanes, b1 in the upper), in place of the lane form's: the per-trajectory
    inputs' loads and stores from both rows (``VLOADP``/``VSTOREP`` with the rows' distance), the
    shared parameters in both halves, the output rows and their gradients, and a term's incoming
    gradient as a vector of the two trajectories' (``GCOST``)."""
    defs = [("VU_LOAD", "(j) VLOADP(u + uo + (j) * U_SH, uo_s)"), ("VU", "(j) VU_LOAD(j)"),
            ("VGU", "(j, v) VSTOREP(gu + uo + (j) * U_SH, uo_s, (v))")]
    for a in table.columns:
        at = table.base(a)
        defs.append((f"V{a.macro}", " " + _read(a, at, "VZERO", f"VLOADP({{p}} + {{at}}, {_stride(at)})")))
        if a.differentiable:
            defs.append((f"VG{a.macro}", f"(v) do {{ if ({a.grad_name}) VSTOREP({a.grad_name} + bo, {_stride('bo')}, (v)); }} while (0)"))
    for a in _per_dof(table):
        default = f"VZERO + (T){a.default}"
        if a.shape == ("D",):
            defs.append((f"V{a.macro}", " " + _read(a, "", default, "VLOADP({p}, 0)")))
        else:
            defs.append((f"V{a.macro}", "(i) " + _read(a, "(i) * D_", default, "VLOADP({p} + {at}, 0)")))
    for k in range(outputs):
        defs += [(f"VY{k}", f"(h, v) VSTOREP(y{k} + yo + (h) * Y_SH, yo_s, (v))"),
                 (f"VG{k}", f"(h) VLOADP(gb{k} + (h) * Y_SH, gb{k}_s)")]
    if table.costs:
        defs.append(("GCOST", "(t) ts_vpair(gcost ? gcost[b * T_ + (t)] : (T)0, gcost ? gcost[b1 * T_ + (t)] : (T)0)"))
    return defs
