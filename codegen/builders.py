"""Builder registry: spec type → the function that derives its operator.

Builders register themselves (``@register(KernelSpec)``, or ``@register(KernelSpec,
control="bspline")`` for one control of a spec type); the driver looks them up. Specs
stay free of SymPy (the runtime uses them on cached loads), and no spec module imports a
builder, so there is no import cycle between a spec and its operator.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

#: (spec type, control or None) → builder; None is the type's builder for every other control
_BUILDERS: dict[tuple[type, str | None], Callable[[Any], Any]] = {}
#: modules whose import registers builders (imported on first look-up: they import SymPy)
MODULES = ("tensorstep.codegen.schemes", "tensorstep.codegen.legacy", "tensorstep.codegen.bspline_scheme",
           "tensorstep.codegen.curobo_v2_scheme")


def register(spec_type: type, control: str | None = None) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator: the operator builder of one spec type (of one of its controls, when given)."""
    def decorate(build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        _BUILDERS[(spec_type, control)] = build
        return build

    return decorate


def _lookup(spec: Any) -> Callable[[Any], Any] | None:
    return _BUILDERS.get((type(spec), getattr(spec, "control", None))) or _BUILDERS.get((type(spec), None))


def build_operator(spec: Any) -> Any:
    """The operator (codegen.operator.Operator) of any registered spec."""
    for module in MODULES:  # after the first call, a look-up in sys.modules
        importlib.import_module(module)
    build = _lookup(spec)
    if build is None:
        raise TypeError(f"no operator builder for {type(spec).__name__}; "
                        f"known: {', '.join(sorted({t.__name__ for t, _ in _BUILDERS}))}")
    return build(spec)
