"""A fused step's plain twin (every state, no cost), which its composite form runs (runtime/costs.py):
loaded on the first call that runs that form, not with the step (runtime/api.py ``Step.plain``), and
each composite path gives the definitions' values and derivatives (NumPy: tests/reference.py, the
terms from tests/reference_costs.py, their derivatives written here from the same definitions)."""
from __future__ import annotations

import copy
import functools
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import reference
import reference_costs
import tensorstep as ts
from tensorstep.runtime import api, native

TERMS = (("bound", "position"), ("bound", "velocity"), ("squared", "position"), ("squared", "acceleration"))
STATES = ("position", "velocity", "acceleration", "jerk")
H, D, B, DT = 7, 2, 3, 0.1
SPEC = ts.KernelSpec(horizon=H, dof=D, dtype="float64", costs=TERMS, outputs=("P",))
PLAIN = SPEC.replace(costs=(), outputs=None)


def _data(seed: int = 0):
    """Actions, start states and every cost keyword, random, with limits that some rows cross."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x = dict(u=r(B, SPEC.n_actions, D), p0=r(B, D), v0=r(B, D), a0=r(B, D))
    params = {"squared_position_target": r(B, D)}
    for kind, state in TERMS:
        params[f"{kind}_{state}_weight"] = r(B, D).abs() + 0.1
        if kind == "bound":
            lo = -0.3 - r(D).abs()
            params[f"bound_{state}_limit"] = torch.stack([lo, lo + 0.5 + r(D).abs()])
            params[f"bound_{state}_margin"] = 0.05 * r(D).abs()
    return x, params


def _states(x, u: np.ndarray, dt: float) -> np.ndarray:
    """The reference states [K, B, H, D]."""
    start = np.stack([x["p0"].numpy(), x["v0"].numpy(), x["a0"].numpy(), np.zeros((B, D))], axis=1)
    return reference.apply(PLAIN, dt, u, start)


def _cost(x, params, u: np.ndarray, dt: float = DT) -> np.ndarray:
    """The definitions' cost [B, T]."""
    Y = _states(x, u, dt)
    return reference_costs.costs(TERMS, {s: Y[k] for k, s in enumerate(STATES)}, {k: v.numpy() for k, v in params.items()})


def _slopes(x, params, u: np.ndarray):
    """Each term's pointwise first and second derivative in its state ([B, H, D] each), from the
    definitions: squared w·(y − t)², bound w·(max(0, y − (hi − m))² + max(0, (lo + m) − y)²)."""
    Y = _states(x, u, DT)
    out = []
    for kind, state in TERMS:
        y = Y[STATES.index(state)]
        w = params[f"{kind}_{state}_weight"].numpy()[:, None, :]
        if kind == "squared":
            t = params["squared_position_target"].numpy()[:, None, :] if state == "position" else 0.0
            out.append((STATES.index(state), 2 * w * (y - t), 2 * w + 0 * y))
        else:
            (lo, hi), m = params[f"bound_{state}_limit"].numpy(), params[f"bound_{state}_margin"].numpy()
            over, under = y - (hi - m), (lo + m) - y
            out.append((STATES.index(state), 2 * w * (np.maximum(0, over) - np.maximum(0, under)),
                        2 * w * ((over > 0) + (under > 0))))
    return out


def _tangents(x, params, v: np.ndarray):
    """The tangents of P [B, H, D] and of the cost [B, T] along actions' tangent v."""
    dY = reference.apply(PLAIN, DT, v, np.zeros((B, 4, D)))
    dcost = np.stack([(g * dY[k]).sum(axis=(1, 2)) for k, g, _ in _slopes(x, params, x["u"].numpy())], axis=1)
    return dY[0], dcost


def _gradient_and_hvp(x, params, v: np.ndarray):
    """The gradient of sum(cost) to u, and its Hessian's product with v."""
    dY = reference.apply(PLAIN, DT, v, np.zeros((B, 4, D)))
    K = PLAIN.order + 1
    gY, hY = np.zeros((K, B, H, D)), np.zeros((K, B, H, D))
    for k, g, h in _slopes(x, params, x["u"].numpy()):
        gY[k] += g
        hY[k] += h * dY[k]
    return reference.apply_adjoint(PLAIN, DT, gY)[0], reference.apply_adjoint(PLAIN, DT, hY)[0]


def _close(got: torch.Tensor, expected: np.ndarray, rtol: float = 1e-10) -> None:
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=rtol, atol=rtol * np.abs(expected).max())


@pytest.fixture
def loads(monkeypatch):
    """The specs runtime/api.py loads from now on (a twin is loaded by ``api.load``)."""
    seen = []
    real = api.load

    @functools.wraps(real)  # pickled by that name, as the step's __reduce__ names it
    def counted(spec, device="cpu"):
        seen.append(spec)
        return real(spec, device)

    monkeypatch.setattr(api, "load", counted)
    _unload_twins(monkeypatch)
    return seen


def _unload_twins(monkeypatch) -> None:
    """As in a new process: no twin loaded (restored after the test)."""
    for twin in api._TWINS.values():
        monkeypatch.setattr(twin, "step", None)


def _call(step, x, params, u=None, dt=DT):
    return step(x["u"] if u is None else u, x["p0"], x["v0"], x["a0"], dt, **params)


PATHS = ("dt_grad", "double_backward", "forward_ad", "jvp", "vmap", "compile", "export")


@pytest.mark.parametrize("path", PATHS)
def test_the_twin_is_loaded_by_the_first_composite_call_and_gives_the_definitions(path, loads):
    """The fused kernels' calls (forward, backward, out=) load no twin; the first call of a composite
    path loads it once, and the path's values and derivatives are the definitions'."""
    x, params = _data()
    step = ts.load(SPEC)
    u = x["u"].clone().requires_grad_()
    P, cost = _call(step, x, params, u)
    (P.sum() + cost.sum()).backward()
    with torch.no_grad():
        step(x["u"], x["p0"], x["v0"], x["a0"], DT, out=(torch.empty_like(P), torch.empty_like(cost)), **params)
    assert PLAIN not in loads and step._twin.step is None

    v = torch.randn(u.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = _cost(x, params, x["u"].numpy())
    if path == "dt_grad":
        dt = torch.tensor(DT, dtype=torch.float64, requires_grad=True)
        for _ in range(2):
            P, cost = _call(step, x, params, dt=dt)
            (g,) = torch.autograd.grad(cost.sum(), dt)
        h = 1e-6
        fd = (_cost(x, params, x["u"].numpy(), DT + h).sum() - _cost(x, params, x["u"].numpy(), DT - h).sum()) / (2 * h)
        _close(g, np.asarray(fd), rtol=1e-6)
    elif path == "double_backward":
        for _ in range(2):
            P, cost = _call(step, x, params, u)
            (g,) = torch.autograd.grad(cost.sum(), u, create_graph=True)
            (hvp,) = torch.autograd.grad((g * v).sum(), u)
        g_expected, hvp_expected = _gradient_and_hvp(x, params, v.numpy())
        _close(g, g_expected)
        _close(hvp, hvp_expected)
    elif path in ("forward_ad", "jvp"):
        for _ in range(2):
            if path == "jvp":
                (P, cost), (dP, dcost) = torch.func.jvp(lambda uu: _call(step, x, params, uu), (x["u"],), (v,))
            else:
                with torch.autograd.forward_ad.dual_level():
                    P, cost = _call(step, x, params, torch.autograd.forward_ad.make_dual(x["u"], v))
                    dP, dcost = (torch.autograd.forward_ad.unpack_dual(y).tangent for y in (P, cost))
        dP_expected, dcost_expected = _tangents(x, params, v.numpy())
        _close(dP, dP_expected)
        _close(dcost, dcost_expected)
    elif path == "vmap":
        stacked = torch.stack([x["u"], v])
        cost = torch.func.vmap(lambda uu: _call(step, x, params, uu)[1])(stacked)
        _close(cost[1], _cost(x, params, v.numpy()))
        cost = cost[0]
    elif path == "compile":
        f = torch.compile(lambda uu: _call(step, x, params, uu)[1], fullgraph=True)
        for _ in range(2):
            cost = f(u)
            (g,) = torch.autograd.grad(cost.sum(), u)
        _close(g, _gradient_and_hvp(x, params, v.numpy())[0])
    else:
        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.step = step

            def forward(self, uu):
                return _call(self.step, x, params, uu)[1]

        cost = torch.export.export(Loss(), (x["u"],)).module()(x["u"])
    _close(cost, expected)
    assert loads.count(PLAIN) == 1 and step.plain.spec == PLAIN and step.plain is step.plain


def test_a_fresh_cache_holds_no_plain_library_until_a_composite_call(tmp_path):
    """In a new process and an empty cache: loading a fused step and calling its kernels (forward,
    backward, out=) builds the fused libraries only; a dt gradient builds the twin's core, and the
    dt kernels it runs. A second process, whose kernels are cached, imports no SymPy, that call included
    (the cost kinds' PyTorch functions, made with the twin, are kept in the cache with the kernels)."""
    code = f"""
        import sys, torch, tensorstep as ts
        from tensorstep.runtime.cache import BuildCache
        spec = ts.KernelSpec(horizon={H}, dof={D}, dtype="float64", costs={TERMS!r}, outputs=("P",))
        plain, fused = spec.replace(costs=(), outputs=None).key, spec.key
        def built():  # the libraries in the cache's index, by spec
            names = [p.stem.rsplit("-", 1)[0] for p in (BuildCache().root / "index").iterdir()]
            return " ".join(sorted(n.replace(fused, "fused").replace(plain, "plain") for n in names))
        u = torch.randn(2, {SPEC.n_actions}, {D}, dtype=torch.float64, requires_grad=True)
        z = torch.zeros(2, {D}, dtype=torch.float64)
        p = dict(squared_position_target=z, **{{f"{{k}}_{{s}}_weight": torch.ones({D}, dtype=torch.float64) for k, s in spec.costs}},
                 **{{f"bound_{{s}}_limit": torch.tensor([[-1.0] * {D}, [1.0] * {D}], dtype=torch.float64)
                    for k, s in spec.costs if k == "bound"}})
        step = ts.load(spec)
        print(built())
        P, cost = step(u, z, z, z, 0.1, **p)
        (P.sum() + cost.sum()).backward()
        with torch.no_grad():
            step(u, z, z, z, 0.1, out=(torch.empty_like(P), torch.empty_like(cost)), **p)
        print(built())
        print("sympy" in sys.modules)
        dt = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
        step(u, z, z, z, dt, **p)[1].sum().backward()
        print(built())
        print("sympy" in sys.modules, bool(dt.grad.isfinite()))
    """
    env = dict(os.environ, TENSORSTEP_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    assert runs[0].returncode == 0 and runs[1].returncode == 0, (runs[0].stderr, runs[1].stderr)
    lines = runs[0].stdout.splitlines()
    assert lines[0].split() == ["fused-core"], lines
    assert lines[1].split() == ["fused-core", "fused-core-form1"], lines  # the form the call runs
    assert lines[3].split() == ["fused-core", "fused-core-form1", "plain-core", "plain-dt_vjp"], lines
    warm = runs[1].stdout.splitlines()
    assert lines[4] == "True True" and warm[2] == "False" and warm[4] == "False True", (lines, warm)


def test_a_first_load_inside_a_cuda_graph_capture_raises_and_prepare_loads_it_ahead(monkeypatch, loads):
    """A capture cannot load a library: the twin's first use there raises, naming ``prepare``, which
    loads it ahead (``dt_grad=True`` also the twin's dt kernels, which a dt gradient runs)."""
    x, params = _data()
    dt = torch.tensor(DT, dtype=torch.float64, requires_grad=True)
    step = ts.load(SPEC)
    monkeypatch.setattr(api, "capturing", lambda: True)  # (what the CUDA backend asks before it loads)
    with pytest.raises(RuntimeError, match=r"during CUDA graph capture.*step\.prepare"):
        _call(step, x, params, dt=dt)
    assert PLAIN not in loads
    monkeypatch.setattr(api, "capturing", lambda: False)
    assert step.prepare(dt_grad=True) is step and loads.count(PLAIN) == 1
    assert {"dt_vjp", "dt_jvp"} <= set(step.plain.launcher.backend.functions)
    monkeypatch.setattr(api, "capturing", lambda: True)
    (g,) = torch.autograd.grad(_call(step, x, params, dt=dt)[1].sum(), dt)
    assert loads.count(PLAIN) == 1

    _unload_twins(monkeypatch)
    other = ts.load(SPEC)
    monkeypatch.setattr(api, "capturing", lambda: False)
    other.prepare(composite=True)
    other.prepare(dt=DT)  # neither loads it again
    monkeypatch.setattr(api, "capturing", lambda: True)
    assert loads.count(PLAIN) == 2 and other.plain.spec == PLAIN


def test_a_twin_in_use_follows_to_and_steps_of_a_spec_share_one(loads):
    """``.to()`` gives a step whose twin is in use the twin of its new dtype (as when the twin was a
    submodule) and leaves an unused one unloaded; steps of one spec (copies too) share one twin."""
    x, params = _data()
    unused = ts.load(SPEC).float()
    assert unused._twin.step is None and loads.count(PLAIN.replace(dtype="float32")) == 0

    step = ts.load(SPEC)
    dt = torch.tensor(DT, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(_call(step, x, params, dt=dt)[1].sum(), dt)[0]
    twin = step.plain
    step.float()
    assert step._twin.step.spec == PLAIN.replace(dtype="float32") and step.plain.dtype == torch.float32
    assert twin.dtype == torch.float64 and unused.plain is step.plain
    step.double()
    assert step.plain is twin
    assert list(step.children()) == [] and not any(k.startswith("plain") for k in step.state_dict())
    for copied in (copy.deepcopy(step), pickle.loads(pickle.dumps(step))):
        got = torch.autograd.grad(_call(copied, x, params, dt=dt)[1].sum(), dt)[0]
        assert torch.equal(got, expected) and copied.plain is twin
    assert loads.count(PLAIN) == 1 and loads.count(PLAIN.replace(dtype="float32")) == 1


def test_a_converted_step_leaves_its_former_kernels_their_twin():
    """The native node serves a spec's kernels with the first launcher loaded for them: a double backward
    through them takes that launcher's own spec's twin, even once the step that loaded it is converted."""
    spec = SPEC.replace(outputs=("P", "V"))  # kernels no other test here loads: this launcher is the node's
    x, params = _data()
    native.wait()
    first = ts.load(spec)
    first.float()
    step = ts.load(spec)
    assert step.native is not None and first.native is not None and first.native != step.native
    u = x["u"].clone().requires_grad_()
    v = torch.randn(u.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (g,) = torch.autograd.grad(_call(step, x, params, u)[-1].sum(), u, create_graph=True)
    (hvp,) = torch.autograd.grad((g * v).sum(), u)
    _close(hvp, _gradient_and_hvp(x, params, v.numpy())[1])


def test_a_second_step_of_a_spec_compiles_no_graph_for_its_twin(loads):
    """torch.compile guards on the twin the steps of a spec share, not on the step that loaded it: a
    compiled function called with another step of the spec reuses its graphs."""
    x, params = _data()
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters["stats"]
    f = torch.compile(lambda s, uu: _call(s, x, params, uu)[1], fullgraph=True)
    first, second = ts.load(SPEC), ts.load(SPEC)
    for _ in range(2):
        expected = f(first, x["u"])
    graphs = counts["unique_graphs"]
    for _ in range(2):
        _close(f(second, x["u"]), expected.numpy(), rtol=0)
    assert counts["unique_graphs"] == graphs and loads.count(PLAIN) == 1


def test_threads_that_need_the_twin_at_once_load_it_once(loads, monkeypatch):
    """Calls from several threads (an autograd worker, a data loader) that each run the composite form
    first: one loads the twin (slowly here, as a build), the others wait for it; each gets the
    definitions' cost."""
    x, params = _data()
    step = ts.load(SPEC)
    counted = api.load
    monkeypatch.setattr(api, "load", lambda spec, device="cpu": (time.sleep(0.3), counted(spec, device))[1])
    barrier = threading.Barrier(4)
    costs = [None] * 4

    def run(i: int) -> None:
        dt = torch.tensor(DT, dtype=torch.float64, requires_grad=True)
        barrier.wait()
        costs[i] = _call(step, x, params, dt=dt)[1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads.count(PLAIN) == 1
    for cost in costs:
        _close(cost, _cost(x, params, x["u"].numpy()))
