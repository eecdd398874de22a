"""Seeded random variants against the independent references: the fields that apply to a
control drawn together, at horizons, dof and batches beyond the hand-picked grids (rows wider
than one vector, batches past OpenMP's threshold and past a 64-trajectory chunk of the dt
gradient). On every kernel path (C through the native node and through the Python Functions,
the CUDA source run on the host): the forward and the dot test, and dt's gradient and tangent.
Through the default path: torch.compile of the whole graph, torch.func.jvp and vmap.

Each test id names its draw (``steps-7``, ``bspline-3``), so a failure reruns with ``-k``.
``TENSORSTEP_RANDOM_SPECS=N`` draws N variants of each family instead of the few CI runs, for
a longer search.
"""
from __future__ import annotations

import copy
import os
import random

import pytest
import torch

import tensorstep as ts
from helpers import ReferenceCase, as_bhd, check_dt_derivatives, kernel_paths, scale_close

DRAWS = int(os.environ.get("TENSORSTEP_RANDOM_SPECS", "6"))
BATCHES = (1, 2, 3, 17, 65, 70)  # 65 and 70: two OpenMP threads, and a uniform dt's gradient in two chunks


def _accuracy(rng: random.Random, difference: str, order: int):
    pick = lambda: rng.choice((1, 2, 3, 4, 5, 6) if difference == "backward" else (2, 4, 6, 8))
    kind = rng.random()
    if kind < 0.3:
        return None
    if kind < 0.6:
        return pick()
    return tuple(pick() for _ in range(rng.choice((3, order))))


def draw_steps(rng: random.Random) -> dict:
    """KernelSpec fields of a position- or integration-control variant (float64)."""
    control = rng.choice(("position", "position", "position", "velocity", "acceleration", "jerk"))
    fields = dict(control=control, horizon=rng.randint(2, 40), dof=rng.randint(1, 9), dtype="float64",
                  dt=rng.choice(("uniform", "per_step", "per_trajectory")), start_index=rng.random() < 0.3,
                  layout=rng.choice(("bhd", "bdh")), order=rng.choice((3, 4)))
    if control == "position":
        fields["difference"] = rng.choice(("backward", "central"))
        fields["accuracy"] = _accuracy(rng, fields["difference"], fields["order"])
        fields["end"] = rng.choice(("hold", "one_sided", "goal"))
        if fields["end"] == "goal":
            fields["goal_index"] = rng.random() < 0.4
            fields["horizon"] = max(fields["horizon"], 3)  # start, an action, the goal
    else:
        fields["integrator"] = rng.choice(("semi_implicit_euler", "exact"))
    return fields


def draw_bspline(rng: random.Random) -> dict:
    """KernelSpec fields of a B-spline variant (float64). Up to 7 knots (with up to 9 rows a span,
    horizons to 145): more knots lengthen the kernels' sources, which a dt per trajectory makes
    slow to build at degree 7 (the CUDA source's host build at 14 knots took three times that at 6)."""
    fields = dict(control="bspline", degree=rng.randint(3, 7), knots=rng.randint(1, 7), steps=rng.randint(1, 9),
                  end=rng.choice(("hold", "goal")), dt=rng.choice(("uniform", "per_trajectory")),
                  start_index=rng.random() < 0.3, layout=rng.choice(("bhd", "bdh")), dof=rng.randint(1, 9),
                  dtype="float64")
    if fields["end"] == "goal":
        fields["goal_index"] = rng.random() < 0.4
    return fields


FAMILIES = {"steps": draw_steps, "bspline": draw_bspline}
DRAWN = [f"{family}-{seed}" for family in FAMILIES for seed in range(DRAWS)]


def drawn(draw: str) -> tuple[ts.KernelSpec, int, int]:
    """The spec, batch size and input seed of a draw (every draw is a valid spec)."""
    rng = random.Random(draw)
    spec = ts.KernelSpec(**FAMILIES[draw.split("-")[0]](rng))
    return spec, rng.choice(BATCHES), rng.randrange(1 << 30)


@pytest.mark.parametrize("draw", DRAWN)
def test_drawn_variant_matches_reference_on_every_path(draw):
    spec, batch, seed = drawn(draw)
    case = ReferenceCase(spec, B=batch, seed=seed)
    case.check_kernels(case.expected())


@pytest.mark.parametrize("draw", DRAWN)
def test_drawn_variant_dt_gradient_and_tangent_match_reference(draw):
    """dt's gradient and tangent on every path against differences of the reference in dt
    (helpers.check_dt_derivatives)."""
    spec, batch, seed = drawn(draw)
    if spec.dt == "per_trajectory":
        batch = min(batch, 3)  # the reference solves every trajectory's stencils anew
    check_dt_derivatives(ReferenceCase(spec, B=batch, seed=seed), kernel_paths(spec))


@pytest.mark.parametrize("draw", DRAWN)
def test_drawn_variant_compiles_to_one_graph(draw):
    """torch.compile(fullgraph=True) of a loss over every output gives eager's value and gradients
    (every input, dt included): the custom ops' schemas hold for every argument combination."""
    spec, batch, seed = drawn(draw)
    ReferenceCase(spec, B=min(batch, 3), seed=seed).check_compile()


@pytest.mark.parametrize("draw", DRAWN)
def test_drawn_variant_forward_mode_and_vmap_match_reference(draw):
    """torch.func.jvp in u and the start and goal states (for a fixed dt the step is linear in
    them, so the outputs' tangent is the reference of the tangents), and vmap over a leading
    axis of u (each slice the reference of its u)."""
    spec, batch, seed = drawn(draw)
    case = ReferenceCase(spec, B=min(batch, 3), seed=seed)
    step = ts.load(spec)
    states, K = case.tensors()[:-1], len(case.expected())
    outputs = lambda *states_: case.call(step, *states_, case.dt)[:K]

    tangent = ReferenceCase(spec, B=case.B, seed=seed + 1)
    tangent.dt, tangent.idx, tangent.gidx = case.dt, case.idx, case.gidx  # the same indices and dt
    _, tangents = torch.func.jvp(outputs, tuple(states), tuple(tangent.tensors()[:-1]))
    for y, e in zip(tangents, tangent.expected()):
        scale_close(as_bhd(y, spec), e, 1e-12)

    other = copy.copy(case)
    other.u = ReferenceCase(spec, B=case.B, seed=seed + 2).u
    ys = torch.func.vmap(lambda u: torch.stack(outputs(u, *states[1:])))(torch.stack([case.u, other.u]))
    for slice_, each in zip(ys, (case, other)):
        for y, e in zip(slice_, each.expected()):
            scale_close(as_bhd(y, spec), e, 1e-12)
