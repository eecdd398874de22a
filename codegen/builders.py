"""Builder registry: spec type → the function that derives its operator.

Builders register themselves (``@register(KernelSpec)``); the driver looks them up. Specs
stay free of SymPy (the runtime uses them on cached loads), and no spec module imports a
builder, so there is no import cycle between a spec and its operator.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

_BUILDERS: dict[type, Callable[[Any], Any]] = {}
#: modules whose import registers builders (imported on first look-up: they import SymPy)
MODULES = ("tensorstep.codegen.schemes", "tensorstep.codegen.legacy", "tensorstep.codegen.legacy_v2")


def register(spec_type: type) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator: the operator builder of one spec type."""
    def decorate(build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        _BUILDERS[spec_type] = build
        return build

    return decorate


def build_operator(spec: Any) -> Any:
    """The operator (codegen.operator.Operator) of any registered spec."""
    if type(spec) not in _BUILDERS:
        for module in MODULES:
            importlib.import_module(module)
    try:
        build = _BUILDERS[type(spec)]
    except KeyError:
        raise TypeError(f"no operator builder for {type(spec).__name__}; "
                        f"known: {', '.join(t.__name__ for t in _BUILDERS)}") from None
    return build(spec)
