"""Launching a spec's kernels on torch tensors (allocation, pointers, layouts).

Inputs are assumed validated (runtime.validate) and contiguous. The backend object
supplies ``call(kernel, B, args)`` for C (cffi) or CUDA (CuPy); everything else here is
backend-neutral.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..codegen import abi
from ..codegen.arguments import REQUIRED, Argument, ArgumentTable, table
from ..codegen.targets import C
from . import memory
from .unbuilt import UNBUILT, raise_unbuilt
from .validate import cost_parameter

Tensor = torch.Tensor
OptTensor = Optional[Tensor]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def capturing() -> bool:
    """A CUDA graph capture is under way on the current stream (never on builds without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def warm_up_first(what: str) -> RuntimeError:
    """The error for work that cannot happen inside a CUDA graph capture."""
    return RuntimeError(
        f"tensorstep: {what} during CUDA graph capture, where nothing may be allocated, compiled or loaded; "
        "run one call outside the capture first (with the same float dt, and with dt gradients if the "
        "captured work needs them), or call step.prepare(dt=..., dt_grad=True) before capturing")


def ptr(t: OptTensor) -> int:
    return 0 if t is None else t.data_ptr()


def pointers(tensors: Sequence[OptTensor]) -> list[int]:
    """``ptr`` of each tensor (one call for a whole argument list: the hot calls pass dozens)."""
    return [0 if t is None else t.data_ptr() for t in tensors]


def contiguous(t: OptTensor) -> OptTensor:
    return None if t is None else t.contiguous()


#: batch sizes whose shapes a launcher keeps
KEPT_BATCH_SIZES = 64


def _kept(kept: dict, B: Any, shapes: Callable[[], list]) -> list:
    """Shapes for a batch of B, worked out on its first call and kept for up to KEPT_BATCH_SIZES
    sizes: a small call would spend more on working them out than on its kernel. Not kept while
    Dynamo traces (a dict it sees change fails its guards) or for a symbolic B (no dict key)."""
    if torch.compiler.is_compiling() or not isinstance(B, int):
        return shapes()
    found = kept.get(B)
    if found is None:
        found = shapes()
        if len(kept) < KEPT_BATCH_SIZES:
            kept[B] = found
    return found


class Launcher:
    """The entry points of one spec on one device, with shapes and pointer lists from its
    argument table. Tensor inputs come in table order (``table.tensors``), dt separately."""

    def __init__(self, spec: Any, backend: Any):
        self.spec = spec
        self.backend = backend
        self.table: ArgumentTable = table(spec)
        self.dtype = DTYPES[spec.dtype]
        self.K = len(self.table.outputs)
        #: dt="per_trajectory": dt is [B], one step duration per trajectory
        self.per_trajectory = self.table.dt.shape == ("B",)
        #: a fused step's cost parameters' places among the tensor inputs (data: no gradient), and
        #: every other input's (runtime/autograd.py ``FusedStepFunction``)
        self.parameter_places = tuple(i for i, a in enumerate(self.table.tensors) if cost_parameter(a))
        self.variable_places = tuple(i for i in range(len(self.table.tensors)) if i not in self.parameter_places)
        self._adjoint_shapes: dict[int, list[tuple[int, ...]]] = {}
        self._output_shapes: dict[int, list[tuple[int, ...]]] = {}
        #: what keeps a CUDA backend's kernels loaded for the native node while this launcher lives
        #: (runtime/native.py ``_cuda_handle``)
        self.native_anchor: Optional[torch.Tensor] = None

    def prepare(self, dt_grad: bool) -> None:
        """Load now what later calls would load lazily (the dt kernels: gradients and tangents)."""
        if dt_grad:
            for library in ("dt_vjp", "dt_jvp"):
                self.backend.load_part(library)

    def output_shape(self, B: int) -> tuple[int, ...]:
        """Shape of each state output (P, V, A, J[, S]) for a batch of B."""
        return self.table.physical(self.table.outputs[0], {"B": B})

    def output_shapes(self, B: int) -> list[tuple[int, ...]]:
        """Shape of every output in order (the states, then a fused step's cost [B, T]), kept for
        a few batch sizes (``_kept``)."""
        return _kept(self._output_shapes, B, lambda: [self.table.physical(y, {"B": B}) for y in self.table.outputs])

    def action_shape(self, B: int) -> tuple[int, ...]:
        """Shape of the actions u (and of their gradient) for a batch of B."""
        return self.table.physical(self.table.inputs[0], {"B": B})

    def per_batch_shape(self, arg: Argument, B: int) -> tuple[int, ...]:
        """The adjoint's gradient shape for an input: one row per trajectory (rows an index
        picks are summed back onto their table later)."""
        free = [s for s in arg.shape if isinstance(s, str) and self.table.size(s) is None]
        return self.table.physical(arg, {s: B for s in free})

    def adjoint_shapes(self, B: int) -> list[tuple[int, ...]]:
        """The adjoint's gradient shapes (``per_batch_shape`` of each differentiable input), kept
        for a few batch sizes (``_kept``)."""
        return _kept(self._adjoint_shapes, B, lambda: [self.per_batch_shape(a, B) for a in self.table.differentiable])

    def forward_inputs(self, B: int, grads: Sequence[OptTensor]) -> Optional[list[OptTensor]]:
        """Tensor inputs for running the forward on adjoint-shaped tensors (double backward):
        the gradients of the differentiable inputs, zeros where missing, no index; None when all
        are missing."""
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None
        given = dict(zip(self.table.differentiable, grads))
        inputs: list[OptTensor] = []
        for arg in self.table.tensors:
            if arg not in given:
                inputs.append(None)
            elif given[arg] is not None:
                inputs.append(given[arg].contiguous())
            else:
                inputs.append(like.new_zeros(self.per_batch_shape(arg, B)) if arg.presence == REQUIRED else None)
        return inputs

    def _empty_outputs(self, like: Tensor, B: int) -> list[Tensor]:
        """New outputs, each in its table row's shape (the states [B, H, D]; a cost [B, T]); large
        ones in huge pages where the system has them (``memory.empty``)."""
        return [memory.empty(shape, self.dtype, like.device) for shape in self.output_shapes(B)]

    def forward(self, inputs: Sequence[OptTensor], dt: Tensor, out: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
        """Outputs (P, V, A, J[, S]): new tensors, or ``out`` (validated by the caller) written in place."""
        u = inputs[0]
        B = u.shape[0]
        ys = list(out) if out is not None else self._empty_outputs(u, B)
        if B:
            self.backend.call("forward", B, pointers((*inputs, dt, *ys)))
            if UNBUILT:
                raise_unbuilt()
        return ys

    def adjoint(self, grads: Sequence[OptTensor], dt: Tensor, B: int, needed: Sequence[bool],
                inputs: Sequence[OptTensor] = ()) -> list[OptTensor]:
        """Per-trajectory gradients of the differentiable inputs (None where not needed; the
        first, the actions', is always written). A fused step's adjoint (cost terms, or some
        states not written) recomputes the rows: it reads the ``inputs`` too."""
        grads = [contiguous(g) for g in grads]
        like = next(g for g in grads if g is not None)
        outs = [memory.empty(shape, self.dtype, like.device) if (need or i == 0)
                else None for i, (shape, need) in enumerate(zip(self.adjoint_shapes(B), needed))]
        reads = inputs if self.table.fused else ()
        if B:
            self.backend.call("adjoint", B, pointers((*reads, *grads, dt, *outs)))
            if UNBUILT:
                raise_unbuilt()
        return outs

    def dt_vjp(self, inputs: Sequence[OptTensor], grads: Sequence[OptTensor], dt: Tensor) -> Tensor:
        """Gradient with respect to the dt vector the kernel reads (summed over the batch): float64
        from C, the spec's dtype from CUDA (the backend's launch plan says)."""
        grads = [contiguous(g) for g in grads]
        u = inputs[0]
        B = u.shape[0]
        plan = self.backend.plan
        # the partial sums, as many as the backend's dt_vjp writes (its launch plan's; the finish adds
        # them in order), zeroed here where dt_vjp only adds to them
        size = plan.dt_vjp_size(B)
        gc = (torch.zeros if plan.zeroed_sums else torch.empty)(size, dtype=torch.float64, device=u.device)
        gdt = torch.empty(dt.shape[0], dtype=DTYPES[plan.gradient_dtype], device=u.device)
        # an integrator's dt_vjp reads every row's value: the forward writes them first
        values = self.forward(inputs, dt) if self.table.values and B else []
        if B:
            self.backend.call("dt_vjp", B, [*map(ptr, inputs), *map(ptr, values), *map(ptr, grads), ptr(dt), ptr(gc)])
        if B or not self.per_trajectory:
            self.backend.call("dt_vjp_finish", B, [ptr(dt), ptr(gc), ptr(gdt)])
        return gdt

    def dt_jvp(self, inputs: Sequence[OptTensor], tangents: Sequence[OptTensor], dt: Tensor,
               ddt: Tensor) -> list[Tensor]:
        """Output tangents for tangents of the differentiable inputs and of dt."""
        u = inputs[0]
        B = u.shape[0]
        ys = self._empty_outputs(u, B)
        tangents = [contiguous(t) for t in tangents]
        if B:
            self.backend.call("dt_jvp", B, [*map(ptr, inputs), *map(ptr, tangents), ptr(dt), ptr(ddt), *map(ptr, ys)])
        return ys


class CpuBackend:
    """Calls into cffi-loaded libraries: the core now, each dt library on first use."""

    def __init__(self, spec: Any, source: Optional[str] = None, metadata: Optional[dict] = None):
        """Kernels generated for ``spec``, or built from a given C ``source`` (all kernels) with the
        metadata its manifest recorded."""
        from .cbackend import load_library, load_source

        self.spec = spec
        self._load = load_library if source is None else (lambda spec, part: load_source(spec, source, metadata or {}))
        self.functions: dict[str, Any] = {}
        self._core, self.metadata = self._bind("core" if source is None else "all")
        self.plan = C.launch_plan(spec, self.metadata)

    def _bind(self, part: str) -> tuple[Any, dict]:
        lib, metadata = self._load(self.spec, part)
        self.functions.update({k: getattr(lib, abi.symbol(self.spec.name, k))
                               for k in abi.part_kernels(part, table(self.spec))})
        return lib, metadata

    def address(self, kernel: str) -> int:
        """Address of a core kernel ('forward', 'adjoint'), for the native autograd node."""
        from .cbackend import address

        return address(self._core, abi.symbol(self.spec.name, kernel))

    def load_part(self, part: str) -> None:
        """Load a library's kernels unless they are loaded."""
        if not all(k in self.functions for k in abi.part_kernels(part, table(self.spec))):
            self._bind(part)

    def call(self, kernel: str, B: int, args: list[int]) -> None:
        if kernel not in self.functions:
            self.load_part(abi.library(kernel))
        self.functions[kernel](B, *args)
