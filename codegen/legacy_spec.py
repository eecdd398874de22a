"""LegacySpec: cuRobo's fixed kernels as variants of the one generator (docs/compat_curobo.md).

Import-light (no SymPy): the compat layer loads cached kernels through it. The operators
themselves are built by codegen.legacy (registered in codegen.builders), on the same IR
as native specs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

#: kind → (minimum horizon, actions rows as a function of H, dt entries as a function of H)
KINDS = {
    "clique_backward": (2, lambda H: H, lambda H: 1),
    "clique_central": (8, lambda H: H - 4, lambda H: 1),
    "accel_semi_euler": (2, lambda H: H, lambda H: H),
    "accel_rk2": (2, lambda H: H, lambda H: H),
}


@dataclasses.dataclass(frozen=True)
class LegacySpec:
    """One of cuRobo's legacy kernels at a horizon, dof and dtype."""

    kind: str
    horizon: int
    dof: int
    dtype: str = "float32"
    start_index: bool = False
    layout: str = "bhd"
    order: int = 3

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LegacySpec.kind={self.kind!r} is invalid: allowed {', '.join(KINDS)}")
        minimum = KINDS[self.kind][0]
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or not minimum <= self.horizon <= 4096:
            raise ValueError(f"LegacySpec.horizon={self.horizon!r} is invalid: {self.kind} needs an integer in [{minimum}, 4096]")
        if isinstance(self.dof, bool) or not isinstance(self.dof, int) or not 1 <= self.dof <= 4096:
            raise ValueError(f"LegacySpec.dof={self.dof!r} is invalid: expected an integer in [1, 4096]")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"LegacySpec.dtype={self.dtype!r} is invalid: allowed 'float32', 'float64'")

    @property
    def n_actions(self) -> int:
        return KINDS[self.kind][1](self.horizon)

    @property
    def n_dt(self) -> int:
        return KINDS[self.kind][2](self.horizon)

    @property
    def dt(self) -> str:
        return "uniform" if self.n_dt == 1 else "per_step"

    @property
    def integrates(self) -> bool:
        """cuRobo's acceleration kernels integrate (each row reads earlier rows); its position ones are stencils."""
        return self.kind.startswith("accel")

    @property
    def name(self) -> str:
        return "_".join(["ts_legacy", self.kind, f"h{self.horizon}", f"d{self.dof}",
                         "idx" if self.start_index else "noidx", "f32" if self.dtype == "float32" else "f64"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
