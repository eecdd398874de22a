"""The code generator's driver: named stages, run in order, one immutable result.

    spec ──operator──▶ Operator (SymPy rows, codegen/schemes.py, legacy.py, ...)
         ──lower────▶ LoweredOperator (statements per kernel, coefficient program)
         ──render───▶ sources per (target, part) (Jinja2 templates)

``generate(spec)`` returns a ``Generated``: the sources, the entry points, the argument
table, the coefficient count, each target's launch plan (codegen/targets.py) and the metadata
the runtime caches beside a build (from which a target rebuilds the same plan). The
runtime compiles and loads that result; it never reaches into the stages or parses the text.

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
from typing import Any, Iterator, Mapping

from ..version import __version__
from . import abi
from .arguments import ArgumentTable, table
from .builders import build_operator
from .targets import TARGETS, target as target_of

STAGES = ("operator", "lower", "render")


@dataclasses.dataclass(frozen=True)
class Generated:
    """One spec's generated kernels: everything the runtime and the CLI need, immutable."""

    spec: Any
    table: ArgumentTable
    sources: Mapping[tuple[str, str], str]  # (target, part) → source text
    entry_points: Mapping[str, str]  # kernel → exported symbol
    n_coefficients: int  # entries of the dt_vjp coefficient accumulator
    metadata: Mapping[str, Any]
    launch_plans: Mapping[str, Any]  # target → its launch plan (None for the header)

    def source(self, target: str, part: str = "all") -> str:
        try:
            return self.sources[(target, part)]
        except KeyError:
            made = ", ".join(f"{t}/{p}" for t, p in self.sources)
            raise KeyError(f"({target!r}, {part!r}) was not generated (generated: {made})") from None

    def launch_plan(self, target: str) -> Any:
        """A generated target's launch plan (codegen/targets.py): its launches for a batch size."""
        try:
            return self.launch_plans[target]
        except KeyError:
            raise KeyError(f"{target!r} was not generated (generated: {', '.join(self.launch_plans)})") from None


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


@functools.lru_cache(maxsize=256)
def lowered(spec: Any) -> Any:
    """Stages 1 and 2, operator and lowering, once per spec and process."""
    from .lower import lower  # SymPy

    return lower(build_operator(spec), per_trajectory=table(spec).dt.shape == ("B",))


def metadata(spec: Any, n_coefficients: int, tapes: bool = False) -> dict[str, Any]:
    """What a build of this spec needs at load time, without generating code again (``tapes``:
    its CUDA coefficient programs are tapes, which the CUDA backend launches a block per run for)."""
    return {"tool": "tensorstep", "version": __version__, "name": spec.name, "spec": spec.to_dict(),
            "n_coefficients": n_coefficients, "tapes": tapes,
            "entry_points": {k: abi.symbol(spec.name, k) for k in abi.KERNELS}}


def generate(spec: Any, targets: tuple[str, ...] = tuple(TARGETS), parts: tuple[str, ...] = ("all",)) -> Generated:
    """Run the stages for one spec; sources for each requested target (by name) and part."""
    from .render import render  # Jinja2

    chosen = {name: target_of(name) for name in targets}
    for part in parts:
        if part not in abi.PARTS:
            raise ValueError(f"part={part!r} is invalid: allowed {', '.join(abi.PARTS)}")
    with _without_cycle_collection():
        program = lowered(spec)
        args = table(spec)
        sources = {(name, p): render(spec, program, args, t, p) for name, t in chosen.items() for p in parts}
    kernels = {k for p in parts for k in abi.PARTS[p]}
    meta = metadata(spec, program.n_coefficients, program.coefs.long)
    return Generated(
        spec=spec, table=args, sources=types.MappingProxyType(sources),
        entry_points=types.MappingProxyType({k: abi.symbol(spec.name, k) for k in abi.KERNELS if k in kernels}),
        n_coefficients=program.n_coefficients,
        metadata=types.MappingProxyType(meta),
        launch_plans=types.MappingProxyType({name: t.launch_plan(spec, meta) for name, t in chosen.items()}),
    )
