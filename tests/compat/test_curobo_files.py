"""cuRobo's own files: the examples in examples/curobo (v0.7 robot + task) and examples/curobo_v2
(v2 robot with kinematics at the top level + transition files), through load_config and the CLI's
generate, run and check; the layouts recognised by their keys; one-line errors for the files a
user gives in the wrong place."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import tensorstep as ts
from tensorstep.cli import main
from tensorstep.codegen.legacy_spec import LegacySpec
from tensorstep.codegen.curobo_v2_spec import CuroboV2Spec
from tensorstep.config import ConfigError, load_config

EXAMPLES = Path(ts.__file__).resolve().parent / "examples"
V07, V2 = EXAMPLES / "curobo", EXAMPLES / "curobo_v2"
FRANKA = tuple(f"panda_joint{i}" for i in range(1, 8))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, *fragments: str) -> None:
    """A user's mistake: exit code 1, one line on stderr naming the problem, no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_v2_files_select_the_v2_kernels():
    """Transition files with their settings under transition_model_cfg: and keys tensorstep does not
    use; a robot file with kinematics: at the top level; no version key anywhere."""
    cfg = load_config(V2 / "franka.yml", V2 / "transition_bspline.yml")
    assert cfg.joints == FRANKA and cfg.dt == 0.05
    assert cfg.specs == (CuroboV2Spec("bspline", 17 * 4 + 1, 7, degree=4, knots=12, steps=4),)
    (position,) = load_config(V2 / "franka.yml", V2 / "transition_position.yml").specs
    assert position == CuroboV2Spec("clique", 30, 7)


def test_robot_cfg_wrapper_and_top_level_kinematics_read_the_same(tmp_path):
    wrapped = tmp_path / "robot.yml"
    wrapped.write_text("robot_cfg:\n" + "".join(f"  {line}\n" for line in (V2 / "franka.yml").read_text().splitlines()
                                                if not line.startswith("#")))
    task = V2 / "transition_bspline.yml"
    assert load_config(wrapped, task).specs == load_config(V2 / "franka.yml", task).specs
    assert load_config(wrapped, task).joints == FRANKA


def test_v07_examples_keep_the_native_mapping():
    cfg = load_config(V07 / "franka.yml", V07 / "trajopt.yml")
    (spec,) = cfg.specs
    assert (cfg.joints, spec.horizon, spec.control, spec.difference) == (FRANKA, 32, "position", "central")


def test_acceleration_transition_maps_to_the_v2_acceleration_kernel(tmp_path):
    task = tmp_path / "transition.yml"
    task.write_text("transition_model_cfg:\n  horizon: 16\n  control_space: ACCELERATION\n  teleport_mode: False\n")
    assert load_config(V2 / "franka.yml", task).specs == (LegacySpec("accel_semi_euler", 16, 7, start_index=True),)


@pytest.mark.parametrize("robot, task", [(V2 / "franka.yml", V2 / "transition_bspline.yml"),
                                         (V2 / "franka.yml", V2 / "transition_position.yml"),
                                         (V07 / "franka.yml", V07 / "trajopt.yml")],
                         ids=["v2-bspline", "v2-position", "v0.7"])
def test_examples_through_generate_run_and_check(robot, task, tmp_path):
    generated = invoke("generate", robot, "--task", task, "-o", tmp_path / "gen")
    assert generated.exit_code == 0, generated.output
    manifest = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    assert manifest["dof"] == 7 and len(manifest["kernels"]) == 1
    ran = invoke("run", robot, "--task", task, "-o", tmp_path / "run", "--batch", "3")
    assert ran.exit_code == 0 and "forward+backward" in ran.output and "outputs 3x" in ran.output, ran.output
    checked = invoke("check", robot, "--task", task)
    assert checked.exit_code == 0 and "all passed" in checked.output, checked.output


@pytest.mark.parametrize("section", ["transition_model_cfg", "model"])
def test_position_with_horizon_one_has_no_trajectory(section, tmp_path):
    """cuRobo's IK and graph-planner files: POSITION with horizon 1. One line naming the key that
    sets a horizon."""
    task = tmp_path / "ik.yml"
    task.write_text(f"{section}:\n  horizon: 1\n  control_space: POSITION\n  dt_traj_params: {{base_dt: 0.02}}\n"
                    "  teleport_mode: True\n")
    one_line_error(invoke("generate", V2 / "franka.yml", "--task", task, "-o", tmp_path / "out"),
                   str(task), f"{section}.horizon: 1: a POSITION task with horizon 1",
                   "has no trajectory", f"set {section}.horizon to")


@pytest.mark.parametrize("section", ["transition_model_cfg", "model"])
def test_unsupported_control_space_lists_every_allowed_one_first(section, tmp_path):
    """BSPLINE_2 with no horizon: the control space is what is wrong, not a missing horizon."""
    task = tmp_path / "task.yml"
    task.write_text(f"{section}:\n  control_space: BSPLINE_2\n  n_knots: 8\n  interpolation_steps: 4\n")
    with pytest.raises(ConfigError, match=rf"{section}.control_space: 'BSPLINE_2' is not supported: allowed "
                       r"POSITION, ACCELERATION, BSPLINE_3, BSPLINE_4, BSPLINE_5"):
        load_config(V2 / "franka.yml", task)


def test_misspelt_setting_is_named_with_the_closest_key(tmp_path):
    task = tmp_path / "task.yml"
    task.write_text("transition_model_cfg:\n  control_space: BSPLINE_4\n  n_knot: 8\n  interpolation_steps: 4\n")
    with pytest.raises(ConfigError, match=r"transition_model_cfg.n_knots: missing key \(did you mean 'n_knot'\?\)"):
        load_config(V2 / "franka.yml", task)


@pytest.mark.parametrize("task", [V2 / "transition_bspline.yml", V07 / "trajopt.yml"], ids=["v2", "v0.7"])
def test_task_file_given_as_config_says_to_pass_it_with_task(task, tmp_path):
    for verb in (["generate", task, "-o", tmp_path / "out"], ["run", task], ["check", task], ["show", task]):
        one_line_error(invoke(*verb), str(task), "this is a cuRobo task file", "with --task")
    one_line_error(invoke("generate", task, "--task", V2 / "franka.yml", "-o", tmp_path / "out"),
                   "with --task")  # the two files swapped


def test_robot_file_given_as_task_says_so(tmp_path):
    one_line_error(invoke("generate", V2 / "franka.yml", "--task", V07 / "franka.yml", "-o", tmp_path / "out"),
                   "expected a cuRobo task file", "this is a cuRobo robot file")


def test_run_and_check_document_task_and_device():
    for verb in ("run", "check"):
        text = invoke(verb, "--help").output
        assert "--task" in text and "cuRobo task" in text, text
    assert "cpu, cuda or cuda:N" in invoke("run", "--help").output
