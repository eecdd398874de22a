"""``python -m tensorstep.bench.frames N SEED [--where FIELD=VALUE|VALUE,...] [--json FILE]``:
ptxas's figures for every per-element kernel of N seeded fused specs (bench/launch_bounds.py
``specs``), their core library compiled as generated (the launch bounds the plan gives), and those
above the limits of tests/cuda/test_ptxas.py: more than 128 registers, spill stores, a stack frame
over 1 KB. Two modules compile at a time; ``--json`` appends each spec's rows to FILE and skips the
specs already there.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from . import launch_bounds, ptxas

MAX_REGISTERS = 128
MAX_STACK = 1024
PER_ELEMENT = ("forward", "adjoint", "dt_vjp", "dt_jvp")
WORKERS = 2


@dataclasses.dataclass(frozen=True)
class Row:
    spec: str
    kernel: str
    registers: int
    spill_stores: int
    stack: int
    seconds: float
    error: str = ""

    def above(self) -> list[str]:
        """The limits this kernel passes (empty: within them)."""
        return [what for what, over in (("registers", self.registers > MAX_REGISTERS),
                                         ("spills", self.spill_stores > 0), ("stack", self.stack > MAX_STACK),
                                         ("nvcc failed", bool(self.error))) if over]


def measure(spec: Any, source: str, workdir: Path) -> list[Row]:
    """The per-element kernels of the spec's core library (``source``, as generated), compiled."""
    module = ptxas.compile_module(spec.name, source, workdir)
    if module.error:
        first = next((line for line in module.error.splitlines() if "error" in line), module.error[:200])
        return [Row(spec.name, "", 0, 0, 0, module.seconds, first.split("error: ")[-1].strip())]
    return [Row(spec.name, k.name[len(spec.name) + 1:], k.registers, k.spill_stores, k.stack, module.seconds)
            for k in module.kernels if k.name[len(spec.name) + 1:] in PER_ELEMENT]


def table(rows: Sequence[Row], drawn: Sequence[Any]) -> list[str]:
    """A Markdown line per kernel above the limits, and a count."""
    specs = {s.name: s for s in drawn}
    over = [r for r in rows if r.above()]
    lines = ["| spec | dt | layout | outputs | costs | kernel | registers | spill (B) | stack (B) | above |",
             "|---|---|---|---|---|---|---:|---:|---:|---|"]
    for r in over:
        s = specs[r.spec]
        costs = ", ".join(" ".join(t) for t in s.costs)
        lines.append(f"| {r.spec} | {s.dt} | {s.layout} | {','.join(s.outputs) or '-'} | {costs} | {r.kernel} "
                     f"| {r.registers} | {r.spill_stores} | {r.stack} | {', '.join(r.above())} |")
    kernels = sum(1 for r in rows if r.kernel)
    lines.append(f"\n{len(drawn)} specs, {kernels} per-element kernels, {len(over)} above the limits; "
                 f"largest stack {max((r.stack for r in rows), default=0)} B, most registers "
                 f"{max((r.registers for r in rows), default=0)}, most spill {max((r.spill_stores for r in rows), default=0)} B")
    return lines


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    where, json_given = launch_bounds.where_option(args), launch_bounds.take_option(args, "--json")
    json_path = Path(json_given) if json_given else None
    if ptxas.nvcc() is None:
        print("frames: nvcc not found on PATH: no ptxas figures")
        return 0
    n, seed = (int(a) for a in args[:2])
    drawn = launch_bounds.specs(n, seed, where)
    earlier = [Row(**json.loads(line)) for line in json_path.open()] if json_path and json_path.exists() else []
    rows = [r for r in earlier if r.spec in {s.name for s in drawn}]
    todo = [s for s in drawn if s.name not in {r.spec for r in rows}]
    workdir = Path(tempfile.mkdtemp(prefix="tensorstep-frames-"))
    try:
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            # rendered here one at a time (SymPy), compiled in nvcc subprocesses two at a time
            compiling = [pool.submit(measure, s, ptxas.source_of(s, "core"), workdir) for s in todo]
            for done in compiling:
                found = done.result()
                rows += found
                if json_path:
                    with json_path.open("a") as out:
                        out.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in found)
                for r in found:
                    print(f"{r.spec} {r.kernel}: {r.registers} registers, {r.spill_stores} B spill, "
                          f"{r.stack} B stack, {r.seconds:.1f} s {r.error}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(table(rows, drawn)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
