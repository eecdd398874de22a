"""The native autograd node: which calls take it, and that its gradients are the exact adjoint."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import native

import reference
from helpers import Inputs, dt_value, make_spec, scale_close

SPEC = make_spec(dict(difference="central", start_index=True))


@pytest.fixture
def step():
    s = ts.load(SPEC)
    if s.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return s


def node_name(t: torch.Tensor) -> str:
    return t.grad_fn.name()


def test_plain_calls_take_the_native_node(step):
    x = Inputs(SPEC, requires_grad=True)
    P, *_ = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    assert "NativeStep" in node_name(P)


PLAIN = make_spec(dict(difference="central"))


@pytest.fixture
def plain_step():
    s = ts.load(PLAIN)
    if s.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return s


def _spy(step, monkeypatch) -> list:
    """Record what the native op returns on each call."""
    calls = []
    native = step._native_step
    monkeypatch.setattr(step, "_native_step", lambda *a: calls.append(native(*a)) or calls[-1])
    return calls


def _native(step, u, p0, v0, a0, j0, idx, dt):
    """The native op called directly, with the arguments in table order."""
    return step._native_step(step.native, [u, p0, v0, a0, j0, idx, dt])


def test_plain_calls_are_checked_in_the_native_op(plain_step, monkeypatch):
    """A plain call skips the Python checks once its float dt is cached: the native op checks the
    tensors itself, and its outputs and gradients are the reference's."""
    calls = _spy(plain_step, monkeypatch)
    x = Inputs(PLAIN, requires_grad=True)
    outs = plain_step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())  # checked in Python, caches dt 0.1
    outs = plain_step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    assert len(calls) == 2 and all(len(c) == 4 for c in calls) and "NativeStep" in node_name(outs[0])
    expect = reference.apply(PLAIN, [0.1], x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(outs):
        scale_close(y.detach().numpy(), expect[k], 1e-12)
    grads = [torch.ones_like(y) for y in outs]
    (gu,) = torch.autograd.grad(outs, [x.u], grads)
    expect_u, _ = reference.apply_adjoint(PLAIN, [0.1], np.ones((4, *outs[0].shape)))
    scale_close(gu.numpy(), expect_u, 1e-12)


def _bad_plain_inputs(x):
    """(the argument at fault, what is wrong with it, arguments u, p0, v0, a0, j0)."""
    f32 = lambda t: t.detach().float()
    return [
        ("u", "dtype", f32(x.u), x.p0, x.v0, x.a0, x.j0),
        ("u", "shape", x.u[:, :-1], x.p0, x.v0, x.a0, x.j0),
        ("u", "dims", x.u[0], x.p0, x.v0, x.a0, x.j0),
        ("u", "empty batch", x.u[:0], x.p0[:0], x.v0[:0], x.a0[:0], x.j0[:0]),
        ("p0", "rows", x.u, x.p0[:-1], x.v0, x.a0, x.j0),
        ("v0", "dtype", x.u, x.p0, f32(x.v0), x.a0, x.j0),
        ("a0", "dof", x.u, x.p0, x.v0, x.a0[:, :-1], x.j0),
        ("j0", "dims", x.u, x.p0, x.v0, x.a0, x.j0[:, None]),
        ("a0", "sparse", x.u, x.p0, x.v0, x.a0.detach().to_sparse(), x.j0),
    ]


def test_native_op_rejects_what_the_python_checks_reject(plain_step):
    """Every structural fault is refused by the native op before any kernel runs, with the
    Python checks' own words (both come from the argument table)."""
    x = Inputs(PLAIN)
    dt_k = plain_step._dt_tensor(0.1)
    python = ts.load(PLAIN)
    python.native = None
    for name, what, u, p0, v0, a0, j0 in _bad_plain_inputs(x):
        with pytest.raises((TypeError, ValueError), match=f"^{name}:") as native_error:
            _native(plain_step, u, p0, v0, a0, j0, None, dt_k)
        with pytest.raises((TypeError, ValueError)) as python_error:
            python(u, p0, v0, a0, 0.1, j0=j0)
        assert (type(native_error.value), str(native_error.value)) == \
            (type(python_error.value), str(python_error.value)), (name, what)


def test_any_strides_are_accepted_and_gradients_keep_the_input_shape(plain_step):
    x = Inputs(PLAIN)
    wide = torch.randn(x.B, PLAIN.n_actions, 2 * PLAIN.dof, dtype=torch.float64, requires_grad=True)
    u = wide[:, :, ::2]
    ut = x.u.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # same values, other strides
    expect = reference.apply(PLAIN, [0.1], u.detach().numpy(), x.numpy_start())
    for path in ("native", "python"):
        step = plain_step if path == "native" else ts.load(PLAIN)
        if path == "python":
            step.native = None
        outs = step(u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)
        scale_close(outs[2].detach().numpy(), expect[2], 1e-12)
        (g,) = torch.autograd.grad(outs[0].sum(), wide)
        assert g.shape == wide.shape and torch.all(g[:, :, 1::2] == 0)
        (gt,) = torch.autograd.grad(step(ut, x.p0, x.v0, x.a0, 0.1)[3].sum(), ut)
        assert gt.shape == ut.shape


PER_STEP = make_spec(dict(difference="central", dt="per_step"))


@pytest.mark.parametrize("spec, dt", [
    (PLAIN, torch.tensor(0.1, dtype=torch.float64)),
    (PLAIN, torch.tensor([0.07], dtype=torch.float64)),
    (PER_STEP, dt_value(PER_STEP, seed=3)),
], ids=["uniform-0d", "uniform-1", "per_step"])
def test_dt_tensors_are_checked_in_the_native_op(spec, dt, monkeypatch):
    """A dt tensor goes to the native op as it is (its values are checked there); outputs and
    gradients are the reference's for those durations."""
    step = ts.load(spec)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    calls = _spy(step, monkeypatch)
    x = Inputs(spec, requires_grad=True)
    outs = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert len(calls) == 1 and len(calls[0]) == 4 and "NativeStep" in node_name(outs[0])
    durations = dt.reshape(-1).tolist()
    expect = reference.apply(spec, durations, x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(outs):
        scale_close(y.detach().numpy(), expect[k], 1e-12)
    grads = [torch.ones_like(y) for y in outs]
    (gu,) = torch.autograd.grad(outs, [x.u], grads)
    expect_u, _ = reference.apply_adjoint(spec, durations, np.ones((4, *outs[0].shape)))
    scale_close(gu.numpy(), expect_u, 1e-12)


def _bad_dt_tensors(spec):
    """(what is wrong, a dt tensor the Python checks reject for this kernel)."""
    good = dt_value(spec)
    n = good.numel()
    return [
        ("negative", -good),
        ("zero", good * 0),
        ("nan", good.reshape(n).index_fill(0, torch.tensor([n - 1]), float("nan"))),
        ("inf", good.reshape(n).index_fill(0, torch.tensor([0]), float("inf"))),
        ("too many values", torch.full((n + 1,), 0.1, dtype=good.dtype)),
        ("two dims", good.reshape(1, n)),
        ("integer", torch.ones(n, dtype=torch.int64)),
    ]


@pytest.mark.parametrize("spec", [PLAIN, PER_STEP], ids=["uniform", "per_step"])
def test_native_op_rejects_the_dt_tensors_python_rejects(spec):
    """dt's values and form are left to the Python checks: the native op runs no kernel."""
    step = ts.load(spec)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    x = Inputs(spec)
    for what, dt in _bad_dt_tensors(spec):
        assert _native(step, x.u, x.p0, x.v0, x.a0, x.j0, None, dt) == [], what
        with pytest.raises((TypeError, ValueError), match="^dt:"):
            step(x.u, x.p0, x.v0, x.a0, dt, j0=x.j0)


@pytest.mark.parametrize("spec", [PLAIN, PER_STEP], ids=["uniform", "per_step"])
def test_dt_tensors_to_convert(spec):
    """Another float dtype or a strided view: converted (by the native op, as Python would); a dt
    that requires grad takes the Python path. All match the reference."""
    step = ts.load(spec)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    x = Inputs(spec)
    good = dt_value(spec, seed=5)
    spaced = torch.zeros(2 * good.numel(), dtype=good.dtype)
    spaced[::2] = good.reshape(-1)
    expect = reference.apply(spec, good.reshape(-1).tolist(), x.numpy_u_bhd(), x.numpy_start())
    cases = [("float32", good.float()), ("requires grad", good.clone().requires_grad_())]
    if good.numel() > 1:  # (one element is contiguous at any stride)
        cases.append(("strided", spaced[::2]))
    for what, dt in cases:
        tol = 1e-6 if what == "float32" else 1e-12
        if what != "requires grad":
            scale_close(_native(step, x.u, x.p0, x.v0, x.a0, x.j0, None, dt)[0].numpy(), expect[0], tol)
        P, *_ = step(x.u, x.p0, x.v0, x.a0, dt, j0=x.j0)
        scale_close(P.detach().numpy(), expect[0], tol)


def test_indexed_calls_are_checked_in_the_native_op(step, monkeypatch):
    calls = _spy(step, monkeypatch)
    x = Inputs(SPEC, batch=5)
    x.idx = torch.tensor([4, 0, 6, 0, 2])
    step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())  # fills the dt cache
    outs = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    assert len(calls) == 2 and len(calls[-1]) == 4
    expect = reference.apply(SPEC, [0.1], x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(outs):
        scale_close(y.numpy(), expect[k], 1e-12)


def test_native_op_rejects_the_start_indices_python_rejects(step, plain_step):
    """Structural faults raise the table's message in the native op; entries out of range make
    it decline, and the Python checks raise IndexError."""
    x = Inputs(SPEC)
    dt_k = step._dt_tensor(0.1)
    S = x.S
    for what, idx in [("past the last row", torch.tensor([0, S, 1])), ("negative", torch.tensor([0, -1, 1]))]:
        assert _native(step, x.u, x.p0, x.v0, x.a0, x.j0, idx, dt_k) == [], what
        with pytest.raises(IndexError, match="^start_index: entry .* is out of range"):
            step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, start_index=idx)
    for what, idx in [("one short", x.idx[:-1]), ("two dims", x.idx[None]), ("float", x.idx.double()),
                      ("missing", None)]:
        with pytest.raises((TypeError, ValueError), match="^start_index:") as native_error:
            _native(step, x.u, x.p0, x.v0, x.a0, x.j0, idx, dt_k)
        with pytest.raises((TypeError, ValueError)) as python_error:
            step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, start_index=idx)
        assert str(native_error.value) == str(python_error.value), what
    y = Inputs(PLAIN)
    idx = torch.zeros(y.B, dtype=torch.int64)
    with pytest.raises(TypeError, match="^start_index: this kernel takes no start_index"):
        _native(plain_step, y.u, y.p0, y.v0, y.a0, y.j0, idx, dt_k)
    with pytest.raises(TypeError, match="^start_index: this kernel takes no start_index"):
        plain_step(y.u, y.p0, y.v0, y.a0, 0.1, j0=y.j0, start_index=idx)


def test_start_indices_are_converted(step):
    x = Inputs(SPEC)
    dt_k = step._dt_tensor(0.1)
    spaced = torch.zeros(2 * x.B, dtype=torch.int64)
    spaced[::2] = x.idx
    expect = reference.apply(SPEC, [0.1], x.numpy_u_bhd(), x.numpy_start())
    for what, idx in [("int32", x.idx.int()), ("strided", spaced[::2])]:
        scale_close(_native(step, x.u, x.p0, x.v0, x.a0, x.j0, idx, dt_k)[1].numpy(), expect[1], 1e-12)
        outs = step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, start_index=idx)
        scale_close(outs[1].numpy(), expect[1], 1e-12)


def test_missing_start_index_is_an_error_on_every_call(step):
    x = Inputs(SPEC)
    step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())  # caches dt 0.1
    for _ in range(2):
        with pytest.raises(TypeError, match="needs a start_index argument"):
            step(x.u, x.p0[: x.B], x.v0[: x.B], x.a0[: x.B], 0.1)


class _Marked(torch.Tensor):
    """A tensor subclass that keeps PyTorch's default torch-function handling."""


def test_parameters_take_the_native_op_and_other_tensor_subclasses_the_checked_python_path(plain_step,
                                                                                            monkeypatch):
    """u as an nn.Parameter (as an optimiser holds it; it overrides no torch function) goes to the
    native op as it is; another subclass (which could override torch functions) takes the Python
    path's checks. Both give the reference's states."""
    from tensorstep.runtime import validate

    x = Inputs(PLAIN)
    checks = []
    check_inputs = validate.check_inputs
    monkeypatch.setattr(validate, "check_inputs", lambda *a, **k: checks.append(1) or check_inputs(*a, **k))
    expect = reference.apply(PLAIN, [0.1], x.numpy_u_bhd(), x.numpy_start())
    plain_step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)  # caches dt 0.1
    for u, python in ((torch.nn.Parameter(x.u.clone()), False), (x.u.clone().as_subclass(_Marked), True)):
        checks.clear()
        P, *_ = plain_step(u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)
        assert bool(checks) == python, type(u)
        scale_close(torch.Tensor(P.detach()).numpy(), expect[0], 1e-12)


def test_dt_gradient_and_forward_mode_take_the_python_path(step):
    x = Inputs(SPEC, requires_grad=True)
    dt = dt_value(SPEC, requires_grad=True)
    P, *_ = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert node_name(P) == "StepFunctionBackward"
    with torch.autograd.forward_ad.dual_level():
        u = torch.autograd.forward_ad.make_dual(x.u.detach(), torch.ones_like(x.u))
        P, *_ = step(u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
        assert torch.autograd.forward_ad.unpack_dual(P).tangent is not None


def test_gradients_equal_dense_transpose_with_shared_start_rows(step):
    """Gradients to u and to start rows shared by several batch elements (index_add), float64."""
    x = Inputs(SPEC, batch=5, requires_grad=True)
    x.idx = torch.tensor([0, 2, 2, 6, 0])
    outs = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs]
    gs[2] = None  # an unused output
    used = [(y, g) for y, g in zip(outs, gs) if g is not None]
    grads = torch.autograd.grad([y for y, _ in used], [x.u, x.p0, x.v0, x.a0, x.j0], [g for _, g in used])

    g_np = np.stack([g.numpy() if g is not None else np.zeros(outs[0].shape) for g in gs])  # [K, B, H, D]
    expect_u, per_batch = reference.apply_adjoint(SPEC, [0.1], g_np)  # per_batch: [B, 4, D]
    expect_s = np.zeros((4, x.S, SPEC.dof))
    for b, row in enumerate(x.idx.tolist()):
        expect_s[:, row] += per_batch[b]
    scale_close(grads[0].numpy(), expect_u, 1e-12)
    for m in range(4):
        scale_close(grads[1 + m].numpy(), expect_s[m], 1e-12)


def test_only_requested_gradients_are_returned(step):
    x = Inputs(SPEC)
    x.u.requires_grad_(True)
    P, V, A, J = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    J.sum().backward()
    assert x.u.grad is not None and x.p0.grad is None and x.j0.grad is None


def test_the_node_keeps_autograds_rules(step):
    """The node is a plain autograd node, as PyTorch's own ops make (not a C++ autograd Function,
    whose bookkeeping cost about 6 us a call), and keeps the engine's rules: its inputs' edges,
    retain_graph, saved tensors freed after a backward, and dt modified in place refused."""
    x = Inputs(SPEC, requires_grad=True)
    dt = torch.tensor(0.1, dtype=torch.float64)
    P, V, A, J = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    assert node_name(P) == "NativeStepBackward" and all(y.grad_fn is P.grad_fn for y in (V, A, J))
    leaves = {id(f.variable) for f, _ in P.grad_fn.next_functions if f is not None}
    assert leaves == {id(t) for t in (x.u, x.p0, x.v0, x.a0, x.j0)}
    loss = (A * A).sum() + J.sum()
    (first,) = torch.autograd.grad(loss, x.u, retain_graph=True)
    (again,) = torch.autograd.grad(loss, x.u)
    assert torch.equal(first, again)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, x.u)
    P, *_ = step(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
    dt.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        P.sum().backward()


def test_double_backward_with_unused_outputs_is_exact(autograd_path):
    """create_graph with only one output used: the backward is itself differentiable
    (hessian-vector product of a quadratic in A), on both autograd paths."""
    step = autograd_path(ts.load(SPEC))
    x = Inputs(SPEC, batch=2, requires_grad=True)
    P, V, A, J = step(x.u, x.p0, x.v0, x.a0, 0.1, **x.kwargs())
    (g,) = torch.autograd.grad((A * A).sum(), x.u, create_graph=True)
    v = torch.randn_like(x.u)
    (hv,) = torch.autograd.grad(g, x.u, v)
    M_u, _ = reference.matrices(SPEC, [0.1])
    expected = np.einsum("hn,hm,bmd->bnd", M_u[2], M_u[2], 2 * v.numpy())
    scale_close(hv.numpy(), expected, 1e-12)


def test_native_off_by_environment_and_warm_load_without_sympy(tmp_path):
    code = textwrap.dedent(
        """
        import sys, tensorstep as ts
        s = ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64"))
        print(s.native is not None, "sympy" in sys.modules, "jinja2" in sys.modules)
        """
    )
    run = lambda **env: subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                                       capture_output=True, text=True)
    ts.load(ts.KernelSpec(horizon=7, dof=2, dtype="float64"))  # the session cache holds node and kernel
    off = run(TENSORSTEP_NATIVE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "False", "False"]
    on = run()
    assert on.returncode == 0, on.stderr
    expected_native = "True" if ts.load(SPEC).native is not None else "False"
    assert on.stdout.split() == [expected_native, "False", "False"]


# ---- first use: nothing waits for the node's build ---------------------------------------------
# Each test runs a fresh process with an empty kernel cache (the first use on a machine).

FIRST_USE = """
import sys, threading, warnings, torch, tensorstep as ts
from tensorstep.runtime import native
warnings.simplefilter("always")
spec = ts.KernelSpec(horizon=7, dof=2, dtype="float64")
gen = torch.Generator().manual_seed(0)
u = torch.randn(3, 6, 2, generator=gen, dtype=torch.float64, requires_grad=True)
start = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in range(4)]
g = [torch.randn(3, 7, 2, generator=gen, dtype=torch.float64) for _ in range(4)]

def call(step):
    outs = step(u, *start[:3], 0.1, j0=start[3])
    (gu,) = torch.autograd.grad(outs, u, g)
    return outs[0].grad_fn.name(), [y.detach() for y in outs], gu
"""


def _first_use(tmp_path, body: str, cache: str = "cache", **env) -> list[str]:
    """Run FIRST_USE + body in a fresh process with an empty kernel cache (tmp_path/cache) and no
    native node built (tmp_path/native); its stdout lines (stderr kept in tmp_path/stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CXX", "TENSORSTEP_NATIVE")}
    environ.update({"TENSORSTEP_CACHE_DIR": str(tmp_path / cache), "TENSORSTEP_NATIVE_DIR": str(tmp_path / "native"),
                    **env})
    environ = {k: v for k, v in environ.items() if v is not None}  # None: unset
    run = subprocess.run([sys.executable, "-c", FIRST_USE + textwrap.dedent(body)], env=environ,
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    (tmp_path / "stderr").write_text(run.stderr)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def _expect_reference(tmp_path, name: str) -> None:
    """The outputs and the gradient saved by the process are the reference's (float64)."""
    got = torch.load(tmp_path / name)
    u_bhd, start = got["u"].numpy(), torch.stack(got["start"], 1).numpy()
    expect = reference.apply(make_spec({}), [0.1], u_bhd, start)
    for k, y in enumerate(got["outs"]):
        scale_close(y.numpy(), expect[k], 1e-12)
    expect_u, _ = reference.apply_adjoint(make_spec({}), [0.1], torch.stack(got["g"]).numpy())
    scale_close(got["gu"].numpy(), expect_u, 1e-12)


def test_first_call_does_not_wait_for_the_node_and_later_calls_take_it(tmp_path):
    """The node's build is held on an event: load and the first forward+backward complete while it
    is held (Python path), then the same step takes the node once it is built. Both exact."""
    built = native.wait()
    if built is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    lines = _first_use(tmp_path, f"""
        import shutil
        from tensorstep.runtime.cache import BuildCache
        held, release = threading.Event(), threading.Event()

        def start_build(cxx, key, source, root):  # the build, held; then the session's node as its output
            def finish():
                held.set()
                release.wait()
                BuildCache(root).build(key, native.ARTEFACT, source, lambda src, out: shutil.copy({str(built)!r}, out))
            return finish

        native._start_build = start_build
        step = ts.load(spec)
        name, outs, gu = call(step)
        print(name, held.is_set(), native.ready())
        release.set()
        assert native.wait() is not None
        later, outs2, gu2 = call(step)
        print(later, all(torch.equal(a, b) for a, b in zip(outs + [gu], outs2 + [gu2])),
              ts.load(spec).native is not None, sep="|")
        torch.save(dict(u=u.detach(), start=start, g=g, outs=outs, gu=gu), "result.pt")
    """)
    assert lines[0].split() == ["StepFunctionBackward", "True", "False"]  # done while the build was held
    later, same, new_step_native = lines[1].split("|")
    assert "NativeStep" in later and same == "True" and new_step_native == "True"
    _expect_reference(tmp_path, "result.pt")
    building = [l for l in (tmp_path / "stderr").read_text().splitlines() if "native autograd node" in l]
    assert len(building) == 1 and building[0].startswith("tensorstep: building") and "in the background" in building[0]


def test_a_second_process_says_it_waits_for_the_first_ones_build(tmp_path):
    """While another process holds the node's build lock, a new process says that one is building
    it (not that it builds it itself), and its step runs exactly on the Python path meanwhile."""
    built = native.wait()
    if built is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    lines = _first_use(tmp_path, f"""
        import shutil, subprocess
        from tensorstep.runtime.cache import BuildCache
        key = native.build_key(native._cxx(), native.SOURCE.read_text())
        lock = BuildCache(native.node_root()).build_dir(key) / ".lock"
        lock.parent.mkdir(parents=True)
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a+'); "
                                   "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()", str(lock)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holder.stdout.readline()  # the other process holds the lock

        def start_build(cxx, key, source, root):  # waits on the lock as the real build does, then finds the node
            def finish():
                BuildCache(root).build(key, native.ARTEFACT, source, lambda src, out: shutil.copy({str(built)!r}, out))
            return finish

        native._start_build = start_build
        step = ts.load(spec)
        name, outs, gu = call(step)
        holder.stdin.close()
        holder.wait()
        print(name, native.wait() is not None)
        torch.save(dict(u=u.detach(), start=start, g=g, outs=outs, gu=gu), "result.pt")
    """)
    assert lines[0].split() == ["StepFunctionBackward", "True"]
    _expect_reference(tmp_path, "result.pt")
    building = [l for l in (tmp_path / "stderr").read_text().splitlines() if "native autograd node" in l]
    assert len(building) == 1 and building[0].startswith("tensorstep: another process is building"), building


def test_failing_build_warns_once_and_results_stay_exact(tmp_path):
    """A C++ compiler that fails (in the background build): one warning, no node, and the
    Python path's results are the reference's, before and after the build failed."""
    lines = _first_use(tmp_path, """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = ts.load(spec)
            first = call(step)
            native.wait()
            later = call(step)
            call(ts.load(spec))
        print(step.native, first[0], later[0], sum("native autograd node" in str(w.message) for w in caught))
        torch.save(dict(u=u.detach(), start=start, g=g, outs=later[1], gu=later[2]), "result.pt")
    """, CXX="/bin/false")
    assert lines[0].split() == ["None", "StepFunctionBackward", "StepFunctionBackward", "1"]
    _expect_reference(tmp_path, "result.pt")


def test_native_off_by_environment_starts_no_build(tmp_path):
    lines = _first_use(tmp_path, """
        step = ts.load(spec)
        print(step.native, call(step)[0], native.ready(), native.wait())
    """, TENSORSTEP_NATIVE="0")
    assert lines[0].split() == ["None", "StepFunctionBackward", "True", "None"]
    assert "native autograd node" not in (tmp_path / "stderr").read_text()


FAKE_CXX = """#!/bin/sh
# a stand-in compiler: logs its run, takes a moment, writes {what} as its output
echo run >> "{log}"
sleep 2
while [ "$1" != "-o" ]; do shift; done
{write} "$2"
"""


def _fake_cxx(tmp_path, node=None):
    """A compiler that writes the session's node (as built) or, without one, a file that is no library."""
    log = tmp_path / "compiler.log"
    cxx = tmp_path / "fake-c++"
    write = f"cp '{node}'" if node else "echo 'not a library' >"
    cxx.write_text(FAKE_CXX.format(log=log, what="the node" if node else "no library", write=write))
    cxx.chmod(0o755)
    return cxx, log


def test_two_processes_building_at_once_build_once(tmp_path):
    """Both start the build process; the cache's lock lets one compile, and both load its node."""
    node = native.wait()
    cxx, log = _fake_cxx(tmp_path, node)
    code = FIRST_USE + "step = ts.load(spec); native.wait(); print(call(step)[0])"
    env = {k: v for k, v in os.environ.items() if k != "TENSORSTEP_NATIVE"}
    env.update(TENSORSTEP_CACHE_DIR=str(tmp_path / "cache"), TENSORSTEP_NATIVE_DIR=str(tmp_path / "native"),
               CXX=str(cxx))
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert ("NativeStep" in out) == (node is not None), (out, err)
    assert log.read_text().split() == ["run"]


def test_a_ctrl_c_leaves_the_build_running_below_the_callers_priority(tmp_path):
    """The build, which no call waits for, is in a session of its own (a Ctrl-C, which the terminal
    or a notebook sends to the caller's process group, does not stop it: on main it did, and the
    node stayed off until a restart) and runs at a lower priority than the caller (os.nice)."""
    node = native.wait()
    if node is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    cxx, log = _fake_cxx(tmp_path, node)
    cxx.write_text(cxx.read_text().replace("echo run >>", "echo run $(nice) >>"))
    lines = _first_use(tmp_path, """
        import os, signal, time
        os.setsid()  # a process group of this process and what it starts (as a terminal's foreground job)
        interrupted = []
        signal.signal(signal.SIGINT, lambda *args: interrupted.append(1))  # this process goes on
        step = ts.load(spec)
        time.sleep(0.5)
        os.killpg(0, signal.SIGINT)  # a Ctrl-C
        native.wait()
        print(len(interrupted), call(step)[0], os.nice(0))
    """, CXX=str(cxx))
    caught, name, niceness = lines[0].split()
    assert (caught, name) == ("1", "NativeStepBackward"), lines  # main: StepFunctionBackward
    assert log.read_text().split() == ["run", str(min(19, int(niceness) + native.BUILD_NICENESS))]


def test_exit_during_the_build_leaves_it_to_finish_whole(tmp_path):
    """A process that exits while the node builds: the build process completes the cache entry
    (all of it, under its temporary names until done), and the next process loads it."""
    cxx, log = _fake_cxx(tmp_path)
    _first_use(tmp_path, "ts.load(spec)", CXX=str(cxx))
    builds = tmp_path / "native" / "builds"
    for _ in range(600):
        done = [d for d in builds.iterdir() if (d / "kernel.native.so").exists() and (d / "meta.json").exists()]
        if done:
            break
        time.sleep(0.1)
    assert done and (done[0] / "kernel.native.so").read_text() == "not a library\n"
    assert not [f.name for f in done[0].iterdir() if f.name.startswith(".kernel.")]
    _first_use(tmp_path, "ts.load(spec); native.wait()", CXX=str(cxx))
    assert log.read_text().split() == ["run"]
    assert "building" not in (tmp_path / "stderr").read_text()


# ---- where the node is kept: once per PyTorch install, not per kernel cache -------------------

def _node_files(folder) -> list:
    return sorted(folder.glob("builds/*/kernel.native.so"))


def test_a_second_cache_folder_uses_the_first_ones_node_without_a_build(tmp_path):
    """Two processes with different kernel caches (as CI's fresh TENSORSTEP_CACHE_DIR gives): the
    first builds the node into the shared folder, the second loads it from there, building nothing."""
    node = native.wait()
    if node is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    cxx, log = _fake_cxx(tmp_path, node)
    body = "step = ts.load(spec); native.wait(); print(call(step)[0])"
    first = _first_use(tmp_path, body, cache="cache-1", CXX=str(cxx))
    second = _first_use(tmp_path, body, cache="cache-2", CXX=str(cxx))
    assert "NativeStep" in first[0] and "NativeStep" in second[0]
    assert log.read_text().split() == ["run"]  # compiled once, by the first process
    assert "native autograd node" not in (tmp_path / "stderr").read_text()  # the second said nothing
    assert len(_node_files(tmp_path / "native")) == 1
    assert not _node_files(tmp_path / "cache-1") and not _node_files(tmp_path / "cache-2")


def test_by_default_the_node_is_kept_in_pytorchs_extension_folder(tmp_path):
    """Without TENSORSTEP_NATIVE_DIR, the node goes to PyTorch's folder for extension builds
    (TORCH_EXTENSIONS_DIR here), and the message says where."""
    cxx, log = _fake_cxx(tmp_path)
    _first_use(tmp_path, "ts.load(spec); native.wait()", CXX=str(cxx), TENSORSTEP_NATIVE_DIR=None,
               TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert len(_node_files(tmp_path / "ext" / "tensorstep_native")) == 1
    message = [l for l in (tmp_path / "stderr").read_text().splitlines() if "native autograd node" in l][0]
    assert "once per PyTorch install and compiler" in message and str(tmp_path / "ext") in message


def test_an_unwritable_shared_folder_keeps_the_node_in_the_kernel_cache(tmp_path):
    """Where the shared folder cannot be made, the node is built into the kernel cache (as before),
    the message says why, and the next process with that cache loads it without a build."""
    node = native.wait()
    if node is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    cxx, log = _fake_cxx(tmp_path, node)
    (tmp_path / "a-file").write_text("")
    env = dict(CXX=str(cxx), TENSORSTEP_NATIVE_DIR=str(tmp_path / "a-file" / "native"))
    _first_use(tmp_path, "ts.load(spec); native.wait()", **env)
    assert len(_node_files(tmp_path / "cache")) == 1
    message = [l for l in (tmp_path / "stderr").read_text().splitlines() if "native autograd node" in l][0]
    assert "into the kernel cache" in message and "cannot be written" in message
    _first_use(tmp_path, "ts.load(spec); native.wait()", **env)
    assert log.read_text().split() == ["run"]
    assert "native autograd node" not in (tmp_path / "stderr").read_text()
