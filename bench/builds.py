"""First-build cost of every kind of kernel at H ≤ 256: generation plus gcc, per library.

Each spec is measured in a fresh process (imports, SymPy's caches and the page cache of a
first build included): the C source of each library (the core, then the dt gradient's and the
dt tangent's, in the order a program needs them) is generated and compiled with the runtime's
flags, as the runtime compiles it (on more than one core, its units side by side), each
compiler run under ``/usr/bin/time`` for its peak memory. One JSON line per spec; the table
at the end gives, per family, how many specs take more than 3 s on their slowest library.

    python -m tensorstep.bench.builds [--quick] [--alone] [--out FILE.jsonl]

``--alone`` measures each library in a process of its own instead, as a later program that
finds the core cached builds a dt library: its generation derives the operator again.

>>> specs = grid()
>>> len(specs), max(spec_of(s).horizon for s in specs)
(260, 256)
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

LIMIT_S = 3.0  # issue 17: every first build of any kernel at H ≤ 256
_BASE = dict(dof=7, dtype="float32", start_index=True)


def spec_of(fields: dict) -> Any:
    from tensorstep import KernelSpec

    return KernelSpec(**fields)


def _position() -> list[dict]:
    specs = []
    for difference, accuracy, end, dt, order in itertools.product(
            ("central", "backward"), (None, 4, 6, 8), ("hold", "one_sided", "goal"),
            ("uniform", "per_step", "per_trajectory"), (3, 4)):
        if accuracy in (4, 6) and dt != "per_step":
            continue  # wider than the default and narrower than 8: only the per-step programs grow
        spec = dict(_BASE, horizon=256, control="position", difference=difference, end=end, dt=dt, order=order)
        if accuracy:
            spec["accuracy"] = accuracy
        if end == "goal":
            spec["goal_index"] = True
        specs.append(spec)
    return specs


def _integration() -> list[dict]:
    return [dict(_BASE, horizon=256, control=control, integrator=integrator, dt=dt, order=order)
            for control, integrator, dt, order in itertools.product(
                ("velocity", "acceleration", "jerk"), ("semi_implicit_euler", "exact"),
                ("uniform", "per_step", "per_trajectory"), (3, 4))]


def _bspline() -> list[dict]:
    from tensorstep.codegen.spec import bspline_horizon

    specs = []
    for degree, steps in itertools.product((3, 4, 5, 6, 7), (1, 2, 4, 8, 12, 16, 32, 64)):
        fits = [k for k in range(1, 300) if bspline_horizon(degree, k, steps, "goal") <= 256]
        if not fits:
            continue
        for dt, end in itertools.product(("uniform", "per_trajectory"), ("hold", "goal")):
            spec = dict(_BASE, control="bspline", degree=degree, knots=max(fits), steps=steps, dt=dt, end=end)
            if end == "goal":
                spec["goal_index"] = True
            specs.append(spec)
    return specs


def grid(quick: bool = False) -> list[dict]:
    """The swept specs (``quick``: the widest per-step stencils and the longest B-spline spans)."""
    specs = _position() + _integration() + _bspline()
    if quick:
        specs = [s for s in specs if s.get("accuracy") == 8 and s["dt"] == "per_step" and s["end"] == "hold"
                 or s.get("steps") == 12 and s["end"] == "goal"]
    return specs


def family(spec: dict) -> str:
    control = spec.get("control", "position")
    if control == "position":
        width = f", accuracy {spec['accuracy']}" if "accuracy" in spec else ""
        return f"position {spec['difference']}, dt {spec['dt']}{width}"
    if control == "bspline":
        return f"B-spline, dt {spec['dt']}"
    return f"integration, dt {spec['dt']}"


def measure(fields: dict, parts: tuple[str, ...] | None = None) -> dict:
    """Generation and gcc seconds, source KB and the compiler's peak MB of each library of
    ``parts`` (default: all), in order (run in the process it is to measure: see ``main``). gcc
    runs as the runtime runs it (on more than one core, a library's units side by side), under a
    wrapper that logs each run's peak memory."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        os.environ["CC"] = _logging_compiler(folder)
        from tensorstep.codegen.abi import LIBRARIES
        from tensorstep.codegen.driver import generate
        from tensorstep.runtime.cbackend import library_build

        spec = spec_of(fields)
        row: dict = {"spec": fields, "horizon": spec.horizon}
        for part in parts or tuple(LIBRARIES):
            source = generate(spec, targets=("c",), parts=(part,)).source("c", part)
            generated = time.perf_counter()
            path = Path(folder) / f"{part}.c"
            path.write_text(source)
            failed = ""
            try:
                library_build(part)(path, Path(folder) / f"{part}.so")
            except RuntimeError as err:
                failed = str(err)[:200]
            compiled = time.perf_counter()
            peaks = (Path(folder) / "peaks").read_text().split()
            (Path(folder) / "peaks").unlink()
            row[part] = {"generate_s": round(generated - started, 2), "gcc_s": round(compiled - generated, 2),
                         "source_kb": len(source) // 1024, "peak_mb": max(map(int, peaks)) // 1024, "failed": failed}
            started = time.perf_counter()
    return row


def _logging_compiler(folder: str) -> str:
    """A compiler that runs the system's (cc or gcc) under /usr/bin/time, logging peak KB."""
    real = shutil.which("cc") or shutil.which("gcc")
    wrapper = Path(folder) / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/time -a -o {folder}/peaks -f "%M" {real} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the widest stencils and longest spans only")
    parser.add_argument("--alone", action="store_true", help="each library in a process of its own")
    parser.add_argument("--family", help="only the families whose name holds this text (e.g. 'accuracy 8')")
    parser.add_argument("--out", help="also write the JSON lines here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure this spec
    parser.add_argument("--part", action="append", help=argparse.SUPPRESS)  # ... these libraries of it
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(json.loads(args.one), tuple(args.part) if args.part else None)))
        return 0
    slowest: dict[str, list[float]] = defaultdict(list)
    with open(args.out, "w") if args.out else contextlib.nullcontext() as out:
        for fields in grid(args.quick):
            if args.family and args.family not in family(fields):
                continue
            _measure_one(fields, out, slowest, args.alone)
    print(f"\n| family | specs | over {LIMIT_S:g} s | slowest |\n|---|---|---|---|")
    for name, times in sorted(slowest.items()):
        print(f"| {name} | {len(times)} | {sum(t > LIMIT_S for t in times)} | {max(times):.2f} s |")
    return 0


def _measure_one(fields: dict, out: Any, slowest: dict[str, list[float]], alone: bool = False) -> None:
    """Measure one spec in a child process (``alone``: a child per library); print its slowest
    library, record it by family."""
    from tensorstep.codegen.abi import LIBRARIES

    row: dict = {}
    for parts in ([[p] for p in LIBRARIES] if alone else [[]]):
        child = subprocess.run([sys.executable, "-m", "tensorstep.bench.builds", "--one", json.dumps(fields),
                                *(a for p in parts for a in ("--part", p))], capture_output=True, text=True)
        if child.returncode:
            print(f"FAILED {fields}: {child.stderr.strip().splitlines()[-1:]}", flush=True)
            return
        row.update(json.loads(child.stdout))
    if out:
        out.write(json.dumps(row) + "\n")

    worst = max(row[part]["generate_s"] + row[part]["gcc_s"] for part in LIBRARIES)
    slowest[family(fields)].append(worst)
    print(f"{worst:6.2f} s  {json.dumps(fields)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
