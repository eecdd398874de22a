"""tensorstep.compat.curobo against docs/compat_curobo.md's formulas (independent NumPy loops)."""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch

from tensorstep.compat import curobo as C

from helpers import gradcheck64, scale_close


# ---- independent references (docs/compat_curobo.md, written as loops) -----------------------------------------

def ref_clique_backward(u, p, v, a, D):
    B, H, n = u.shape
    x = lambda k: u[:, k - 1] if k >= 1 else (p if k == 0 else p - (-k) * (v - 0.5 * a * D) * D)
    out = np.zeros((4, B, H, n))
    out[0, :, 0], out[1, :, 0], out[2, :, 0] = p, v, a
    for h in range(1, H):
        out[0, :, h] = x(h)
        out[1, :, h] = D * (x(h) - x(h - 1))
        out[2, :, h] = D**2 * (x(h) - 2 * x(h - 1) + x(h - 2))
        out[3, :, h] = D**3 * (x(h) - 3 * x(h - 1) + 3 * x(h - 2) - x(h - 3))
    return out


def ref_clique_central(u, p, v, a, D):
    B, A, n = u.shape
    H = A + 4
    tau = 1.0 / D
    ghosts = {-2: p - 3 * tau * v - 1.5 * tau**2 * a, -1: p - 2 * tau * v - 2 * tau**2 * a,
              0: p - tau * v - 1.5 * tau**2 * a, 1: p}
    y = lambda k: ghosts[k] if k <= 1 else u[:, min(k - 2, A - 1)]
    out = np.zeros((4, B, H, n))
    for h in range(H):
        w = [y(h - 2 + i) for i in range(5)]
        out[0, :, h] = w[2]
        out[1, :, h] = D * (w[0] / 12 - 2 * w[1] / 3 + 2 * w[3] / 3 - w[4] / 12)
        out[2, :, h] = D**2 * (-w[0] / 12 + 4 * w[1] / 3 - 5 * w[2] / 2 + 4 * w[3] / 3 - w[4] / 12)
        out[3, :, h] = D**3 * (-w[0] / 2 + w[1] - w[3] + w[4] / 2)
    return out


def ref_acceleration(u, p, v, a, tau, rk2):
    B, H, n = u.shape
    P, V, A, J = (np.zeros((B, H, n)) for _ in range(4))
    P[:, 0], V[:, 0], A[:, 0] = p, v, a
    for h in range(1, H):
        A[:, h] = u[:, h - 1]
        J[:, h] = (A[:, h] - A[:, h - 1]) / tau[h]
        if rk2:
            P[:, h] = P[:, h - 1] + tau[h] * V[:, h - 1] + 0.5 * tau[h] ** 2 * A[:, h]
            V[:, h] = V[:, h - 1] + 0.5 * tau[h] * A[:, h]
        else:
            V[:, h] = V[:, h - 1] + tau[h] * A[:, h]
            P[:, h] = P[:, h - 1] + tau[h] * V[:, h]
    return np.stack([P, V, A, J])


def ref_fd_matrix(H, order=1, shift=False, prev_state=False):
    """build_fd_matrix: F^order, F[i, i] = −1, F[i, i+1] = 1 (i < H−1), or with ``shift``
    F[i, i−1] = −1, F[i, i] = 1 (i ≥ 1); ``prev_state``: −(G^order)[:H], G the plain form of H + order."""
    size = H + order if prev_state else H
    F = np.zeros((size, size))
    for i in range(size):
        if shift and i >= 1:
            F[i, i - 1], F[i, i] = -1.0, 1.0
        elif not shift and i < size - 1:
            F[i, i], F[i, i + 1] = -1.0, 1.0
    power = np.eye(size)
    for _ in range(order):
        power = power @ F
    return -power[:H] if prev_state else power


def ref_integrate(x0, x, dt):
    """x0 + (tril(ones)·diag(dt)) @ x, as running sums: row h adds dt_i·x_i for i ≤ h; x [B, H, n]."""
    out = np.zeros_like(x)
    total = np.array(x0, dtype=np.float64)
    for h in range(x.shape[1]):
        total = total + dt[h] * x[:, h]
        out[:, h] = total
    return out


# kernel class → (reference, rows of u_act for horizon H, indexed, smallest horizon)
CLASSES = {
    "CliqueTensorStepKernel": (ref_clique_backward, lambda H: H, False, 2),
    "CliqueTensorStepIdxKernel": (ref_clique_backward, lambda H: H, True, 2),
    "CliqueTensorStepCoalesceKernel": (ref_clique_backward, lambda H: H, False, 2),
    "CliqueTensorStepCentralDifferenceKernel": (ref_clique_central, lambda H: H - 4, False, 8),
    "CliqueTensorStepIdxCentralDifferenceKernel": (ref_clique_central, lambda H: H - 4, True, 8),
    "AccelerationTensorStepKernel": (lambda *a: ref_acceleration(*a, rk2=True), lambda H: H, False, 2),
    "AccelerationTensorStepIdxKernel": (lambda *a: ref_acceleration(*a, rk2=False), lambda H: H, True, 2),
}


def call(name, H, B, dtype, seed=0, n=3, requires_grad=False):
    reference, rows, indexed, _ = CLASSES[name]
    g = torch.Generator().manual_seed(seed)
    S = B + 3 if indexed else B
    u = torch.randn(B, rows(H), n, generator=g, dtype=torch.float64)
    p, v, a = (torch.randn(S, n, generator=g, dtype=torch.float64) for _ in range(3))
    idx = torch.randint(0, S, (B,), generator=g, dtype=torch.int32)
    if name.startswith("Acceleration"):
        traj_dt = 0.02 + 0.03 * torch.rand(H, generator=g, dtype=torch.float64)
        param = traj_dt.numpy()
    else:
        traj_dt = torch.full((H,), 40.0, dtype=torch.float64)  # inverse durations
        param = 40.0
    rows_of = (lambda t: t.numpy()[idx.numpy()]) if indexed else (lambda t: t.numpy())
    expected = reference(u.numpy(), rows_of(p), rows_of(v), rows_of(a), param)
    t = [x.to(dtype).requires_grad_(requires_grad) for x in (u, p, v, a)]
    outs = [torch.empty(B, H, n, dtype=dtype) for _ in range(4)]
    cls = getattr(C, name)
    args = (t[0], t[1], t[2], t[3]) + ((idx,) if indexed else ()) + (*outs, traj_dt.to(dtype), torch.empty(B, H, n, dtype=dtype))
    return cls.apply(*args), expected, t, outs


CASES = [(name, H, B, dtype) for name in CLASSES for (H, B, dtype) in
         [(CLASSES[name][3], 1, torch.float64), (33, 1000, torch.float32), (256, 4, torch.float32), (33, 7, torch.float64)]]


@pytest.mark.parametrize("name, H, B, dtype", CASES, ids=[f"{c[0]}-H{c[1]}-B{c[2]}-{str(c[3])[6:]}" for c in CASES])
def test_kernel_class_forward_matches_compat_formulas(name, H, B, dtype):
    got, expected, _, outs = call(name, H, B, dtype)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for k, y in enumerate(got):
        assert y.shape == (B, H, 3)
        scale_close(y.double().numpy(), expected[k], rtol)
        assert torch.equal(outs[k], y)  # cuRobo's out_* buffers are filled too


@pytest.mark.parametrize("name", list(CLASSES))
def test_kernel_class_backward_is_exact(name):
    H = 9 if "Central" in name else 6
    got, _, t, _ = call(name, H, 2, torch.float64, requires_grad=True)
    # gradcheck of the whole class call (u and start tensors)
    def f(u, p, v, a):
        return call_with(name, H, u, p, v, a)
    assert gradcheck64(f, tuple(t), check_forward_ad=True)
    # adjoint dot test, including the last (held) central action and both acceleration classes
    gen = torch.Generator().manual_seed(5)  # not the global generator: the same case in any test order
    gs = [torch.randn(y.shape, generator=gen, dtype=y.dtype) for y in got]
    grads = torch.autograd.grad(got, t, gs)
    lhs = sum(float((y.detach() * g).sum()) for y, g in zip(got, gs))
    rhs = sum(float((x.detach() * g).sum()) for x, g in zip(t, grads))
    # rounding grows with the terms summed (entries scale like 1/dt³), not with their sum, which cancels
    scale = sum(float((y.detach() * g).abs().sum()) for y, g in zip(got, gs))
    assert abs(lhs - rhs) <= 1e-13 * max(1.0, scale)
    assert float(grads[0][:, -1].abs().sum()) > 0 or "Central" not in name  # last central action has a gradient


def call_with(name, H, u, p, v, a):
    _, rows, indexed, _ = CLASSES[name]
    traj_dt = (0.02 + 0.01 * torch.arange(H, dtype=torch.float64)) if name.startswith("Acceleration") \
        else torch.full((H,), 40.0, dtype=torch.float64)
    args = (u, p, v, a) + ((torch.tensor([1, 0], dtype=torch.int32),) if indexed else ())
    return getattr(C, name).apply(*args, None, None, None, None, traj_dt, None)


def test_builders_follow_compat_definitions():
    F = C.build_fd_matrix(5, order=1)
    assert torch.equal(F[:4].diagonal(), -torch.ones(4)) and torch.equal(F[:4].diagonal(1), torch.ones(4))
    assert torch.equal(F[4], torch.zeros(5))
    for order in (1, 2, 3):  # small integers: exact in float32
        assert np.array_equal(C.build_fd_matrix(5, order=order).numpy(), ref_fd_matrix(5, order))
        assert np.array_equal(C.build_fd_matrix(5, order=order, SHIFT=True).numpy(), ref_fd_matrix(5, order, shift=True))
    S = C.build_fd_matrix(4, SHIFT=True)
    assert torch.equal(S[0], torch.zeros(4)) and S[2, 1] == -1 and S[2, 2] == 1
    prev = C.build_fd_matrix(4, order=2, PREV_STATE=True)
    assert prev.shape == (4, 6) and np.array_equal(prev.numpy(), ref_fd_matrix(4, 2, prev_state=True))
    full = C.build_fd_matrix(5, FULL_RANK=True)
    assert torch.equal(full[2], torch.tensor([0.0, -1.0, 0.0, 1.0, 0.0]))
    assert torch.equal(full[0], torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0])) and torch.equal(full[4], torch.tensor([0.0, 0.0, 0.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="odd horizon"):
        C.build_fd_matrix(4, FULL_RANK=True)
    steps = np.array([0.1, 0.2, 0.3])
    once = np.array([[steps[j] if j <= i else 0.0 for j in range(3)] for i in range(3)])  # tril(ones)·diag(dt)
    got = C.build_int_matrix(3, order=2, traj_dt=torch.from_numpy(steps), dtype=torch.float64).numpy()
    np.testing.assert_allclose(got, once @ once, rtol=1e-15, atol=0)
    clique = C.build_clique_matrix(3, torch.tensor([0.1, 0.2, 0.3]))
    assert clique.shape == (9, 3) and clique[3, 0] == 0  # Vm[0, 0] = 0
    assert torch.isclose(clique[4, 1], torch.tensor(1 / 0.2)) and torch.isclose(clique[4, 0], torch.tensor(-1 / 0.2))
    assert torch.isclose(clique[7, 1], torch.tensor(1 / 0.2**2)) and torch.isclose(clique[7, 0], torch.tensor(-1 / 0.2**2))
    targs = C.TensorDeviceType(dtype=torch.float64)
    mask, n_mask = C.build_start_state_mask(4, targs)
    assert mask.shape == (4, 1) and mask[0, 0] == 1 and n_mask[1, 0] == 1 and n_mask.dtype == torch.float64
    Ssum = C.sum_matrix(3, 4, targs)
    assert Ssum.shape == (8, 3) and Ssum[:4, 0].sum() == 4 and Ssum[4:, 1].sum() == 4
    K = C.interpolate_kernel(3, 4, targs)
    assert torch.allclose(K[:4, 0], torch.tensor([1, 2 / 3, 1 / 3, 0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(K[:4, 1], torch.tensor([0, 1 / 3, 2 / 3, 1], dtype=torch.float64), rtol=0, atol=1e-15)
    Ka = C.action_interpolate_kernel(3, 6, targs, offset=2)
    assert torch.equal(Ka[:4, 0], torch.tensor([0.75, 0.5, 0.25, 0.0], dtype=torch.float64))
    assert torch.equal(Ka[:4, 1], torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64))
    assert torch.equal(Ka[-2:, 1], torch.ones(2, dtype=torch.float64))
    lin = C.tensor_linspace(torch.zeros(2), torch.ones(2) * 4, steps=4)
    assert torch.equal(lin, torch.tensor([[1.0, 2, 3, 4], [1.0, 2, 3, 4]]))


def test_clique_dense_step_and_backward():
    """The dense clique step (and its backward) against loops of docs/compat_curobo.md: position
    rows 1… the actions, velocity..jerk backward differences (first row zero), the gradient
    n_maskᵀ Σ F_kᵀ g_k with F_k and n_mask written out."""
    H, n = 6, 2
    targs = C.TensorDeviceType(dtype=torch.float64)
    mask, n_mask = C.build_start_state_mask(H, targs)
    fds = [C.build_fd_matrix(H, dtype=torch.float64, order=k, SHIFT=True) for k in (1, 2, 3)]
    u = torch.randn(3, H, n, dtype=torch.float64, requires_grad=True)
    p0 = torch.randn(3, n, dtype=torch.float64)
    state = C.JointState(position=p0)
    seq = C.tensor_step_pos_clique(state, u, C.JointState(), (mask, n_mask), fds)
    expected = [np.concatenate([p0.numpy()[:, None], u.detach().numpy()[:, :-1]], 1)]
    for _ in range(3):  # each row minus the one before, the first row zero
        lower, y = expected[-1], np.zeros_like(expected[-1])
        for h in range(1, H):
            y[:, h] = lower[:, h] - lower[:, h - 1]
        expected.append(y)
    got = [seq.position, seq.velocity, seq.acceleration, seq.jerk]
    plain = C.jit_tensor_step_pos_clique(u.detach(), p0, mask, n_mask, *fds)
    for y, yp, e in zip(got, plain, expected):
        scale_close(y.detach().numpy(), e, 1e-15)
        scale_close(yp.numpy(), e, 1e-15)
    gs = [torch.randn(3, H, n, dtype=torch.float64) for _ in range(4)]
    (g_custom,) = torch.autograd.grad(got, u, gs)
    sub = np.eye(H, k=-1)  # n_mask: row h picks action h − 1
    pulled = gs[0].numpy() + sum(np.einsum("ih,bid->bhd", ref_fd_matrix(H, k, shift=True), gs[k].numpy())
                                 for k in (1, 2, 3))
    expect_u = np.einsum("ih,bid->bhd", sub, pulled)
    scale_close(g_custom.numpy(), expect_u, 1e-14)
    scale_close(C.jit_backward_pos_clique_contiguous(*gs, n_mask, *fds).numpy(), expect_u, 1e-14)


def test_dense_integration_steps():
    """The dense integration steps against running sums (docs/compat_curobo.md: qd' = qd + M·act,
    q' = q + M·qd', M = tril(ones)·diag(dt)), dt per step."""
    B, H, n = 2, 5, 3
    act = torch.randn(B, H, n, dtype=torch.float64)
    dt = 0.05 + 0.1 * torch.rand(H, dtype=torch.float64)
    M = C.build_int_matrix(H, dtype=torch.float64, traj_dt=dt)
    state = torch.randn(B, 1, 3 * n, dtype=torch.float64)
    seq = C.tensor_step_acc(state, act, torch.zeros(B, H, 3 * n, dtype=torch.float64), dt, n, M)
    s, d = state.numpy()[:, 0], dt.numpy()
    qd = ref_integrate(s[:, n:2 * n], act.numpy(), d)
    q = ref_integrate(s[:, :n], qd, d)
    scale_close(seq[..., n:2 * n].numpy(), qd, 1e-14)
    scale_close(seq[..., :n].numpy(), q, 1e-14)
    assert torch.equal(seq[..., 2 * n:], act)
    cat = C.step_acc_semi_euler(state, act, dt, n, M)
    assert torch.equal(cat, seq)
    js = C.JointState(position=torch.randn(B, n, dtype=torch.float64), velocity=torch.randn(B, n, dtype=torch.float64))
    out = C.tensor_step_acc_semi_euler(js, act, C.JointState(), dt, M, M)
    velocity = ref_integrate(js.velocity.numpy(), act.numpy(), d)
    scale_close(out.velocity.numpy(), velocity, 1e-14)
    scale_close(out.position.numpy(), ref_integrate(js.position.numpy(), velocity, d), 1e-14)
    assert js[torch.tensor([1])].position.shape == (1, n) and js.unsqueeze(1).velocity.shape == (B, 1, n)


def test_signatures_match_curobo_argument_order():
    expected = {
        "build_fd_matrix": ["horizon", "device", "dtype", "order", "PREV_STATE", "FULL_RANK", "SHIFT"],
        "build_int_matrix": ["horizon", "diagonal", "device", "dtype", "order", "traj_dt"],
        "build_clique_matrix": ["horizon", "dt", "device", "dtype"],
        "tensor_step_acc": ["state", "act", "state_seq", "dt_h", "n_dofs", "integrate_matrix", "fd_matrix"],
        "tensor_step_vel": ["state", "act", "state_seq", "dt_h", "n_dofs", "integrate_matrix", "fd_matrix"],
        "tensor_step_pos": ["state", "act", "state_seq", "fd_matrix"],
        "jit_tensor_step_pos_clique": ["pos_act", "start_position", "mask", "n_mask", "fd_1", "fd_2", "fd_3"],
        "jit_backward_pos_clique": ["grad_p", "grad_v", "grad_a", "grad_j", "n_mask", "fd_1", "fd_2", "fd_3"],
        "action_interpolate_kernel": ["h", "int_steps", "tensor_args", "offset"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(C, name)).parameters) == params, name
    plain = list(inspect.signature(C.CliqueTensorStepKernel.apply).parameters)
    assert plain == ["u_act", "start_position", "start_velocity", "start_acceleration", "out_position",
                     "out_velocity", "out_acceleration", "out_jerk", "traj_dt", "out_grad_position"]
    indexed = list(inspect.signature(C.AccelerationTensorStepIdxKernel.apply).parameters)
    assert indexed[4] == "start_idx" and len(indexed) == 11


def test_action_interpolate_kernel_offset_equal_to_int_steps_and_zero():
    """cuRobo's definition at the edges: no ramp rows (offset = int_steps); M[-0:] is every row."""
    targs = C.TensorDeviceType(dtype=torch.float64)
    M = C.action_interpolate_kernel(3, 4, targs, offset=4)
    expected = np.zeros((8, 3))
    expected[-4:, 1] = 1.0
    assert np.array_equal(M.numpy(), expected)
    M0 = C.action_interpolate_kernel(2, 2, targs, offset=0)
    assert np.array_equal(M0.numpy(), np.array([[0.5, 1.0], [0.0, 1.0]]))


def test_tensor_linspace_keeps_curobos_shape_for_a_last_dimension_of_one():
    g = torch.Generator().manual_seed(3)
    start, end = torch.randn(2, 3, 1, generator=g, dtype=torch.float64), torch.randn(2, 3, 1, generator=g, dtype=torch.float64)
    got = C.tensor_linspace(start, end, steps=5)
    c = np.arange(1, 6) / 5
    assert got.shape == (2, 3, 5)
    assert np.allclose(got.numpy(), start.numpy() + c * (end.numpy() - start.numpy()), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name, bad, message", [
    ("CliqueTensorStepKernel", "p", "start_position"),
    ("AccelerationTensorStepKernel", "dt", "traj_dt"),
    ("AccelerationTensorStepIdxKernel", "idx", "start_idx"),
])
def test_compat_errors_use_curobo_names(name, bad, message):
    _, rows, indexed, _ = CLASSES[name]
    H, n = 6, 2
    u = torch.randn(2, rows(H), n, dtype=torch.float64)
    p, v, a = (torch.randn(2, n, dtype=torch.float64) for _ in range(3))
    traj_dt = torch.full((H,), 0.02, dtype=torch.float64)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    if bad == "p":
        p = torch.randn(2, n + 1, dtype=torch.float64)
    elif bad == "dt":
        traj_dt = traj_dt[:3]
    else:
        idx = torch.tensor([0, 5], dtype=torch.int32)
    args = (u, p, v, a) + ((idx,) if indexed else ()) + (None, None, None, None, traj_dt, None)
    with pytest.raises((ValueError, TypeError, IndexError)) as info:
        getattr(C, name).apply(*args)
    text = str(info.value)
    assert message in text and not re.search(r"\b(p0|dt|start_index)\b", text), text


@pytest.mark.parametrize("name", list(CLASSES))
def test_kernel_classes_are_autograd_functions_with_exact_gradients(name):
    """issubclass(Cls, torch.autograd.Function) as in cuRobo; gradcheck also through traj_dt."""
    cls = getattr(C, name)
    assert issubclass(cls, torch.autograd.Function)
    _, rows, indexed, _ = CLASSES[name]
    H, n = (9 if "Central" in name else 6), 2
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, rows(H), n, generator=g, dtype=torch.float64, requires_grad=True)
    p, v, a = (torch.randn(2, n, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    base = 0.02 + 0.01 * torch.arange(H, dtype=torch.float64) if name.startswith("Acceleration") \
        else 40.0 + torch.arange(H, dtype=torch.float64)
    traj_dt = base.requires_grad_(True)
    idx = (torch.tensor([1, 0], dtype=torch.int32),) if indexed else ()

    def f(u, p, v, a, traj_dt):
        return cls.apply(u, p, v, a, *idx, None, None, None, None, traj_dt, None)

    assert type(f(u, p, v, a, traj_dt)[0].grad_fn).__name__ == f"{name}Backward"
    assert gradcheck64(f, (u, p, v, a, traj_dt), check_forward_ad=True)
