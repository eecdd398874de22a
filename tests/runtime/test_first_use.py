"""First use with a warm kernel cache: a process whose kernels are cached loads and calls its steps
without the generator (SymPy, Jinja2, codegen's lowering), a fused step's dt gradient included (its
composite form: the cost kinds' PyTorch functions are kept in the cache beside the kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reference
import reference_costs
import tensorstep as ts
from helpers import scale_close

H, D, B, DT = 6, 2, 3, 0.1
PLAIN = ts.KernelSpec(horizon=H, dof=D, dtype="float64", difference="central")
TERMS = (("bound", "velocity"), ("squared", "jerk"))
FUSED = PLAIN.replace(costs=TERMS, outputs=("P",))
STATES = ("position", "velocity", "acceleration", "jerk")
#: the modules a warm process must not import
GENERATOR = ("sympy", "jinja2", "tensorstep.codegen.driver", "tensorstep.codegen.lower", "tensorstep.codegen.render")

# The process: the plain step's forward and the gradient to u of Σ_k Σ W_k·Y_k; the fused step's P and
# cost and the gradients to u and to dt of Σ W_0·P + Σ cost (scalar losses: torch.autograd.grad given
# output gradients imports SymPy itself, through torch.fx)
CODE = f"""
import json, sys, torch, tensorstep as ts
H, D, B, DT = {H}, {D}, {B}, {DT}
plain = ts.KernelSpec(horizon=H, dof=D, dtype="float64", difference="central")
fused = plain.replace(costs={TERMS!r}, outputs=("P",))
g = torch.Generator().manual_seed(0)
r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
u, p0, v0, a0, W = r(B, H - 1, D), r(B, D), r(B, D), r(B, D), r(4, B, H, D)
params = dict(bound_velocity_weight=1 + r(D).abs(), bound_velocity_limit=torch.tensor([[-5.0] * D, [5.0] * D],
              dtype=torch.float64), bound_velocity_margin=torch.full((D,), 0.5, dtype=torch.float64),
              squared_jerk_weight=1e-4 * (1 + r(D).abs()))
step = ts.load(plain)
x = u.clone().requires_grad_()
Y = step(x, p0, v0, a0, DT)
sum((y * w).sum() for y, w in zip(Y, W)).backward()
fused_step = ts.load(fused)
x2, dt = u.clone().requires_grad_(), torch.tensor(DT, dtype=torch.float64, requires_grad=True)
P, cost = fused_step(x2, p0, v0, a0, dt, **params)
((P * W[0]).sum() + cost.sum()).backward()
l = lambda t: t.detach().tolist()
print(json.dumps(dict(modules=[m for m in {GENERATOR!r} if m in sys.modules], native=step.native is not None,
                      fused_native=fused_step.native is not None, inputs=[l(t) for t in (u, p0, v0, a0, W)],
                      params={{k: l(v) for k, v in params.items()}}, Y=[l(y) for y in Y], grad_u=l(x.grad), P=l(P),
                      cost=l(cost), fused_grad_u=l(x2.grad), grad_dt=dt.grad.item())))
"""


def _run(cache: str) -> dict:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE)], env=dict(os.environ, TENSORSTEP_CACHE_DIR=cache),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


def _loss_reference(dt: float, u, start, W, params) -> tuple[float, np.ndarray, np.ndarray]:
    """The fused loss Σ W_0·P + Σ cost, the states [K, B, H, D] and the cost [B, T], from the definitions."""
    Y = reference.apply(PLAIN, dt, u, start)
    cost = reference_costs.costs(TERMS, dict(zip(STATES, Y)), params)
    return float((W[0] * Y[0]).sum() + cost.sum()), Y, cost


def _cost_slopes(Y: np.ndarray, params: dict) -> np.ndarray:
    """d Σ cost / d Y [K, B, H, D], each term's derivative written from its definition."""
    G = np.zeros_like(Y)
    for kind, state in TERMS:
        k, w = STATES.index(state), params[f"{kind}_{state}_weight"]
        if kind == "squared":
            G[k] += 2 * w * Y[k]
        else:
            (lower, upper), m = params[f"bound_{state}_limit"], params[f"bound_{state}_margin"]
            G[k] += 2 * w * (np.maximum(0, Y[k] - (upper - m)) - np.maximum(0, (lower + m) - Y[k]))
    return G


def test_a_warm_process_loads_and_calls_steps_without_the_generator(tmp_path):
    """The first process (an empty cache) builds and generates; the second, in that cache, imports no SymPy,
    Jinja2 or codegen lowering through a plain step's forward and backward and a fused step's forward,
    backward and dt gradient (its composite form), on the native node where the session has it; both get
    the values of the definitions in float64."""
    native = ts.load(PLAIN).native is not None  # the session's native node, built before the processes start
    cold, warm = _run(str(tmp_path)), _run(str(tmp_path))
    assert {"sympy", "jinja2"} <= set(cold["modules"])  # the probe sees a generating process
    assert warm["modules"] == [], warm["modules"]
    for got in (cold, warm):
        assert got["native"] == got["fused_native"] == native
        u, p0, v0, a0, W = (np.array(t) for t in got["inputs"])
        params = {k: np.array(v) for k, v in got["params"].items()}
        start = np.stack([p0, v0, a0, np.zeros_like(p0)], axis=1)
        loss, Y, cost = _loss_reference(DT, u, start, W, params)
        scale_close(np.array(got["Y"]), Y, 1e-12)
        scale_close(np.array(got["grad_u"]), reference.apply_adjoint(PLAIN, DT, W)[0], 1e-12)
        scale_close(np.array(got["P"]), Y[0], 1e-12)
        scale_close(np.array(got["cost"]), cost, 1e-12)
        G = _cost_slopes(Y, params)
        G[0] += W[0]
        scale_close(np.array(got["fused_grad_u"]), reference.apply_adjoint(PLAIN, DT, G)[0], 1e-12)
        h = 1e-6
        slope = (_loss_reference(DT + h, u, start, W, params)[0] - _loss_reference(DT - h, u, start, W, params)[0]) / (2 * h)
        assert got["grad_dt"] == pytest.approx(slope, rel=1e-6)


@pytest.fixture
def kinds_cache(tmp_path, monkeypatch):
    """runtime/costs.py's kept kinds read from an empty cache at tmp_path (the process's memo cleared around)."""
    from tensorstep.runtime import costs

    monkeypatch.setenv("TENSORSTEP_CACHE_DIR", str(tmp_path))
    costs.sources.cache_clear(), costs.pointwise.cache_clear()
    yield costs, tmp_path / "generated"
    costs.sources.cache_clear(), costs.pointwise.cache_clear()


@pytest.mark.parametrize("damage", ["missing", "truncated", "not a function", "unwritable"])
def test_the_kept_cost_kinds_are_made_again_where_missing_or_damaged(kinds_cache, damage):
    """Where the kept functions are missing, unreadable or not functions, they are made again (SymPy) and
    written; where the cache cannot be written (its folder a file, as a read-only one even for root), made
    in each process. Each gives the cost of its definition."""
    import torch

    costs, folder = kinds_cache
    costs.sources()  # written once
    (kept,) = folder.iterdir()
    whole = kept.read_text()
    if damage == "missing":
        kept.unlink()
    elif damage == "truncated":
        kept.write_text(whole[: len(whole) // 2])
    elif damage == "not a function":
        kept.write_text(json.dumps({"bound": "import os"}))
    else:
        kept.unlink()
        folder.rmdir()
        folder.write_text("")
    costs.sources.cache_clear()
    bound = costs.pointwise("bound")
    assert folder.is_file() if damage == "unwritable" else kept.read_text() == whole
    y = torch.linspace(-3, 3, 13, dtype=torch.float64)
    w, lower, upper, margin = 2.0, torch.tensor(-1.0, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64), 0.25
    got = bound(y, w, lower, upper, margin, 0.0).numpy()
    expected = reference_costs.term("bound", y.numpy().reshape(1, -1, 1), np.array([w]), limit=np.array([[-1.0], [1.5]]),
                                    margin=np.array([margin]))
    assert got.sum() == pytest.approx(expected[0], rel=1e-14)


def test_a_builds_notice_counts_the_generators_imports(tmp_path):
    """A cache miss's 'tensorstep: compiling ...' notice is timed from before the generator's imports
    (SymPy, Jinja2: the larger part of a short build's wait), not from after them."""
    code = f"""
        import sys, tensorstep as ts
        from tensorstep.runtime import cbackend
        seen, real = [], cbackend.building
        cbackend.building = lambda *args: (seen.append("sympy" in sys.modules), real(*args))[1]
        ts.load(ts.KernelSpec(horizon=5, dof=1, dtype="float64"))
        print(*seen)
    """
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TENSORSTEP_CACHE_DIR=str(tmp_path), TENSORSTEP_NATIVE="0"))
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["False"]  # one build (the core), its notice started before SymPy came
