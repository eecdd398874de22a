"""The kernels' C ABI: one list of (type, name) arguments per kernel entry point.

Templates, the header, cffi declarations and CUDA launches all read these lists, so the
signatures cannot drift apart. ``T`` stands for the spec's scalar type. This module is
import-light (used on the cached-load path).
"""
from __future__ import annotations

KERNELS = ("forward", "adjoint", "dt_vjp", "dt_vjp_finish", "dt_jvp")
#: Kernels are built in two libraries: the core (always) and the dt derivatives (on first use).
PARTS = {"core": ("forward", "adjoint"), "dt": ("dt_vjp", "dt_vjp_finish", "dt_jvp"), "all": KERNELS,
         # single kernels, for reading (`tensorstep show --kernel`)
         "forward": ("forward",), "adjoint": ("adjoint",), "backward": ("adjoint",),
         "dt_vjp": ("dt_vjp", "dt_vjp_finish"), "dt_jvp": ("dt_jvp",)}
START = ("p0", "v0", "a0", "j0")


def arguments(kernel: str, order: int) -> list[tuple[str, str]]:
    """Arguments of one entry point, in call order."""
    outs = range(order + 1)
    inputs = [("const T*", "u")] + [("const T*", s) for s in START] + [("const int64_t*", "idx")]
    if kernel == "forward":
        return [("int64_t", "B")] + inputs + [("const T*", "dt_in")] + [("T*", f"y{k}") for k in outs]
    if kernel == "adjoint":
        return ([("int64_t", "B")] + [("const T*", f"g{k}") for k in outs] + [("const T*", "dt_in")]
                + [("T*", "gu")] + [("T*", f"g{s}") for s in START])
    if kernel == "dt_vjp":
        return ([("int64_t", "B")] + inputs + [("const T*", f"g{k}") for k in outs]
                + [("const T*", "dt_in"), ("double*", "gc")])
    if kernel == "dt_vjp_finish":
        return [("int64_t", "B"), ("const T*", "dt_in"), ("const double*", "gc"), ("double*", "gdt")]
    if kernel == "dt_jvp":
        return ([("int64_t", "B")] + inputs + [("const T*", "du")] + [("const T*", f"d{s}") for s in START]
                + [("const T*", "dt_in"), ("const T*", "ddt_in")] + [("T*", f"ty{k}") for k in outs])
    raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")


def signature(kernel: str, order: int, ctype: str, restrict: str = "") -> str:
    """The comma-separated parameter list with T replaced by the concrete type.

    ``restrict`` ('restrict' for C, '__restrict__' for CUDA) qualifies every pointer: the
    runtime always passes distinct buffers (outputs are freshly allocated), so nothing aliases.
    """
    def param(t: str, n: str) -> str:
        t = t.replace("T*", f"{ctype}*")
        return f"{t} {restrict} {n}" if restrict and "*" in t else f"{t} {n}"

    return ", ".join(param(t, n) for t, n in arguments(kernel, order))


def symbol(name: str, kernel: str) -> str:
    """Exported symbol of one entry point of a spec (unique per spec name)."""
    return f"{name}_{kernel}"
