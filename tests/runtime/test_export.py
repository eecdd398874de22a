"""torch.export: a program that calls a step is saved, then loaded and run in a fresh process
that never called ts.load (the kernel key in the graph names the spec and device)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorstep as ts
from helpers import ReferenceCase, as_bhd, scale_close

SPECS = [
    ts.KernelSpec(horizon=8, dof=3, dtype="float64", start_index=True),
    ts.KernelSpec(horizon=8, dof=2, dtype="float64", end="goal", goal_index=True, dt="per_trajectory"),
    ts.KernelSpec(dof=2, dtype="float64", control="bspline", knots=3, steps=2, end="goal", layout="bdh"),
]


class Planner(torch.nn.Module):
    """A step inside a user's module: the state, goal, dt and indices are all arguments."""

    def __init__(self, spec: ts.KernelSpec):
        super().__init__()
        self.step = ts.load(spec)

    def forward(self, u, start, goal, dt, indices):
        return self.step(u, *start[:3], dt, j0=start[3], **({"goal": goal} if goal else {}), **indices)


def _arguments(case: ReferenceCase) -> tuple:
    indices = {name: i for name, i in (("start_index", case.idx), ("goal_index", case.gidx)) if i is not None}
    return case.u, tuple(case.start), tuple(case.goal), case.dt, indices


def _dynamic_batch(case: ReferenceCase) -> tuple:
    """B is dynamic wherever it is a size; the tables an index picks from keep their rows."""
    B = torch.export.Dim("B")
    rows = lambda indexed: None if indexed else {0: B}
    return ({0: B}, tuple(rows(case.idx is not None) for _ in case.start),
            tuple(rows(case.gidx is not None) for _ in case.goal),
            {0: B} if case.spec.dt == "per_trajectory" else None,
            {name: {0: B} for name in _arguments(case)[4]})


_FRESH = """
import sys, torch, tensorstep as ts
ts.register_ops()
program = torch.export.load(sys.argv[1])
u, start, goal, dt, indices = torch.load(sys.argv[2])
inputs = [t.requires_grad_(True) for t in (u, *start, *goal, dt)]
outputs = program.module()(u, start, goal, dt, indices)
gen = torch.Generator().manual_seed(5)
weights = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outputs]
gradients = torch.autograd.grad(outputs, inputs, weights)
torch.save([[y.detach() for y in outputs], weights, list(gradients)], sys.argv[3])
"""


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_an_exported_program_runs_in_a_fresh_process(spec, tmp_path):
    """Exported at B=3, run at B=5: the outputs against the independent reference, the
    gradients of the tensors by the dot test against it, dt's against its difference in dt."""
    traced = ReferenceCase(spec, B=3, seed=0)
    program = torch.export.export(Planner(spec), _arguments(traced), dynamic_shapes=_dynamic_batch(traced))
    torch.export.save(program, tmp_path / "planner.pt2")

    case = ReferenceCase(spec, B=5, seed=1)
    if case.idx is not None:  # the tables keep the traced rows
        case.start, case.idx = [s[: traced.start[0].shape[0]] for s in case.start], case.idx % traced.start[0].shape[0]
    if case.gidx is not None:
        case.goal, case.gidx = [g[: traced.goal[0].shape[0]] for g in case.goal], case.gidx % traced.goal[0].shape[0]
    torch.save(_arguments(case), tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH), str(tmp_path / "planner.pt2"),
                          str(tmp_path / "inputs.pt"), str(tmp_path / "result.pt")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs, weights, gradients = torch.load(tmp_path / "result.pt")

    expected = case.expected()
    assert len(outputs) == len(expected) == spec.order + 1
    for y, e in zip(outputs, expected):
        scale_close(as_bhd(y, spec), e, 1e-12)
    W = np.stack([as_bhd(w, spec) for w in weights])
    dot, size = float((W * expected).sum()), float(np.abs(W * expected).sum())
    total = sum(float((x * g).sum()) for x, g in zip(case.tensors()[:-1], gradients[:-1]))
    assert abs(total - dot) <= 1e-12 * size, (total, dot)

    dt0 = case.dt.clone()

    def slope(h: float) -> np.ndarray:  # d/d(dt) of each trajectory's <W, Y> (each reads its own dt)
        per_b = []
        for sign in (1, -1):
            case.dt = dt0 + sign * h
            per_b.append(np.einsum("kbhd,kbhd->b", W, case.expected()))
        return (per_b[0] - per_b[1]) / (2 * h)

    derivative = (4 * slope(5e-5) - slope(1e-4)) / 3
    expect = derivative if spec.dt == "per_trajectory" else derivative.sum()
    scale_close(np.atleast_1d(gradients[-1].numpy()), np.atleast_1d(expect), 1e-8)


@pytest.mark.parametrize("key", ["ts_h8", "ts_h8@cpu@{not json", 'ts_h8@cpu@{"horizon": 1, "dof": 2}'])
def test_a_string_that_is_no_kernel_key_is_refused(key):
    from tensorstep.runtime import registry

    with pytest.raises(RuntimeError, match=r"is not a kernel key \(name@device@fields\)"):
        registry.launcher(key)


def test_a_step_collected_while_another_program_is_exported_adds_nothing_to_it():
    """A fused step keeps its cost parameters in a slot of the native node, released when the step is
    collected; export's tracer records every op called on its thread, so a release that was an op
    landed in whatever program was being exported then (and that program failed to load)."""
    import gc
    import weakref

    from tensorstep.runtime import native

    if native.wait() is None:
        pytest.skip("no native node here")
    held = [native.Slot()]  # a fused step's slot (the registry keeps the step loaded last alive)
    released = weakref.ref(held[0])

    class Collects(torch.nn.Module):
        def forward(self, x):
            held.clear()  # the slot's last reference: released here, during the trace
            gc.collect()
            return x + 1

    program = torch.export.export(Collects(), (torch.zeros(3),))
    assert released() is None
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "tensorstep" in t], targets
