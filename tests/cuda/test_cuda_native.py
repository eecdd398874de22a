"""The native node's CUDA launches (runtime/native_node.cpp, TENSORSTEP_CUDA_NATIVE=1).

Without a GPU, the node launches the CUDA kernels run on the host (tests/cuda_on_host.py) through
the driver double given to it as a C function: outputs and gradients equal the Python path's (the
same kernels through ``Packed``) bit for bit, and the dense float64 references (tests/reference.py,
tests/reference_bspline.py, tests/reference_costs.py); each launch is ``Packed``'s, with as many
temporaries; a (entry point, B) pair's launches are asked from Python once; a tensor on another
device than the step's is refused by name. On a GPU (``.ci/gpu``), the node's launches against the
Python path's, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
import reference_costs
import tensorstep as ts
from cuda_on_host import HostCudaBackend, host_step
from helpers import ReferenceCase, as_bhd, grid_id, make_spec, scale_close
from tensorstep.codegen.arguments import table
from tensorstep.runtime import native
from tensorstep.runtime.api import Step
from tensorstep.runtime.launch import Launcher

PLAIN = [
    dict(control="acceleration", integrator="exact", start_index=True),  # an integrator
    dict(difference="central", accuracy=2, end="one_sided", dt="per_step"),  # a stencil, a coefficient table
    dict(control="bspline", degree=3, knots=5, steps=3, start_index=True),  # a B-spline
    dict(difference="central", start_index=True, layout="bdh"),  # layout bdh
    dict(end="goal", goal_index=True, start_index=True, dt="per_trajectory"),  # start and goal tables
]
FUSED = dict(control="acceleration", dt="per_step", costs=(("bound", "position"), ("squared", "velocity")),
             outputs=("P",))


@pytest.fixture(autouse=True)
def cuda_native(monkeypatch):
    monkeypatch.setenv(native.CUDA_SWITCH, "1")


def _spec(overrides: dict) -> ts.KernelSpec:
    if overrides.get("control") == "bspline":  # the horizon follows from knots and steps
        return ts.KernelSpec(dof=2, dtype="float64", **overrides)
    return make_spec(overrides, dof=2)


def _native_step(spec: ts.KernelSpec) -> Step:
    step = host_step(spec, native=True)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return step


def _run(step: Step, case: ReferenceCase, weights: list) -> tuple[list, list]:
    """Outputs and the gradients of every tensor input for output gradients ``weights``."""
    xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    ys = case.call(step, *xs, case.dt)
    assert (ys[0].grad_fn.name() == "NativeStepBackward") == (step.native is not None)
    backend = step.launcher.backend
    assert not backend.errors, backend.errors
    grads = torch.autograd.grad(ys, xs, weights[:len(ys)])
    assert not backend.errors, backend.errors
    return [y.detach() for y in ys], list(grads)


@pytest.mark.parametrize("overrides", PLAIN, ids=grid_id)
def test_native_launches_equal_the_python_path_and_the_reference(overrides):
    """B·D = 260 columns (two blocks): every output and every input's gradient (start and goal tables
    scatter-added through their indices) equal the Python path's bit for bit; the outputs against the
    dense reference at 1e-12, the gradients by the dot test against it: <M x, w> = Σ <x, Mᵀ w>."""
    spec = _spec(overrides)
    case = ReferenceCase(spec, B=130, seed=2)
    gen = torch.Generator().manual_seed(5)
    shapes = [y.shape for y in case.call(host_step(spec), *case.tensors())]
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    ys, gs = _run(_native_step(spec), case, weights)
    ys_python, gs_python = _run(host_step(spec), case, weights)
    for got, expected in zip([*ys, *gs], [*ys_python, *gs_python]):
        assert torch.equal(got, expected)
    expect = case.expected()
    for y, e in zip(ys, expect):
        scale_close(as_bhd(y, spec), e, 1e-12)
    K = len(expect)
    terms = [as_bhd(w, spec) * e for w, e in zip(weights, expect)]
    dot = sum(float(t.sum()) for t in terms)
    size = sum(float(np.abs(t).sum()) for t in terms)
    assert K == len(ys)  # (every output has a reference: the dot test covers every gradient)
    total = sum(float((x * g).sum()) for x, g in zip(case.tensors()[:-1], gs))
    assert abs(total - dot) <= 1e-12 * size, (total, dot, size)


@pytest.mark.parametrize("overrides", PLAIN[:2], ids=grid_id)
def test_out_a_sum_s_gradient_and_double_backward_equal_the_python_path(overrides):
    """The node's other calls on the CUDA launches: ``out=`` under no_grad (written in place), a
    gradient of stride 0 along the batch (``.sum()``: the adjoint run for one trajectory and
    broadcast, a plan at B=1), and a create_graph backward (AdjointFunction, called back from the
    node) and its gradient: each equal to the Python path's bit for bit."""
    spec = _spec(overrides)
    case = ReferenceCase(spec, B=130, seed=2)
    steps = (_native_step(spec), host_step(spec))
    results = []
    for step in steps:
        with torch.no_grad():
            out = [torch.full_like(y, float("nan")) for y in case.call(step, *case.tensors())]
            got = case.call(step, *case.tensors(), out=out)
        assert all(a is b for a, b in zip(got, out))
        xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
        ys = case.call(step, *xs, case.dt)
        summed = torch.autograd.grad(sum(y.sum() for y in ys), xs)
        ys = case.call(step, *xs, case.dt)
        first = torch.autograd.grad(sum((y * y).sum() for y in ys), xs, create_graph=True)
        second = torch.autograd.grad(sum((g * g).sum() for g in first), xs)
        results.append([*out, *summed, *(g.detach() for g in first), *second])
        assert not step.launcher.backend.errors
    assert steps[0].launcher.backend.launched != []
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert native.cuda_plans(steps[0].native)[0] >= 3  # forward and adjoint at B=130, the adjoint at B=1


def test_each_launch_is_packeds_with_as_many_temporaries_and_python_is_asked_once():
    """A per-step dt's coefficient table is a temporary: forward and adjoint launch the same kernels,
    grids and blocks as ``Packed``, the same integers at the same places, the arguments where Packed
    has them (none where it has none), and as many distinct temporaries, none an argument's memory. The
    node asks Python for a (entry point, B) pair's launches once, and keeps them."""
    spec = _spec(PLAIN[1])
    case = ReferenceCase(spec, B=130, seed=2)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(y.shape, generator=gen, dtype=torch.float64)
               for y in case.call(host_step(spec), *case.tensors())]
    records = []
    for step in (_native_step(spec), host_step(spec)):
        backend = step.launcher.backend
        _run(step, case, weights)
        records.append((list(backend.launched), list(backend.parameters), backend))
    (launched, parameters, backend), (launched_python, parameters_python, _) = records
    assert launched == launched_python and len(launched) >= 2
    plan = backend.plan
    temporaries = 0
    at = 0
    for entry in ("forward", "adjoint"):
        launches = plan.launches(entry, case.B)
        placed, constants = launches.positions
        n, T = len(launches.parameters), len(launches.temporaries)
        temporaries += T
        for native_call in (parameters, parameters_python):
            seen, arguments = set(), set()
            for j, (_, _, _, _, positions) in enumerate(placed):
                values = native_call[at + j]
                assert values[0] == case.B
                for k, (p, value) in enumerate(zip(positions, values[1:])):
                    if p < n:  # an argument: given (or not) as Packed gives it
                        assert (value == 0) == (parameters_python[at + j][1 + k] == 0)
                        arguments.add(value)
                    elif p < n + T:
                        seen.add((p, value))
                    else:
                        assert value == constants[p - n - T]
            assert len(seen) == len({p for p, _ in seen}) == len({v for _, v in seen}) == T  # one address each
            assert not {v for _, v in seen} & arguments
        at += len(placed)
    assert temporaries > 0, "the case was chosen for its coefficient table"
    fresh = _native_step(spec)  # (a backend of its own: a handle of its own)
    assert native.cuda_plans(fresh.native) == (0, 0)
    x = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    for _ in range(3):
        torch.autograd.grad(case.call(fresh, *x, case.dt), x, weights)
    assert native.cuda_plans(fresh.native) == (2, 2)  # forward and adjoint at B=130, asked once each
    small = ReferenceCase(spec, B=7, seed=3)
    small.call(fresh, *small.tensors())
    assert native.cuda_plans(fresh.native) == (3, 3)


@pytest.mark.parametrize("name", ["u", "p0", "a0", "j0", "start_index"])
def test_a_tensor_on_another_device_is_refused_by_name(name):
    """A tensor on another device than the step's is refused before any launch, naming it, with the
    Python path's message; a step registered for cuda:0 refuses CPU tensors the same way."""
    spec = _spec(PLAIN[0])
    case = ReferenceCase(spec, B=3, seed=2)
    names = ["u", "p0", "v0", "a0", "j0"]
    messages = []
    for step in (_native_step(spec), host_step(spec)):
        xs = [t.to("meta") if n == name else t for n, t in zip(names, case.tensors()[:-1])]
        idx = case.idx
        if name == "start_index":
            case.idx = idx.to("meta")
        try:
            with pytest.raises(ValueError, match=f"^{name}: ") as error:
                case.call(step, *xs, case.dt)
        finally:
            case.idx = idx
        assert not step.launcher.backend.launched
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "meta" in messages[0]
    backend = HostCudaBackend(spec)
    backend.device = torch.device("cuda", 0)  # (a device this machine may lack: nothing runs on it)
    handle = native.handle(Launcher(spec, backend))
    assert handle is not None
    dt = torch.full((1,), 0.1, dtype=torch.float64)
    given = [*case.tensors()[:-1], case.idx, dt]
    with pytest.raises(ValueError, match="^u: .*cuda:0.*cpu|^u: .*cpu.*cuda:0"):
        torch.ops.tensorstep_native.step(handle, given)
    assert not backend.launched


def _fused_data(spec: ts.KernelSpec, B: int) -> tuple[dict, dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    D = spec.dof
    x = dict(u=r(B, spec.n_actions, D), p0=r(B, D), v0=r(B, D), a0=r(B, D), j0=r(B, D))
    lo = -0.3 - r(D).abs()
    params = dict(bound_position_weight=r(B, D).abs() + 0.1, bound_position_row_weight=r(spec.horizon).abs(),
                  bound_position_limit=torch.stack([lo, lo + 0.5 + r(D).abs()]),
                  bound_position_margin=0.05 * r(D).abs(),
                  squared_velocity_weight=r(B, D).abs() + 0.1, squared_velocity_row_weight=r(spec.horizon).abs())
    dt = 0.05 + 0.05 * torch.rand(spec.n_dt, generator=gen, dtype=torch.float64)
    return x, params, dt


def test_a_fused_step_equals_the_python_path_and_the_definitions():
    """A fused step (cost terms, P only; its adjoint reads the inputs): P, the cost and the gradients
    of u and p0 equal the Python path's bit for bit over three calls (the cost parameters kept in the
    step's slot from the second on); P and the cost against the reference and the cost definitions
    (tests/reference_costs.py) at 1e-12, the gradients against the C kernels' at 1e-12."""
    spec = make_spec(FUSED, dof=2)
    B = 70
    x, params, dt = _fused_data(spec, B)
    gen = torch.Generator().manual_seed(5)
    wP = torch.randn(B, spec.horizon, spec.dof, generator=gen, dtype=torch.float64)
    wcost = torch.randn(B, len(spec.costs), generator=gen, dtype=torch.float64)

    def run(step):
        u, p0 = x["u"].clone().requires_grad_(), x["p0"].clone().requires_grad_()
        P, cost = step(u, p0, x["v0"], x["a0"], dt, j0=x["j0"], **params)
        assert (P.grad_fn.name() == "NativeStepBackward") == (step.native is not None)
        gu, gp0 = torch.autograd.grad((P, cost), (u, p0), (wP, wcost))
        return [P.detach(), cost.detach(), gu, gp0]

    native_step, python_step = _native_step(spec), host_step(spec)
    for _ in range(3):
        got, expected = run(native_step), run(python_step)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    assert not native_step.launcher.backend.errors
    K = spec.order + 1
    Y = np.zeros((K, B, spec.horizon, spec.dof))
    for b in range(B):
        for d in range(spec.dof):
            start = [x[n][b, d].item() for n in ("p0", "v0", "a0", "j0")]
            Y[:, b, :, d] = reference.column(spec.replace(costs=(), outputs=None), x["u"][b, :, d].numpy(),
                                             np.array(start), dt.numpy())
    states = dict(zip(("position", "velocity", "acceleration", "jerk"), Y))
    cost = reference_costs.costs(spec.costs, states, {k: v.numpy() for k, v in params.items()})
    scale_close(got[0].numpy(), Y[0], 1e-12)
    scale_close(got[1].numpy(), cost, 1e-12)
    for a, c in zip(got[2:], run(ts.load(spec))[2:]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12 * float(c.abs().max()))


def test_off_unless_asked(monkeypatch):
    """Without TENSORSTEP_CUDA_NATIVE=1 a CUDA step takes the Python path (the default until a GPU run
    confirms the node's launches)."""
    monkeypatch.delenv(native.CUDA_SWITCH)
    spec = _spec(PLAIN[0])
    assert Step(spec, torch.device("cpu"), Launcher(spec, HostCudaBackend(spec))).native is None
    assert native.handle(Launcher(spec, HostCudaBackend(spec))) is None
    monkeypatch.setenv(native.CUDA_SWITCH, "1")
    assert native.handle(Launcher(spec, HostCudaBackend(spec))) is not None


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@gpu
@pytest.mark.parametrize("overrides", [*PLAIN, FUSED], ids=grid_id)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_on_a_gpu_native_launches_equal_the_python_paths(overrides, dtype):
    """On a GPU: the node's launches (driver, PyTorch's current stream, temporaries from its caching
    allocator) give the Python path's outputs and gradients bit for bit, at B=400 and B=40000, and on a
    side stream."""
    spec = (_spec(overrides) if "costs" not in overrides else make_spec(overrides, dof=2)).replace(dtype=dtype)
    step = ts.load(spec, "cuda")
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    python = ts.load(spec, "cuda")
    python.native = None
    for B in (400, 40000):
        if spec.costs:
            x, params, dt = _fused_data(spec, B)
            given = [x["u"], x["p0"], x["v0"], x["a0"]]
            kw = dict(j0=x["j0"], **params)
        else:
            case = ReferenceCase(spec.replace(dtype="float64"), B=B, seed=2)
            given, dt = case.tensors()[:4], case.dt
            kw = dict(j0=case.tensors()[4])
            if case.idx is not None:
                kw["start_index"] = case.idx.cuda()
            if case.goal:
                kw.update(goal=tuple(g.cuda().to(step.dtype) for g in case.goal), goal_index=case.gidx.cuda())
        to = lambda t: t.cuda().to(step.dtype) if t.is_floating_point() else t.cuda()
        kw = {k: (to(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        results = []
        for s in (step, python, step):
            stream = torch.cuda.Stream() if len(results) == 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())  # (the keyword tensors were copied there)
            with torch.cuda.stream(stream):
                u, p0 = (to(t).requires_grad_() for t in given[:2])
                ys = s(u, p0, *(to(t) for t in given[2:]), to(dt), **kw)
                assert (ys[0].grad_fn.name() == "NativeStepBackward") == (s is step)
                ws = [torch.ones_like(y) * 0.5 + y.detach() for y in ys]
                grads = torch.autograd.grad(ys, (u, p0), ws)
            stream.synchronize()
            results.append([*(y.detach() for y in ys), *grads])
        for run in (results[0], results[2]):
            for a, b in zip(run, results[1]):
                assert torch.equal(a, b)
