"""What the CUDA backend launches for a spec and a batch, without a GPU (``tensorstep bench
--cuda-plan``): each launch of a forward, a backward and a backward with a dt gradient (kernel,
grid, block, dynamic shared memory) from the spec's launch plan (codegen/targets.py), the bytes of
temporaries each allocates, and ptxas's registers, spill stores, stack and static shared memory per
kernel (bench/ptxas.py, each library compiled on its own, as the runtime compiles them).

An operation calls the entry points of the C ABI as runtime/launch.py's ``Launcher`` does: a
backward with a dt gradient runs the adjoint, then (integrators) a forward whose outputs dt_vjp
reads, dt_vjp into partial sums it writes itself, and dt_vjp_finish into a gradient of dt's dtype
(no zero fill, no cast: every launch is listed). Those buffers of the Launcher are temporaries too.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

from ..codegen.render import ITEMSIZE
from ..codegen.targets import Launch
from . import ptxas

#: the operations reported, each in words
OPERATIONS = {"forward": "forward", "backward": "backward", "backward_dt": "backward with a dt gradient"}
#: the libraries the operations load
PARTS = ("core", "dt_vjp")


@dataclasses.dataclass(frozen=True)
class Operation:
    """One operation's launches, each with the entry point that runs it, and its temporaries."""

    name: str
    launches: tuple[tuple[str, Launch], ...]
    temporaries: tuple[tuple[str, int], ...]  # (name, bytes)

    @property
    def temporary_bytes(self) -> int:
        return sum(size for _, size in self.temporaries)


def entry_points(table: Any, operation: str) -> tuple[str, ...]:
    """The entry points an operation calls, in order (runtime/launch.py ``Launcher``)."""
    if operation == "forward":
        return ("forward",)
    if operation == "backward":
        return ("adjoint",)
    if operation == "backward_dt":
        return ("adjoint", *(("forward",) if table.values else ()), "dt_vjp", "dt_vjp_finish")
    raise ValueError(f"operation={operation!r} is invalid: allowed {', '.join(OPERATIONS)}")


def operation(generated: Any, name: str, B: int) -> Operation:
    """An operation's launches over a batch of B, from the spec's CUDA launch plan, and its
    temporaries: the plan's and, with a dt gradient, the Launcher's (dt_vjp's partial sums, the
    forward's outputs an integrator's dt_vjp reads, the dt gradient)."""
    plan, table, spec = generated.launch_plan("cuda"), generated.table, generated.spec
    launches: list[tuple[str, Launch]] = []
    temporaries: list[tuple[str, int]] = []
    for entry in entry_points(table, name):
        planned = plan.launches(entry, B)
        launches += [(entry, launch) for launch in planned.launches]
        temporaries += [(f"{entry}.{t.name}", t.size * ITEMSIZE[t.dtype]) for t in planned.temporaries]
    if name == "backward_dt":
        temporaries.append(("gc", plan.dt_vjp_size(B) * 8))
        if table.values:
            outputs = math.prod(table.physical(table.outputs[0], {"B": B})) * len(table.outputs)
            temporaries.append(("values", outputs * ITEMSIZE[spec.dtype]))
        temporaries.append(("gdt", math.prod(table.physical(table.dt, {"B": B})) * ITEMSIZE[plan.gradient_dtype]))
    return Operation(name, tuple(launches), tuple(temporaries))


def resources(spec: Any) -> dict[str, Any]:
    """ptxas's figures per kernel of the libraries the operations load ({} and a reason without nvcc)."""
    if ptxas.nvcc() is None:
        return {"kernels": {}, "error": "nvcc not found on PATH: no ptxas figures"}
    prefix = f"{spec.name}_"
    kernels: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tensorstep-plan-") as workdir:
        for part in PARTS:
            module = ptxas.compile_module(f"{spec.name}-{part}", ptxas.source_of(spec, part), Path(workdir))
            if module.error:
                return {"kernels": kernels, "error": f"{part}: nvcc failed: {module.error.splitlines()[-1]}"}
            for k in module.kernels:
                kernels[k.name[len(prefix):] if k.name.startswith(prefix) else k.name] = {
                    "registers": k.registers, "spill_stores": k.spill_stores, "stack": k.stack, "shared": k.shared}
    return {"kernels": kernels, "error": ""}


def report(spec: Any, batches: tuple[int, ...], with_ptxas: bool = True) -> dict[str, Any]:
    """The JSON-ready report of one spec: operations per batch and ptxas's figures."""
    from ..codegen.driver import generate

    generated = generate(spec, targets=("cuda",), parts=PARTS)
    per_batch = []
    for B in batches:
        ops = {}
        for name in OPERATIONS:
            op = operation(generated, name, B)
            ops[name] = {
                "launches": [{"entry": entry, "kernel": l.kernel, "grid": l.grid, "block": l.block, "shared": l.shared}
                             for entry, l in op.launches],
                "temporaries": dict(op.temporaries),
                "temporary_bytes": op.temporary_bytes,
            }
        per_batch.append({"batch": B, "operations": ops})
    return {"spec": spec.name, "fields": spec.to_dict(), "n_coefficients": generated.n_coefficients,
            "batches": per_batch,
            "ptxas": resources(spec) if with_ptxas else {"kernels": {}, "error": "not asked for (--no-ptxas)"}}


def _bytes(n: int) -> str:
    return f"{n:,}" if n < 10 ** 6 else f"{n:,} ({n / 2 ** 20:.1f} MiB)"


def tables(reports: list[dict[str, Any]]) -> str:
    """Markdown: the launches and temporaries of each operation, then ptxas's figures per kernel."""
    rows = ["| spec | B | operation | launches (kernel grid×block, shared) | temporaries (bytes) |",
            "|---|---:|---|---|---:|"]
    for r in reports:
        for b in r["batches"]:
            for name, op in b["operations"].items():
                launches = ", ".join(f"{l['kernel']} {l['grid']}×{l['block']}" + (f" +{l['shared']} B" if l["shared"] else "")
                                     for l in op["launches"])
                rows.append(f"| {r['spec']} | {b['batch']} | {OPERATIONS[name]} ({len(op['launches'])}) | "
                            f"{launches} | {_bytes(op['temporary_bytes'])} |")
    rows += ["", "| spec | kernel | registers | spill stores (B) | stack (B) | static shared (B) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in reports:
        if r["ptxas"]["error"]:
            rows.append(f"| {r['spec']} | {r['ptxas']['error']} | | | | |")
        for kernel, k in r["ptxas"]["kernels"].items():
            rows.append(f"| {r['spec']} | {kernel} | {k['registers']} | {k['spill_stores']} | {k['stack']} | {k['shared']} |")
    return "\n".join(rows)

