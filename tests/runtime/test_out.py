"""out=: the forward written into caller-owned outputs (rollouts), on the native and Python paths."""
from __future__ import annotations

import pytest
import torch

import tensorstep as ts

import reference
from helpers import Inputs, make_spec, scale_close

PLAIN = make_spec(dict(difference="central"))
SPECS = [PLAIN, make_spec(dict(control="acceleration", integrator="exact", start_index=True)),
         make_spec(dict(difference="backward"), dtype="float32")]


@pytest.fixture(params=["native", "python"])
def path(request):
    return request.param


def load(spec, path):
    step = ts.load(spec)
    if path == "python":
        step.native = None
    elif step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    return step


def outputs(spec, B):
    dtype = torch.float32 if spec.dtype == "float32" else torch.float64
    return torch.full((spec.order + 1, B, spec.horizon, spec.dof), float("nan"), dtype=dtype).unbind(0)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_out_holds_the_reference_outputs(spec, path):
    """Views of one buffer as outputs; twice, as the first call fills the dt cache."""
    step = load(spec, path)
    x = Inputs(spec)
    out = outputs(spec, x.B)
    expect = reference.apply(spec, [0.1], x.numpy_u_bhd(), x.numpy_start())
    rtol = 1e-12 if spec.dtype == "float64" else 1e-5
    for call in range(2):
        version = out[0]._version
        result = step(x.u, x.p0, x.v0, x.a0, 0.1, out=out, **x.kwargs())
        assert all(r is o for r, o in zip(result, out)) and len(result) == len(out)
        assert out[0]._version > version  # written in place: autograd sees the change
        for k, y in enumerate(out):
            scale_close(y.double().numpy(), expect[k], rtol)
        for y in out:
            y.fill_(float("nan"))
    if path == "native":  # plain and indexed calls alike are the native op's to check
        assert step._native_step_out(step.native, [x.u, x.p0, x.v0, x.a0, x.j0, x.idx, step._dt_tensor(0.1)], out)
        scale_close(out[1].double().numpy(), expect[1], rtol)


def test_out_overwrite_of_a_saved_tensor_is_detected(path):
    step = load(PLAIN, path)
    x = Inputs(PLAIN)
    out = outputs(PLAIN, x.B)
    step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)  # caches dt 0.1: the out= call below takes the native op
    w = torch.ones_like(out[0], requires_grad=True)
    loss = (w * out[0]).sum()  # saves out[0] for w's gradient
    step(x.u, x.p0, x.v0, x.a0, 0.1, out=out, j0=x.j0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _bad_out_calls(x, spec):
    """Fresh NaN outputs, and (error pattern, out, u) for calls the checks must refuse."""
    good = outputs(spec, x.B)
    flat = torch.zeros(2 * x.B * spec.horizon * spec.dof + 64, dtype=torch.float64)
    u_in_flat = flat[: x.u.numel()].view(x.u.shape).copy_(x.u)
    n = good[0].numel()
    overlapping_u = flat[16 : 16 + n].view(good[0].shape)
    return good, [
        ("out: expected a tuple of 4 tensors", good[:3], x.u),
        ("out: expected a tuple of 4 tensors", torch.stack(good), x.u),
        (r"out\[3\]: expected a torch.Tensor", [*good[:3], "P"], x.u),
        (r"out\[2\]: expected shape", (*good[:2], good[2][:, :-1], good[3]), x.u),
        (r"out\[1\]: expected dtype", (good[0], good[1].float(), *good[2:]), x.u),
        (r"out\[3\]: expected a contiguous tensor", (*good[:3], good[3].transpose(1, 2).contiguous().transpose(1, 2)), x.u),
        (r"out\[2\]: expected a tensor whose memory holds its values .* got a negated view",
         (*good[:2], torch._neg_view(good[2]), good[3]), x.u),
        (r"out\[1\]: overlaps out\[0\]", (good[0], good[0], *good[2:]), x.u),
        (r"out\[0\]: overlaps u", (overlapping_u, *good[1:]), u_in_flat),
    ]


def test_bad_out_is_refused_with_a_message_and_nothing_written(path):
    step = load(PLAIN, path)
    x = Inputs(PLAIN)
    step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0)  # caches dt 0.1: later calls take the native op first
    good, calls = _bad_out_calls(x, PLAIN)
    for pattern, out, u in calls:
        if step.native is not None and isinstance(out, tuple) and all(type(t) is torch.Tensor for t in out):
            dt_k = step._dt_tensor(0.1)
            assert step._native_step_out(step.native, [u, x.p0, x.v0, x.a0, x.j0, None, dt_k], out) is False, pattern
        with pytest.raises((TypeError, ValueError), match=pattern):
            step(u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, out=out)
    assert all(bool(torch.isnan(y).all()) for y in good)  # no kernel ran


def test_out_is_not_differentiable(path):
    step = load(PLAIN, path)
    x = Inputs(PLAIN, requires_grad=True)
    out = outputs(PLAIN, x.B)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="out: outputs written into out= are not differentiable, and u requires"):
            step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, out=out)
    with torch.no_grad():  # rollouts: fine, and nothing is recorded
        P, *_ = step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, out=out)
        P, *_ = step(x.u, x.p0, x.v0, x.a0, 0.1, j0=x.j0, out=out)
    assert P.grad_fn is None and not P.requires_grad
    w = torch.zeros_like(out[0], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out\[0\]: requires grad"):
        step(x.u.detach(), x.p0.detach(), x.v0.detach(), x.a0.detach(), 0.1, out=(w, *out[1:]))


def test_out_inside_torch_compile_fullgraph():
    step = ts.load(PLAIN)
    x = Inputs(PLAIN)
    out = outputs(PLAIN, x.B)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def rollout(u, p0, v0, a0, j0, out):
        step(u, p0, v0, a0, 0.1, j0=j0, out=out)
        return out[1].square().sum()

    with torch.no_grad():
        cost = rollout(x.u, x.p0, x.v0, x.a0, x.j0, out)
    expect = reference.apply(PLAIN, [0.1], x.numpy_u_bhd(), x.numpy_start())
    for k, y in enumerate(out):
        scale_close(y.numpy(), expect[k], 1e-12)
    assert abs(float(cost) - float((expect[1] ** 2).sum())) <= 1e-9 * float((expect[1] ** 2).sum())
