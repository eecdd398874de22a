"""The command line: generate (deterministic, careful), show, list, check, stencil, errors."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tensorstep as ts
from tensorstep.cli import main

ROOT = Path(ts.__file__).resolve().parent
EXAMPLES = ["franka_panda", "ur5e", "mobile_manipulator"]
DATA = Path(__file__).parents[1] / "data"


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("robot", EXAMPLES)
def test_generated_folder_is_up_to_date(robot, tmp_path):
    """generated/ must be exactly what `tensorstep generate` writes today (byte for byte)."""
    result = run("generate", str(ROOT / "examples" / f"{robot}.yml"), "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    checked_in = ROOT / "generated" / robot
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in checked_in.iterdir())
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (checked_in / name).read_bytes(), (
            f"generated/{robot}/{name} is stale: run `tensorstep generate examples/{robot}.yml -o generated/{robot}`"
        )


def test_generate_is_deterministic_and_manifest_describes_files(tmp_path):
    cfg = str(ROOT / "examples" / "ur5e.yml")
    assert run("generate", cfg, "-o", str(tmp_path / "a")).exit_code == 0
    assert run("generate", cfg, "-o", str(tmp_path / "b")).exit_code == 0
    a = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    b = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    assert a == b
    manifest = json.loads(a["manifest.json"])
    assert manifest["tool"] == "tensorstep" and manifest["dof"] == 6
    assert {f["path"] for k in manifest["kernels"] for f in k["files"].values()} == set(a) - {"manifest.json"}


def test_generate_refuses_to_overwrite_foreign_or_edited_files(tmp_path):
    cfg = str(ROOT / "examples" / "ur5e.yml")
    out = tmp_path / "out"
    assert run("generate", cfg, "-o", str(out)).exit_code == 0
    victim = next(out.glob("*.c"))
    victim.write_text("/* my edits */\n")
    result = CliRunner().invoke(main, ["generate", cfg, "-o", str(out)])
    assert result.exit_code != 0
    assert "refusing to overwrite" in result.output and "Traceback" not in result.output
    assert victim.read_text() == "/* my edits */\n"  # nothing lost
    assert run("generate", cfg, "-o", str(out), "--force").exit_code == 0
    assert victim.read_text() != "/* my edits */\n"


def test_generate_refuses_foreign_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text('{"mine": true}')
    result = CliRunner().invoke(main, ["generate", str(ROOT / "examples" / "ur5e.yml"), "-o", str(tmp_path)])
    assert result.exit_code != 0 and "not written by tensorstep" in result.output
    assert (tmp_path / "manifest.json").read_text() == '{"mine": true}'


def test_list_and_check_generated_folder(tmp_path):
    shutil.copytree(ROOT / "generated" / "franka_panda", tmp_path / "g")
    listing = run("list", str(tmp_path / "g"))
    assert listing.exit_code == 0 and "franka_panda: 7 dof" in listing.output
    checked = run("check", str(tmp_path / "g"))
    assert checked.exit_code == 0, checked.output
    assert checked.output.count("PASS") == 3 and "all passed" in checked.output


def test_check_reads_states_through_their_indices():
    """`check` picks the start and goal rows from tables by start_index and goal_index: kernels
    that pass it fail it once a forward ignores either index (each trajectory reading its own row)."""
    import torch

    from tensorstep.codegen.arguments import table
    from tensorstep.runtime.launch import CpuBackend, Launcher
    from tensorstep.runtime.verify import verify_launcher

    spec = ts.KernelSpec(horizon=7, dof=2, dtype="float64", end="goal", start_index=True, goal_index=True)
    assert verify_launcher(spec, Launcher(spec, CpuBackend(spec)), torch.device("cpu"))["ok"]
    for name in ("start_index", "goal_index"):
        backend = CpuBackend(spec)
        position, call = [a.name for a in table(spec).tensors].index(name), backend.call

        def no_index(kernel, B, args, position=position, call=call):
            return call(kernel, B, [0 if kernel == "forward" and i == position else a for i, a in enumerate(args)])

        backend.call = no_index
        row = verify_launcher(spec, Launcher(spec, backend), torch.device("cpu"))
        assert not row["ok"] and row["forward"] > 1e-3, (name, row)


def test_check_config_and_show_and_stencil():
    checked = run("check", str(ROOT / "examples" / "mobile_manipulator.yml"))
    assert checked.exit_code == 0 and "all passed" in checked.output
    shown = run("show", "--horizon", "8", "--dof", "2", "--control", "jerk", "--target", "cuda", "--kernel", "core")
    assert shown.exit_code == 0 and '__global__ void ts_h8_d2_jer' in shown.output
    stencil = run("stencil", "--difference", "central", "--accuracy", "4", "--derivative", "2")
    assert stencil.exit_code == 0 and "-5/2" in stencil.output and "4/3" in stencil.output


def test_curobo_files(tmp_path):
    result = run("generate", str(DATA / "curobo_robot.yml"), "--task", str(DATA / "curobo_task.yml"), "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (spec,) = [k["spec"] for k in manifest["kernels"]]
    assert (spec["horizon"], spec["dof"], spec["control"], spec["difference"]) == (30, 6, "position", "central")
    assert manifest["dt"] == 0.025


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("robot: x\njoints: [a, b]\nkernels: [{horizon: 1}]\n", "kernels[0]: KernelSpec.horizon=1"),
        ("robot: x\njoints: [a, a]\nkernels: [{horizon: 8}]\n", "joints: joint names must be unique"),
        ("robot: x\ndof: 2\ndt: -1\nkernels: [{horizon: 8}]\n", "dt: expected a finite, positive number"),
        ("robot: x\ndof: 2\nkernels: [{horizon: 8, control: torque}]\n", "KernelSpec.control='torque'"),
        ("robot: x\ndof: 2\n", "kernels: expected a non-empty list"),
        ("robot: [x\n", "invalid YAML"),
        ("robot_cfg: {kinematics: {}}\n", "needs its task file"),
    ],
)
def test_bad_configs_name_file_key_and_problem(tmp_path, text, fragment):
    path = tmp_path / "robot.yml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["generate", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert str(path) in result.output and fragment in result.output
    assert "Traceback" not in result.output


def test_python_dash_m_and_plain_output_when_piped(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tensorstep", "generate", str(ROOT / "examples" / "ur5e.yml"),
                           "-o", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "deriving [1/2]" in proc.stderr and "\x1b" not in proc.stderr  # plain lines, no bar
    missing = subprocess.run([sys.executable, "-m", "tensorstep", "generate", str(tmp_path / "nope.yml")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr and "cannot read the file" in missing.stderr


def test_bench_smoke_prints_table_and_same_run_floor():
    """`bench` runs end to end (tiny budget: this checks the command, not speed)."""
    result = CliRunner().invoke(main, ["bench", "--scheme", "backward", "--batch", "1", "--no-codegen", "--budget", "0.01",
                                       "--no-inductor"])  # the torch.compile column: tests/tools/test_plot.py
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| backward | 32 | 1 |"))
    assert row.count("|") == 15 and "µs" in row
    assert "one built-in op (x * 2)" in result.output and "dt as a tensor: " in result.output
    assert "threads" in result.output
    rollout = [line for line in result.output.split("Forward only (rollouts")[1].splitlines()
               if line.startswith("| backward | 32 | 1 |")]
    assert len(rollout) == 1 and rollout[0].count("|") == 11


def error_line(result) -> str:
    """The one 'error: ...' line of a failed command (and no traceback)."""
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("args, fragment", [
    (("run", "ur5e", "--device", "gpu"), "--device='gpu' is invalid: allowed cpu, cuda, cuda:N"),
    (("bench", "--device", "gpu", "--no-codegen"), "--device='gpu' is invalid"),
    (("stencil", "--accuracy", "9", "--difference", "backward"), "--accuracy=9: expected 1 to 8"),
    (("show", "ur5e", "--horizon", "8", "--dt", "per_step"), "--horizon, --dt cannot be combined with CONFIG"),
    (("run", "ur5e", "--batch", "-3"), "--batch=-3: expected a positive integer"),
    (("run", "ur5e", "--batch", "0"), "--batch=0: expected a positive integer"),
    (("bench", "--batch", "400", "--batch", "-5", "--no-codegen"), "--batch=-5: expected a positive integer"),
    (("bench", "--budget", "nan", "--no-codegen"), "--budget=nan: expected a positive number"),
    (("bench", "--budget", "0", "--no-codegen"), "--budget=0.0: expected a positive number"),
    (("plot", "ur5e", "-o", "x.png", "--step-dt", "-0.02"), "--step-dt=-0.02: expected a positive number"),
])
def test_cli_errors_are_one_line(tmp_path, args, fragment):
    assert fragment in error_line(run(*args, *(("-o", str(tmp_path)) if args[0] == "run" else ())))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", [("run", "ur5e"), ("bench", "--no-codegen")])
def test_cuda_without_a_gpu_is_one_line(tmp_path, command):
    args = (*command, "--device", "cuda") + (("-o", str(tmp_path)) if command[0] == "run" else ())
    assert "sees no CUDA device" in error_line(run(*args))


def test_cuda_unavailable_from_the_runtime_is_one_line(tmp_path, monkeypatch):
    """A GPU PyTorch without CuPy: load raises CudaUnavailable, the CLI prints one line."""
    import torch

    from tensorstep.runtime.cuda_backend import CudaUnavailable

    def unavailable(spec, device="cpu"):
        raise CudaUnavailable("device='cuda' needs CuPy: install it with 'pip install tensorstep[cuda]'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ts, "load", unavailable)
    assert "needs CuPy" in error_line(run("run", "ur5e", "--device", "cuda", "-o", str(tmp_path)))


def test_check_a_folder_whose_source_does_not_compile(tmp_path):
    shutil.copytree(ROOT / "generated" / "ur5e", tmp_path / "g")
    broken = sorted((tmp_path / "g").glob("*.c"))[0]
    broken.write_text(broken.read_text().replace("#include", "@@@ #include", 1))
    line = error_line(run("check", str(tmp_path / "g")))
    assert f"{broken} does not compile" in line and "stray" in line


def test_generate_reports_unchanged_files_and_follows_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        first = run("generate", "ur5e", "-o", str(tmp_path))
    finally:
        os.umask(old)
    assert "\nwrote 7 files for ur5e" in first.output
    assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {"0o644"}
    again = run("generate", "ur5e", "-o", str(tmp_path))
    assert again.exit_code == 0 and "\nnothing changed (7 files up to date) for ur5e" in again.output


def test_generating_another_config_removes_only_its_own_unchanged_files(tmp_path):
    assert run("generate", "franka_panda", "-o", str(tmp_path)).exit_code == 0
    old = json.loads((tmp_path / "manifest.json").read_text())
    old_files = sorted(f["path"] for k in old["kernels"] for f in k["files"].values())
    edited = tmp_path / old_files[0]
    edited.write_text("/* my edits */\n")
    (tmp_path / "notes.txt").write_text("mine")
    result = run("generate", "ur5e", "-o", str(tmp_path))
    assert result.exit_code == 0, result.output
    removed = [p for p in old_files[1:]]
    assert f"removed {len(removed)} files of kernels no longer in the config: {', '.join(removed)}" in result.output
    assert f"left 1 files of kernels no longer in the config (edited since tensorstep wrote them): {edited.name}" in result.output
    assert edited.read_text() == "/* my edits */\n" and (tmp_path / "notes.txt").read_text() == "mine"
    assert not any((tmp_path / name).exists() for name in removed)


SMALL_CONFIG = """
robot: demo_arm
dof: 2
dt: 0.02
defaults: {horizon: 8, dtype: float64}
kernels:
  - {control: position, difference: central}
  - {control: acceleration, integrator: exact}
"""


def test_run_prints_the_thread_count_beside_its_timings(tmp_path):
    """Timings on a busy machine depend on the thread count: run says how many it used, beside
    each timing, and what to set on a shared machine."""
    import torch

    config = tmp_path / "small.yml"
    config.write_text(SMALL_CONFIG)
    before = torch.get_num_threads()
    try:
        for n, words in ((1, "1 thread)"), (2, "2 threads)")):
            torch.set_num_threads(n)
            lines = run("run", str(config), "-o", str(tmp_path / f"out-{n}"), "--batch", "4").output.splitlines()
            assert [l for l in lines if l.startswith("CPU threads: ")] == [
                f"CPU threads: {n} (torch.get_num_threads(), set by OMP_NUM_THREADS; on a machine other busy "
                "processes share, OMP_NUM_THREADS=1 can be many times faster: README, 'CPU kernels')"]
            timings = [l for l in lines if "us/call" in l]
            assert len(timings) == 2 and all(re.search(r"\d+ us/call \((native node|Python autograd path), "
                                                       + re.escape(words), l) for l in timings), timings
    finally:
        torch.set_num_threads(before)


COSTS_CONFIG = """
robot: demo_arm
joints: [a, b]
dt: 0.05
defaults: {horizon: 8, dtype: float64, outputs: [P]}
kernels:
  - {control: position, difference: central}
limits:
  position: {lower: [-0.5, -1], upper: [0.5, 0.25]}
  velocity: [3, 2]
costs:
  - {kind: bound, state: position, weight: [2, 3], margin: 0.1}
  - {kind: bound, state: velocity, weight: 0.5}
  - {kind: squared, state: jerk, weight: 1.0e-4}
"""


def test_run_prints_the_cost_per_term_from_the_configs_limits_and_weights(tmp_path):
    """The printed cost per term is the one the definitions (tests/reference_costs.py) give on the
    states of the NumPy reference, for the actions and start states run draws (seeded here)."""
    import numpy as np
    import torch

    import reference
    import reference_costs

    config = tmp_path / "costs.yml"
    config.write_text(COSTS_CONFIG)
    torch.manual_seed(5)
    result = run("run", str(config), "-o", str(tmp_path / "out"), "--batch", "3")
    assert result.exit_code == 0, result.output
    line = next(l for l in result.output.splitlines() if "cost per term" in l)
    printed = dict(re.findall(r"(\w+) ([-+.e\d]+)(?:,|$)", line.split(": ", 1)[1]))
    torch.manual_seed(5)  # run draws u, then p0, v0, a0 (float64, as the config's kernels)
    spec = ts.KernelSpec(horizon=8, dof=2, dtype="float64")
    u = torch.randn(3, 7, 2, dtype=torch.float64).numpy()
    start = np.stack([torch.randn(3, 2, dtype=torch.float64).numpy() for _ in range(3)] + [np.zeros((3, 2))], axis=1)
    Y = np.array([[reference.column(spec, u[b, :, d], start[b, :, d], 0.05) for d in range(2)] for b in range(3)])
    states = {name: Y[:, :, k].transpose(0, 2, 1) for k, name in enumerate(("position", "velocity", "acceleration", "jerk"))}
    params = {"bound_position_weight": np.array([2.0, 3.0]), "bound_position_limit": np.array([[-0.5, -1], [0.5, 0.25]]),
              "bound_position_margin": np.array([0.1, 0.1]), "bound_velocity_weight": np.array([0.5, 0.5]),
              "bound_velocity_limit": np.array([[-3.0, -2], [3, 2]]), "squared_jerk_weight": np.array([1e-4, 1e-4])}
    terms = (("bound", "position"), ("bound", "velocity"), ("squared", "jerk"))
    expected = reference_costs.costs(terms, states, params).mean(axis=0)
    assert list(printed) == ["bound_position", "bound_velocity", "squared_jerk"]
    for (kind, state), value in zip(terms, expected):
        assert float(printed[f"{kind}_{state}"]) == pytest.approx(value, rel=1e-3)


@pytest.mark.parametrize("source", ["config", "folder"])
def test_check_verifies_the_cost_terms_of_a_config_and_a_generated_folder(tmp_path, source):
    config = tmp_path / "costs.yml"
    config.write_text(COSTS_CONFIG)
    target = str(config)
    if source == "folder":
        target = str(tmp_path / "g")
        assert run("generate", str(config), "-o", target, "--target", "c").exit_code == 0
    checked = run("check", target)
    assert checked.exit_code == 0 and "all passed" in checked.output, checked.output
    (line,) = [l for l in checked.output.splitlines() if l.startswith("  cost terms ")]
    assert line.startswith("  cost terms bound_position, bound_velocity, squared_jerk: cost err ")
    assert float(line.rsplit(" ", 1)[1]) < 1e-10


@pytest.mark.parametrize("fault", ["cost", "adjoint"])
def test_check_fails_a_fused_kernel_whose_cost_or_adjoint_is_off(fault):
    """A cost off by a relative 1e-6, or an adjoint that leaves out the cost's gradient, fails."""
    import torch

    from tensorstep.runtime.verify import verify_launcher

    spec = ts.KernelSpec(horizon=8, dof=2, dtype="float64", outputs=("P",),
                         costs=(("bound", "velocity"), ("squared", "position")))
    launcher = ts.load(spec).launcher
    forward, adjoint = launcher.forward, launcher.adjoint
    if fault == "cost":
        launcher.forward = lambda inputs, dt, out=None: [*forward(inputs, dt)[:-1], forward(inputs, dt)[-1] * (1 + 1e-6)]
    else:
        launcher.adjoint = lambda grads, *a: adjoint([*grads[:-1], torch.zeros_like(grads[-1])], *a)
    try:
        row = verify_launcher(spec, launcher, torch.device("cpu"))
    finally:
        launcher.forward, launcher.adjoint = forward, adjoint
    assert not row["ok"]
    assert (row["cost"] if fault == "cost" else row["adjoint"]) > 1e-8, row


@pytest.mark.parametrize("old, new, fragment", [
    ("upper: [0.5, 0.25]", "upper: [0.5, -2]", "limits.position: lower > upper for joint b (-1 > -2)"),
    ("weight: 0.5", "weight: -0.5", "costs[1].weight: expected values >= 0, got -0.5"),
    ("kind: squared", "kind: squares", "costs[2].kind: unknown kind 'squares' (did you mean 'squared'?"),
])
@pytest.mark.parametrize("command", ["run", "check", "plot"])
def test_bad_limits_or_costs_are_one_line_in_every_command(tmp_path, old, new, fragment, command):
    config = tmp_path / "bad.yml"
    config.write_text(COSTS_CONFIG.replace(old, new))
    extra = ["-o", str(tmp_path / ("x.png" if command == "plot" else "out"))] if command != "check" else []
    line = error_line(run(command, str(config), *extra))
    assert fragment in line and line.startswith(f"error: {config}: ")


def test_outputs_out_of_order_in_a_config_are_one_line_in_check(tmp_path):
    """A config's outputs out of order: `check` prints the spec's message on one line, no traceback."""
    config = tmp_path / "bad.yml"
    config.write_text(COSTS_CONFIG.replace("outputs: [P]", "outputs: [A, P]"))
    assert error_line(run("check", str(config))) == (f"error: {config}: kernels[0]: KernelSpec.outputs=('A', 'P') is invalid: give the "
                                  "states in the order the step returns them, ('P', 'A'); got ('A', 'P')")


def test_runs_backward_hands_each_output_its_gradient(tmp_path):
    """`run`'s backward (a scalar's, which imports no SymPy) gives u the gradient PyTorch's backward given
    the output gradients does, for a plain step and a fused one (its cost's gradient as run sets it)."""
    import torch

    from tensorstep.cli import _backward
    from tensorstep.config import load_config

    config = tmp_path / "costs.yml"
    config.write_text(COSTS_CONFIG)
    fused = load_config(str(config), None).specs[0]
    for spec in (ts.KernelSpec(horizon=8, dof=2, dtype="float64"), fused):
        step = ts.load(spec)
        g = torch.Generator().manual_seed(3)
        r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
        u, start = r(3, 7, 2), [r(3, 2) for _ in range(3)]
        kw = {"bound_position_weight": torch.tensor([2.0, 3.0], dtype=torch.float64),
              "bound_position_limit": torch.tensor([[-0.5, -1], [0.5, 0.25]], dtype=torch.float64),
              "bound_position_margin": torch.tensor([0.1, 0.1], dtype=torch.float64),
              "bound_velocity_weight": torch.tensor([0.5, 0.5], dtype=torch.float64),
              "bound_velocity_limit": torch.tensor([[-3.0, -2], [3, 2]], dtype=torch.float64),
              "squared_jerk_weight": torch.tensor([1e-4, 1e-4], dtype=torch.float64)} if spec.costs else {}
        grads = []
        for backward in (_backward, torch.autograd.backward):
            x = u.clone().requires_grad_()
            outs = step(x, *start, 0.05, **kw)
            grads = grads or [r(*o.shape) for o in outs]
            backward(outs, grads)
            if backward is _backward:
                ours = x.grad
        assert len(grads) == (2 if spec.costs else 4)
        assert torch.equal(ours, x.grad)
