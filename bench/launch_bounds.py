"""``python -m tensorstep.bench.launch_bounds N SEED [--where FIELD=VALUE,...] [--blocks 2,3,4]
[--model DIR] [--json FILE]``: ptxas's figures for the fused forward and adjoint of N seeded fused
specs at each register cap ``__launch_bounds__(256, n)`` gives (n = 2, 3, 4: 128, 80 and 64
registers), without a GPU. ``--where`` keeps the draws whose spec fields, or ``terms``, ``kind``
and ``row_terms`` (what the launch plan's rule reads), have those values (``control=velocity|jerk``: either); ``--json`` appends each
spec's rows to FILE and skips the specs already there.

Each spec's core library is rendered once, then compiled by ``nvcc -cubin -arch=sm_90
--ptxas-options=-v`` (bench/ptxas.py) once per n, with the forward's and the adjoint's bounds set to
n (the other kernels as generated): registers, spill stores, stack frame. With ``--model DIR`` (the
cuda_model tools: sim.py and sassraw.py beside a cuobjdump) each kernel also gets its SASS
instructions and a one-warp issue model's cycles (a straight walk, loops once); the blocks an SM
holds come from the registers. Estimates, which a GPU run decides. The draws cover every control and B-spline degree, end, dt mode and layout, float32
and float64, orders 3 and 4, horizons 16 to 256, few and many cost terms.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import ptxas

#: the resident blocks asked for (``__launch_bounds__(256, n)``): caps of 128, 80 and 64 registers
MIN_BLOCKS = (2, 3, 4)
#: the kernels whose bounds are varied
KERNELS = ("forward", "adjoint")
HORIZONS = (16, 24, 32, 48, 64, 100, 128, 200, 256)
DOF = 7


def with_min_blocks(source: str, kernels: Sequence[str], blocks: int) -> str:
    """The CUDA source with the named kernels' ``__launch_bounds__`` asking for ``blocks`` resident
    blocks (their threads unchanged); the other kernels as they are."""
    found = 0

    def bound(match: re.Match) -> str:
        nonlocal found
        found += 1
        return f"__launch_bounds__({match[1]}, {blocks}){match[2]}"

    wanted = "|".join(re.escape(k) for k in kernels)
    patched = re.sub(rf"__launch_bounds__\((\d+), \d+\)( void \w+_(?:{wanted})\()", bound, source)
    if found != len(kernels):
        raise ValueError(f"{found} of the kernels {', '.join(kernels)} have __launch_bounds__ in the source")
    return patched


def draw(rng: random.Random) -> dict[str, Any]:
    """One fused spec's fields drawn at random (a spec may be invalid: the caller redraws)."""
    from ..codegen.spec import (BSPLINE_DEGREES, BSPLINE_DT, BSPLINE_ENDS, CONTROLS, DERIVATIVE_NAMES, DT_MODES,
                                ENDS, LAYOUTS, OUTPUT_NAMES, bspline_horizon)

    control = rng.choice(CONTROLS)
    order = rng.choice((3, 4))
    fields: dict[str, Any] = dict(control=control, order=order, dof=DOF, dtype=rng.choice(("float32", "float64")),
                                  layout=rng.choice(LAYOUTS), start_index=rng.random() < 0.3)
    if control == "bspline":
        degree = rng.randint(*BSPLINE_DEGREES)
        end = rng.choice(BSPLINE_ENDS)
        knots, steps = rng.choice((8, 16, 32, 64)), rng.choice((1, 2, 4, 8))
        if not HORIZONS[0] <= bspline_horizon(degree, knots, steps, end) <= HORIZONS[-1]:
            return {}
        fields.update(degree=degree, knots=knots, steps=steps, end=end, dt=rng.choice(BSPLINE_DT))
    else:
        fields.update(horizon=rng.choice(HORIZONS), dt=rng.choice(DT_MODES), end=rng.choice(ENDS))
        if control == "position":
            fields["difference"] = rng.choice(("central", "backward"))
        else:
            fields["integrator"] = rng.choice(("semi_implicit_euler", "exact"))
    terms = [(k, s) for k in ("bound", "squared") for s in DERIVATIVE_NAMES[: order + 1]]
    many = rng.random() < 0.5  # few terms (1 or 2) or many (6 up to all)
    costs = rng.sample(terms, rng.randint(6, len(terms)) if many else rng.randint(1, 2))
    fields["costs"] = tuple(sorted(costs, key=terms.index))
    fields["outputs"] = tuple(o for o in OUTPUT_NAMES[: order + 1] if rng.random() < 0.3)
    return fields


def described(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields, and what the launch plan's rule reads of them (codegen/targets.py): ``terms``,
    ``kind`` (``cuda_column_kind``) and ``row_terms`` (``cuda_row_terms``)."""
    from ..codegen import targets

    return {**fields, "terms": len(fields["costs"]), "kind": targets.cuda_column_kind(fields["control"]),
            "row_terms": targets.cuda_row_terms(len(fields["costs"]), fields.get("steps"), fields["order"])}


def specs(n: int, seed: int, where: Optional[dict[str, str]] = None,
          drawing: Callable[[random.Random], dict[str, Any]] = draw) -> list[Any]:
    """``n`` fused specs drawn with ``seed`` by ``drawing`` (invalid draws redrawn), those whose fields (and
    ``described``'s) have the values of ``where`` (as strings; ``a|b``: either) where given."""
    import tensorstep as ts

    rng, drawn = random.Random(seed), []
    while len(drawn) < n:
        fields = drawing(rng)
        if not fields or any(str(described(fields).get(k)) not in v.split("|") for k, v in (where or {}).items()):
            continue
        try:
            drawn.append(ts.KernelSpec(**fields))
        except ValueError:
            continue
    return drawn


@dataclasses.dataclass(frozen=True)
class Row:
    """One kernel of one spec at one cap: ptxas's figures and, with the model, its estimates."""

    spec: str
    kernel: str
    blocks: int  # the resident blocks asked for
    registers: int
    spill_stores: int
    stack: int
    sm_blocks: int  # the blocks of 256 threads an SM holds (``sm_blocks``)
    walk_cycles: Optional[int] = None  # one warp's straight walk (sim.py)
    instructions: Optional[int] = None  # SASS instructions of the function
    error: str = ""  # nvcc's error, where the module failed (no kernel)


def sm_blocks(registers: int, shared: int, threads: int = 256) -> int:
    """Blocks of ``threads`` an sm_90 SM holds by its 65,536 registers (allocated 256 a warp at a
    time), 228 KB of shared memory (1 KB reserved a block) and 64 warps."""
    warps = threads // 32
    by_registers = 65536 // (-(-registers * 32 // 256) * 256 * warps)
    by_shared = 233472 // (shared + 1024) if shared else 32
    return min(by_registers, by_shared, 64 // warps, 32)


def model_tools(tools: Path) -> dict[str, Any]:
    """The cuda_model tools' sass reader and issue model (sassraw.py, sim.py in ``tools``)."""
    sys.path.insert(0, str(tools))
    return {name: __import__(name) for name in ("sassraw", "sim")}


def measure(spec: Any, workdir: Path, model: Any = None, blocks: Sequence[int] = MIN_BLOCKS) -> list[Row]:
    """The fused forward's and adjoint's figures at each of ``blocks``."""
    source = ptxas.source_of(spec, "core")
    rows = []
    for n in blocks:
        label = f"{spec.name}-n{n}"
        module = ptxas.compile_module(label, with_min_blocks(source, KERNELS, n), workdir)
        if module.error:  # a row that says so, and the next spec
            first = next((line for line in module.error.splitlines() if "error" in line), module.error[:200])
            return [Row(spec.name, "", n, 0, 0, 0, 0, error=first.split("error: ")[-1].strip())]
        functions = model["sassraw"].functions(str(workdir / f"{label}.cubin")) if model else {}
        for k in module.kernels:
            kernel = k.name[len(spec.name) + 1:]
            if kernel not in KERNELS:
                continue
            estimates: dict[str, Any] = {}
            if model:
                # the tools drop a name's prefix up to its order (``_o3_``): a fused spec's cost suffix stays
                (ins,) = [f for name, f in functions.items() if name == kernel or name.endswith(f"_{kernel}")]
                walk = model["sim"].simulate(ins, ins[0]["addr"], ins[-1]["addr"], 500)[0]  # a cold load: 500 cycles
                estimates = dict(instructions=len(ins), walk_cycles=walk)
            rows.append(Row(spec.name, kernel, n, k.registers, k.spill_stores, k.stack,
                            sm_blocks(k.registers, k.shared), **estimates))
    return rows


def table(rows: Sequence[Row]) -> list[str]:
    """A Markdown line per (spec, kernel): registers and spill stores at each n (and the model's
    blocks per SM and walk cycles where measured)."""
    by: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:
        by.setdefault((r.spec, r.kernel), {})[r.blocks] = r
    ns = sorted({r.blocks for r in rows})
    lines = ["| spec | kernel | " + " | ".join(f"n={n}: registers, spill (B)" for n in ns) + " |",
             "|---|---|" + "---:|" * len(ns)]
    for (name, kernel), at in by.items():
        if not kernel:
            lines.append(f"| {name} | nvcc failed: {next(iter(at.values())).error} |" + " |" * (len(ns) - 1))
            continue
        cells = []
        for n in ns:
            r = at.get(n)
            cell = "" if r is None else f"{r.registers}, {r.spill_stores}"
            if r is not None and r.walk_cycles is not None:
                cell += f" ({r.sm_blocks} blocks, {r.walk_cycles} cycles)"
            cells.append(cell)
        lines.append(f"| {name} | {kernel} | " + " | ".join(cells) + " |")
    return lines


def _ratio(at: dict[int, Row], first_n: int, n: int) -> Optional[float]:
    """The model's time at n over its time at ``first_n``: walk cycles over blocks an SM holds (the
    warps in flight hiding one warp's latency), or None without the model."""
    first, r = at.get(first_n), at.get(n)
    if first is None or r is None or first.walk_cycles is None or r.walk_cycles is None:
        return None
    return (r.walk_cycles / r.sm_blocks) / (first.walk_cycles / first.sm_blocks)


def summary(rows: Sequence[Row], drawn: Sequence[Any]) -> list[str]:
    """Per dtype and kernel: the kernels, how many spill at each n, their registers at the first n,
    the model's median time at each n over the first; then the same for the kernels the launch plan's
    rule (codegen/targets.py ``cuda_min_blocks``) gives more blocks, and those it leaves."""
    from ..codegen import targets

    specs = {s.name: s for s in drawn}
    by: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:
        if r.kernel and r.spec in specs:
            by.setdefault((r.spec, r.kernel), {})[r.blocks] = r
    groups: dict[str, list[dict[int, Row]]] = {}
    for (name, kernel), at in by.items():
        spec = specs[name]
        more = targets.CUDA.min_blocks(spec).get(kernel, targets.CUDA_MIN_BLOCKS) > targets.CUDA_MIN_BLOCKS
        for group in (f"{spec.dtype} {kernel}", f"{spec.dtype} {kernel}, " + ("given more blocks" if more else "kept at 2")):
            groups.setdefault(group, []).append(at)
    ns = sorted({r.blocks for r in rows})
    lines = ["| kernels | count | " + " | ".join(f"spill at n={n}" for n in ns) + f" | registers at n={ns[0]} (median, most) | "
             + " | ".join(f"model n={n} / n={ns[0]} (median)" for n in ns[1:]) + " |",
             "|---|---:|" + "---:|" * (len(ns) + 1 + len(ns) - 1)]
    for group in sorted(groups):
        ats = groups[group]
        spills = [sum(1 for at in ats if n in at and at[n].spill_stores) for n in ns]
        registers = sorted(at[ns[0]].registers for at in ats if ns[0] in at)
        models = []
        for n in ns[1:]:
            found = sorted(x for x in (_ratio(at, ns[0], n) for at in ats) if x is not None)
            models.append(f"{found[len(found) // 2]:.2f}" if found else "")
        lines.append(f"| {group} | {len(ats)} | " + " | ".join(str(x) for x in spills)
                     + f" | {registers[len(registers) // 2]}, {registers[-1]} | " + " | ".join(models) + " |")
    return lines


def by_size(rows: Sequence[Row], drawn: Sequence[Any]) -> list[str]:
    """Per dtype, kernel, kind of column and ``row_terms`` (what the launch plan's rule reads): the
    kernels, and at each n how many spill (their most bytes), and the blocks the rule gives."""
    from ..codegen import targets

    specs = {s.name: s for s in drawn}
    ns = sorted({r.blocks for r in rows})
    groups: dict[tuple, dict[int, list[Row]]] = {}
    for r in rows:
        spec = specs.get(r.spec)
        if not r.kernel or spec is None:
            continue
        size = targets.cuda_row_terms(len(spec.costs), spec.steps, spec.order)
        kind = targets.cuda_column_kind(spec.control)
        key = (spec.dtype, r.kernel, kind, size, targets.cuda_min_blocks(r.kernel, spec.dtype, kind, size))
        groups.setdefault(key, {}).setdefault(r.blocks, []).append(r)
    lines = ["| dtype | kernel | kind | row_terms | kernels | " + " | ".join(f"spill at n={n} (most B)" for n in ns)
             + " | the rule's n |", "|---|---|---|---:|---:|" + "---:|" * (len(ns) + 1)]
    for (dtype, kernel, kind, size, blocks), at in sorted(groups.items()):
        count = max(len(v) for v in at.values())
        cells = []
        for n in ns:
            spilled = [r.spill_stores for r in at.get(n, []) if r.spill_stores]
            cells.append(f"{len(spilled)} ({max(spilled)})" if spilled else "0")
        lines.append(f"| {dtype} | {kernel} | {kind} | {size} | {count} | " + " | ".join(cells) + f" | {blocks} |")
    return lines


def take_option(args: list[str], flag: str) -> Optional[str]:
    """The value after ``flag`` in ``args``, both removed from ``args``; None where ``flag`` is absent."""
    if flag not in args:
        return None
    at = args.index(flag)
    value = args[at + 1]
    del args[at:at + 2]
    return value


def where_option(args: list[str]) -> dict[str, str]:
    """``--where field=value,...`` taken from ``args``: only the draws with those values (``specs``)."""
    where = take_option(args, "--where")
    return dict(pair.split("=", 1) for pair in where.split(",")) if where else {}


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    model_dir, where = take_option(args, "--model"), where_option(args)
    blocks_given, json_given = take_option(args, "--blocks"), take_option(args, "--json")
    blocks = tuple(int(b) for b in blocks_given.split(",")) if blocks_given else MIN_BLOCKS  # n,...: only these
    json_path = Path(json_given) if json_given else None
    if ptxas.nvcc() is None:
        print("launch_bounds: nvcc not found on PATH: no ptxas figures")
        return 0
    n, seed = (int(a) for a in args[:2])
    model = model_tools(Path(model_dir)) if model_dir else None
    workdir = Path(tempfile.mkdtemp(prefix="tensorstep-bounds-"))
    rows: list[Row] = []
    drawn = specs(n, seed, where)
    try:
        earlier = [Row(**json.loads(line)) for line in json_path.open()] if json_path and json_path.exists() else []
        rows += [r for r in earlier if r.spec in {s.name for s in drawn}]
        done = {r.spec for r in rows}
        for spec in drawn:
            if spec.name in done:  # measured by an earlier run into the same file
                continue
            found = measure(spec, workdir, model, blocks)
            rows += found
            if json_path:
                with json_path.open("a") as out:
                    out.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in found)
            print(table(found)[-1], table(found)[-2] if len(found) > 3 else "", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(table(rows)))
    print()
    print("\n".join(summary(rows, drawn)))
    print()
    print("\n".join(by_size(rows, drawn)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
