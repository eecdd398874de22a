"""The kernels' C ABI, derived from the argument table (codegen/arguments.py).

Every entry point takes the batch size B and then pointers, in an order that follows the
table: the forward reads the inputs and writes the outputs; the adjoint reads the output
gradients and writes the inputs' gradients; the dt kernels add what they need. Templates,
headers, cffi declarations, CUDA launches and the native node all use these lists. ``T``
stands for the spec's scalar type. Import-light (used on the cached-load path).
"""
from __future__ import annotations

from .arguments import INDEX, ArgumentTable

KERNELS = ("forward", "adjoint", "dt_vjp", "dt_vjp_finish", "dt_jvp")
#: Kernels are built in three libraries, each when first needed: the core (forward and adjoint)
#: when a step loads, the dt gradient's kernels on the first gradient with respect to dt, the dt
#: tangent's on the first forward-mode derivative in dt (which most programs never take).
LIBRARIES = {"core": ("forward", "adjoint"), "dt_vjp": ("dt_vjp", "dt_vjp_finish"), "dt_jvp": ("dt_jvp",)}
#: each library in words (messages)
LIBRARY_ROLES = {"core": "forward and adjoint", "dt_vjp": "dt gradient", "dt_jvp": "dt tangent"}
#: What can be generated: a library, both dt libraries ("dt"), everything, or one kernel for reading
#: (`tensorstep show --kernel`).
PARTS = {**LIBRARIES, "dt": ("dt_vjp", "dt_vjp_finish", "dt_jvp"), "all": KERNELS,
         "forward": ("forward",), "adjoint": ("adjoint",), "backward": ("adjoint",)}


def part_kernels(part: str, table: ArgumentTable | None = None) -> tuple[str, ...]:
    """The kernels of a part (``PARTS``) a spec has: a fused step (cost terms, or some states not
    written) has no dt kernels of its own (its dt derivatives run its plain twin's: runtime/costs.py)."""
    kernels = PARTS[part]
    if table is not None and table.fused:
        kernels = tuple(k for k in kernels if k in LIBRARIES["core"])
    return kernels


def units(part: str, table: ArgumentTable | None = None) -> tuple[str, ...]:
    """What each C translation unit of a part compiles (``-DTS_UNIT=i`` is the i-th, from 1): an
    entry point each, and dt_jvp's once-per-call tangent program one of its own (with a duration
    per step its interior rows are a loop as long to compile as the kernel; elsewhere that unit is
    empty). The runtime compiles a library's units side by side and links them.

    >>> units("core"), units("dt_jvp")
    (('forward', 'adjoint'), ('dt_jvp', 'coefficients_jvp'))
    """
    kernels = part_kernels(part, table)
    return kernels + (("coefficients_jvp",) if "dt_jvp" in kernels else ())


def library(kernel: str) -> str:
    """The library a kernel is built in.

    >>> library("dt_vjp_finish")
    'dt_vjp'
    """
    for name, kernels in LIBRARIES.items():
        if kernel in kernels:
            return name
    raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")

#: batch elements per row of the C dt_vjp's partial sums: a row per chunk, added in order, so the
#: dt gradient is the same for any number of OpenMP threads (the runtime allocates the rows)
C_DT_VJP_CHUNK = 64

Parameter = tuple[str, str]  # (C type with T for the scalar, name)


def _reads(table: ArgumentTable) -> list[Parameter]:
    """The inputs other than dt, as read-only pointers (indices are int64)."""
    return [("const int64_t*" if a.dtype == INDEX else "const T*", a.c_name) for a in table.tensors]


def arguments(kernel: str, table: ArgumentTable) -> list[Parameter]:
    """Parameters of one entry point, in call order."""
    batch: list[Parameter] = [("int64_t", "B")]
    dt: list[Parameter] = [("const T*", table.dt.c_name)]
    grads = [("const T*", y.grad_name) for y in table.outputs]
    if kernel == "forward":
        return batch + _reads(table) + dt + [("T*", y.c_name) for y in table.outputs]
    if kernel == "adjoint":  # with cost terms it recomputes the rows: it reads the inputs too
        return (batch + (_reads(table) if table.fused else []) + grads + dt
                + [("T*", a.grad_name) for a in table.differentiable])
    if kernel == "dt_vjp":
        values = [("const T*", v.c_name) for v in table.values]  # an integrator's forward outputs
        return batch + _reads(table) + values + grads + dt + [("double*", "gc")]
    if kernel == "dt_vjp_finish":
        return batch + dt + [("const double*", "gc"), ("double*", "gdt")]
    if kernel == "dt_jvp":
        return (batch + _reads(table) + [("const T*", a.tangent_name) for a in table.differentiable] + dt
                + [("const T*", "ddt_in")] + [("T*", y.tangent_name) for y in table.outputs])
    raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")


#: CUDA runs the coefficient program once per call, in kernels of its own, not in every thread:
#: ``coefficients`` fills the table C (one thread, or one per trajectory), ``coefficients_jvp`` the
#: tables C and CD of dt_jvp. The per-element kernels that read the table take it as one more
#: argument, ``coef_g`` (``cuda_table``).
CUDA_TABLES = {"forward": "coefficients", "adjoint": "coefficients", "dt_vjp": "coefficients",
               "dt_jvp": "coefficients_jvp"}


def cuda_table(kernel: str, table: ArgumentTable) -> str | None:
    """The kernel that fills the coefficient table a CUDA per-element kernel reads, or None. A
    stencil's dt_vjp reads none: its outputs are sums of coefficient x input, so the gradient of a
    coefficient is a sum of output gradient x input, with no coefficient in it (a recurrence's,
    which reads the forward's values, holds the coefficients of the rows after)."""
    if kernel == "dt_vjp" and not table.values:
        return None
    return CUDA_TABLES.get(kernel)


def cuda_kernels(kernels: tuple[str, ...], table: ArgumentTable | None = None,
                 inline: bool = False) -> tuple[str, ...]:
    """The CUDA entry points of a library with these kernels: the once-per-call kernels they need,
    then the kernels. dt_vjp reads the table the core library's kernel fills (always loaded);
    ``inline`` kernels compute their coefficients in each thread, and no table kernel exists. A
    step with cost terms adds each trajectory's dof columns of its terms after the forward
    (``cost_sum``).

    >>> cuda_kernels(("forward", "adjoint")), cuda_kernels(("forward", "adjoint"), inline=True)
    (('coefficients', 'forward', 'adjoint'), ('forward', 'adjoint'))
    """
    extra = [k for k, needed in (("coefficients", {"forward", "adjoint"} & set(kernels)),
                                 ("coefficients_jvp", "dt_jvp" in kernels)) if needed and not inline]
    after = ("cost_sum",) if table is not None and table.costs and "forward" in kernels else ()
    return (*extra, *kernels, *after)


def cuda_arguments(kernel: str, table: ArgumentTable) -> list[Parameter]:
    """Parameters of one CUDA entry point: the C ABI's (``arguments``) plus the coefficient table
    for the per-element kernels that read it, or those of a once-per-call kernel. dt_vjp_finish
    writes the gradient in the spec's type and takes dt_vjp's row count, the doubles from a row to
    the next and a buffer for the rows' sums (unused, null, with a dt per trajectory)."""
    batch: list[Parameter] = [("int64_t", "B")]
    dt: list[Parameter] = [("const T*", table.dt.c_name)]
    if kernel == "coefficients":
        return batch + dt + [("T*", "coef_g")]
    if kernel == "coefficients_jvp":
        return batch + dt + [("const T*", "ddt_in"), ("T*", "coef_g")]
    if kernel == "dt_vjp_finish":
        return batch + dt + [("const double*", "gc"), ("T*", "gdt"), ("int64_t", "rows"), ("int64_t", "stride"),
                                                   ("double*", "sums")]
    if kernel == "cost_sum":
        return batch + [("const double*", "cpart"), ("T*", "cost")]
    partials = [("double*", "cpart")] if kernel == "forward" and table.costs else []
    return arguments(kernel, table) + ([("const T*", "coef_g")] if cuda_table(kernel, table) else []) + partials


def signature(kernel: str, table: ArgumentTable, ctype: str, restrict: str = "", cuda: bool = False) -> str:
    """The comma-separated parameter list with T replaced by the concrete type.

    ``restrict`` ('restrict' for C, '__restrict__' for CUDA) qualifies every pointer: the
    runtime always passes distinct buffers (outputs are freshly allocated), so nothing aliases.
    ``cuda``: the CUDA entry point's parameters (``cuda_arguments``).
    """
    def param(t: str, n: str) -> str:
        t = t.replace("T*", f"{ctype}*")
        return f"{t} {restrict} {n}" if restrict and "*" in t else f"{t} {n}"

    return ", ".join(param(t, n) for t, n in (cuda_arguments if cuda else arguments)(kernel, table))


def symbol(name: str, kernel: str) -> str:
    """Exported symbol of one entry point of a spec (unique per spec name)."""
    return f"{name}_{kernel}"
