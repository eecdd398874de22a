"""A dropped step is freed: the runtime's registries (kernel keys, the native node's handles, the ops'
kernels, a fused step's plain twin) hold steps and launchers weakly, so a program that loads many
specs and drops them gets the memory back; a graph that outlives its step still runs (its kernels
are found again by key), and its gradients equal those of a step that was kept."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import tensorstep as ts
from tensorstep.runtime import native, ops, registry

TERMS = (("bound", "position"), ("squared", "acceleration"))


def _spec(horizon: int, fused: bool) -> ts.KernelSpec:
    # horizons no other test loads: nothing else in this process holds these steps
    return ts.KernelSpec(horizon=horizon, dof=2, dtype="float64", **(dict(costs=TERMS, outputs=("P",)) if fused else {}))


def _parameters() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"bound_position_weight": 0.5 + r(2), "squared_acceleration_weight": r(2),
            "bound_position_limit": torch.stack([-0.2 - r(2), 0.2 + r(2)]), "bound_position_margin": 0.05 * r(2)}


def _inputs(step: ts.Step, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = (0.3 * torch.randn(*step.action_shape(3), generator=g, dtype=torch.float64)).cumsum(1).requires_grad_()
    return u, torch.zeros(3, 2, dtype=torch.float64)


def _loss(step: ts.Step, u: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    outs = step(u, z, z, z, 0.1, **(_parameters() if step.table.fused else {}))
    return sum(y.square().sum() for y in outs)


@pytest.mark.parametrize("path", ["native", "python"])
def test_dropped_steps_are_freed_with_their_launchers_and_twins(path):
    refs = []
    for horizon in (23, 29):
        for fused in (False, True):
            step = ts.load(_spec(horizon, fused))
            if path == "python":
                step.native = None
            elif step.native is None:
                pytest.skip("the native autograd node is unavailable here (no C++ compiler?)")
            u, z = _inputs(step)
            _loss(step, u, z).backward()
            if fused:  # its dt gradient runs the plain twin (the composite form)
                dt = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
                sum(y.sum() for y in step(u, z, z, z, dt, **_parameters())).backward()
                refs.append(weakref.ref(step.plain))
                refs.append(weakref.ref(step.plain.launcher))
            ops._kernel(step.op_key)  # the ops' view of the key, as a compiled graph's first call takes it
            refs += [weakref.ref(step), weakref.ref(step.launcher)]
            del step, u, z
            dt = None
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, alive


def _derivatives(held: list[ts.Step], drop: bool) -> tuple[np.ndarray, ...]:
    """The gradient of ``_loss`` (backward), and again with a Hessian-vector product through it (double
    backward) of the step ``held`` (a list of one, which this takes it from: its only reference is then
    this frame's, whereas an argument may stay referenced by the caller's frame for the call, as CPython
    does where a call is not inlined, e.g. once Dynamo has set its frame hook), the step freed before
    either where ``drop``."""
    step = held.pop()
    u, z = _inputs(step, seed=1)
    v = torch.randn(u.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    once, twice = _loss(step, u, z), _loss(step, u, z)
    if drop:
        freed = weakref.ref(step)
        del step
        gc.collect()
        assert freed() is None
    (first,) = torch.autograd.grad(once, u)
    (grad,) = torch.autograd.grad(twice, u, create_graph=True)
    (hvp,) = torch.autograd.grad((grad * v).sum(), u)
    return first.numpy(), grad.detach().numpy(), hvp.numpy()


def test_a_graph_that_outlives_its_step_runs_its_kernels_found_again(autograd_path):
    # a backward, and a double backward (the native node's create_graph path, which finds the
    # launcher by its handle), after the step itself was freed
    for fused in (False, True):
        spec = _spec(31 + fused, fused)
        expected = _derivatives([autograd_path(ts.load(spec))], drop=False)  # (that step freed on return)
        steps = [autograd_path(ts.load(spec))]
        key, on_node = steps[0].op_key, steps[0].native is not None
        got = _derivatives(steps, drop=True)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
        if on_node:  # its create_graph backward found the launcher again by key (a Python graph holds it)
            assert key in registry._LOADED


def test_a_launcher_found_by_key_after_its_step_was_freed_is_kept_for_the_key():
    # a key whose step is gone (a compiled graph, a saved program) loads its launcher again, once
    spec = _spec(37, False)
    key = ts.load(spec).op_key
    gc.collect()
    first = registry.launcher(key)
    assert registry.launcher(key) is first
    assert first.spec == spec
    if native._PATH is not None:
        _, handle, _ = ops._kernel(key)
        assert handle is not None and native.launcher(handle) is first


def test_the_twin_of_a_spec_is_shared_while_a_fused_step_holds_it():
    spec = _spec(41, True)
    a, b = ts.load(spec), ts.load(spec)
    assert a._twin is b._twin
    twin = weakref.ref(a._twin)
    del a, b
    gc.collect()
    assert twin() is None
    assert ts.load(spec)._twin is not None
