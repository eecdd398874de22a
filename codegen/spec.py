"""KernelSpec: the immutable, validated description of one kernel variant (docs/kernelspec.md).

This module imports nothing heavy: the runtime uses it on the cached-load path,
which must not import SymPy or Jinja2.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import numbers
import operator
from typing import Any, Mapping, Sequence

CONTROLS = ("position", "velocity", "acceleration", "jerk", "bspline")
DIFFERENCES = ("backward", "central")
INTEGRATORS = ("semi_implicit_euler", "exact")
ENDS = ("hold", "one_sided", "goal")
DT_MODES = ("uniform", "per_step", "per_trajectory")
LAYOUTS = ("bhd", "bdh")
DTYPES = ("float32", "float64")
ORDERS = (3, 4)
MAX_HORIZON = 4096
MAX_DOF = 4096
MAX_ACCURACY = 8
#: B-spline control (control="bspline"): degrees, the default degree, the ends and dt modes it allows
BSPLINE_DEGREES = (3, 7)
DEFAULT_DEGREE = 4
BSPLINE_ENDS = ("hold", "goal")
BSPLINE_DT = ("uniform", "per_trajectory")

#: Derivative index of each control mode's action (0 = position).
CONTROL_ORDER = {"position": 0, "velocity": 1, "acceleration": 2, "jerk": 3}
DERIVATIVE_NAMES = ("position", "velocity", "acceleration", "jerk", "snap")
DEFAULT_ACCURACY = {"backward": (1, 1, 1, 1), "central": (4, 4, 2, 2)}
#: the outputs a step can write, in order (P V A J, S with order=4)
OUTPUT_NAMES = ("P", "V", "A", "J", "S")
#: the cost kinds a term may have, each with the per-dof parameters it reads besides its weights:
#: "limit" (keyword ``<kind>_<state>_limit``, [2, D]: lower, upper) and "margin" (``<kind>_<state>_margin``,
#: [D]). A kind's expression is in codegen/costs.py ``KINDS``, which reads no other parameter than
#: these (and the squared position term's target); kept here, without SymPy, for the spec's and
#: the argument table's checks (tests/codegen/test_cost_kinds.py checks that the two agree)
COST_KINDS: dict[str, tuple[str, ...]] = {"squared": (), "bound": ("limit", "margin")}


def unknown_name(name: Any, allowed: Sequence[str]) -> str:
    """The hint for a misspelt field or key: "did you mean 'x'? allowed: a, b, ..." (the closest
    allowed name where one is close)."""
    close = difflib.get_close_matches(str(name), list(allowed), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}allowed: {', '.join(allowed)}"


def _beyond_order(what: str, name: Any, names: Sequence[str], order: int) -> str:
    """For a state (or output) of ``names`` (by derivative) past ``order``: that it needs a higher order,
    the spec's order, and what that order allows ("" for any other name)."""
    if name not in names[order + 1:]:
        return ""
    return (f"the {what} {name!r} needs order={names.index(name)}; the spec's order is {order}, "
            f"which allows {', '.join(names[: order + 1])}")


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"KernelSpec.{field}={value!r} is invalid: {allowed}")


def _as_int(value: Any) -> Any:
    """A plain int for any integer (int, numpy integers); anything else unchanged (bools included)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    return value


def _check_int(field: str, value: Any, lo: int, hi: int) -> int:
    value = _as_int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, value, f"expected an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise _fail(field, value, f"expected an integer in [{lo}, {hi}]")
    return value


def _as_dtype(value: Any) -> Any:
    """'float32'/'float64' for those strings and for torch.float32/float64 or NumPy's dtypes (by
    their text, so this module needs neither library); anything else unchanged."""
    if isinstance(value, str):
        return value
    text = str(value)
    text = text[len("torch."):] if text.startswith("torch.") else text
    return text if text in DTYPES else value


#: field → the controls that use it (fields not listed mean something for every control)
RELEVANT = {
    "difference": ("position",),
    "accuracy": ("position",),
    "end": ("position", "bspline"),
    "integrator": ("velocity", "acceleration", "jerk"),
    "degree": ("bspline",),
    "knots": ("bspline",),
    "steps": ("bspline",),
}
#: fields that exist only for some controls: None elsewhere, and absent from to_dict (so existing
#: specs keep their dicts, keys and banners)
OPTIONAL_FIELDS = ("degree", "knots", "steps")


def _check_choice(field: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise _fail(field, value, "allowed: " + ", ".join(repr(a) for a in allowed))
    return value


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel variant. Immutable and hashable; invalid combinations raise ValueError."""

    horizon: Any = None  # required, except for control="bspline" (derived: R = T·s + 1)
    dof: Any = None  # required
    control: str = "position"
    difference: str = "central"
    accuracy: Any = None
    integrator: str = "semi_implicit_euler"
    end: str = "hold"
    dt: str = "uniform"
    start_index: bool = False
    layout: str = "bhd"
    dtype: str = "float32"
    order: int = 3
    goal_index: bool = False
    degree: Any = None  # B-spline degree D (control="bspline"; default 4)
    knots: Any = None  # B-spline free control points n (control="bspline")
    steps: Any = None  # B-spline output rows per span s (control="bspline")
    costs: Any = ()  # cost terms (kind, state) computed inside the step, in the order of the cost output
    outputs: Any = None  # the states written, a subset of P, V, A, J (S) in order; default all

    def __new__(cls, *args: Any, **kwargs: Any) -> "KernelSpec":
        # Python's own "unexpected keyword argument" names no field: say the closest and the allowed
        for name in kwargs:
            if name not in cls.__dataclass_fields__:
                raise TypeError(f"KernelSpec() got an unexpected keyword argument {name!r} "
                                f"({unknown_name(name, tuple(cls.__dataclass_fields__))})")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.dof is None:
            raise _fail("dof", self.dof, f"required: an integer in [1, {MAX_DOF}]")
        if self.control == "bspline":
            self._check_bspline()
        elif self.horizon is None:
            raise _fail("horizon", self.horizon, f"required: an integer in [2, {MAX_HORIZON}]")
        object.__setattr__(self, "horizon", _check_int("horizon", self.horizon, 2, MAX_HORIZON))
        object.__setattr__(self, "dof", _check_int("dof", self.dof, 1, MAX_DOF))
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))
        object.__setattr__(self, "order", _as_int(self.order))
        _check_choice("control", self.control, CONTROLS)
        _check_choice("difference", self.difference, DIFFERENCES)
        _check_choice("integrator", self.integrator, INTEGRATORS)
        _check_choice("end", self.end, ENDS)
        _check_choice("dt", self.dt, DT_MODES)
        if not isinstance(self.start_index, bool):
            raise _fail("start_index", self.start_index, "expected True or False")
        if self.end == "goal" and self.control not in ("position", "bspline"):
            raise _fail("end", self.end, "end='goal' needs control='position' or 'bspline' "
                        f"(got control={self.control!r}); "
                        "integration control allows 'hold', 'one_sided'")
        if self.end == "goal" and self.horizon < 3:
            raise _fail("horizon", self.horizon, "end='goal' needs at least 3 rows (start, one action, goal)")
        if not isinstance(self.goal_index, bool):
            raise _fail("goal_index", self.goal_index, "expected True or False")
        if self.goal_index and self.end != "goal":
            raise _fail("goal_index", self.goal_index, f"goal_index=True needs end='goal' (got end={self.end!r})")
        _check_choice("layout", self.layout, LAYOUTS)
        if self.dtype not in DTYPES:
            raise _fail("dtype", self.dtype, "allowed: 'float32', 'float64' (or torch.float32, torch.float64)")
        if isinstance(self.order, bool) or self.order not in ORDERS:
            raise _fail("order", self.order, "allowed: 3 (up to jerk), 4 (up to snap)")
        object.__setattr__(self, "accuracy", self._normalise_accuracy(self.accuracy))
        object.__setattr__(self, "costs", self._normalise_costs(self.costs))
        object.__setattr__(self, "outputs", self._normalise_outputs(self.outputs))
        self._refuse_irrelevant()

    def _check_bspline(self) -> None:
        """degree, knots, steps, end and dt of a B-spline; the horizon derived (R = T·s + 1), and
        a given horizon that differs refused."""
        if self.degree is None:
            object.__setattr__(self, "degree", DEFAULT_DEGREE)
        lo, hi = BSPLINE_DEGREES
        object.__setattr__(self, "degree", _check_int("degree", self.degree, lo, hi))
        for field in ("knots", "steps"):
            if getattr(self, field) is None:
                raise _fail(field, None, f"control='bspline' needs {field}: an integer in [1, {MAX_HORIZON}]")
            object.__setattr__(self, field, _check_int(field, getattr(self, field), 1, MAX_HORIZON))
        if self.end not in BSPLINE_ENDS:
            raise _fail("end", self.end, "control='bspline' allows 'hold', 'goal'")
        if self.dt not in BSPLINE_DT:
            raise _fail("dt", self.dt, "control='bspline' allows 'uniform', 'per_trajectory' "
                        "(one step duration per trajectory; per-step durations would make the spline non-uniform)")
        derived = bspline_horizon(self.degree, self.knots, self.steps, self.end)
        if derived > MAX_HORIZON:
            raise _fail("knots", self.knots,
                        f"the derived horizon (T·steps + 1 = {derived} rows) exceeds {MAX_HORIZON}")
        given = _as_int(self.horizon)
        if given is not None and given != derived:
            raise _fail("horizon", self.horizon, f"control='bspline' with degree={self.degree}, knots={self.knots}, "
                        f"steps={self.steps}, end={self.end!r} has {derived} rows (T·steps + 1); "
                        f"give horizon={derived} or leave it out")
        object.__setattr__(self, "horizon", derived)

    def _refuse_irrelevant(self) -> None:
        """A field the control does not use must keep its default: a set value would be ignored."""
        defaults = {"difference": "central", "end": "hold", "integrator": "semi_implicit_euler",
                    "accuracy": DEFAULT_ACCURACY["central"][: self.order], "degree": None, "knots": None,
                    "steps": None}
        for field, controls in RELEVANT.items():
            value = getattr(self, field)
            if self.control not in controls and value != defaults[field]:
                where = "/".join(controls) + " control"
                raise ValueError(f"KernelSpec.{field}={value!r} means nothing for control={self.control!r} "
                                 f"(it applies to {where}); leave it at its default {defaults[field]!r}")

    def _normalise_accuracy(self, accuracy: Any) -> tuple[int, ...]:
        """Return one accuracy per derivative 1..order (a tuple), validating parity for central."""
        n = self.order
        if accuracy is None:
            values = DEFAULT_ACCURACY[self.difference][:n]
        elif isinstance(accuracy, bool):
            raise _fail("accuracy", accuracy, "expected an int or a tuple of ints")
        elif isinstance(_as_int(accuracy), int):
            values = (_as_int(accuracy),) * n
        elif isinstance(accuracy, (tuple, list)) and all(
            isinstance(_as_int(a), int) and not isinstance(a, bool) for a in accuracy
        ):
            values = tuple(_as_int(a) for a in accuracy)
            if len(values) == 3 and n == 4:
                values = values + (DEFAULT_ACCURACY[self.difference][3],)
            if len(values) != n:
                raise _fail("accuracy", accuracy, f"expected an int or a tuple of {n} ints (one per derivative)")
        else:
            raise _fail("accuracy", accuracy, "expected an int or a tuple of ints")
        for a in values:
            if not 1 <= a <= MAX_ACCURACY:
                raise _fail("accuracy", accuracy, f"each accuracy must be in [1, {MAX_ACCURACY}]")
            if self.difference == "central" and a % 2:
                raise _fail("accuracy", accuracy, "central differences need even accuracies (2, 4, 6, 8)")
        return tuple(values)

    def _normalise_costs(self, costs: Any) -> tuple[tuple[str, str], ...]:
        """Cost terms as a tuple of (kind, state) pairs, each known and at most once."""
        states = DERIVATIVE_NAMES[: self.order + 1]
        if isinstance(costs, (str, bytes)) or not isinstance(costs, (tuple, list)):
            raise _fail("costs", costs, "expected a tuple of (kind, state) pairs, e.g. (('bound', 'velocity'),)")
        terms = []
        for term in costs:
            if not (isinstance(term, (tuple, list)) and len(term) == 2 and all(isinstance(x, str) for x in term)):
                one = len(costs) == 2 and all(isinstance(x, str) for x in costs)  # one term, not in a tuple
                hint = f" (one term is given as a tuple of it: costs=({tuple(costs)!r},))" if one else ""
                raise _fail("costs", costs, f"each term is a (kind, state) pair of strings, got {term!r}{hint}")
            kind, state = term
            if kind not in COST_KINDS:
                raise _fail("costs", costs, f"unknown kind {kind!r} ({unknown_name(kind, COST_KINDS)})")
            if state not in states:
                raise _fail("costs", costs, _beyond_order("state", state, DERIVATIVE_NAMES, self.order)
                            or f"unknown state {state!r} ({unknown_name(state, states)})")
            if (kind, state) in terms:
                raise _fail("costs", costs, f"the term ({kind!r}, {state!r}) is listed twice")
            terms.append((kind, state))
        return tuple(terms)

    def _normalise_outputs(self, outputs: Any) -> tuple[str, ...]:
        """The written states, given in output order (default: every state of the order)."""
        allowed = OUTPUT_NAMES[: self.order + 1]
        if outputs is None:
            return allowed
        if isinstance(outputs, str):
            outputs = tuple(outputs)
        if not isinstance(outputs, (tuple, list)) or not all(isinstance(o, str) for o in outputs):
            raise _fail("outputs", outputs, f"expected a tuple of output names from {', '.join(allowed)}")
        for o in outputs:
            if o not in allowed:
                raise _fail("outputs", outputs, _beyond_order("output", o, OUTPUT_NAMES, self.order)
                            or f"unknown output {o!r} ({unknown_name(o, allowed)})")
        if len(set(outputs)) != len(outputs):
            raise _fail("outputs", outputs, "each output at most once")
        if not outputs and not self.costs:
            raise _fail("outputs", outputs, "a step without costs must write at least one output")
        ordered = tuple(o for o in allowed if o in outputs)
        if tuple(outputs) != ordered:  # the step returns them in this order: another would swap states on unpacking
            raise _fail("outputs", outputs, f"give the states in the order the step returns them, {ordered!r}; "
                        f"got {tuple(outputs)!r}")
        return ordered

    # ---- derived properties -------------------------------------------------------------
    @property
    def n_actions(self) -> int:
        """Rows of the action tensor u (N = H - 1; H - 2 with end="goal", whose last row is the goal;
        the knots n of a B-spline)."""
        if self.control == "bspline":
            return self.knots
        return self.horizon - (2 if self.end == "goal" else 1)

    @property
    def n_dt(self) -> int:
        """Entries of the dt vector the kernel reads per trajectory (1 uniform or per trajectory, H per step)."""
        return self.horizon if self.dt == "per_step" else 1

    @property
    def control_order(self) -> int:
        return CONTROL_ORDER[self.control]

    @property
    def integrates(self) -> bool:
        """Integration control: each output row reads earlier rows (a recurrence, not a stencil)."""
        return self.control in ("velocity", "acceleration", "jerk")


    @property
    def name(self) -> str:
        """A stable, valid C identifier derived from the fields (never from user strings)."""
        parts = ["ts", f"h{self.horizon}", f"d{self.dof}", self.control[:3]]
        if self.control == "position":
            parts += [self.difference[:3], "a" + "".join(str(a) for a in self.accuracy), self.end.replace("_", "")]
        elif self.control == "bspline":
            parts += [f"p{self.degree}", f"n{self.knots}", f"s{self.steps}", self.end]
        else:
            parts += ["semi" if self.integrator == "semi_implicit_euler" else "exact"]
        parts += [
            {"uniform": "dtu", "per_step": "dts", "per_trajectory": "dtb"}[self.dt],
            "idx" if self.start_index else "noidx",
            self.layout,
            "f32" if self.dtype == "float32" else "f64",
            f"o{self.order}",
        ]
        if self.goal_index:  # new options only add parts: existing names stay as they were
            parts.append("gidx")
        if self.outputs != OUTPUT_NAMES[: self.order + 1]:
            parts.append("out" + "".join(self.outputs).lower())
        for kind, state in self.costs:
            parts.append(f"{kind[0]}{state[0]}")
        return "_".join(parts)

    @property
    def key(self) -> str:
        """Short content hash of the spec (stable across runs and machines)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["accuracy"] = list(self.accuracy)
        if not self.goal_index:  # absent at its default: existing specs keep their dicts, keys and banners
            del d["goal_index"]
        for field in OPTIONAL_FIELDS:
            if d[field] is None:
                del d[field]
        if not self.costs:  # absent at their defaults, as goal_index
            del d["costs"]
        else:
            d["costs"] = [list(t) for t in self.costs]
        if self.outputs == OUTPUT_NAMES[: self.order + 1]:
            del d["outputs"]
        else:
            d["outputs"] = list(self.outputs)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelSpec":
        fields = tuple(f.name for f in dataclasses.fields(cls))
        unknown = [name for name in data if name not in fields]
        if unknown:
            raise ValueError(f"unknown KernelSpec field {unknown[0]!r} ({unknown_name(unknown[0], fields)})")
        kwargs = dict(data)
        if isinstance(kwargs.get("accuracy"), list):
            kwargs["accuracy"] = tuple(kwargs["accuracy"])
        if isinstance(kwargs.get("costs"), list):
            kwargs["costs"] = tuple(tuple(t) if isinstance(t, list) else t for t in kwargs["costs"])
        if isinstance(kwargs.get("outputs"), list):
            kwargs["outputs"] = tuple(kwargs["outputs"])
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "KernelSpec":
        return dataclasses.replace(self, **changes)


def as_spec(spec: Any, caller: str) -> Any:
    """A KernelSpec from a dict of its fields (the argument of ``ts.<caller>``); a spec (a cuRobo kernel's
    too) as it is; a TypeError saying what to pass for anything else."""
    if isinstance(spec, Mapping):
        return KernelSpec.from_dict(spec)
    if not all(hasattr(spec, field) for field in ("name", "horizon", "dof", "dtype")):
        raise TypeError(f"ts.{caller}: expected a KernelSpec, e.g. ts.{caller}(ts.KernelSpec(horizon=32, dof=7)), "
                        f"or a dict of its fields, got {type(spec).__name__}")
    return spec


def spec_from_dict(data: Any) -> Any:
    """A spec from its ``to_dict()`` (manifests, kernel keys): a KernelSpec, or a cuRobo kernel's
    (codegen/legacy_spec.py, codegen/curobo_v2_spec.py)."""
    if isinstance(data, dict) and "curobo_v2" in (data.get("spec"), data.get("family")):
        from .curobo_v2_spec import CuroboV2Spec

        return CuroboV2Spec.from_dict(data)
    if isinstance(data, dict) and "kind" in data:
        from .legacy_spec import LegacySpec

        return LegacySpec(**data)
    return KernelSpec.from_dict(data)


def bspline_horizon(degree: int, knots: int, steps: int, end: str) -> int:
    """R = T·s + 1 rows for T = m − D spans of m = (D+1) + n + (D+1 with a goal, D holding) control points."""
    spans = knots + degree + (2 if end == "goal" else 1)
    return spans * steps + 1
