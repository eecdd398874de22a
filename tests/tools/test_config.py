"""Robot configs: cuRobo's files (locked joints), misspelt keys, bundled examples by name."""
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
    with pytest.raises(ConfigError, match="bundled examples, by name: franka_panda, mobile_manipulator, ur5e"):
        load_config("franka")
