"""The code generator's driver: named stages, run in order, one immutable result.

    spec ──operator──▶ Operator (SymPy rows, codegen/schemes.py, legacy.py, ...)
         ──lower────▶ LoweredOperator (statements per kernel, coefficient program)
         ──render───▶ sources per (target, part) (Jinja2 templates)

``generate(spec)`` returns a ``Generated``: the sources, the entry points, the argument
table, the coefficient count, each target's launch plan (codegen/targets.py) and the metadata
the runtime caches beside a build (from which a target rebuilds the same plan). The
runtime compiles and loads that result; it never reaches into the stages or parses the text.
``generate(spec, keep=True)`` also keeps each stage's output (``Generated.stages``), each
printable (``Stages.text``: what `tensorstep show --stage` prints).

>>> from tensorstep.codegen.spec import KernelSpec
>>> g = generate(KernelSpec(horizon=6, dof=2), targets=("c",), parts=("core",))
>>> sorted(g.entry_points)
['adjoint', 'forward']
>>> "void ts_h6_d2_pos_cen_a442_hold_dtu_noidx_bhd_f32_o3_forward(" in g.source("c", "core")
True
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import types
from typing import Any, Collection, Iterator, Mapping, Optional

from ..version import __version__
from . import abi
from .arguments import ArgumentTable, table
from .builders import build_operator
from .targets import TARGETS, target as target_of

STAGES = ("operator", "lower", "render")
#: what a kept stage prints as (``Stages.text``): the operator, the lowered statements, a target's source
FORMS = ("operator", "lowered", *TARGETS)


@dataclasses.dataclass(frozen=True)
class Generated:
    """One spec's generated kernels: everything the runtime and the CLI need, immutable."""

    spec: Any
    table: ArgumentTable
    sources: Mapping[tuple[str, str], str]  # (target, part) → source text
    entry_points: Mapping[str, str]  # kernel → exported symbol
    n_coefficients: int  # entries of the dt_vjp coefficient accumulator
    metadata: Mapping[str, Any]
    stages: Stages | None = None  # each stage's output, with generate(..., keep=True)

    def source(self, target: str, part: str = "all") -> str:
        try:
            return self.sources[(target, part)]
        except KeyError:
            made = ", ".join(f"{t}/{p}" for t, p in self.sources)
            raise KeyError(f"({target!r}, {part!r}) was not generated (generated: {made})") from None

    def launch_plan(self, target: str) -> Any:
        """A generated target's launch plan (codegen/targets.py): its launches for a batch size,
        worked out when asked for (a backend builds its own once, from its libraries' metadata)."""
        generated = dict.fromkeys(t for t, _ in self.sources)
        if target not in generated:
            raise KeyError(f"{target!r} was not generated (generated: {', '.join(generated)})")
        return target_of(target).launch_plan(self.spec, self.metadata)


@dataclasses.dataclass(frozen=True)
class Stages:
    """Each stage's output for one spec (``generate(..., keep=True)``): the operator's rows, the
    lowered kernels (statements) and the rendered sources, each printable by ``text``."""

    spec: Any
    table: ArgumentTable
    operator: Any  # codegen/operator.py Operator
    lowered: Any  # codegen/lower.py LoweredOperator
    kernels: tuple[str, ...]  # the kernels of the parts generated
    sources: Mapping[tuple[str, str], str]  # (target, part) → source text

    def text(self, form: str) -> str:
        """One stage's output as text: 'operator' (its rows), 'lowered' (each generated kernel's
        statements) or a target's name (its source, where one part was generated)."""
        if form == "operator":
            return operator_text(self.operator, self.table, self.spec.name)
        if form == "lowered":
            return lowered_text(self.lowered, self.kernels, self.spec.name)
        sources = [text for (t, _), text in self.sources.items() if t == form]
        if len(sources) != 1:
            made = ", ".join(f"{t}/{p}" for t, p in self.sources)
            raise ValueError(f"form={form!r}: allowed {', '.join(FORMS)} with one part of that target "
                             f"generated (generated: {made})")
        return sources[0]


def operator_text(op: Any, table: ArgumentTable, name: str = "") -> str:
    """An operator's rows as text, one per line in evaluation order: ``V[3] = (c)*u[2] + ...``
    (references by their argument's name: ``u[j]`` an action row, ``p0``… the start state,
    ``gp``… the goal state, any other input by its name, ``P[h]``… an earlier output row;
    coefficients are SymPy's)."""
    from sympy.core.function import AppliedUndef

    from .operator import is_formula, is_row

    outputs = [a.name for a in table.outputs]
    action = table.action.name

    def ref(r: tuple) -> str:
        if is_row(r):
            return f"{outputs[r[1]]}[{r[2]}]"
        return f"{r[0]}[{r[1]}]" if r[0] == action else r[0]

    def term(coef: Any, r: tuple) -> str:
        return ref(r) if coef == 1 else f"-{ref(r)}" if coef == -1 else f"({coef})*{ref(r)}"

    lines = [f"# operator {name}: outputs {', '.join(outputs[:op.n_outputs])} over {op.horizon} rows; "
             f"{op.n_actions} rows of {action}; step durations {', '.join(map(str, op.dt_symbols))}"]
    formulas = {type(f) for row in op.rows for c, _ in row.terms for f in c.atoms(AppliedUndef) if is_formula(f)}
    for f in sorted(formulas, key=str):
        lines.append(f"# formula {f}{tuple(f.definition.variables)} = {f.definition.expr}".replace(",)", ")"))
    lines += [f"{symbol} = {expr}" for symbol, expr in op.program]
    for row in op.rows:
        body = " + ".join(term(c, r) for c, r in row.terms).replace("+ -", "- ")
        lines.append(f"{outputs[row.k]}[{row.h}] = {body or 0}")
    return "\n".join(lines) + "\n"


def lowered_text(code: Any, kernels: tuple[str, ...], name: str = "") -> str:
    """The lowered kernels as text: the coefficient table's program, then each kernel's setup,
    its loops (index range, output row, guard) and its statements (per column; dt_vjp_finish's
    run once per call), over the column macros (codegen/printer.py). Target-neutral: each
    target picks among a kernel's variants (codegen/targets.py)."""
    def block(title: str, lines: list[str], indent: str = "    ") -> list[str]:
        return [title] + [indent + line for line in lines] if lines else []

    out = [f"# lowered {name}: a {'stencil' if code.stencil else 'recurrence'}; coefficient table of "
           f"{code.n_coefficients} slots; step durations: {code.n_dt}"]
    out += block("# coefficient table (once per call, double precision)", code.coefficient_lines)
    for kernel in kernels:
        kc = getattr(code, kernel)
        out.append(f"# {kernel}")
        out += block("  setup:", kc.preamble)
        for loop in kc.loops:
            guard = f", where {loop.guard} is given" if loop.guard else ""
            out += block("  before the loop:", loop.init_lines)
            out += block(f"  for r in [{loop.start}, {loop.stop}), output row {loop.row}{guard}:", loop.lines)
            out += block("  after the loop:", loop.finish_lines)
        out += block("  statements:", kc.body)
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused: the stages make millions of short-lived SymPy objects and
    few cycles, and each of the collector's passes walks the live heap (PyTorch's too, in a
    program that imported it), a fifth of a long generation for almost nothing found."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def operator_stage(spec: Any) -> Any:
    """Stage 1, operator: the spec's rows, derived by the builder registered for its type (SymPy)."""
    return build_operator(spec)


def lower_stage(spec: Any, op: Any) -> Any:
    """Stage 2, lower: the operator's kernels as statements and its coefficient program (SymPy)."""
    from .lower import lower

    return lower(op, table(spec))


def render_stage(spec: Any, code: Any, args: ArgumentTable, targets: Mapping[str, Any],
                 parts: tuple[str, ...], forms: Optional[Collection[int]] = None) -> dict[tuple[str, str], str]:
    """Stage 3, render: each target's source of each part (Jinja2); ``forms``: as ``generate``'s."""
    from .render import render

    return {(name, p): render(spec, code, args, t, p, forms) for name, t in targets.items() for p in parts}


@functools.lru_cache(maxsize=256)
def lowered(spec: Any) -> Any:
    """Stages 1 and 2, operator and lowering, once per spec and process."""
    return lower_stage(spec, operator_stage(spec))


def metadata(spec: Any, n_coefficients: int, coefficients: str = "code") -> dict[str, Any]:
    """What a build of this spec needs at load time, without generating code again
    (``coefficients``: the form of its coefficient programs, codegen/targets.py
    ``coefficient_form``, which the CUDA launch plan follows)."""
    return {"tool": "tensorstep", "version": __version__, "name": spec.name, "spec": spec.to_dict(),
            "n_coefficients": n_coefficients, "coefficients": coefficients,
            "entry_points": {k: abi.symbol(spec.name, k) for k in abi.KERNELS}}


def generate(spec: Any, targets: tuple[str, ...] = tuple(TARGETS), parts: tuple[str, ...] = ("all",),
             keep: bool = False, forms: Optional[Collection[int]] = None) -> Generated:
    """Run the stages for one spec; sources for each requested target (by name) and part.
    ``keep``: the result holds each stage's output too (``Generated.stages``). ``forms``: the variants
    of a fused C forward and adjoint whose batch functions the C sources hold, from 1 (None: every
    one; the runtime builds each in a library of its own, runtime/cbackend.py ``Forms``)."""
    chosen = {name: target_of(name) for name in targets}
    for part in parts:
        if part not in abi.PARTS:
            raise ValueError(f"part={part!r} is invalid: allowed {', '.join(abi.PARTS)}")
    with _without_cycle_collection():
        program = lowered(spec)  # operator_stage, then lower_stage
        args = table(spec)
        sources = types.MappingProxyType(render_stage(spec, program, args, chosen, parts, forms))
    kernels = {k for p in parts for k in abi.part_kernels(p, args)}
    meta = metadata(spec, program.n_coefficients, program.coefs.form)
    stages = Stages(spec, args, program.op, program, tuple(k for k in abi.KERNELS if k in kernels), sources) if keep else None
    return Generated(
        spec=spec, table=args, sources=sources, stages=stages,
        entry_points=types.MappingProxyType({k: abi.symbol(spec.name, k) for k in abi.KERNELS if k in kernels}),
        n_coefficients=program.n_coefficients,
        metadata=types.MappingProxyType(meta),
    )
