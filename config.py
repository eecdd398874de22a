"""Robot configs (YAML): tensorstep's native form and cuRobo's robot + task files.

Native form::

    robot: franka_panda            # a label: stored in manifests as data, never in source
    joints: [j1, j2, ...]          # or  dof: 7
    dt: 0.02                       # step duration used by `run` and `check`
    defaults: {horizon: 32}        # KernelSpec fields shared by every kernel
    kernels:                       # one KernelSpec per entry (fields: docs/kernelspec.md)
      - {control: position, difference: central}
      - {control: acceleration}
      - {control: bspline, degree: 4, knots: 8, steps: 4}   # horizon derived (T·steps + 1)

cuRobo form: a robot file with ``robot_cfg.kinematics.cspace.joint_names`` (less the joints
in ``robot_cfg.kinematics.lock_joints``, which are not optimised) plus a task file with
``model.horizon``, ``model.dt_traj_params``, ``model.control_space`` and
``model.state_finite_difference_mode``. cuRobo v2's task files (``control_space: BSPLINE_3/4/5``
with ``n_knots`` and ``interpolation_steps``, or ``curobo_version: 2``) map to the kernels of
``tensorstep.compat.curobo_v2``.

A bare name that is not a file (``franka_panda``) names a bundled example config.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any, Optional

import yaml

from .codegen.spec import RELEVANT, KernelSpec

MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """A bad config: names the file, the key path and the problem."""

    def __init__(self, path: Any, key: str, problem: str):
        self.path, self.key, self.problem = str(path), key, problem
        super().__init__(f"{path}: {key or '<top level>'}: {problem}")


@dataclasses.dataclass(frozen=True)
class RobotConfig:
    robot: str
    dof: int
    joints: tuple[str, ...]
    dt: float
    specs: tuple[Any, ...]  # KernelSpecs; a cuRobo v2 task file gives the compat kernel it selects
    source: str  # the file(s) it came from

    def to_dict(self) -> dict[str, Any]:
        return {"robot": self.robot, "dof": self.dof, "joints": list(self.joints), "dt": self.dt}


def _read_yaml(path: Path) -> Any:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(path, "", f"file is larger than {MAX_CONFIG_BYTES} bytes")
        text = path.read_text()
    except OSError as err:
        hint = ""
        if not path.exists() and path.parent == Path("."):
            hint = f" (bundled examples, by name: {', '.join(sorted(bundled_examples()))})"
        raise ConfigError(path, "", f"cannot read the file: {err.strerror or err}{hint}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(path, "", f"invalid YAML: {err}") from None


def _get(data: Any, path: Path, keys: str, required: bool = True) -> Any:
    node = data
    walked = []
    for key in keys.split("."):
        walked.append(key)
        if not isinstance(node, dict) or key not in node:
            if not required:
                return None
            raise ConfigError(path, ".".join(walked), "missing key")
        node = node[key]
    return node


def _positive_float(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(path, key, f"expected a finite, positive number, got {value!r}")
    return float(value)


def _joint_names(path: Path, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(j, str) for j in value):
        raise ConfigError(path, key, "expected a non-empty list of joint names (strings)")
    if len(set(value)) != len(value):
        raise ConfigError(path, key, "joint names must be unique")
    return tuple(value)


def _spec(path: Path, key: str, fields: Any, dof: int) -> KernelSpec:
    if not isinstance(fields, dict):
        raise ConfigError(path, key, f"expected a mapping of KernelSpec fields, got {type(fields).__name__}")
    fields = {k: v for k, v in fields.items() if k != "name"}  # 'name' is an optional human label
    if "dof" in fields and fields["dof"] != dof:
        raise ConfigError(path, f"{key}.dof", f"{fields['dof']!r} disagrees with the robot's {dof} joints")
    fields["dof"] = dof
    if isinstance(fields.get("accuracy"), list):
        fields["accuracy"] = tuple(fields["accuracy"])
    try:
        return KernelSpec.from_dict(fields)
    except (TypeError, ValueError) as err:
        raise ConfigError(path, key, str(err)) from None


NATIVE_KEYS = ("robot", "joints", "dof", "dt", "defaults", "kernels")
SPEC_KEYS = tuple(f.name for f in dataclasses.fields(KernelSpec)) + ("name",)


def _check_keys(path: Path, key: str, data: dict, allowed: tuple[str, ...]) -> None:
    """Name the first unknown key (with the closest allowed one) before anything reads the rest."""
    for name in data:
        if name not in allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            where = f"{key}.{name}" if key else str(name)
            raise ConfigError(path, where, f"unknown key ({hint}allowed: {', '.join(allowed)})")


def _mapping(path: Path, key: str, value: Any, allowed: Any, expected: str) -> dict:
    """A mapping whose keys are all allowed (a misspelt key is named with the allowed ones)."""
    if not isinstance(value, dict):
        raise ConfigError(path, key, expected)
    _check_keys(path, key, value, allowed)
    return value


def load_native(path: Path, data: Any) -> RobotConfig:
    _mapping(path, "", data, NATIVE_KEYS, "expected a mapping with robot, joints/dof and kernels")
    robot = data.get("robot")
    if not isinstance(robot, str) or not robot:
        raise ConfigError(path, "robot", "expected a non-empty robot name (string)")
    if "joints" in data:
        joints = _joint_names(path, "joints", data["joints"])
        dof = len(joints)
        if "dof" in data and data["dof"] != dof:
            raise ConfigError(path, "dof", f"{data['dof']!r} disagrees with {dof} joint names")
    elif "dof" in data:
        dof = data["dof"]
        if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
            raise ConfigError(path, "dof", f"expected a positive integer, got {dof!r}")
        joints = tuple(f"joint_{i}" for i in range(dof))
    else:
        raise ConfigError(path, "joints", "missing key (give joint names, or dof)")
    dt = _positive_float(path, "dt", data.get("dt", 0.02))
    defaults = _mapping(path, "defaults", data.get("defaults") or {}, SPEC_KEYS, "expected a mapping of KernelSpec fields")
    kernels = data.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        raise ConfigError(path, "kernels", "expected a non-empty list of kernel specs")
    specs = tuple(_spec(path, f"kernels[{i}]", _with_defaults(defaults, k), dof) for i, k in enumerate(kernels))
    return RobotConfig(robot, dof, joints, dt, specs, str(path))


def _with_defaults(defaults: dict, kernel: Any) -> Any:
    """A kernel's fields over the shared defaults, of which a kernel takes those that apply to its
    control: a B-spline's horizon is derived, and difference/accuracy/end/integrator or
    degree/knots/steps mean nothing to some controls. Its own fields are checked as given."""
    if kernel is None:
        kernel = {}
    if not isinstance(kernel, dict):
        return kernel
    control = kernel.get("control", defaults.get("control", "position"))
    skipped = {f for f, controls in RELEVANT.items() if control not in controls}
    if control == "bspline":
        skipped.add("horizon")
    return {**{k: v for k, v in defaults.items() if k not in skipped}, **kernel}


CUROBO_CONTROL = {"POSITION": {"control": "position"}, "ACCELERATION": {"control": "acceleration"}}
CUROBO_DIFFERENCE = {"BACKWARD": {"difference": "backward", "accuracy": 1}, "CENTRAL": {"difference": "central"}}


def _unlocked_joints(path: Path, robot: Any) -> tuple[str, ...]:
    """cspace joint names less those in ``lock_joints`` (name → fixed value): the optimised joints."""
    key = "robot_cfg.kinematics.cspace.joint_names"
    joints = _joint_names(path, key, _get(robot, path, key))
    locked = _get(robot, path, "robot_cfg.kinematics.lock_joints", required=False) or {}
    if not isinstance(locked, dict):
        raise ConfigError(path, "robot_cfg.kinematics.lock_joints", "expected a mapping of joint name to locked value")
    for name in locked:
        if name not in joints:
            raise ConfigError(path, f"robot_cfg.kinematics.lock_joints.{name}", f"not a joint of {key}")
    free = tuple(j for j in joints if j not in locked)
    if not free:
        raise ConfigError(path, "robot_cfg.kinematics.lock_joints", "locks every joint: nothing left to optimise")
    return free


CUROBO_V2_BSPLINE = {"BSPLINE_3": 3, "BSPLINE_4": 4, "BSPLINE_5": 5}


def _is_curobo_v2(task: Any, task_path: Path) -> bool:
    """cuRobo v2's task files: a B-spline control space (v2 only), or ``model.curobo_version: 2``
    (which selects v2's position and acceleration kernels; without it they read as v0.7's)."""
    version = _get(task, task_path, "model.curobo_version", required=False)
    if version not in (None, 2, 0.7, "0.7", "2"):
        raise ConfigError(task_path, "model.curobo_version", f"{version!r} is not supported: allowed 2 (cuRobo v2) "
                          "or 0.7 (the default for POSITION and ACCELERATION)")
    return str(version) == "2" or _get(task, task_path, "model.control_space", required=False) in CUROBO_V2_BSPLINE


def _count(path: Path, key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(path, key, f"expected an integer >= {least}, got {value!r}")
    return value


def curobo_v2_spec(task: Any, task_path: Path, dof: int) -> Any:
    """The kernel tensorstep.compat.curobo_v2 runs for a cuRobo v2 task file (float32, as cuRobo):
    POSITION → the position kernel (H ≥ 9 rows, H − 4 actions), ACCELERATION → the acceleration
    kernel, BSPLINE_3/4/5 → the B-spline kernel of that degree with ``model.n_knots`` knots and
    ``model.interpolation_steps`` rows per span (``model.horizon``, if given, must hold them)."""
    from .codegen.legacy_spec import LegacySpec
    from .codegen.legacy_v2_spec import CuroboV2Spec

    control = _get(task, task_path, "model.control_space")
    allowed = ("POSITION", "ACCELERATION", *CUROBO_V2_BSPLINE)
    if control not in allowed:
        raise ConfigError(task_path, "model.control_space", f"{control!r} is not supported for cuRobo v2: allowed "
                          + ", ".join(allowed))
    horizon = _get(task, task_path, "model.horizon", required=control not in CUROBO_V2_BSPLINE)
    if horizon is not None:
        horizon = _count(task_path, "model.horizon", horizon, 2)
    try:
        if control == "POSITION":
            mode = _get(task, task_path, "model.state_finite_difference_mode", required=False) or "CENTRAL"
            if mode != "CENTRAL":
                raise ConfigError(task_path, "model.state_finite_difference_mode",
                                  f"{mode!r}: cuRobo v2's position kernel is the five-point central one (allowed CENTRAL)")
            return CuroboV2Spec("clique", horizon, dof)
        if control == "ACCELERATION":
            return LegacySpec("accel_semi_euler", horizon, dof, start_index=True)
        degree = CUROBO_V2_BSPLINE[control]
        knots = _count(task_path, "model.n_knots", _get(task, task_path, "model.n_knots"), 1)
        steps = _count(task_path, "model.interpolation_steps", _get(task, task_path, "model.interpolation_steps"), 1)
        rows = (knots + degree + 1) * steps + 1
        if horizon is not None and (horizon - 1) // (knots + degree + 1) != steps:
            raise ConfigError(task_path, "model.horizon", f"{horizon} rows do not give {steps} rows per span for "
                              f"{knots + degree + 1} spans (n_knots + degree + 1): expected {rows} (or drop it)")
        return CuroboV2Spec("bspline", horizon or rows, dof, degree=degree, knots=knots, steps=steps)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(task_path, "model", str(err)) from None


def spec_from_dict(data: Any) -> Any:
    """A spec from its ``to_dict()`` (manifests): tensorstep's KernelSpec, or a cuRobo kernel's."""
    if isinstance(data, dict) and data.get("family") == "curobo_v2":
        from .codegen.legacy_v2_spec import CuroboV2Spec

        return CuroboV2Spec.from_dict(data)
    if isinstance(data, dict) and "kind" in data:
        from .codegen.legacy_spec import LegacySpec

        return LegacySpec(**data)
    return KernelSpec.from_dict(data)


def load_curobo(robot_path: Path, robot: Any, task_path: Path) -> RobotConfig:
    joints = _unlocked_joints(robot_path, robot)
    task = _read_yaml(task_path)
    name = Path(robot_path).stem
    if _is_curobo_v2(task, task_path):
        dt_params = _get(task, task_path, "model.dt_traj_params", required=False) or {}
        if not isinstance(dt_params, dict):
            raise ConfigError(task_path, "model.dt_traj_params", "expected a mapping with base_dt")
        base_dt = _positive_float(task_path, "model.dt_traj_params.base_dt", dt_params.get("base_dt", 0.02))
        spec = curobo_v2_spec(task, task_path, len(joints))
        return RobotConfig(name, len(joints), joints, base_dt, (spec,), f"{robot_path} + {task_path}")
    horizon = _get(task, task_path, "model.horizon")
    if isinstance(horizon, bool) or not isinstance(horizon, int):
        raise ConfigError(task_path, "model.horizon", f"expected an integer, got {horizon!r}")
    dt_params = _get(task, task_path, "model.dt_traj_params")
    if not isinstance(dt_params, dict):
        raise ConfigError(task_path, "model.dt_traj_params", "expected a mapping with base_dt")
    base_dt = _positive_float(task_path, "model.dt_traj_params.base_dt", dt_params.get("base_dt"))
    ratio = dt_params.get("base_ratio", 1.0)
    if "max_dt" in dt_params:  # a value of the traj_dt tensor passed at call time, not part of a kernel
        _positive_float(task_path, "model.dt_traj_params.max_dt", dt_params["max_dt"])
    control = _get(task, task_path, "model.control_space")
    if control not in CUROBO_CONTROL:
        raise ConfigError(task_path, "model.control_space", f"{control!r} is not supported: allowed {', '.join(CUROBO_CONTROL)}")
    mode = _get(task, task_path, "model.state_finite_difference_mode", required=False) or "BACKWARD"
    if mode not in CUROBO_DIFFERENCE:
        raise ConfigError(task_path, "model.state_finite_difference_mode",
                          f"{mode!r} is not supported: allowed {', '.join(CUROBO_DIFFERENCE)}")
    fields: dict[str, Any] = {"horizon": horizon, **CUROBO_CONTROL[control]}
    if control == "POSITION":
        fields.update(CUROBO_DIFFERENCE[mode])
    if ratio != 1.0:
        fields["dt"] = "per_step"
    spec = _spec(task_path, "model", fields, len(joints))
    return RobotConfig(name, len(joints), joints, base_dt, (spec,), f"{robot_path} + {task_path}")


def bundled_examples() -> dict[str, Path]:
    """name → path of the example configs shipped in the package (``tensorstep.examples``)."""
    from importlib import resources

    folder = resources.files("tensorstep.examples")
    return {Path(e.name).stem: Path(str(e)) for e in folder.iterdir() if e.name.endswith((".yml", ".yaml"))}


def resolve_config_path(path: Any) -> Path:
    """The path as given; a bare name with no such file (``franka_panda``) is a bundled example."""
    given = Path(path)
    if given.exists() or given.parent != Path("."):
        return given
    stem = given.stem if given.suffix in (".yml", ".yaml") else given.name
    return bundled_examples().get(stem, given)


def load_config(path: Any, task: Optional[Any] = None) -> RobotConfig:
    """Read a native config, or a cuRobo robot file together with its task file."""
    path = resolve_config_path(path)
    data = _read_yaml(path)
    if isinstance(data, dict) and "robot_cfg" in data:
        if task is None:
            raise ConfigError(path, "robot_cfg", "a cuRobo robot file needs its task file too (--task TASK.yml)")
        return load_curobo(path, data, Path(task))
    if task is not None:
        raise ConfigError(path, "", "--task is only for cuRobo robot files (with robot_cfg)")
    return load_native(path, data)
