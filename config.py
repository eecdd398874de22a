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
    limits:                        # per joint (optional): a number or a list of one per joint
      position: {lower: [-2.9, ...], upper: [2.9, ...]}
      velocity: 2.1                # a bound b alone means lower -b, upper b
    costs:                         # cost terms every kernel computes (optional; docs/costs.md)
      - {kind: bound, state: velocity, weight: 100, margin: 0.1}   # its limits from limits:
      - {kind: squared, state: jerk, weight: 1.0e-6}

cuRobo form: a robot file with ``kinematics.cspace.joint_names`` (less the joints in
``kinematics.lock_joints``, which are not optimised), under ``robot_cfg:`` or at the top level
(cuRobo v2's robot files), plus a task file. The task file's layout is recognised by its keys:
cuRobo v2's transition files put their settings under ``transition_model_cfg:`` and map to the
kernels of ``tensorstep.compat.curobo_v2``; v0.7's task files put them under ``model:``
(``horizon``, ``dt_traj_params``, ``control_space``, ``state_finite_difference_mode``) and map to
tensorstep's own kernels, unless they name a B-spline control space (v2 only) or carry
``curobo_version: 2``. Keys tensorstep does not use (``state_filter_cfg``, ``teleport_mode``,
``vel_scale``, ...) are ignored. Of a robot file's limits tensorstep reads those it carries,
``cspace.max_acceleration`` and ``cspace.max_jerk`` (symmetric: a bound b is the limits −b, b);
position and velocity limits live in the URDF, which tensorstep does not read.

A bare name that is not a file (``franka_panda``) names a bundled example config.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any, Optional

import yaml

from .codegen.arguments import cost_parameter_names
from .codegen.spec import COST_KINDS, DERIVATIVE_NAMES, RELEVANT, KernelSpec, unknown_name

MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """A bad config: names the file, the key path and the problem."""

    def __init__(self, path: Any, key: str, problem: str):
        self.path, self.key, self.problem = str(path), key, problem
        super().__init__(f"{path}: {key or '<top level>'}: {problem}")


@dataclasses.dataclass(frozen=True)
class CostTerm:
    """A cost term of a config's ``costs:``: the spec's (kind, state) and its parameters per joint."""

    kind: str
    state: str
    weight: tuple[float, ...]
    margin: Optional[tuple[float, ...]] = None  # bound terms only


@dataclasses.dataclass(frozen=True)
class RobotConfig:
    robot: str
    dof: int
    joints: tuple[str, ...]
    dt: float
    specs: tuple[Any, ...]  # KernelSpecs; a cuRobo v2 task file gives the compat kernel it selects
    source: str  # the file(s) it came from
    #: state → (lower, upper), one value per joint each (``limits:``; a cuRobo robot file's limits)
    limits: tuple[tuple[str, tuple[tuple[float, ...], tuple[float, ...]]], ...] = ()
    costs: tuple[CostTerm, ...] = ()  # ``costs:``: the parameters of every kernel's cost terms

    def to_dict(self) -> dict[str, Any]:
        return {"robot": self.robot, "dof": self.dof, "joints": list(self.joints), "dt": self.dt}

    def limit(self, state: str) -> Optional[tuple[tuple[float, ...], tuple[float, ...]]]:
        """(lower, upper) of a state, one value per joint each, or None where none is given."""
        return dict(self.limits).get(state)

    def cost_keywords(self, spec: Any) -> dict[str, list]:
        """The keyword arguments (as nested lists) a kernel with cost terms takes, by name:
        ``<kind>_<state>_weight`` [D], ``<kind>_<state>_limit`` [2, D] and ``<kind>_<state>_margin`` [D]
        where the kind reads them (a bound's: spec.COST_KINDS)."""
        terms = {(t.kind, t.state): t for t in self.costs}
        keywords: dict[str, list] = {}
        for kind, state in getattr(spec, "costs", ()):
            term = terms[(kind, state)]  # load_native checked every spec's terms have parameters
            keywords[f"{kind}_{state}_weight"] = list(term.weight)
            if "limit" in COST_KINDS[kind]:
                keywords[f"{kind}_{state}_limit"] = [list(side) for side in self.limit(state)]
            if term.margin is not None:
                keywords[f"{kind}_{state}_margin"] = list(term.margin)
        return keywords


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
            close = difflib.get_close_matches(key, [str(k) for k in node], n=1) if isinstance(node, dict) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, ".".join(walked), f"missing key{hint}")
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


NATIVE_KEYS = ("robot", "joints", "dof", "dt", "defaults", "kernels", "limits", "costs")
LIMIT_SIDES = ("lower", "upper")
COST_KEYS = ("kind", "state", "weight", "margin")
SPEC_KEYS = tuple(f.name for f in dataclasses.fields(KernelSpec)) + ("name",)


def _check_keys(path: Path, key: str, data: dict, allowed: tuple[str, ...]) -> None:
    """Name the first unknown key (with the closest allowed one) before anything reads the rest."""
    for name in data:
        if name not in allowed:
            where = f"{key}.{name}" if key else str(name)
            raise ConfigError(path, where, f"unknown key ({unknown_name(name, allowed)})")


def _mapping(path: Path, key: str, value: Any, allowed: Any, expected: str) -> dict:
    """A mapping whose keys are all allowed (a misspelt key is named with the allowed ones)."""
    if not isinstance(value, dict):
        raise ConfigError(path, key, expected)
    _check_keys(path, key, value, allowed)
    return value


def _per_joint(path: Path, key: str, value: Any, joints: tuple[str, ...], least: Optional[float] = None
               ) -> tuple[float, ...]:
    """A number for every joint, or a list of one finite number per joint (each >= ``least``)."""
    if isinstance(value, list):
        if len(value) != len(joints):
            raise ConfigError(path, key, f"expected one value per joint ({len(joints)}), got {len(value)}")
        values = value
    else:
        values = [value] * len(joints)
    for joint, v in zip(joints, values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(path, key, f"expected finite numbers (one, or a list of one per joint), got {value!r}")
        if least is not None and v < least:
            where = f" (joint {joint})" if isinstance(value, list) else ""
            raise ConfigError(path, key, f"expected values >= {least:g}, got {v!r}{where}")
    return tuple(float(v) for v in values)


def _limits(path: Path, key: str, value: Any, joints: tuple[str, ...]
            ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One state's limits: ``{lower: .., upper: ..}``, or a bound b (lower −b, upper b); each side a
    number for every joint or a list of one per joint, with lower <= upper."""
    if isinstance(value, dict):
        _check_keys(path, key, value, LIMIT_SIDES)
        for side in LIMIT_SIDES:
            if side not in value:
                raise ConfigError(path, f"{key}.{side}", "missing key (give lower and upper, or one bound b "
                                  "for the limits -b, b)")
        lower, upper = (_per_joint(path, f"{key}.{side}", value[side], joints) for side in LIMIT_SIDES)
    else:
        upper = _per_joint(path, key, value, joints, least=0.0)
        lower = tuple(-b for b in upper)
    for joint, lo, hi in zip(joints, lower, upper):
        if lo > hi:
            raise ConfigError(path, key, f"lower > upper for joint {joint} ({lo:g} > {hi:g})")
    return lower, upper


def _read_limits(path: Path, value: Any, joints: tuple[str, ...]) -> tuple:
    states = DERIVATIVE_NAMES
    _mapping(path, "limits", value, states, f"expected a mapping of state ({', '.join(states)}) to limits")
    return tuple((state, _limits(path, f"limits.{state}", value[state], joints)) for state in states if state in value)


def _read_costs(path: Path, value: Any, joints: tuple[str, ...], limits: tuple) -> tuple[CostTerm, ...]:
    """``costs:``: a list of terms {kind, state, weight[, margin]}, each (kind, state) once; a bound
    term's limits come from ``limits:``."""
    if not isinstance(value, list):
        raise ConfigError(path, "costs", "expected a list of cost terms, e.g. [{kind: bound, state: velocity, "
                          "weight: 100}]")
    terms: list[CostTerm] = []
    for i, entry in enumerate(value):
        key = f"costs[{i}]"
        _given_elsewhere(path, key, entry)
        _mapping(path, key, entry, COST_KEYS, "expected a mapping with kind, state, weight (and margin for bounds)")
        for name in ("kind", "state", "weight"):
            if name not in entry:
                raise ConfigError(path, f"{key}.{name}", "missing key")
        kind, state = entry["kind"], entry["state"]
        if kind not in COST_KINDS:
            raise ConfigError(path, f"{key}.kind", f"unknown kind {kind!r} ({unknown_name(kind, COST_KINDS)})")
        if state not in DERIVATIVE_NAMES:
            raise ConfigError(path, f"{key}.state", f"unknown state {state!r} ({unknown_name(state, DERIVATIVE_NAMES)})")
        if any((t.kind, t.state) == (kind, state) for t in terms):
            raise ConfigError(path, key, f"the term ({kind}, {state}) is listed twice")
        weight = _per_joint(path, f"{key}.weight", entry["weight"], joints, least=0.0)
        margin = None
        if "limit" in COST_KINDS[kind] and state not in dict(limits):
            raise ConfigError(path, key, f"a {kind} on {state} needs its limits: add limits.{state}")
        if "margin" in entry:
            if "margin" not in COST_KINDS[kind]:
                with_margin = " and ".join(k for k, p in COST_KINDS.items() if "margin" in p)
                raise ConfigError(path, f"{key}.margin", f"only {with_margin} terms take a margin")
            margin = _per_joint(path, f"{key}.margin", entry["margin"], joints, least=0.0)
        terms.append(CostTerm(kind, state, weight, margin))
    return tuple(terms)


def _given_elsewhere(path: Path, key: str, entry: Any) -> None:
    """A cost term's key that names a parameter the config gives elsewhere (the limits, under ``limits:``)
    or not at all (a parameter only a call passes: a row weight, a target) says where it goes (an entry
    that is no mapping is ``_mapping``'s to refuse)."""
    if not isinstance(entry, dict):
        return
    state = entry.get("state", "<state>")
    for name in entry:
        if name in COST_KEYS:
            continue
        if name in ("limit", "limits"):
            raise ConfigError(path, f"{key}.{name}", f"a term's limits are given under limits: (limits.{state}: "
                              "{lower: .., upper: ..}, or a bound b for -b, b)")
        if name in cost_parameter_names():
            raise ConfigError(path, f"{key}.{name}", f"a config gives no {name}: a call passes it, as the keyword "
                              f"{entry.get('kind', '<kind>')}_{state}_{name} (config keys: {', '.join(COST_KEYS)})")


def _check_terms(path: Path, specs: tuple, costs: tuple[CostTerm, ...]) -> None:
    """Every term a kernel computes has its parameters in ``costs:``."""
    given = {(t.kind, t.state) for t in costs}
    for i, spec in enumerate(specs):
        for kind, state in getattr(spec, "costs", ()):
            if (kind, state) not in given:
                raise ConfigError(path, f"kernels[{i}].costs", f"the term ({kind}, {state}) has no weight: add "
                                  f"{{kind: {kind}, state: {state}, weight: ...}} to costs:")


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
    limits = _read_limits(path, data["limits"], joints) if "limits" in data else ()
    costs = _read_costs(path, data["costs"], joints, limits) if "costs" in data else ()
    if costs:  # every kernel computes the terms, unless its own costs field (or defaults') says otherwise
        defaults = {"costs": [[t.kind, t.state] for t in costs], **defaults}
    specs = tuple(_spec(path, f"kernels[{i}]", _with_defaults(defaults, k), dof) for i, k in enumerate(kernels))
    _check_terms(path, specs, costs)
    return RobotConfig(robot, dof, joints, dt, specs, str(path), limits, costs)


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
CUROBO_V2_BSPLINE = {"BSPLINE_3": 3, "BSPLINE_4": 4, "BSPLINE_5": 5}
CUROBO_CONTROL_SPACES = (*CUROBO_CONTROL, *CUROBO_V2_BSPLINE)
#: the keys that make a cuRobo file's layout: robot files, then task files (v2's, v0.7's)
CUROBO_ROBOT_KEYS = ("robot_cfg", "kinematics")
CUROBO_TASK_KEYS = ("transition_model_cfg", "model")


def _curobo_key(data: Any, keys: tuple[str, ...]) -> Optional[str]:
    """The first of ``keys`` at the top level of a mapping (the layout it marks), else None."""
    return next((k for k in keys if k in data), None) if isinstance(data, dict) else None


def _unlocked_joints(path: Path, robot: dict) -> tuple[str, ...]:
    """cspace joint names less those in ``lock_joints`` (name → fixed value): the optimised joints.
    The kinematics sit under ``robot_cfg:`` or, in cuRobo v2's robot files, at the top level."""
    root = "robot_cfg.kinematics" if "robot_cfg" in robot else "kinematics"
    key = f"{root}.cspace.joint_names"
    joints = _joint_names(path, key, _get(robot, path, key))
    locked = _get(robot, path, f"{root}.lock_joints", required=False) or {}
    if not isinstance(locked, dict):
        raise ConfigError(path, f"{root}.lock_joints", "expected a mapping of joint name to locked value")
    for name in locked:
        if name not in joints:
            raise ConfigError(path, f"{root}.lock_joints.{name}", f"not a joint of {key}")
    free = tuple(j for j in joints if j not in locked)
    if not free:
        raise ConfigError(path, f"{root}.lock_joints", "locks every joint: nothing left to optimise")
    return free


#: the limits a cuRobo robot file carries under cspace: a bound per joint (or one for every joint)
CUROBO_LIMITS = (("acceleration", "max_acceleration"), ("jerk", "max_jerk"))


def _curobo_limits(path: Path, robot: dict, free: tuple[str, ...]) -> tuple:
    """``cspace.max_acceleration`` and ``cspace.max_jerk`` as limits (−b, b) of the optimised joints:
    a number for every joint, or a list over ``cspace.joint_names`` (locked joints dropped)."""
    root = "robot_cfg.kinematics" if "robot_cfg" in robot else "kinematics"
    names = _get(robot, path, f"{root}.cspace.joint_names")
    limits = []
    for state, name in CUROBO_LIMITS:
        key = f"{root}.cspace.{name}"
        value = _get(robot, path, key, required=False)
        if value is None:
            continue
        bounds = dict(zip(names, _per_joint(path, key, value, tuple(names), least=0.0)))
        upper = tuple(bounds[j] for j in free)
        limits.append((state, (tuple(-b for b in upper), upper)))
    return tuple(limits)


def _count(path: Path, key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(path, key, f"expected an integer >= {least}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class _Task:
    """A cuRobo task file's settings: the section they sit in (``transition_model_cfg`` or
    ``model``), read with that section's key paths in errors."""

    path: Path
    section: str
    settings: dict

    def get(self, key: str, required: bool = True) -> Any:
        return _get({self.section: self.settings}, self.path, f"{self.section}.{key}", required)

    def key(self, key: str) -> str:
        return f"{self.section}.{key}"


def _read_task(task_path: Path) -> _Task:
    """The task file's settings section, its control space checked first (every allowed one named)."""
    data = _read_yaml(task_path)
    section = _curobo_key(data, CUROBO_TASK_KEYS)
    if section is None:
        robot = _curobo_key(data, CUROBO_ROBOT_KEYS)
        hint = (f" (this is a cuRobo robot file, with {robot}: give it as CONFIG and the task file with --task)"
                if robot else "")
        raise ConfigError(task_path, "", "expected a cuRobo task file: its settings under transition_model_cfg: "
                          f"(cuRobo v2's transition files) or model: (v0.7's task files){hint}")
    settings = data[section]
    if not isinstance(settings, dict):
        raise ConfigError(task_path, section, f"expected a mapping of settings, got {type(settings).__name__}")
    task = _Task(task_path, section, settings)
    control = task.get("control_space")
    if control not in CUROBO_CONTROL_SPACES:
        raise ConfigError(task_path, task.key("control_space"), f"{control!r} is not supported: allowed "
                          f"{', '.join(CUROBO_CONTROL_SPACES)} (B-splines of degree 3 to 5 are cuRobo v2's)")
    return task


def _is_curobo_v2(task: _Task) -> bool:
    """cuRobo v2's settings: a transition file (transition_model_cfg:), a B-spline control space
    (v2 only), or ``model.curobo_version: 2`` (without it, POSITION and ACCELERATION under model:
    read as v0.7's)."""
    version = task.get("curobo_version", required=False)
    if version not in (None, 2, 0.7, "0.7", "2"):
        raise ConfigError(task.path, task.key("curobo_version"), f"{version!r} is not supported: allowed 2 (cuRobo "
                          "v2) or 0.7 (the default for POSITION and ACCELERATION under model:)")
    return (task.section == "transition_model_cfg" or str(version) == "2"
            or task.settings["control_space"] in CUROBO_V2_BSPLINE)


def _horizon(task: _Task, least: int, required: bool = True) -> Optional[int]:
    """The horizon (output rows). POSITION with horizon 1 is an IK or graph-planner file: no
    trajectory, said in one line."""
    horizon = task.get("horizon", required=required)
    if horizon == 1 and task.settings["control_space"] == "POSITION":
        raise ConfigError(task.path, task.key("horizon"), "1: a POSITION task with horizon 1 (cuRobo's IK and "
                          "graph-planner files) has no trajectory to step; use a trajectory-optimisation or MPC task "
                          f"file, or set {task.key('horizon')} to {least} or more")
    return None if horizon is None else _count(task.path, task.key("horizon"), horizon, 2)


def curobo_v2_spec(task: _Task, dof: int) -> Any:
    """The kernel tensorstep.compat.curobo_v2 runs for cuRobo v2 settings (float32, as cuRobo):
    POSITION → the position kernel (H ≥ 9 rows, H − 4 actions), ACCELERATION → the acceleration
    kernel, BSPLINE_3/4/5 → the B-spline kernel of that degree with ``n_knots`` knots and
    ``interpolation_steps`` rows per span (``horizon``, if given, must hold them)."""
    from .codegen.legacy_spec import LegacySpec
    from .codegen.curobo_v2_spec import CLIQUE_MIN_HORIZON, CuroboV2Spec

    control = task.settings["control_space"]
    horizon = _horizon(task, CLIQUE_MIN_HORIZON, required=control not in CUROBO_V2_BSPLINE)
    try:
        if control == "POSITION":
            mode = task.get("state_finite_difference_mode", required=False) or "CENTRAL"
            if mode != "CENTRAL":
                raise ConfigError(task.path, task.key("state_finite_difference_mode"),
                                  f"{mode!r}: cuRobo v2's position kernel is the five-point central one (allowed CENTRAL)")
            return CuroboV2Spec("clique", horizon, dof)
        if control == "ACCELERATION":
            return LegacySpec("accel_semi_euler", horizon, dof, start_index=True)
        degree = CUROBO_V2_BSPLINE[control]
        knots = _count(task.path, task.key("n_knots"), task.get("n_knots"), 1)
        steps = _count(task.path, task.key("interpolation_steps"), task.get("interpolation_steps"), 1)
        rows = (knots + degree + 1) * steps + 1
        if horizon is not None and (horizon - 1) // (knots + degree + 1) != steps:
            raise ConfigError(task.path, task.key("horizon"), f"{horizon} rows do not give {steps} rows per span for "
                              f"{knots + degree + 1} spans (n_knots + degree + 1): expected {rows} (or drop it)")
        return CuroboV2Spec("bspline", horizon or rows, dof, degree=degree, knots=knots, steps=steps)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(task.path, task.section, str(err)) from None


def load_curobo(robot_path: Path, robot: dict, task_path: Path) -> RobotConfig:
    joints = _unlocked_joints(robot_path, robot)
    limits = _curobo_limits(robot_path, robot, joints)
    task = _read_task(task_path)
    name = Path(robot_path).stem
    if _is_curobo_v2(task):
        dt_params = task.get("dt_traj_params", required=False) or {}
        if not isinstance(dt_params, dict):
            raise ConfigError(task_path, task.key("dt_traj_params"), "expected a mapping with base_dt")
        base_dt = _positive_float(task_path, task.key("dt_traj_params.base_dt"), dt_params.get("base_dt", 0.02))
        spec = curobo_v2_spec(task, len(joints))
        return RobotConfig(name, len(joints), joints, base_dt, (spec,), f"{robot_path} + {task_path}", limits)
    control = task.settings["control_space"]
    horizon = _horizon(task, 2)
    dt_params = task.get("dt_traj_params")
    if not isinstance(dt_params, dict):
        raise ConfigError(task_path, "model.dt_traj_params", "expected a mapping with base_dt")
    base_dt = _positive_float(task_path, "model.dt_traj_params.base_dt", dt_params.get("base_dt"))
    ratio = dt_params.get("base_ratio", 1.0)
    if "max_dt" in dt_params:  # a value of the traj_dt tensor passed at call time, not part of a kernel
        _positive_float(task_path, "model.dt_traj_params.max_dt", dt_params["max_dt"])
    mode = task.get("state_finite_difference_mode", required=False) or "BACKWARD"
    if mode not in CUROBO_DIFFERENCE:
        raise ConfigError(task_path, "model.state_finite_difference_mode",
                          f"{mode!r} is not supported: allowed {', '.join(CUROBO_DIFFERENCE)}")
    fields: dict[str, Any] = {"horizon": horizon, **CUROBO_CONTROL[control]}
    if control == "POSITION":
        fields.update(CUROBO_DIFFERENCE[mode])
    if ratio != 1.0:
        fields["dt"] = "per_step"
    spec = _spec(task_path, "model", fields, len(joints))
    return RobotConfig(name, len(joints), joints, base_dt, (spec,), f"{robot_path} + {task_path}", limits)


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
    robot = _curobo_key(data, CUROBO_ROBOT_KEYS)
    if robot is not None:
        if task is None:
            raise ConfigError(path, robot, "a cuRobo robot file needs its task file too (--task TASK.yml)")
        return load_curobo(path, data, Path(task))
    section = _curobo_key(data, CUROBO_TASK_KEYS)
    if section is not None:
        raise ConfigError(path, section, "this is a cuRobo task file, not a robot config: give the robot file as "
                          "CONFIG and this file with --task (tensorstep generate ROBOT.yml --task TASK.yml)")
    if task is not None:
        raise ConfigError(path, "", "--task is only for cuRobo robot files (with robot_cfg: or kinematics:)")
    return load_native(path, data)
