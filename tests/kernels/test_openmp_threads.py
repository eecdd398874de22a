"""dt gradients of batches large enough for the C kernels to split them over OpenMP threads
(64 batch elements and more): exact against the independent reference, and the same bits for
any number of threads. The accumulator of the coefficient gradients was once shared by the
threads, which lost updates (errors of tens of percent on a 2-core machine)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorstep as ts

import reference
from helpers import Inputs, dt_gradient, dt_value, grid_id

BATCH = 300  # several chunks of the C kernel's partial sums, split over threads

CASES = [
    dict(difference="central", dt="uniform"),
    dict(difference="central", dt="per_step"),
    dict(control="acceleration", integrator="exact", dt="uniform"),
    dict(control="jerk", integrator="semi_implicit_euler", dt="per_step"),
]


def _spec(overrides: dict) -> ts.KernelSpec:
    return ts.KernelSpec(horizon=10, dof=3, dtype="float64", **overrides)


def _reference_loss(spec, dt: np.ndarray, x: Inputs, g: np.ndarray) -> float:
    return float((g * np.asarray(reference.apply(spec, dt.tolist(), x.numpy_u_bhd(), x.numpy_start()))).sum())


@pytest.mark.parametrize("overrides", CASES, ids=grid_id)
def test_dt_gradient_of_a_large_batch_matches_the_reference(overrides):
    spec = _spec(overrides)
    x = Inputs(spec, batch=BATCH)
    dt = dt_value(spec, requires_grad=True)
    got, g = dt_gradient(spec, x, dt)
    d0, eps = dt.detach().numpy().astype(np.float64), 1e-4
    rng = np.random.default_rng(7)
    for direction in rng.normal(size=(2, *d0.shape)):  # projections on random directions
        f = lambda e: _reference_loss(spec, d0 + e * direction, x, g)
        expected = (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)
        actual = float((got * direction).sum())
        assert abs(actual - expected) <= 1e-7 * max(1.0, abs(expected)), (actual, expected)


_SCRIPT = """
import sys, torch, tensorstep as ts
sys.path.insert(0, {tests!r})
from helpers import Inputs, dt_value
spec = ts.KernelSpec(horizon=10, dof=3, dtype="float64", difference="central", dt="per_step")
x = Inputs(spec, batch={batch})
dt = dt_value(spec, requires_grad=True)
outs = ts.load(spec, "cpu")(x.u, x.p0, x.v0, x.a0, dt, **x.kwargs())
gen = torch.Generator().manual_seed(5)
(g,) = torch.autograd.grad(outs, [dt], [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in outs])
print(g.numpy().tobytes().hex())
"""


def test_dt_gradient_has_the_same_bits_for_any_number_of_threads():
    script = _SCRIPT.format(tests=str(Path(__file__).parents[1]), batch=BATCH)
    bits = set()
    for threads in ("1", "2", "3"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        bits.add(run.stdout.strip())
    assert len(bits) == 1


_FORK_SCRIPT = """
import multiprocessing, torch, tensorstep as ts
step = ts.load(ts.KernelSpec(horizon=10, dof=3, dtype="float64"), "cpu")
u, s = torch.randn(300, 9, 3, dtype=torch.float64), torch.randn(300, 3, dtype=torch.float64)
expected = step(u, s, s, s, 0.1)  # B=300: the parent's OpenMP threads run the batch
def child(queue):
    torch.set_num_threads(1)  # as README says (and DataLoader's workers do)
    queue.put(all(torch.equal(y, e) for y, e in zip(step(u, s, s, s, 0.1), expected)))
queue = multiprocessing.get_context("fork").SimpleQueue()
worker = multiprocessing.get_context("fork").Process(target=child, args=(queue,))
worker.start()
worker.join(60)
print("hung" if worker.is_alive() else queue.get())
worker.kill()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork as multiprocessing's default start method")
def test_a_forked_process_that_sets_one_thread_runs_the_step():
    """GNU OpenMP's threads do not survive a fork: like PyTorch's own CPU ops, the kernels in a
    process forked after they ran in parallel need torch.set_num_threads(1) (the kernels follow
    torch's setting: one OpenMP runtime serves both), and then give the parent's bits."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    run = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
