"""CuroboV2Spec: cuRobo v2's position and B-spline kernels as variants of the one generator.

Import-light (no SymPy): the compat layer (tensorstep.compat.curobo_v2) loads cached kernels
through it; codegen.curobo_v2_scheme builds the operators (registered in codegen.builders).

Both kernels read, per trajectory, a start state picked by ``start_index``, one step
duration (dt="per_trajectory") and one goal state (end="goal", one row per trajectory): the
compat layer gathers the goal rows, the dt and cuRobo's per-goal flag before the call, so
one generic kernel serves every flag pattern.

- ``clique``: cuRobo v2's central-difference position kernel, H output rows, H − 4 actions;
  the goal position is the held value L (the goal, or the last action when the flag is off).
- ``bspline``: ``knots`` knots of degree 3–5, ``steps`` rows per span, ``horizon`` rows; the
  goal state is the tail's boundary state ((u_{n−1}, 0, 0, 0) when the flag is off).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

KINDS = ("clique", "bspline")
CLIQUE_MIN_HORIZON = 9
BSPLINE_DEGREES = (3, 4, 5)
MAX_ROWS = 4096


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"CuroboV2Spec.{field}={value!r} is invalid: {allowed}")


#: the key naming the spec type in its dict (manifests, kernel keys); earlier versions wrote "family",
#: a word the argument table keeps for kernel families
SPEC_TAG, OLD_SPEC_TAG = "spec", "family"


@dataclasses.dataclass(frozen=True)
class CuroboV2Spec:
    """One of cuRobo v2's kernels at a row count, dof and dtype (B-spline: degree, knots, steps)."""

    kind: str
    horizon: int  # output rows
    dof: int
    dtype: str = "float32"
    degree: int = 0  # B-spline only
    knots: int = 0
    steps: int = 0  # rows per span
    layout: str = "bhd"

    # what the argument table reads: an indexed start, one goal row and one dt per trajectory
    order = 3
    start_index = True
    end = "goal"
    goal_index = False
    dt = "per_trajectory"
    n_dt = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _fail("kind", self.kind, f"allowed {', '.join(map(repr, KINDS))}")
        if not _int(self.dof) or not 1 <= self.dof <= MAX_ROWS:
            raise _fail("dof", self.dof, f"expected an integer in [1, {MAX_ROWS}]")
        if self.dtype not in ("float32", "float64"):
            raise _fail("dtype", self.dtype, "allowed 'float32', 'float64'")
        if self.layout != "bhd":
            raise _fail("layout", self.layout, "cuRobo's tensors are [B, rows, dof]: allowed 'bhd'")
        if not _int(self.horizon) or self.horizon > MAX_ROWS:
            raise _fail("horizon", self.horizon, f"expected an integer up to {MAX_ROWS}")
        if self.kind == "clique":
            if (self.degree, self.knots, self.steps) != (0, 0, 0):
                raise ValueError("CuroboV2Spec: degree, knots and steps are for kind='bspline' only")
            if self.horizon < CLIQUE_MIN_HORIZON:
                raise _fail("horizon", self.horizon, f"the position kernel needs H >= {CLIQUE_MIN_HORIZON} "
                            "(cuRobo reads outside its tensors below that)")
            return
        if self.degree not in BSPLINE_DEGREES or not _int(self.degree):
            raise _fail("degree", self.degree, f"allowed {', '.join(map(str, BSPLINE_DEGREES))}")
        if not _int(self.knots) or self.knots < self.degree:
            raise _fail("knots", self.knots, f"degree {self.degree} needs at least {self.degree} knots (with fewer, "
                        "a span is both a start and a goal boundary)")
        if not _int(self.steps) or self.steps < 1:
            raise _fail("steps", self.steps, "expected an integer >= 1 (rows per span)")
        if self.horizon < self.spans * self.steps + 1:
            raise _fail("horizon", self.horizon, f"{self.spans} spans of {self.steps} rows need at least "
                        f"{self.spans * self.steps + 1} rows")

    @property
    def spans(self) -> int:
        """T = n + D + 1 spans (B-spline)."""
        return self.knots + self.degree + 1

    @property
    def n_actions(self) -> int:
        return self.horizon - 4 if self.kind == "clique" else self.knots

    @property
    def name(self) -> str:
        parts = ["ts_curobo2", self.kind]
        if self.kind == "bspline":
            parts += [f"deg{self.degree}", f"n{self.knots}", f"s{self.steps}"]
        parts += [f"h{self.horizon}", f"d{self.dof}", "f32" if self.dtype == "float32" else "f64"]
        return "_".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {SPEC_TAG: "curobo_v2", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CuroboV2Spec":
        fields = {k: v for k, v in data.items() if k not in (SPEC_TAG, OLD_SPEC_TAG)}
        return cls(**fields)

    def replace(self, **changes: Any) -> "CuroboV2Spec":
        return dataclasses.replace(self, **changes)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
