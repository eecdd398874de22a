"""Argument checks before any kernel runs (kernels read raw pointers), derived from the
argument table (codegen/arguments.py). The native node runs the same checks in C++ from the
same rows and message templates, so both paths refuse the same calls with the same words.

Any strides are accepted, as in PyTorch's own ops: inputs are made contiguous here, and
autograd returns gradients in each input's own shape. So are negated views (``torch._neg_view``,
the imaginary part of a conjugated complex tensor: a real tensor with the negative bit set), whose
memory holds the values negated: the kernels read raw memory, so such an input is materialised
first (``Tensor.resolve_neg``, differentiable: gradients reach the view's base), as PyTorch's own
ops resolve it. (A conjugated tensor is complex, which no argument takes.) In the common case
this costs one bit test. Not under torch.compile: Dynamo cannot trace the test, and a compiled
step reads a negated view's memory as it is, as compiled PyTorch ops do (torch 2.13: ``u * 2 + 1``
compiled and given ``torch._neg_view(-u)`` returns ``-u * 2 + 1``).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import torch

from ..codegen.arguments import ABSENT, INDEX, REQUIRED, Argument, ArgumentTable, message

Tensor = torch.Tensor
#: the tensor types whose values the kernels and the native op read as they are: a plain Tensor and
#: an nn.Parameter (a plain tensor to the op: it overrides no torch function); another subclass has
#: its own view of versions and data. Tested inline (``type(v) in TENSOR_TYPES``): no call per value
TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter))


def shape_text(shape: Sequence[Any]) -> str:
    """A shape as Python prints a tuple: (3, 2), (3,), or with symbols (S, 2)."""
    items = [str(s) for s in shape]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _fail(kind: type, key: str, **fields: Any) -> Exception:
    return kind(message(key, **fields))


def _bind(table: ArgumentTable, arg: Argument, t: Tensor, dims: dict[str, int]) -> None:
    """Learn the free symbols (B, S) from the first argument that has them."""
    for symbol, size in zip(arg.shape, _logical(table, arg, tuple(t.shape))):
        if isinstance(symbol, str) and symbol not in dims and table.size(symbol) is None:
            if size == 0:
                raise _fail(ValueError, "empty" if symbol == "B" else "no_rows", name=arg.name,
                            got=shape_text(t.shape))
            dims[symbol] = size


def _logical(table: ArgumentTable, arg: Argument, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape in the table's logical order (undo the bdh layout)."""
    if arg.layout and table.layout == "bdh" and len(shape) == 3:
        return (shape[0], shape[2], shape[1])
    return shape


def own_values(t: Tensor, resolve: bool = True) -> Tensor:
    """``t``, or a negated view's values as a tensor of its own (``Tensor.resolve_neg``:
    differentiable, gradients reach the view's base; see the module's docstring) unless
    ``resolve`` is False (while Dynamo traces: it cannot trace the test)."""
    return t.resolve_neg() if resolve and t.is_neg() else t


def check_argument(table: ArgumentTable, arg: Argument, t: Any, dims: dict[str, int], dtype: torch.dtype,
                   device: torch.device, resolve: bool = True) -> Optional[Tensor]:
    """One input: presence, type, layout, rank, shape, dtype, device; returned contiguous, and a
    negated view resolved unless ``resolve`` is False (while Dynamo traces: it cannot trace the
    bit's test)."""
    if t is None:
        if arg.presence == REQUIRED:
            raise _fail(TypeError, "missing", name=arg.name, expected=arg.meaning)
        return None
    if arg.presence == ABSENT:
        raise _fail(TypeError, "unexpected", name=arg.name, expected=arg.meaning)
    if not isinstance(t, Tensor):
        raise _fail(TypeError, "type", name=arg.name, expected=shape_text(table.symbolic(arg)),
                    got=type(t).__name__)
    if t.layout != torch.strided:
        raise _fail(TypeError, "layout", name=arg.name, got=t.layout)
    if t.dim() != len(arg.shape):
        raise _fail(ValueError, "dims", name=arg.name, count=len(arg.shape),
                    expected=shape_text(table.symbolic(arg)), got=shape_text(t.shape))
    _bind(table, arg, t, dims)
    expected = table.physical(arg, dims)
    if tuple(t.shape) != expected:
        raise _fail(ValueError, "shape", name=arg.name, expected=shape_text(expected), got=shape_text(t.shape))
    if arg.dtype == INDEX:
        if t.dtype not in (torch.int32, torch.int64):
            raise _fail(TypeError, "index_dtype", name=arg.name, got=t.dtype)
    elif t.dtype != dtype:
        raise _fail(TypeError, "dtype", name=arg.name, expected=dtype, got=t.dtype)
    if t.device != device:
        raise _fail(ValueError, "device", name=arg.name, expected=device, got=t.device)
    t = own_values(t, resolve)
    if arg.dtype == INDEX:
        t = t.to(torch.int64)
    return t.contiguous()


def check_index_values(name: str, idx: Tensor, rows_name: str, rows: int) -> None:
    """Every entry of an index in [0, rows): read on the CPU, a device-side assert on CUDA."""
    if torch.compiler.is_compiling():
        return  # checked inside the custom op, on real data
    if idx.device.type != "cpu":  # no host synchronisation on the hot path
        torch._assert_async(((idx >= 0) & (idx < rows)).all(), f"{name} out of range")
        return
    idx = _values(idx)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        bad = idx[(idx < 0) | (idx >= rows)][0].item()
        raise IndexError(message("range", name=name, got=bad, rows=rows_name, count=rows, max=rows - 1))


def _values(t: Tensor) -> Tensor:
    """The plain tensor under functorch's wrappers (a vmapped index holds every element's entries)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def cost_parameter(arg: Argument) -> bool:
    """A fused step's weight, limit or margin: data whose values are checked once per tensor (not
    the target, which is differentiable)."""
    return arg.role.startswith("cost_") and arg.role != "cost_target"


def stamp(t: Tensor, *more: Any) -> tuple:
    """What a tensor passed again can have changed since it was checked: its version (in-place
    writes), data pointer (``t.data = other`` keeps the version), shape, strides, dtype, negative
    bit (``t.data = torch._neg_view(t)`` keeps the data pointer too), device and requires_grad,
    and ``more`` (a batch size, the tensor's identity). Kept with the tensor itself: while kept,
    its address cannot be another's. An inference tensor has no version: its stamp equals no
    other (it is checked on every call)."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor
        version = object()
    return (version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_neg(), t.device, t.requires_grad, *more)


def check_inputs(table: ArgumentTable, values: Sequence[Any], dtype: torch.dtype, device: torch.device,
                 only: Optional[Sequence[int]] = None) -> tuple[list[Optional[Tensor]], dict[str, int]]:
    """The tensor inputs (all but dt, in table order), checked and contiguous, and the sizes of
    the free symbols (B, S) they fix. ``only``: the positions to check, in table order; the others
    are taken as they are (a fused step's cost parameters that passed every check before and are
    passed again unchanged: runtime/costs.py CheckedParameters)."""
    dims: dict[str, int] = {}
    resolve = not torch.compiler.is_compiling()
    if only is None:
        checked = [check_argument(table, arg, v, dims, dtype, device, resolve)
                   for arg, v in zip(table.tensors, values)]
    else:
        checked = list(values)
        tensors = table.tensors
        for i in only:
            checked[i] = check_argument(table, tensors[i], values[i], dims, dtype, device, resolve)
    check_indices(table, checked)
    return checked, dims


def check_indices(table: ArgumentTable, inputs: Sequence[Optional[Tensor]]) -> None:
    """Every index entry within the rows of the tables it picks from."""
    for arg, t in zip(table.tensors, inputs):
        if arg.dtype == INDEX and t is not None:
            picked = [(a, x) for a, x in zip(table.tensors, inputs) if a.index == arg.name]
            rows = next(x for _, x in picked if x is not None).shape[0]
            check_index_values(arg.name, t, ", ".join(a.name for a, _ in picked), rows)


def check_dt_values(dt: Tensor, name: str = "dt") -> None:
    """Finite, positive step durations (reads the values: CPU tensors); the message names the
    first bad entry."""
    values = _values(dt).detach().reshape(-1).tolist()  # H or B numbers (every vmapped element's): cheap
    bad = next((i for i, x in enumerate(values) if not (math.isfinite(x) and x > 0)), None)
    if bad is not None:
        got = values[:8] if len(values) <= 8 else f"{values[bad]!r} at entry {bad}"
        raise ValueError(message("dt_value", name=name, got=got) + (f" (entry {bad})" if len(values) <= 8 else ""))


def dt_tensor(dt: Any, table: ArgumentTable, dtype: torch.dtype, device: torch.device,
              batch: Optional[int] = None) -> Tensor:
    """Normalise dt (a float, see ``python_number``, or a tensor) to the kernel's dt vector; refuse non-finite or ≤ 0.

    With dt="per_trajectory" dt is a tensor [B] (``batch`` = B); a float is refused rather than
    broadcast, so that a forgotten per-trajectory dt never passes silently.
    Under torch.compile a float dt may arrive as a symbolic float: it becomes a tensor with no
    value check (the custom op checks the values on real data)."""
    arg = table.dt
    per_trajectory = arg.shape == ("B",)
    n = batch if per_trajectory else table.size("NDT")
    expected = (f"shape ({n},), one step duration per trajectory" if per_trajectory
                else "a scalar (0-dim or 1 element)" if n == 1 else f"shape ({n},)")
    if isinstance(dt, bool) or dt is None:
        raise TypeError(f"{arg.name}: expected a positive float or a tensor, got {dt!r}")
    if isinstance(dt, (int, float)) or _symbolic_float(dt):
        if per_trajectory:
            raise TypeError(f"{arg.name}: this kernel takes one step duration per trajectory (dt='per_trajectory'), "
                            f"a tensor of {expected}; got a float (use torch.full((B,), dt) for one shared value)")
        if n != 1:
            raise ValueError(f"{arg.name}: this kernel takes per-step durations, a tensor of {expected}; got a scalar")
        # while Dynamo traces, a float may stand for a symbolic one (math.isfinite would break the graph)
        if not torch.compiler.is_compiling() and not (math.isfinite(dt) and dt > 0):
            raise ValueError(message("dt_value", name=arg.name, got=dt))
        return torch.full((1,), dt, dtype=dtype, device=device)
    if not isinstance(dt, Tensor):
        raise TypeError(f"{arg.name}: expected a positive float or a tensor, got {type(dt).__name__}")
    if dt.numel() != n or dt.dim() > 1 or (per_trajectory and dt.dim() != 1):
        raise ValueError(f"{arg.name}: expected {expected}, got shape {shape_text(dt.shape)}")
    if not dt.is_floating_point():
        raise TypeError(f"{arg.name}: expected a floating-point tensor, got {dt.dtype}")
    if dt.device != device:
        raise ValueError(message("device", name=arg.name, expected=device, got=dt.device))
    compiling = torch.compiler.is_compiling()
    dt = own_values(dt, not compiling)
    if dt.device.type == "cpu" and not compiling:
        check_dt_values(dt, arg.name)
    return dt.reshape(n).to(dtype).contiguous()


def python_number(value: Any) -> Any:
    """A real number that is no Python int or float (a NumPy scalar: numpy.float32 is no float
    subclass; a Fraction) as a Python float; anything else as it is."""
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        return float(value)
    return value


def _symbolic_float(value: Any) -> bool:
    return type(value).__name__ == "SymFloat"


def _byte_range(t: Tensor) -> tuple[int, int]:
    """The bytes a tensor can touch: its own extent if contiguous, else its whole storage."""
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def check_out(out: Any, table: ArgumentTable, shapes: Sequence[tuple], dtype: torch.dtype, device: torch.device,
              inputs: dict[str, Any]) -> tuple[Tensor, ...]:
    """out=: one distinct dense output per table output, aliasing no input, and nothing to
    differentiate (as for torch's own out= functions, the result is not differentiable)."""
    count = len(table.outputs)
    names = ", ".join(y.name for y in table.outputs)
    if not isinstance(out, (tuple, list)) or len(out) != count:
        got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(f"out: expected a tuple of {count} tensors ({names}), got {got}")
    for k, (t, shape) in enumerate(zip(out, shapes)):
        _check_output(f"out[{k}]", t, shape, dtype, device)
    grad = torch.is_grad_enabled()
    for name, t in inputs.items():
        if grad and isinstance(t, Tensor) and t.requires_grad:
            raise RuntimeError(f"out: outputs written into out= are not differentiable, and {name} requires grad; "
                               "call the step under torch.no_grad() (rollouts) or without out=")
    for k, t in enumerate(out):
        if grad and t.requires_grad:
            raise RuntimeError(f"out[{k}]: requires grad and would be overwritten in place; "
                               "call the step under torch.no_grad() or pass tensors that do not require grad")
    if torch.compiler.is_compiling():
        # traced tensors have no addresses; the compiled step copies into out, so an overlap
        # cannot reach memory the kernels do not own
        return tuple(out)
    taken = [(name, t.device, *_byte_range(t)) for name, t in inputs.items() if isinstance(t, Tensor) and t.numel()]
    for k, t in enumerate(out):  # each output against the inputs and the outputs before it
        if not t.numel():
            continue
        lo, hi = _byte_range(t)
        for other, dev, olo, ohi in taken:
            if dev == t.device and lo < ohi and olo < hi:
                raise ValueError(f"out[{k}]: overlaps {other} in memory; every output needs memory of its own, "
                                 "which no input uses")
        taken.append((f"out[{k}]", t.device, lo, hi))
    return tuple(out)


def _check_output(name: str, t: Any, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """An out= tensor: written through a raw pointer, so dense, contiguous, exactly shaped."""
    if not isinstance(t, Tensor):
        raise TypeError(message("type", name=name, expected=shape_text(shape), got=type(t).__name__))
    if t.layout != torch.strided:
        raise TypeError(message("layout", name=name, got=t.layout))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(message("shape", name=name, expected=shape_text(shape), got=shape_text(t.shape)))
    if t.dtype != dtype:
        raise TypeError(message("dtype", name=name, expected=dtype, got=t.dtype))
    if t.device != device:
        raise ValueError(message("device", name=name, expected=device, got=t.device))
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (outputs are written in place), "
                         f"got strides {t.stride()}")
    if not torch.compiler.is_compiling() and t.is_neg():  # (a compiled step copies into out: no raw write)
        raise ValueError(f"{name}: expected a tensor whose memory holds its values (outputs are written in "
                         "place), got a negated view (its negative bit is set); pass a tensor of its own")
