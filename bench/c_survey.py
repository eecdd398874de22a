"""``python -m tensorstep.bench.c_survey N SEED [--where FIELD=VALUE|VALUE,...] [--json FILE]``: N seeded
fused specs (bench/launch_bounds.py ``specs``, here with other dofs, goal indices and a stencil's
accuracy) generated, compiled and loaded in C, each run at B=3 and checked against the plain step
plus the cost terms in PyTorch (runtime/costs.py ``term_values``: the runtime's composite form).

Each spec runs in a process of its own (a crash is a row, not the end of the survey), one at a
time: its C core compiles as two units side by side, so at most two compilers run. Each spec makes
a call per form of the C entry points (``CALLS``: row weights given or left out, margins past the
middle of the limits or within them), each form built by the call that first runs it. A call's
written states, cost and the gradients of the actions, the start and goal states and the target
(from random output weights) are compared with the composite's, in float64, on the same inputs (a
float32 spec's rounded to float32): the largest difference over the largest value of each. A spec
fails on a build, load or run error, a form the runtime could not build (its warning), or a
difference above ``TOLERANCE``. ``--json`` appends each spec's row to FILE and skips the specs
already there.
"""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from . import launch_bounds

#: the largest difference a spec's values may have, over the largest value of each (a float32
#: step's rounding grows with the horizon and the derivative a term reads)
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
B = 3
#: each call's name, and whether its margins are within the limits and its row weights left out: the C
#: entry points' general form, then each variant (codegen/fused.py ``forms``) where the terms have it
CALLS = (("general", False, False), ("narrow", True, False), ("unit_rows", False, True),
         ("narrow_unit_rows", True, True))
#: one spec's process at most this long (generation and compiles of a long order-4 spec included)
SPEC_TIMEOUT_S = 1200


#: the dofs drawn: C's lanes hold a row of 7 in one vector, of 1 or 3 two trajectories' rows in one
#: (codegen/render.py ``paired``), of 9 or 16 more than one vector in float64
DOFS = (1, 3, 7, 7, 9, 16)


def draw(rng: random.Random) -> dict[str, Any]:
    """``launch_bounds.draw``'s fields, then a dof (``DOFS``), with end="goal" a goal index (half the
    draws) and for a stencil an accuracy (a third of the draws; a central one's odd values are redrawn)."""
    fields = launch_bounds.draw(rng)
    if not fields:
        return fields
    fields["dof"] = rng.choice(DOFS)
    if fields.get("end") == "goal":
        fields["goal_index"] = rng.random() < 0.5
    if fields.get("control") == "position" and rng.random() < 1 / 3:
        fields["accuracy"] = rng.randint(1, 8)
    return fields


def specs(n: int, seed: int, where: Optional[dict[str, str]] = None) -> list[Any]:
    """``n`` specs drawn with ``seed`` (``draw``), those of ``where`` where given."""
    return launch_bounds.specs(n, seed, where, draw)


@dataclasses.dataclass(frozen=True)
class Row:
    spec: str
    fields: dict
    seconds: float
    #: "" (passed) | build (the core's compiler) | load (the core, or at a call every form of a kernel) | run
    #: (a call raised) | form (a variant not built: its calls ran the general form) | values | crashed
    failure: str = ""
    detail: str = ""
    #: "<call> <quantity>" → the largest difference over the largest value
    errors: dict = dataclasses.field(default_factory=dict)


def _inputs(step: Any, gen: Any, narrow: bool, unit_rows: bool) -> tuple[dict, dict, Any]:
    """One call's tensors (float64): the plain step's keywords, the cost parameters and dt."""
    import torch

    spec = step.spec
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    D, S, G = spec.dof, B + 2 if spec.start_index else B, B + 1 if spec.goal_index else B
    x = dict(u=r(*step.action_shape(B)), p0=r(S, D), v0=r(S, D), a0=r(S, D), j0=r(S, D))
    if spec.start_index:
        x["start_index"] = torch.tensor([3, 0, 4])
    if spec.end == "goal":
        x["goal"] = tuple(r(G, D) for _ in range(4))
    if spec.goal_index:
        x["goal_index"] = torch.tensor([1, 3, 0])
    params = {}
    for kind, state in spec.costs:
        prefix = f"{kind}_{state}_"
        params[prefix + "weight"] = r(B, D).abs() + 0.1
        if not unit_rows:
            params[prefix + "row_weight"] = r(spec.horizon).abs() + 0.1
        if kind == "bound":
            lo = -0.3 - r(D).abs()
            hi = lo + 0.5 + r(D).abs()
            params[prefix + "limit"] = torch.stack([lo, hi])
            # within the limits (the narrow forms), or past their middle (the general form)
            params[prefix + "margin"] = (0.2 if narrow else 0.7) * (hi - lo)
        if (kind, state) == ("squared", "position"):
            params[prefix + "target"] = r(G, D)
    n_dt = B if spec.dt == "per_trajectory" else spec.n_dt
    dt = 0.1 if spec.dt == "uniform" else 0.05 + 0.05 * torch.rand(n_dt, generator=gen, dtype=torch.float64)
    return x, params, dt


def _run(step: Any, x: dict, params: dict, dt: Any, dtype: Any) -> tuple[list, dict]:
    """The step's outputs on ``x``, ``params`` and ``dt`` in ``dtype`` and the float leaves it reads
    (the actions, start and goal states, the target), which take gradients."""
    cast = lambda t: t.to(dtype) if hasattr(t, "to") and t.is_floating_point() else t
    leaves = {k: cast(v).clone().requires_grad_() for k, v in x.items() if k in ("u", "p0", "v0", "a0", "j0")}
    goal = tuple(cast(g).clone().requires_grad_() for g in x.get("goal", ()))
    leaves.update((f"goal{i}", g) for i, g in enumerate(goal))
    given = {k: cast(v) for k, v in params.items()}
    if "squared_position_target" in given:
        leaves["target"] = given["squared_position_target"] = given["squared_position_target"].clone().requires_grad_()
    extra = {k: x[k] for k in ("start_index", "goal_index") if k in x}
    if goal:
        extra["goal"] = goal
    outs = step(leaves["u"], leaves["p0"], leaves["v0"], leaves["a0"], cast(dt) if hasattr(dt, "to") else dt,
                j0=leaves["j0"], **extra, **given)
    return list(outs), leaves


def _compare(fused: Any, plain: Any, x: dict, params: dict, dt: Any, call: str) -> dict[str, float]:
    """The fused step's written states, cost and gradients against the plain float64 step plus the
    terms (``term_values``), on the same inputs (rounded to the fused step's dtype first)."""
    import torch

    from ..runtime import costs

    dtype = fused.dtype
    seen = lambda t: t.to(dtype).double() if hasattr(t, "to") and t.is_floating_point() else t
    x = {k: tuple(map(seen, v)) if isinstance(v, tuple) else seen(v) for k, v in x.items()}
    params, dt = {k: seen(v) for k, v in params.items()}, seen(dt)
    outs, leaves = _run(fused, x, params, dt, dtype)
    states, expected_leaves = _run(plain, x, {}, dt, torch.float64)
    named = {**params, **{k: v for k, v in x.items() if k == "goal_index"}}
    if "squared_position_target" in params:
        target = params["squared_position_target"].clone().requires_grad_()
        expected_leaves["target"] = named["squared_position_target"] = target
    kept = {o.name for o in fused.table.outputs}
    written = [states[i] for i, a in enumerate(plain.table.outputs) if a.name in kept]
    expected = written + ([costs.term_values(fused.table, states, named)] if fused.spec.costs else [])
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in expected]
    for ys in (outs, expected):
        sum((y.double() * w).sum() for y, w in zip(ys, weights)).backward()
    names = [a.name for a in fused.table.outputs]
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # (a state the outputs do not read)
    pairs = list(zip(names, outs, expected)) + [(f"d{k}", grad(leaves[k]), grad(expected_leaves[k])) for k in leaves]
    errors = {}
    for name, got, want in pairs:
        scale = float(want.detach().abs().max()) or 1.0  # (a zero gradient: the difference itself)
        errors[f"{call} {name}"] = float((got.detach().double() - want.detach()).abs().max()) / scale
    return errors


def check(spec: Any) -> Row:
    """One spec's row: loaded (generated and compiled where not cached) and run (``_compare``)."""
    import torch

    import tensorstep as ts
    from ..runtime.cbackend import CompileError

    begun = time.perf_counter()
    fields = spec.to_dict()
    row = lambda failure="", detail="", errors=None: Row(spec.name, fields, time.perf_counter() - begun, failure,
                                                         detail, errors or {})
    try:
        fused = ts.load(spec)
        plain = ts.load(spec.replace(costs=(), outputs=None, dtype="float64"))
    except CompileError as err:
        return row("build", err.summary())
    except Exception as err:  # noqa: BLE001 (any failure to load is this spec's finding)
        return row("load", f"{type(err).__name__}: {err}"[:500])
    errors: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    for call, narrow, unit_rows in CALLS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                errors.update(_compare(fused, plain, *_inputs(fused, gen, narrow, unit_rows), call))
            except Exception as err:  # noqa: BLE001
                # no form built or loaded (runtime/unbuilt.py): the library's failure, raised by the call
                failure = "load" if "could be built" in str(err) else "run"
                return row(failure, f"{call}: {type(err).__name__}: {err}"[:500], errors)
        built = [str(w.message) for w in caught if "of its kernels could not be built" in str(w.message)]
        if built:
            return row("form", built[0][:500], errors)
    worst = max(errors, key=errors.get)
    if errors[worst] > TOLERANCE[spec.dtype]:
        return row("values", f"{worst}: {errors[worst]:.2e}", errors)
    return row(errors=errors)


def in_process(spec: Any) -> Row:
    """``check`` in a process of its own (``--one``); a crash or a timeout is the row's failure."""
    begun = time.perf_counter()
    command = [sys.executable, "-m", "tensorstep.bench.c_survey", "--one", json.dumps(spec.to_dict())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SPEC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Row(spec.name, spec.to_dict(), time.perf_counter() - begun, "crashed", f"over {SPEC_TIMEOUT_S} s")
    last = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode or not last[0].startswith("{"):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return Row(spec.name, spec.to_dict(), time.perf_counter() - begun, "crashed",
                   f"exit status {done.returncode}: {tail}"[:500])
    return Row(**json.loads(last[0]))


def table(rows: Sequence[Row]) -> list[str]:
    """A Markdown line per failing spec, the counts per failure, and the largest differences."""
    failed = [r for r in rows if r.failure]
    lines = ["| spec | failure | detail |", "|---|---|---|"]
    lines += [f"| {r.spec} | {r.failure} | {r.detail.replace('|', '/')} |" for r in failed]
    counts = {}
    for r in failed:
        counts[r.failure] = counts.get(r.failure, 0) + 1
    lines.append(f"\n{len(rows)} specs: {len(rows) - len(failed)} pass, "
                 + (", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "none fail"))
    for dtype in TOLERANCE:
        worst = [max(r.errors.values()) for r in rows if r.errors and r.fields["dtype"] == dtype]
        if worst:
            median = sorted(worst)[len(worst) // 2]
            lines.append(f"{dtype}: {len(worst)} specs run, largest difference {max(worst):.1e} (median of each "
                         f"spec's largest {median:.1e}; tolerance {TOLERANCE[dtype]:.0e})")
    seconds = [r.seconds for r in rows]
    lines.append(f"{sum(seconds) / 60:.1f} min in all, slowest spec {max(seconds):.0f} s")
    return lines


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    one = launch_bounds.take_option(args, "--one")
    if one is not None:  # a worker: one spec, its row as JSON on the last line
        import tensorstep as ts

        print(json.dumps(dataclasses.asdict(check(ts.KernelSpec.from_dict(json.loads(one))))))
        return 0
    where, json_given = launch_bounds.where_option(args), launch_bounds.take_option(args, "--json")
    json_path = Path(json_given) if json_given else None
    n, seed = (int(a) for a in args[:2])
    drawn = specs(n, seed, where)
    earlier = [Row(**json.loads(line)) for line in json_path.open()] if json_path and json_path.exists() else []
    rows = [r for r in earlier if r.spec in {s.name for s in drawn}]
    for spec in drawn:
        if spec.name in {r.spec for r in rows}:
            continue
        found = in_process(spec)
        rows.append(found)
        if json_path:
            with json_path.open("a") as out:
                out.write(json.dumps(dataclasses.asdict(found)) + "\n")
        worst = max(found.errors.values(), default=float("nan"))
        print(f"{found.spec}: {found.failure or 'pass'} {found.detail} (largest {worst:.1e}, {found.seconds:.0f} s)",
              file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
