"""Robot configs: cuRobo's files (locked joints, limits), misspelt keys, bundled examples by name,
limits and cost terms."""
from __future__ import annotations

from pathlib import Path

import pytest

from tensorstep.config import ConfigError, load_config

DATA = Path(__file__).parents[1] / "data"
FRANKA_ARM = tuple(f"panda_joint{i}" for i in range(1, 8))


def test_curobo_locked_joints_are_not_optimised():
    cfg = load_config(DATA / "curobo_franka.yml", DATA / "curobo_task.yml")
    assert cfg.joints == FRANKA_ARM and cfg.dof == 7
    assert {s.dof for s in cfg.specs} == {7}


def test_curobo_acceleration_task_with_base_ratio_takes_per_step_dt():
    cfg = load_config(DATA / "curobo_franka.yml", DATA / "curobo_task_accel.yml")
    (spec,) = cfg.specs
    assert (spec.horizon, spec.dof, spec.control, spec.integrator, spec.dt) == (
        16, 7, "acceleration", "semi_implicit_euler", "per_step")
    assert cfg.dt == 0.02


def test_curobo_lock_joints_must_name_cspace_joints(tmp_path):
    robot = tmp_path / "robot.yml"
    robot.write_text((DATA / "curobo_franka.yml").read_text().replace('"panda_finger_joint2": 0.04', '"panda_fingr": 0.04'))
    with pytest.raises(ConfigError, match=r"lock_joints\.panda_fingr: not a joint"):
        load_config(robot, DATA / "curobo_task.yml")


@pytest.mark.parametrize("typo, right", [("defualts", "defaults"), ("kernals", "kernels")])
def test_misspelt_key_is_named_with_the_allowed_keys(tmp_path, typo, right):
    path = tmp_path / "robot.yml"
    text = "robot: x\ndof: 2\ndefaults: {horizon: 8}\nkernels: [{control: position}]\n"
    path.write_text(text.replace(f"{right}:", f"{typo}:"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{typo}: unknown key (did you mean '{right}'?" in message
    assert "allowed: robot, joints, dof, dt, defaults, kernels" in message and "horizon" not in message


def test_misspelt_default_field_is_named(tmp_path):
    path = tmp_path / "robot.yml"
    path.write_text("robot: x\ndof: 2\ndefaults: {horizn: 8}\nkernels: [{horizon: 8}]\n")
    with pytest.raises(ConfigError, match=r"defaults\.horizn: unknown key \(did you mean 'horizon'\?"):
        load_config(path)


def test_bundled_example_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such file here: the name is the packaged example's
    cfg = load_config("franka_panda")
    assert cfg.robot == "franka_panda" and cfg.dof == 7
    with pytest.raises(ConfigError, match="bundled examples, by name: franka_panda, franka_panda_costs, mobile_manipulator, ur5e"):
        load_config("franka")


COSTS = """robot: arm
joints: [a, b]
defaults: {horizon: 8, outputs: [P]}
kernels: [{control: position}, {control: acceleration, costs: [[squared, jerk]]}]
limits:
  position: {lower: [-1, -2], upper: [1, 0.5]}
  velocity: [2, 3]
  jerk: 40
costs:
  - {kind: bound, state: velocity, weight: [1, 2], margin: 0.25}
  - {kind: squared, state: jerk, weight: 0.5}
  - {kind: bound, state: position, weight: 3}
"""


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "robot.yml"
    path.write_text(text)
    return path


def test_limits_and_costs_become_spec_terms_and_keywords(tmp_path):
    cfg = load_config(_write(tmp_path, COSTS))
    first, second = cfg.specs
    assert first.costs == (("bound", "velocity"), ("squared", "jerk"), ("bound", "position"))
    assert first.outputs == ("P",)
    assert second.costs == (("squared", "jerk"),)  # a kernel's own costs field: a subset of costs:
    assert cfg.limit("position") == ((-1.0, -2.0), (1.0, 0.5))
    assert cfg.limit("velocity") == ((-2.0, -3.0), (2.0, 3.0))  # a bound b: the limits -b, b
    assert cfg.limit("jerk") == ((-40.0, -40.0), (40.0, 40.0))  # one number: every joint
    assert cfg.limit("acceleration") is None
    assert cfg.cost_keywords(first) == {
        "bound_velocity_weight": [1.0, 2.0], "bound_velocity_limit": [[-2.0, -3.0], [2.0, 3.0]],
        "bound_velocity_margin": [0.25, 0.25], "squared_jerk_weight": [0.5, 0.5],
        "bound_position_weight": [3.0, 3.0], "bound_position_limit": [[-1.0, -2.0], [1.0, 0.5]]}
    assert cfg.cost_keywords(second) == {"squared_jerk_weight": [0.5, 0.5]}


def test_bundled_costs_example_runs_its_terms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("franka_panda_costs")
    assert all(len(s.costs) == 6 and s.outputs == ("P",) for s in cfg.specs)
    lower, upper = cfg.limit("position")
    assert lower[3] == -3.0718 and upper[5] == 3.7525


@pytest.mark.parametrize("old, new, match", [
    ("upper: [1, 0.5]", "upper: [1, -2.5]", r"limits\.position: lower > upper for joint b \(-2 > -2\.5\)"),
    ("velocity: [2, 3]", "velocity: [2, -3]", r"limits\.velocity: expected values >= 0, got -3 \(joint b\)"),
    ("velocity: [2, 3]", "velocity: [2, .nan]", r"limits\.velocity: expected finite numbers"),
    ("velocity: [2, 3]", "velocity: [2, 3, 4]", r"limits\.velocity: expected one value per joint \(2\), got 3"),
    ("velocity: [2, 3]", "velocty: [2, 3]", r"limits\.velocty: unknown key \(did you mean 'velocity'\?"),
    ("position: {lower", "position: {lowr", r"limits\.position\.lowr: unknown key \(did you mean 'lower'\?"),
    ("weight: [1, 2]", "weight: [1, -2]", r"costs\[0\]\.weight: expected values >= 0, got -2 \(joint b\)"),
    ("margin: 0.25", "margin: -0.25", r"costs\[0\]\.margin: expected values >= 0, got -0\.25"),
    ("kind: squared, state: jerk", "kind: squard, state: jerk", r"costs\[1\]\.kind: unknown kind 'squard' \(did you mean 'squared'\?"),
    ("kind: squared, state: jerk", "kind: squared, state: jerks", r"costs\[1\]\.state: unknown state 'jerks' \(did you mean 'jerk'\?"),
    ("state: jerk, weight: 0.5", "state: jerk, wieght: 0.5", r"costs\[1\]\.wieght: unknown key \(did you mean 'weight'\?"),
    ("state: jerk, weight: 0.5", "state: jerk, weight: 0.5, margin: 1", r"costs\[1\]\.margin: only bound terms take a margin"),
    # a parameter given elsewhere (the limits) or only by a call (row weights, the target): where it goes
    ("margin: 0.25", "margin: 0.25, limit: 2",
     r"costs\[0\]\.limit: a term's limits are given under limits: \(limits\.velocity: \{lower"),
    ("state: jerk, weight: 0.5", "state: jerk, weight: 0.5, row_weight: 2",
     r"costs\[1\]\.row_weight: a config gives no row_weight: a call passes it, as the keyword squared_jerk_row_weight"),
    ("state: position, weight: 3", "state: velocity, weight: 3", r"costs\[2\]: the term \(bound, velocity\) is listed twice"),
    ("  jerk: 40\n", "", None),  # no jerk limit: fine, no bound on jerk
    ("state: position, weight: 3", "state: acceleration, weight: 3",
     r"costs\[2\]: a bound on acceleration needs its limits: add limits\.acceleration"),
    ("costs: [[squared, jerk]]", "costs: [[squared, velocity]]",
     r"kernels\[1\]\.costs: the term \(squared, velocity\) has no weight"),
    ("state: jerk, weight: 0.5", "state: snap, weight: 0.5",
     r"kernels\[0\]: .*the state 'snap' needs order=4; the spec's order is 3, which allows position, velocity, "
     r"acceleration, jerk$"),
])
def test_bad_limits_and_costs_name_the_key(tmp_path, old, new, match):
    assert old in COSTS
    path = _write(tmp_path, COSTS.replace(old, new))
    if match is None:
        assert load_config(path).limit("jerk") is None
        return
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_curobo_robot_file_gives_its_acceleration_and_jerk_limits(tmp_path):
    assert load_config(DATA / "curobo_franka.yml", DATA / "curobo_task.yml").limits == ()  # none carried
    example = Path(__file__).parents[2] / "examples" / "curobo" / "franka.yml"
    cfg = load_config(example, DATA / "curobo_task.yml")
    assert cfg.limit("position") is None and cfg.limit("velocity") is None  # in the URDF, not the file
    assert cfg.limit("acceleration") == ((-15.0,) * 7, (15.0,) * 7)
    text = example.read_text()
    robot = tmp_path / "robot.yml"
    # a list runs over cspace.joint_names, the locked fingers' entries included (and dropped)
    robot.write_text(text.replace("max_acceleration: 15.0", "max_acceleration: [1, 2, 3, 4, 5, 6, 7, 8, 9]"))
    cfg = load_config(robot, DATA / "curobo_task.yml")
    assert cfg.limit("acceleration") == ((-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0), (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0))
    assert cfg.limit("jerk") == ((-500.0,) * 7, (500.0,) * 7)
    robot.write_text(text.replace("max_jerk: 500.0", "max_jerk: -5"))
    with pytest.raises(ConfigError, match=r"cspace\.max_jerk: expected values >= 0, got -5"):
        load_config(robot, DATA / "curobo_task.yml")
