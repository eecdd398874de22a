"""Cost parameters held by a fused step (``Step.set_costs``): checked as a call checks them before
anything is held, held as the module's buffers, used by calls that leave their keywords out, and on
the native node passed by the step's slot instead of by the call.

Each call with held parameters is compared with the same call passing them as keywords (itself
checked against the definitions in tests/kernels/test_costs.py), bit for bit, and once against the
definitions in NumPy (tests/reference_costs.py).
"""
from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch

import reference
import reference_costs
import tensorstep as ts
from tensorstep.runtime import costs, native

TERMS = (("bound", "position"), ("bound", "velocity"), ("squared", "position"), ("squared", "jerk"))
STATES = ("position", "velocity", "acceleration", "jerk")
PATHS = pytest.mark.parametrize("path", ["native", "python"])
DTYPES = pytest.mark.parametrize("dtype", ["float32", "float64"])


def _spec(dtype: str = "float64") -> ts.KernelSpec:
    return ts.KernelSpec(horizon=9, dof=3, dtype=dtype, costs=TERMS, outputs=("P",))


def _data(spec, B: int = 3, seed: int = 0):
    """Forward's tensors and every cost keyword ([D] and [B, D] weights, row weights, limits,
    margins, the target), random, with limits that some rows cross."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if spec.dtype == "float64" else torch.float32
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
    D = spec.dof
    x = dict(u=r(B, spec.n_actions, D), p0=r(B, D), v0=r(B, D), a0=r(B, D))
    params = {}
    for kind, state in spec.costs:
        params[f"{kind}_{state}_weight"] = r(D).abs() + 0.1 if kind == "bound" else r(B, D).abs() + 0.1
        params[f"{kind}_{state}_row_weight"] = r(spec.horizon).abs()
        if kind == "bound":
            lo = -0.3 - r(D).abs()
            params[f"bound_{state}_limit"] = torch.stack([lo, lo + 0.5 + r(D).abs()])
            params[f"bound_{state}_margin"] = 0.05 * r(D).abs()
    params["squared_position_target"] = r(B, D)
    return x, params


def _loaded(spec, path: str):
    native.wait()  # no build under way that would give the step its node later
    step = ts.load(spec)
    if path == "python":
        step.native = None  # every call the Python path, as on CUDA
    return step


def _run(step, x, params, W=None):
    """Forward and backward of sum(P · W) + sum(cost): P, the cost, u's gradient."""
    u = x["u"].clone().requires_grad_()
    P, cost = step(u, x["p0"], x["v0"], x["a0"], 0.1, **params)
    W = torch.ones_like(P) if W is None else W
    torch.autograd.backward((P, cost), (W, torch.ones_like(cost)))
    return P.detach(), cost.detach(), u.grad


def _same(got, expected):
    for y, e in zip(got, expected):
        assert torch.equal(y, e)


@PATHS
@DTYPES
def test_a_call_with_held_parameters_gives_the_keyword_calls_bits(path, dtype, monkeypatch):
    """Held parameters give P, the cost and u's gradient bit for bit as the same tensors passed as
    keywords, call after call; on the native node, after the first call (checked in Python), each
    call passes forward's tensors only (no cost parameter crosses) and checks nothing in Python. The
    cost is the definitions' (NumPy)."""
    spec = _spec(dtype)
    x, params = _data(spec)
    gen = torch.Generator().manual_seed(1)
    W = torch.randn(3, spec.horizon, spec.dof, generator=gen, dtype=torch.float64).to(x["u"].dtype)
    expected = _run(_loaded(spec, path), x, params, W)
    step = _loaded(spec, path).set_costs(**params)
    lengths, checked = [], []
    if path == "native":
        op = step._native_step
        monkeypatch.setattr(step, "_native_step", lambda h, given, *a: lengths.append(len(given)) or op(h, given, *a))
    check = costs.check_parameter
    monkeypatch.setattr(costs, "check_parameter", lambda arg, t: checked.append(arg.name) or check(arg, t))
    for call in range(3):
        checked.clear()
        _same(_run(step, x, {}, W), expected)
        if call and path == "native":  # u, p0, v0, a0, j0, start_index, the target, dt
            assert lengths[-1] == 8 and checked == []
    B = x["u"].shape[0]
    start = np.stack([x[n].double().numpy() for n in ("p0", "v0", "a0")] + [np.zeros((B, spec.dof))], axis=1)
    Y = np.stack([np.stack([reference.column(spec.replace(costs=(), outputs=None), x["u"].double().numpy()[b, :, d],
                                             start[b, :, d], 0.1, None) for d in range(spec.dof)], -1)
                  for b in range(B)], 1)
    named = {k: (v.expand(B, -1) if v.dim() == 1 and k.endswith("_weight") and "row" not in k else v).double().numpy()
             for k, v in params.items()}
    cost = reference_costs.costs(spec.costs, {STATES[k]: Y[k] for k in range(4)}, named)
    tol = 1e-12 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(expected[1].double().numpy(), cost, rtol=tol, atol=tol * np.abs(cost).max())


@PATHS
def test_a_keyword_wins_over_the_held_tensor_for_that_call(path):
    """A keyword given in a call is used for that call (a cost parameter or the target); the next
    call without it uses the held tensor again."""
    spec = _spec()
    x, params = _data(spec)
    step = _loaded(spec, path).set_costs(**params)
    keyword = _loaded(spec, "python")
    other = {"squared_jerk_weight": 2.5 * params["squared_jerk_weight"],
             "bound_velocity_limit": 0.5 * params["bound_velocity_limit"],
             "squared_position_target": params["squared_position_target"] + 1.0}
    held = _run(step, x, {})
    for name, value in other.items():
        got = _run(step, x, {name: value})
        _same(got, _run(keyword, x, {**params, name: value}))
        assert not torch.equal(got[1], held[1])
        _same(_run(step, x, {}), held)


def _changes(spec):
    """Ways a held tensor changes after it was held, each with the keywords a call would pass
    for the same values (None: the next call raises, naming the parameter)."""
    name = "bound_velocity_limit"

    def in_place(step, p):
        getattr(step, name).mul_(2.0)
        return {name: 2.0 * p[name]}

    def data(step, p):
        getattr(step, name).data = 0.5 * p[name]
        return {name: 0.5 * p[name]}

    def assigned(step, p):  # the buffer replaced by attribute assignment, as on any module
        setattr(step, name, 0.25 * p[name])
        return {name: 0.25 * p[name]}

    def held_again(step, p):
        step.set_costs(squared_jerk_weight=3.0 * p["squared_jerk_weight"])
        return {"squared_jerk_weight": 3.0 * p["squared_jerk_weight"]}

    def negative(step, p):
        getattr(step, "bound_position_margin").sub_(10.0)

    def requires_grad(step, p):
        getattr(step, "bound_position_weight").requires_grad_()

    return {"in place": in_place, ".data": data, "assigned": assigned, "set_costs again": held_again,
            "negative margin in place": negative, "requires_grad": requires_grad}


@PATHS
@pytest.mark.parametrize("change", list(_changes(None)))
def test_a_held_tensor_changed_is_seen_by_the_next_call(path, change):
    """A held tensor written in place, given new data (``.data =``), replaced, or held anew: the next
    call reads the new values (those of a call passing them as keywords) or refuses them with the
    keyword's error, on the native node as on the Python path, as for keyword tensors."""
    spec = _spec()
    x, params = _data(spec)
    step = _loaded(spec, path).set_costs(**{k: v.clone() for k, v in params.items()})
    _same(_run(step, x, {}), _run(step, x, {}))  # checked, then kept
    now = _changes(spec)[change](step, params)
    if now is None:
        name = "bound_position_margin" if "margin" in change else "bound_position_weight"
        with pytest.raises(ValueError, match=name):
            _run(step, x, {})
        return
    expected = _run(_loaded(spec, "python"), x, {**params, **now})
    for _ in range(2):
        _same(_run(step, x, {}), expected)


def test_calls_alternating_held_parameters_and_keywords_keep_both(monkeypatch):
    """A step that holds its cost parameters, called alternately with them held and with a cost
    keyword of the call's own, keeps both on the native node (a slot each): after the first call of
    each, no value is checked in Python again, and each call gives the bits of the Python path."""
    spec = _spec()
    x, params = _data(spec)
    step = _loaded(spec, "native").set_costs(**params)
    if step.native is None:
        pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
    reference = _loaded(spec, "python")
    other = {"squared_jerk_weight": 2.5 * params["squared_jerk_weight"]}
    expected = _run(reference, x, params), _run(reference, x, {**params, **other})
    checked = []
    check = costs.check_parameter
    monkeypatch.setattr(costs, "check_parameter", lambda arg, t: checked.append(arg.name) or check(arg, t))
    for call in range(3):
        checked.clear()
        _same(_run(step, x, {}), expected[0])
        _same(_run(step, x, other), expected[1])
        if call:
            assert checked == [], call


def test_set_costs_checks_every_tensor_before_holding_any():
    """set_costs checks names (the closest one named), shapes, dtypes and values as a call does,
    and holds nothing when one fails; None stops holding one; a step without costs holds none."""
    spec = _spec()
    x, params = _data(spec)
    step = _loaded(spec, "native")
    bad = [
        ({"bound_velocity_limt": params["bound_velocity_limit"]}, TypeError,
         "bound_velocity_limt: no cost parameter of that name; did you mean 'bound_velocity_limit'"),
        ({"u": x["u"]}, TypeError, "u: a step holds its cost parameters only"),
        ({"bound_velocity_limit": params["bound_velocity_limit"][:, :2]}, ValueError,
         r"bound_velocity_limit: expected shape \(2, 3\)"),
        ({"bound_velocity_limit": params["bound_velocity_limit"].float()}, TypeError,
         "bound_velocity_limit: expected dtype torch.float64"),
        ({"squared_jerk_weight": -params["squared_jerk_weight"]}, ValueError, "squared_jerk_weight: expected values >= 0"),
        ({"bound_position_limit": params["bound_position_limit"].flip(0)}, ValueError, "bound_position_limit: lower > upper"),
        ({"bound_position_margin": params["bound_position_margin"].clone().requires_grad_()}, ValueError,
         "bound_position_margin: cost parameters take no gradient"),
        ({"squared_jerk_weight": params["squared_jerk_weight"],  # [3, D] after [2, D] (table order): one B
          "squared_position_weight": params["squared_position_weight"][:2]}, ValueError,
         r"squared_jerk_weight: expected shape \(2, 3\), got shape \(3, 3\)"),
    ]
    for given, error, match in bad:
        with pytest.raises(error, match=match):
            step.set_costs(squared_position_row_weight=None, **{"bound_position_weight": params["bound_position_weight"], **given})
        assert dict(step.named_buffers()) == {}
    step.set_costs(**params)
    assert set(dict(step.named_buffers())) == set(params)
    step.set_costs(squared_position_target=None)
    assert "squared_position_target" not in dict(step.named_buffers())
    P, cost = step(x["u"], x["p0"], x["v0"], x["a0"], 0.1)  # no target: the squared position term of P itself
    expected = _loaded(spec, "python")(x["u"], x["p0"], x["v0"], x["a0"], 0.1,
                                       **{k: v for k, v in params.items() if k != "squared_position_target"})
    _same((P, cost), expected)
    with pytest.raises(TypeError, match="set_costs: this step has no cost terms"):
        ts.load(spec.replace(costs=(), outputs=None)).set_costs(**params)
    missing = _loaded(spec, "native").set_costs(bound_position_limit=params["bound_position_limit"])
    with pytest.raises(TypeError, match="bound_position_weight"):
        missing(x["u"], x["p0"], x["v0"], x["a0"], 0.1)


def test_held_parameters_are_the_modules_buffers():
    """Held tensors are buffers: in state_dict, loaded by load_state_dict into a step that holds none
    (then held as copies), converted by .double() with the step's kernels, kept by deepcopy and pickle,
    swapped for one call by torch.func.functional_call; out= (rollouts) reads them too."""
    spec32 = _spec("float32")
    x, params = _data(spec32)
    step = _loaded(spec32, "native").set_costs(**params)
    expected = _run(step, x, {})
    state = step.state_dict()
    assert set(state) == set(params) and all(state[k] is params[k] or torch.equal(state[k], params[k]) for k in params)
    fresh = _loaded(spec32, "native")
    assert not fresh.load_state_dict(state).unexpected_keys
    assert all(getattr(fresh, k) is not params[k] for k in params)
    _same(_run(fresh, x, {}), expected)
    for twin in (copy.deepcopy(step), pickle.loads(pickle.dumps(step))):
        _same(_run(twin, x, {}), expected)
    buffer = io.BytesIO()
    torch.save(step.state_dict(), buffer)
    buffer.seek(0)
    assert set(torch.load(buffer)) == set(params)

    wide = copy.deepcopy(step).double()
    assert {t.dtype for t in wide.buffers()} == {torch.float64} and wide.dtype == torch.float64
    x64 = {k: v.double() for k, v in x.items()}
    _same(_run(wide, x64, {}), _run(_loaded(_spec("float64"), "python"), x64, {k: v.double() for k, v in params.items()}))

    # functional_call swaps a buffer for one call; the next call reads the held one again
    args = (x["u"], x["p0"], x["v0"], x["a0"], 0.1)
    half = {"bound_velocity_limit": 0.5 * params["bound_velocity_limit"]}
    with torch.no_grad():
        _same(torch.func.functional_call(step, half, args), _loaded(spec32, "python")(*args, **{**params, **half}))
        _same(step(*args), expected[:2])

    P, cost = torch.empty_like(expected[0]), torch.empty_like(expected[1])
    with torch.no_grad():
        for _ in range(2):
            step(x["u"], x["p0"], x["v0"], x["a0"], 0.1, out=(P, cost))
            _same((P, cost), expected[:2])


def test_held_parameters_under_compile_vmap_and_export():
    """torch.compile(fullgraph=True), vmap and torch.export of a step that holds its cost parameters
    give the values and gradients of the same calls passing them as keywords."""
    spec = _spec()
    x, params = _data(spec)
    step = _loaded(spec, "native").set_costs(**params)
    keyword = _loaded(spec, "native")

    def loss(s, kw, u):
        P, cost = s(u, x["p0"], x["v0"], x["a0"], 0.1, **kw)
        return P.square().sum() + cost.sum()

    u = x["u"].clone().requires_grad_()
    expected = loss(keyword, params, u)
    (g_expected,) = torch.autograd.grad(expected, u)
    compiled = torch.compile(lambda uu: loss(step, {}, uu), fullgraph=True)(u)
    (g_compiled,) = torch.autograd.grad(compiled, u)
    torch.testing.assert_close(compiled, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_compiled, g_expected, rtol=1e-12, atol=1e-12 * float(g_expected.abs().max()))

    stacked = torch.stack([x["u"], 2 * x["u"]])
    cost_of = lambda s, kw: (lambda uu: s(uu, x["p0"], x["v0"], x["a0"], 0.1, **kw)[1])
    torch.testing.assert_close(torch.func.vmap(cost_of(step, {}))(stacked), torch.func.vmap(cost_of(keyword, params))(stacked),
                               rtol=1e-12, atol=0)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.step = step

        def forward(self, uu):
            return loss(self.step, {}, uu)

    exported = torch.export.export(Loss(), (x["u"],))
    torch.testing.assert_close(exported.module()(x["u"]), loss(keyword, params, x["u"]), rtol=1e-12, atol=0)


def test_every_way_of_changing_the_held_dict_is_counted():
    """HeldParameters counts each change to which tensors are held, by every mutating dict method
    (nn.Module uses some; anything else that holds the dict may use the others): a call after any
    of them must take the Python checks again."""
    from tensorstep.runtime.costs import HeldParameters

    a, b = torch.zeros(1), torch.ones(1)
    changes = {
        "__setitem__": lambda d: d.__setitem__("x", b),
        "__delitem__": lambda d: d.__delitem__("w"),
        "pop": lambda d: d.pop("w"),
        "popitem": lambda d: d.popitem(),
        "setdefault": lambda d: d.setdefault("x", b),
        "update": lambda d: d.update(x=b),
        "clear": lambda d: d.clear(),
        "__ior__": lambda d: d.__ior__({"x": b}),
    }
    mutators = {"__setitem__", "__delitem__", "pop", "popitem", "setdefault", "update", "clear", "__ior__"}
    assert set(changes) == mutators
    for name, change in changes.items():
        held = HeldParameters()
        dict.__setitem__(held, "w", a)
        before = held.changes
        change(held)
        assert held.changes > before, name
