"""The native node's CUDA launches (runtime/native_node.cpp; TENSORSTEP_CUDA_NATIVE=0 turns them off).

Without a GPU, the node launches the CUDA kernels run on the host (tests/cuda_on_host.py) through
the driver double given to it as a C function: outputs and gradients equal the Python path's (the
same kernels through ``Packed``) bit for bit, and the dense float64 references (tests/reference.py,
tests/reference_bspline.py, tests/reference_costs.py); each launch is ``Packed``'s, with as many
temporaries; a (entry point, B) pair's launches are asked from Python once; a tensor on another
device than the step's is refused by name. On a GPU (``.ci/gpu``), the node's launches against the
Python path's, bit for bit.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Iterator
from unittest import mock

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


@contextlib.contextmanager
def _python_checks() -> Iterator[list]:
    """The steps whose calls ran the Python path's checks (``Step._checked``), one entry per call:
    a call the node takes whole runs none."""
    checked, calls = Step._checked, []

    def counted(self, *args, **kwargs):
        calls.append(self)
        return checked(self, *args, **kwargs)

    with mock.patch.object(Step, "_checked", counted):
        yield calls


def _run(step: Step, case: ReferenceCase, weights: list) -> tuple[list, list]:
    """Outputs and the gradients of every tensor input for output gradients ``weights``; a native
    step's call (start and goal tables, goal=, a dt per trajectory) taken by the node whole."""
    xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    with _python_checks() as checked:
        ys = case.call(step, *xs, case.dt)
    assert not checked or step.native is None
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


@pytest.mark.parametrize("overrides", [PLAIN[1], PLAIN[4]], ids=grid_id)
def test_forward_mode_transforms_and_dt_gradients_take_the_python_path_and_equal_it(overrides):
    """What the node leaves to the Python Functions, on a step with its CUDA launches: a jvp
    (torch.func.jvp), a forward-mode dual, a vmap, a dt gradient (a dt per step, and one per
    trajectory): each equals the Python path's bit for bit. With a dt per trajectory, an entry that is
    not positive and a float dt are refused with the Python path's messages."""
    spec = _spec(overrides)
    case = ReferenceCase(spec, B=40, seed=2)
    xs = case.tensors()[:-1]
    places = [i for i, x in enumerate(xs) if x.is_floating_point()]
    gen = torch.Generator().manual_seed(1)
    tangents = [torch.randn(xs[i].shape, generator=gen, dtype=torch.float64) for i in places]
    results, messages = [], []
    for step in (_native_step(spec), host_step(spec)):
        def call(*values, dt=case.dt):
            given = list(xs)
            for i, v in zip(places, values):
                given[i] = v
            return case.call(step, *given, dt)

        got = []
        _, tangent = torch.func.jvp(call, tuple(xs[i] for i in places), tuple(tangents))
        got += tangent
        with torch.autograd.forward_ad.dual_level():
            ys = call(*(torch.autograd.forward_ad.make_dual(xs[i], t) for i, t in zip(places, tangents)))
            got += [torch.autograd.forward_ad.unpack_dual(y).tangent for y in ys]
        u = torch.stack([xs[0], 2 * xs[0]])
        got += torch.func.vmap(lambda a: call(a, *(xs[i] for i in places[1:])))(u)
        dt = case.dt.clone().requires_grad_()
        got += torch.autograd.grad(sum((y * y).sum() for y in call(*(xs[i] for i in places), dt=dt)), dt)
        if spec.dt == "per_trajectory":
            bad = case.dt.clone()
            bad[3] = 0.0
            for dt, kind in ((bad, ValueError), (0.07, TypeError)):
                with pytest.raises(kind) as error:
                    call(*(xs[i] for i in places), dt=dt)
                messages.append(str(error.value))
        assert not step.launcher.backend.errors
        results.append(got)
    assert len(results[0]) == len(results[1]) > 0
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert messages[:len(messages) // 2] == messages[len(messages) // 2:]


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



def _fused_output_grads(spec, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random gradients of a fused step's P and cost."""
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(B, spec.horizon, spec.dof, generator=gen, dtype=torch.float64),
            torch.randn(B, len(spec.costs), generator=gen, dtype=torch.float64))

def test_a_fused_step_equals_the_python_path_and_the_definitions():
    """A fused step (cost terms, P only; its adjoint reads the inputs): P, the cost and the gradients
    of u and p0 equal the Python path's bit for bit over three calls (the cost parameters kept in the
    step's slot from the second on); P and the cost against the reference and the cost definitions
    (tests/reference_costs.py) at 1e-12, the gradients against the C kernels' at 1e-12."""
    spec = make_spec(FUSED, dof=2)
    B = 70
    x, params, dt = _fused_data(spec, B)
    wP, wcost = _fused_output_grads(spec, B)

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


def test_held_cost_parameters_take_the_nodes_launches_without_crossing_per_call():
    """A fused step holding its cost parameters (``set_costs``; a planner's loop): the first call keeps
    them in the step's slot after the Python checks; every later call passes forward's tensors only and
    the node takes it whole (no Python check). Over four calls, P, the cost and the gradients of u and p0
    equal the Python path's bit for bit, with the same launches; a held tensor written in place is seen
    by the next call, on both paths."""
    spec = make_spec(FUSED, dof=2)
    B = 70
    x, params, dt = _fused_data(spec, B)
    wP, wcost = _fused_output_grads(spec, B)
    steps = (_native_step(spec), host_step(spec))
    held = [{k: v.clone() for k, v in params.items()} for _ in steps]
    for step, tensors in zip(steps, held):
        step.set_costs(**tensors)
    results, checks = [], []
    for step, tensors in zip(steps, held):
        got = []
        with _python_checks() as checked:
            for call in range(4):
                if call == 3:  # written in place: no longer the node's stamp, so the Python checks run
                    tensors["squared_velocity_weight"].mul_(1.5)
                u, p0 = x["u"].clone().requires_grad_(), x["p0"].clone().requires_grad_()
                P, cost = step(u, p0, x["v0"], x["a0"], dt, j0=x["j0"])
                assert (P.grad_fn.name() == "NativeStepBackward") == (step.native is not None)
                got += [P.detach(), cost.detach(), *torch.autograd.grad((P, cost), (u, p0), (wP, wcost))]
        assert not step.launcher.backend.errors
        results.append(got)
        checks.append(len(checked))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][4 * 2 + 1], results[0][4 * 3 + 1])  # (the write was seen: the cost)
    assert checks == [2, 4]  # the native step's first call and the one after the write
    native_backend, python_backend = (s.launcher.backend for s in steps)
    assert native_backend.launched == python_backend.launched


def test_a_dropped_step_frees_its_backend_and_a_graph_that_outlives_it_runs_its_backward():
    """The node holds a CUDA step's kernels loaded (its backend, through the anchor a launcher and each
    autograd node hold) while the step or a graph whose backward has not run may launch them, no
    longer. A graph that outlives its step runs its backward, a ``.sum()`` loss's adjoint at B=1 asked
    of Python after the step was freed, and its gradients equal the Python path's bit for bit; the
    backend is freed after that backward. A step dropped with no graph frees its backend at once, and
    its handle refuses to launch afterwards."""
    spec = _spec(PLAIN[0])
    case = ReferenceCase(spec, B=130, seed=2)
    expected = []
    for native_path in (True, False):
        step = _native_step(spec) if native_path else host_step(spec)
        backend, handle = weakref.ref(step.launcher.backend), step.native
        xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
        loss = sum(y.sum() for y in case.call(step, *xs, case.dt))
        del step
        gc.collect()
        assert backend() is not None  # the graph holds it
        if native_path:
            assert native.cuda_plans(handle) == (1, 1)  # the forward's: the adjoint's at B=1 is asked below
        expected.append(torch.autograd.grad(loss, xs))
        assert not backend().errors
        if native_path:
            assert native.cuda_plans(handle) == (2, 2)
            gc.collect()
            assert backend() is None  # its backward ran: the graph (still alive) launches nothing more
            given = [*case.tensors()[:-1], case.idx, torch.full((1,), 0.1, dtype=torch.float64)]
            with pytest.raises(RuntimeError, match=f"kernels of handle {handle} were freed"):
                torch.ops.tensorstep_native.step(handle, given)
        del loss
    for a, b in zip(*expected):
        assert torch.equal(a, b)
    step = _native_step(spec)
    backend = weakref.ref(step.launcher.backend)
    xs = [t.clone().requires_grad_(True) for t in case.tensors()[:-1]]
    torch.autograd.grad(sum(y.sum() for y in case.call(step, *xs, case.dt)), xs)
    ys = case.call(step, *xs, case.dt)  # a graph dropped without a backward
    del step, ys
    gc.collect()
    assert backend() is None


@pytest.mark.parametrize("off", ["0", "off", "False"])
def test_on_unless_turned_off(monkeypatch, off):
    """A CUDA launcher gets a native handle by default; TENSORSTEP_CUDA_NATIVE=0 (or off/false/no, any
    case) keeps CUDA steps on the Python path."""
    monkeypatch.delenv(native.CUDA_SWITCH)
    spec = _spec(PLAIN[0])
    assert native.handle(Launcher(spec, HostCudaBackend(spec))) is not None
    monkeypatch.setenv(native.CUDA_SWITCH, off)
    assert native.handle(Launcher(spec, HostCudaBackend(spec))) is None


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


def _held_calls(native_step: Step, python_step: Step, to) -> None:
    """A fused step holding its cost parameters, three forward+backward calls on each path (``to``: onto
    the steps' device and dtype): the native step's calls after the first taken by the node whole, and
    every output and gradient equal to the Python path's bit for bit."""
    spec = native_step.spec
    x, params, dt = _fused_data(spec.replace(dtype="float64"), 400)
    results, checks = [], []
    for step in (native_step, python_step):
        step.set_costs(**{k: to(v) for k, v in params.items()})
        got = []
        with _python_checks() as checked:
            for _ in range(3):
                u, p0 = to(x["u"]).requires_grad_(), to(x["p0"]).requires_grad_()
                P, cost = step(u, p0, to(x["v0"]), to(x["a0"]), to(dt), j0=to(x["j0"]))
                weights = (P.detach(), cost.detach())
                got += [*weights, *torch.autograd.grad((P, cost), (u, p0), weights)]
        results.append(got)
        checks.append(len(checked))
    assert checks == [1, 3]
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _outliving_graph(steps: list, case: ReferenceCase, to) -> None:
    """A plain step's graph whose step is dropped before its backward (a ``.sum()`` loss: the adjoint at
    B=1, asked of Python after the step is gone) gives the Python path's gradients bit for bit, and the
    native step's backend is freed once that backward ran. ``steps``: [native step, Python path's step],
    taken from the list (the caller keeps no reference)."""
    case.idx = to(case.idx) if case.idx is not None else None
    grads = []
    while steps:
        step = steps.pop(0)
        backend = weakref.ref(step.launcher.backend)
        xs = [to(t).requires_grad_(True) for t in case.tensors()[:-1]]
        loss = sum(y.sum() for y in case.call(step, *xs, to(case.dt)))
        native_path = step.native is not None
        del step
        gc.collect()
        assert backend() is not None
        grads.append(torch.autograd.grad(loss, xs))
        if native_path:
            gc.collect()
            assert backend() is None
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_device_checks_bodies_run_on_the_host():
    """The bodies of the GPU test below, on the host double (where they are checked on every run)."""
    _held_calls(_native_step(make_spec(FUSED, dof=2)), host_step(make_spec(FUSED, dof=2)), lambda t: t.clone())
    spec = _spec(PLAIN[0])
    _outliving_graph([_native_step(spec), host_step(spec)], ReferenceCase(spec, B=130, seed=2), lambda t: t.clone())


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_on_a_gpu_held_parameters_and_a_graph_that_outlives_its_step(dtype):
    """On a GPU: a fused step's held cost parameters (set_costs) and a plain step's graph that outlives
    its step (``_held_calls``, ``_outliving_graph``) against the Python path bit for bit, at B=400."""
    loaded = []
    for overrides in (FUSED, PLAIN[0]):
        spec = make_spec(overrides, dof=2).replace(dtype=dtype)
        steps = [ts.load(spec, "cuda"), ts.load(spec, "cuda")]
        if steps[0].native is None:
            pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
        steps[1].native = None
        loaded.append(steps)
    del steps
    to = lambda t: t.cuda().to(getattr(torch, dtype)) if t.is_floating_point() else t.cuda()
    _held_calls(*loaded[0], to)
    case = ReferenceCase(make_spec(PLAIN[0], dof=2), B=400, seed=2)
    _outliving_graph(loaded.pop(), case, to)
