"""PyTorch conventions: module conversions (to, double, float, cuda) and what load accepts."""
from __future__ import annotations

import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch

import reference
import tensorstep as ts
from helpers import scale_close

SPEC32 = ts.KernelSpec(horizon=6, dof=2, control="acceleration", integrator="exact")


def _check_against_reference(step: ts.Step, dtype: torch.dtype, rtol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(3, step.spec.n_actions, step.spec.dof, generator=gen, dtype=torch.float64)
    starts = [torch.randn(3, step.spec.dof, generator=gen, dtype=torch.float64) for _ in range(4)]
    outs = step(u.to(dtype), *(s.to(dtype) for s in starts[:3]), 0.1, j0=starts[3].to(dtype))
    expected = reference.apply(step.spec, 0.1, u.numpy(), torch.stack(starts, 1).numpy())
    for k, y in enumerate(outs):
        assert y.dtype == dtype
        scale_close(y.double().numpy(), expected[k], rtol)


def test_double_and_to_float64_load_the_float64_kernel_in_place():
    step = ts.load(SPEC32)
    assert step.double() is step
    assert step.spec == SPEC32.replace(dtype="float64") and step.dtype == torch.float64
    _check_against_reference(step, torch.float64, 1e-12)
    assert step.to(torch.float32) is step and step.spec == SPEC32
    _check_against_reference(step, torch.float32, 1e-5)
    assert step.to(dtype=torch.float64).spec.dtype == "float64"
    assert step.float().spec.dtype == "float32"
    assert pickle.loads(pickle.dumps(step.double())).spec.dtype == "float64"


def test_same_dtype_and_device_keep_the_kernel():
    step = ts.load(SPEC32)
    launcher = step.launcher
    assert step.to("cpu", torch.float32) is step and step.cpu() is step and step.float() is step
    assert step.launcher is launcher


@pytest.mark.parametrize("convert", [lambda s: s.half(), lambda s: s.to(torch.bfloat16),
                                     lambda s: s.to(torch.float16)])
def test_other_dtypes_raise_and_leave_the_step_as_it_was(convert):
    step = ts.load(SPEC32)
    with pytest.raises(TypeError, match="tensorstep kernels are float32 or float64"):
        convert(step)
    assert step.spec == SPEC32 and step.dtype == torch.float32


@pytest.mark.parametrize("device, error", [("tpu", ValueError), ("cuda:x", ValueError), ("mps", ValueError),
                                           (3, TypeError), (None, TypeError)])
def test_load_names_the_allowed_devices(device, error):
    with pytest.raises(error, match=r"device=.* is invalid: allowed 'cpu', 'cuda', 'cuda:N' or a torch.device"):
        ts.load(SPEC32, device)


def test_unsupported_devices_raise():
    step = ts.load(SPEC32)
    with pytest.raises(ValueError, match="device=.*meta.* is invalid"):
        step.to("meta")
    assert step.device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a PyTorch that sees no CUDA device")
@pytest.mark.parametrize("convert", [lambda s: s.to("cuda"), lambda s: s.cuda(), lambda s: s.to("cuda:0"),
                                     lambda s: s.to(torch.device("cuda"), torch.float64),
                                     lambda s: torch.nn.Sequential(s).to("cuda")])
def test_cuda_without_a_gpu_says_what_load_says(convert):
    """Not PyTorch's bare 'Torch not compiled with CUDA enabled': the message ts.load gives, which
    says what to install; the step stays as it was."""
    step = ts.load(SPEC32)
    with pytest.raises(RuntimeError) as load_error:
        ts.load(SPEC32, "cuda")
    with pytest.raises(RuntimeError) as to_error:
        convert(step)
    assert type(to_error.value) is type(load_error.value) and str(to_error.value) == str(load_error.value)
    assert "sees no CUDA device" in str(to_error.value) and "install" in str(to_error.value)
    assert step.device == torch.device("cpu") and step.spec == SPEC32


def test_load_takes_a_dict_of_spec_fields():
    step = ts.load({"horizon": 6, "dof": 2, "control": "acceleration", "integrator": "exact"})
    assert step.spec == SPEC32
    assert ts.load(SPEC32.to_dict()).spec == SPEC32


@pytest.mark.parametrize("call", [ts.load, ts.source, lambda s: ts.operator_matrices(s, 0.1)])
@pytest.mark.parametrize("bad", [None, 32, "franka_panda"])
def test_load_source_and_matrices_say_what_to_pass(call, bad):
    with pytest.raises(TypeError, match=r"expected a KernelSpec, e\.g\. ts\.\w+\(ts\.KernelSpec\(horizon=32, dof=7\)\), "
                                        r"or a dict of its fields, got " + type(bad).__name__):
        call(bad)


def test_unknown_dict_fields_name_them():
    with pytest.raises(ValueError, match="unknown KernelSpec field"):
        ts.load({"horizon": 6, "dof": 2, "stpes": 4})


def test_numpy_and_torch_spellings_load_the_same_kernel():
    spec = ts.KernelSpec(horizon=np.int64(6), dof=np.int64(2), control="acceleration", integrator="exact",
                         dtype=torch.float32)
    assert ts.load(spec).spec.name == SPEC32.name


@pytest.mark.parametrize("dt", [np.float32(0.125), np.float64(0.125), Fraction(1, 8)],
                         ids=["numpy.float32", "numpy.float64", "Fraction"])
def test_a_scalar_dt_may_be_any_real_number(dt):
    """As PyTorch's ops take NumPy scalars: a dt read from a NumPy config (numpy.float32 is no
    float subclass) gives the reference's outputs for that dt (0.125 is exact in binary)."""
    step = ts.load(SPEC32.replace(dtype="float64"))
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64)
    starts = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    expected = reference.apply(step.spec, 0.125, u.numpy(), np.concatenate(
        [torch.stack(starts, 1).numpy(), np.zeros((3, 1, 2))], 1))
    for k, y in enumerate(step(u, *starts, dt)):
        scale_close(y.numpy(), expected[k], 1e-12)
    assert step.prepare(dt=dt) is step and 0.125 in step._dt_cache  # later calls reuse its tensor


@pytest.mark.parametrize("dt", [True, np.bool_(True), "0.1", None], ids=["bool", "numpy.bool_", "str", "None"])
def test_a_dt_that_is_no_real_number_is_refused(dt):
    step = ts.load(SPEC32)
    with pytest.raises(TypeError, match=r"^dt: expected a positive float or a tensor, got "):
        step(torch.zeros(3, 5, 2), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2), dt)


def test_module_hooks_run_as_on_any_module():
    """A step's call skips nn.Module's hook machinery only while no hook is set: forward pre-hooks
    (which may replace the arguments, keywords included), forward hooks (which may replace the
    result) and global hooks run as on any module, and the step's result is the one they see."""
    step = ts.load(SPEC32)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(2, SPEC32.n_actions, SPEC32.dof, generator=gen)
    starts = [torch.randn(2, SPEC32.dof, generator=gen) for _ in range(4)]
    plain = step(u, *starts[:3], 0.1, j0=starts[3])
    seen = []

    def pre(module, args, kwargs):
        seen.append(("pre", module is step, sorted(kwargs)))
        return (2 * args[0], *args[1:]), {**kwargs, "j0": torch.zeros_like(starts[3])}

    def post(module, args, kwargs, result):
        seen.append(("post", module is step, len(result)))
        return tuple(-y for y in result)

    handles = [step.register_forward_pre_hook(pre, with_kwargs=True),
               step.register_forward_hook(post, with_kwargs=True)]
    hooked = step(u, *starts[:3], 0.1, j0=starts[3])
    expected = step.forward(2 * u, *starts[:3], 0.1, j0=torch.zeros_like(starts[3]))
    assert seen == [("pre", True, ["j0"]), ("post", True, 4)]
    for y, e in zip(hooked, expected):
        torch.testing.assert_close(y, -e, rtol=0, atol=0)
    for h in handles:
        h.remove()
    hook = lambda module, args, result: seen.append(("global", module is step))
    global_hook = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        again = step(u, *starts[:3], 0.1, j0=starts[3])
    finally:
        global_hook.remove()
    assert seen[-1] == ("global", True)
    for y, e in zip(again, plain):
        torch.testing.assert_close(y, e, rtol=0, atol=0)


def test_a_patched_module_call_sees_the_step(monkeypatch):
    """A tool that patches nn.Module.__call__ (FX's tracer does) still sees a step's calls."""
    step = ts.load(SPEC32)
    seen = []
    call = torch.nn.Module.__call__

    def patched(module, *args, **kwargs):
        seen.append(module)
        return call(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", patched)
    u = torch.zeros(2, SPEC32.n_actions, SPEC32.dof)
    P = step(u, *(torch.zeros(2, SPEC32.dof) for _ in range(3)), 0.1)[0]
    assert seen == [step] and P.shape == (2, SPEC32.horizon, SPEC32.dof)



def test_a_call_with_keywords_runs_an_overridden_forward_and_binds_as_forward_does():
    """A call of (u, p0, v0, a0, dt) and keyword rows (a fused step's cost parameters) goes to
    forward's body without binding forward's signature: it gives what forward gives; a forward
    overridden by a subclass or on the instance is what runs; a name given twice or unknown raises
    forward's TypeError."""
    spec = ts.KernelSpec(horizon=7, dof=2, dtype="float64", control="acceleration", costs=(("squared", "jerk"),),
                         outputs=())
    step = ts.load(spec)
    gen = torch.Generator().manual_seed(2)
    u = torch.randn(3, spec.n_actions, spec.dof, generator=gen, dtype=torch.float64)
    starts = [torch.randn(3, spec.dof, generator=gen, dtype=torch.float64) for _ in range(3)]
    weight = torch.rand(spec.dof, generator=gen, dtype=torch.float64)
    (cost,) = step(u, *starts, 0.1, squared_jerk_weight=weight)
    assert torch.equal(cost, step.forward(u, *starts, 0.1, squared_jerk_weight=weight)[0])
    assert cost.shape == (3, 1) and bool((cost > 0).all())

    class Mine(ts.Step):
        def forward(self, *args, **kwargs):
            return ("subclass", len(args), sorted(kwargs))

    mine = Mine(step.spec, step.device, step.launcher)
    assert mine(u, *starts, 0.1, squared_jerk_weight=weight) == ("subclass", 5, ["squared_jerk_weight"])
    step.forward = lambda *args, **kwargs: ("instance", len(args), sorted(kwargs))
    assert step(u, *starts, 0.1, squared_jerk_weight=weight) == ("instance", 5, ["squared_jerk_weight"])
    del step.forward
    assert torch.equal(step(u, *starts, 0.1, squared_jerk_weight=weight)[0], cost)
    with pytest.raises(TypeError, match="multiple values for argument 'u'"):
        step(u, *starts, 0.1, squared_jerk_weight=weight, u=u)
    with pytest.raises(TypeError, match="nonsense: this kernel takes no argument of that name"):
        step(u, *starts, 0.1, squared_jerk_weight=weight, nonsense=u)


NEGATED = ts.KernelSpec(horizon=6, dof=2, dt="per_step", start_index=True, dtype="float64")


def _negated_view(t: torch.Tensor, how: str) -> torch.Tensor:
    """t's values as a view whose memory holds them negated (the negative bit set): torch._neg_view,
    or the imaginary part of a conjugated complex tensor (strided, but contiguous for one element)."""
    if how == "neg_view":
        return torch._neg_view(-t)
    return torch.complex(torch.zeros_like(t), -t).conj().imag


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("name, how", [("u", "neg_view"), ("u", "conj_imag"), ("p0", "conj_imag"),
                                       ("dt", "neg_view"), ("dt", "conj_imag"), ("start_index", "neg_view")])
def test_a_negated_view_is_read_as_its_values(path, name, how):
    """A plain step's argument given as a negated view (the actions, a start state, per-step dt, an
    index) is read as its values, as PyTorch's ops read it: states the reference's (of the values),
    and u's gradient the reference adjoint's, reaching the view's base. (One dt for every step for
    the conjugate's imaginary part: one element, the view is contiguous.)"""
    spec, B, S = NEGATED.replace(dt="uniform") if (name, how) == ("dt", "conj_imag") else NEGATED, 3, 5
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    values = dict(u=r(B, spec.n_actions, spec.dof), p0=r(S, spec.dof), dt=0.05 + 0.05 * r(spec.n_dt).abs(),
                  start_index=torch.tensor([3, 0, 4]))
    v0, a0, j0 = r(S, spec.dof), r(S, spec.dof), r(S, spec.dof)
    given = dict(values, u=values["u"].clone().requires_grad_())
    u_grad = lambda: given["u"].grad
    if name == "u" and how == "neg_view":
        leaf = (-values["u"]).requires_grad_()
        given["u"], u_grad = torch._neg_view(leaf), lambda: -leaf.grad
    elif name == "u":  # the imaginary part of a complex leaf's conjugate: -Im(leaf) = u
        leaf = torch.complex(torch.zeros_like(values["u"]), -values["u"]).requires_grad_()
        given["u"], u_grad = leaf.conj().imag, lambda: -leaf.grad.imag
    else:
        given[name] = _negated_view(values[name], how)
    assert given[name].is_neg() and torch.equal(given[name], values[name])
    step = ts.load(spec)
    if path == "python":
        step.native = None
    elif step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    ys = step(given["u"], given["p0"], v0, a0, given["dt"], j0=j0, start_index=given["start_index"])
    assert ("NativeStep" in ys[0].grad_fn.name()) == (path == "native")
    rows = values["start_index"].numpy()
    start = np.stack([t.numpy()[rows] for t in (values["p0"], v0, a0, j0)], axis=1)
    expected = reference.apply(spec, values["dt"].numpy(), values["u"].numpy(), start)
    for k, y in enumerate(ys):
        np.testing.assert_allclose(y.detach().numpy(), expected[k], rtol=1e-12, atol=1e-12)
    grads = [r(*y.shape) for y in ys]
    torch.autograd.backward(ys, grads)
    expected_u = reference.apply_adjoint(spec, values["dt"].numpy(), np.stack([g.numpy() for g in grads]))[0]
    np.testing.assert_allclose(u_grad().numpy(), expected_u, rtol=1e-12, atol=1e-12)
