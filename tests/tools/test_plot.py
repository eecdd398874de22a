"""Pictures (`tensorstep plot`, `bench --plot`) and the torch.compile baseline of `bench`."""
from __future__ import annotations

import struct
from pathlib import Path
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import reference
import reference_bspline
import tensorstep as ts
from helpers import scale_close
from tensorstep import plot as pictures
from tensorstep.bench import harness
from tensorstep.cli import main


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as where it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.mark.parametrize("args", [("plot", "ur5e"), ("bench", "--batch", "1", "--no-codegen", "--plot")])
def test_without_matplotlib_one_line_says_what_to_install(no_matplotlib, tmp_path, args):
    result = invoke(*args, str(tmp_path / "x.png")) if args[0] == "bench" else invoke(*args, "-o", str(tmp_path / "x.png"))
    assert result.exit_code != 0 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert errors == ["error: drawing needs matplotlib, which is not installed: pip install 'tensorstep[plot]'"]
    assert "machine:" not in result.output  # refused before any timing
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("fields", [
    dict(control="position", difference="backward", end="one_sided"),
    dict(control="jerk", integrator="exact", dt="per_step", order=4, layout="bdh", start_index=True),
    dict(control="position", end="goal", dt="per_trajectory", goal_index=True),
])
def test_the_sample_drawn_is_the_kernel_on_the_sample(fields):
    spec = ts.KernelSpec(horizon=9, dof=3, dtype="float64", **fields)
    outs = pictures.run_sample(spec, 0.05)
    u = np.array([pictures.sample_actions(spec)])
    assert u.shape == (1, spec.n_actions, spec.dof)
    dt = [0.05] * spec.horizon if spec.dt == "per_step" else 0.05
    expected = reference.apply(spec, dt, u, np.zeros((1, 4, spec.dof)))  # from rest; the goal is rest too
    assert len(outs) == spec.order + 1
    for k, y in enumerate(outs):
        assert y.shape == (spec.horizon, spec.dof)
        scale_close(y, expected[k][0], 1e-12)


@pytest.mark.parametrize("end", ["hold", "goal"])
def test_the_sample_of_a_bspline_is_the_spline_of_its_knots(end):
    spec = ts.KernelSpec(control="bspline", degree=4, knots=6, steps=3, end=end, dof=2, dtype="float64",
                         dt="per_trajectory")
    outs = pictures.run_sample(spec, 0.05)
    knots = np.array(pictures.sample_actions(spec))
    rest = [np.zeros(2)] * 4
    expected = reference_bspline.trajectory(knots, rest, rest if end == "goal" else None, 4, 3, 0.05).Y
    for k in range(4):
        scale_close(outs[k], expected[k], 1e-12)


def test_plot_draws_every_kernel_of_a_config(tmp_path):
    """matplotlib is in the test extra: drawn headless (Agg, a file backend, whatever MPLBACKEND says)."""
    import matplotlib

    out = tmp_path / "ur5e.png"
    result = invoke("plot", "ur5e", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert matplotlib.get_backend().lower() == "agg"
    assert "2 kernel(s), dt=0.025 s" in result.output
    width, height = png_size(out)
    assert width > 1000 and height > 500  # four panels across, two kernels down


def test_plot_from_spec_options_and_refusals(tmp_path):
    out = tmp_path / "jerk.png"
    assert invoke("plot", "--horizon", "8", "--dof", "2", "--control", "jerk", "--order", "4",
                  "--step-dt", "0.1", "-o", str(out)).exit_code == 0
    assert png_size(out)[0] > png_size(out)[1] * 3  # one kernel, five panels
    bad = invoke("plot", "--control", "position", "--integrator", "exact", "-o", str(tmp_path / "x.png"))
    assert "error: KernelSpec.integrator='exact' means nothing for control='position'" in bad.output
    assert "--horizon cannot be combined with CONFIG" in invoke("plot", "ur5e", "--horizon", "8", "-o",
                                                                 str(tmp_path / "x.png")).output


def test_bench_times_the_compiled_slicing_baseline_in_the_same_run(monkeypatch, tmp_path):
    """The column and ratio are there (the eager backend stands in for Inductor: this checks the
    plumbing, not Inductor's speed)."""
    monkeypatch.setattr(harness, "COMPILE_BACKEND", "eager")
    args = ["bench", "--scheme", "central", "--scheme", "accel", "--batch", "1", "--batch", "4", "--no-codegen",
            "--budget", "0.01"]
    out = tmp_path / "bench.png"
    result = invoke(*args, "--plot", str(out))
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("| scheme |"))
    assert "slicing, torch.compile" in header and "compiled slicing / tensorstep" in header
    for scheme in ("central", "accel"):
        row = next(line for line in result.output.splitlines() if line.startswith(f"| {scheme} | 32 | 4 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 14 and cells[9].endswith("s") and cells[12].endswith("×")
    assert png_size(out)[0] > 800


def test_compiled_slicing_is_compiled_before_timing(monkeypatch):
    """torch.compile is called while the case is prepared (its first calls compile), not in timing."""
    calls = []
    real = torch.compile

    def spy(fn, **kw):
        calls.append(kw)
        return real(fn, **kw)

    monkeypatch.setattr(harness, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(torch, "compile", spy)
    case = harness.Case("central", 8, 3, "float64")
    assert "compiled" in harness.case_callables(case) and calls == [dict(backend="eager", dynamic=False)]
    assert "compiled" not in harness.case_callables(case, inductor=False) and len(calls) == 1


@pytest.mark.parametrize("scheme", ["central", "backward", "accel"])
def test_the_slicing_baseline_computes_what_the_kernel_does(scheme):
    """A ratio against a baseline means something only if it computes the same outputs: the
    slicing step (the function bench compiles) against the float64 reference, from rest in jerk."""
    spec = harness.Case(scheme, 12, 3, "float64").spec
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(3, spec.n_actions, spec.dof, generator=gen, dtype=torch.float64)
    starts = [torch.randn(3, spec.dof, generator=gen, dtype=torch.float64) for _ in range(3)]
    outs = torch.compile(harness.slicing_step(spec, harness.DT), backend="eager")(u, *starts)
    s = np.concatenate([torch.stack(starts, 1).numpy(), np.zeros((3, 1, spec.dof))], 1)
    expected = reference.apply(spec, harness.DT, u.numpy(), s)
    for k, y in enumerate(outs):
        scale_close(y.numpy(), expected[k], 1e-10)


def test_plot_refuses_curobo_kernels_in_one_line(tmp_path):
    """cuRobo's kernels (compat) take cuRobo's arguments, so there is no sample to draw."""
    data = Path(__file__).parents[1] / "data"
    result = invoke("plot", str(data / "curobo_franka.yml"), "--task", str(data / "curobo_v2_task_bspline.yml"),
                    "-o", str(tmp_path / "x.png"))
    assert result.exit_code != 0
    assert result.output.startswith("error: plot draws tensorstep's own kernels") and "compat" in result.output
    assert not (tmp_path / "x.png").exists()


def test_draw_state_draws_the_limits_of_each_dof():
    """The dashed lines sit at the given limits, one pair per dof, in the dof's colour."""
    plt = pictures.pyplot()
    fig, ax = plt.subplots()
    y = np.zeros((2, 5, 3))  # a batch of 2 trajectories, 5 rows, 3 dof
    limits = {"velocity": ((-1.0, -2.0, -3.0), (1.5, 2.5, 3.5))}
    pictures.draw_state(ax, y, 0.1, 1, limits)
    dashed = [(line.get_color(), line.get_ydata()[0]) for line in ax.lines if line.get_linestyle() == "--"]
    assert sorted(dashed) == sorted([("C0", -1.0), ("C0", 1.5), ("C1", -2.0), ("C1", 2.5), ("C2", -3.0), ("C2", 3.5)])
    assert len(ax.lines) == 6 + 6 and ax.get_title() == "velocity (limits dashed)"
    plt.close(fig)


def test_plot_draws_a_configs_limits_and_names_its_cost_terms(tmp_path):
    out = tmp_path / "costs.png"
    result = invoke("plot", "franka_panda_costs", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "2 kernel(s), dt=0.02 s; limits drawn on position, velocity, acceleration, jerk" in result.output
    assert result.output.count("cost terms bound_position, bound_velocity, bound_acceleration, bound_jerk, "
                               "squared_acceleration, squared_jerk") == 2
    assert png_size(out)[0] > 1000


def test_run_sample_cost_matches_the_definitions_on_its_states():
    """The cost plot puts in a fused kernel's title: the terms' definitions on the sample's states."""
    import reference_costs

    spec = ts.KernelSpec(horizon=9, dof=2, dtype="float64", outputs=("P",),
                         costs=(("bound", "velocity"), ("squared", "jerk")))
    keywords = {"bound_velocity_weight": [1.0, 2.0], "bound_velocity_limit": [[-0.1, -0.2], [0.1, 0.2]],
                "bound_velocity_margin": [0.01, 0.0], "squared_jerk_weight": [1e-3, 1e-3]}
    *states, cost = pictures.run_sample(spec, 0.1, keywords)
    ys = {name: y[None] for name, y in zip(("position", "velocity", "acceleration", "jerk"), states)}
    expected = reference_costs.costs(spec.costs, ys, {k: np.array(v) for k, v in keywords.items()})[0]
    np.testing.assert_allclose(cost, expected, rtol=1e-12)
    assert len(states) == 4 and expected[0] > 0  # every state drawn, the velocity bound active


def test_plot_says_which_limits_it_cannot_draw(tmp_path):
    """A config's snap limits with no kernel of order 4: no snap panel, so the line says they are not
    drawn and why (it named snap among the limits drawn)."""
    config = tmp_path / "arm.yml"
    config.write_text("robot: arm\njoints: [a, b]\ndefaults: {horizon: 8}\nkernels: [{control: position}]\n"
                      "limits: {velocity: [2, 3], snap: 4}\n")
    result = invoke("plot", str(config), "-o", str(tmp_path / "x.png"))
    assert result.exit_code == 0, result.output
    assert "; limits drawn on velocity; snap limits not drawn (no kernel has order=4)\n" in result.output
