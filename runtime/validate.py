"""Argument checks done before any kernel runs: kernels read raw pointers."""
from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t: Any, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Type, shape, dtype, device and contiguity of one input tensor."""
    if (type(t) is Tensor and t.layout is torch.strided and t.dtype is dtype and t.shape == shape
            and t.device == device and t.is_contiguous()):
        return t  # the common case in one expression; the checks below name what is wrong
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.dim() != len(shape):
        raise ValueError(f"{name}: expected {len(shape)} dims {shape}, got {_describe(t)}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {shape}, got {_describe(t)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the kernel's dtype), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the kernel's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")
    return t


def check_index(idx: Any, batch: int, rows: int, device: torch.device) -> Tensor:
    """start_index: integer tensor [B], every entry in [0, rows)."""
    if not isinstance(idx, Tensor):
        raise TypeError(f"start_index: expected an integer torch.Tensor of shape ({batch},), got {type(idx).__name__}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"start_index: expected dtype torch.int32 or torch.int64, got {idx.dtype}")
    if idx.layout != torch.strided:
        raise TypeError(f"start_index: expected a dense tensor, got layout {idx.layout}")
    if tuple(idx.shape) != (batch,):
        raise ValueError(f"start_index: expected shape ({batch},), got {tuple(idx.shape)}")
    if idx.device != device:
        raise ValueError(f"start_index: expected device {device}, got {idx.device}")
    idx = idx.to(torch.int64).contiguous()
    if torch.compiler.is_compiling():
        pass  # checked inside the custom op, on real data
    elif idx.device.type == "cpu":
        check_index_values(idx, rows)
    else:  # device-side assert: no host synchronisation on the hot path
        torch._assert_async(((idx >= 0) & (idx < rows)).all(), "start_index out of range")
    return idx


def check_index_values(idx: Tensor, rows: int) -> None:
    """Every start_index entry in [0, rows) (reads the values: CPU tensors)."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        bad = idx[(idx < 0) | (idx >= rows)][0].item()
        raise IndexError(f"start_index: entry {bad} is out of range: start tensors have {rows} rows (allowed 0..{rows - 1})")


def check_dt_values(dt: Tensor) -> None:
    """Finite, positive step durations (reads the values: CPU tensors)."""
    values = dt.detach().reshape(-1).tolist()  # at most H numbers: cheaper than reductions on the tensor
    if not all(math.isfinite(x) and x > 0 for x in values):
        raise ValueError(f"dt: expected finite, positive step durations, got {values[:8]}")


def dt_tensor(dt: Any, n_dt: int, horizon: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Normalise dt (float or tensor) to the kernel's dt vector [n_dt]; reject non-finite or ≤ 0."""
    if isinstance(dt, bool) or dt is None:
        raise TypeError(f"dt: expected a positive float or a tensor, got {dt!r}")
    if isinstance(dt, (int, float)):
        if n_dt != 1:
            raise ValueError(f"dt: this kernel takes per-step durations, a tensor of shape ({horizon},); got a scalar")
        if not (math.isfinite(dt) and dt > 0):
            raise ValueError(f"dt: expected a finite, positive step duration, got {dt!r}")
        return torch.full((1,), float(dt), dtype=dtype, device=device)
    if not isinstance(dt, Tensor):
        raise TypeError(f"dt: expected a positive float or a tensor, got {type(dt).__name__}")
    expected = "a scalar (0-dim or 1 element)" if n_dt == 1 else f"shape ({horizon},)"
    if dt.numel() != n_dt or dt.dim() > 1:
        raise ValueError(f"dt: expected {expected}, got shape {tuple(dt.shape)}")
    if not dt.is_floating_point():
        raise TypeError(f"dt: expected a floating-point tensor, got {dt.dtype}")
    if dt.device != device:
        raise ValueError(f"dt: expected device {device}, got {dt.device}")
    if dt.device.type == "cpu" and not torch.compiler.is_compiling():
        check_dt_values(dt)
    return dt.reshape(n_dt).to(dtype).contiguous()


def check_batch(u: Any, name: str = "u") -> int:
    if not isinstance(u, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(u).__name__}")
    if u.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims, got shape {tuple(u.shape)}")
    if u.shape[0] == 0:
        raise ValueError(f"{name}: batch size is 0; expected at least one trajectory")
    return int(u.shape[0])


def start_rows(p0: Any, batch: int, indexed: bool) -> int:
    """Rows of the start tensors: B, or S with a start index."""
    if not indexed:
        return batch
    if not isinstance(p0, Tensor) or p0.dim() != 2:
        raise ValueError("p0: expected a [S, D] tensor with start_index")
    if p0.shape[0] == 0:
        raise ValueError("p0: start tensors have 0 rows; start_index needs at least one")
    return int(p0.shape[0])


def _byte_range(t: Tensor) -> tuple[int, int]:
    """The bytes a tensor can touch: its own extent if contiguous, else its whole storage."""
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def check_out(out: Any, count: int, shape: tuple, dtype: torch.dtype, device: torch.device,
              inputs: dict[str, Any]) -> tuple[Tensor, ...]:
    """out=: ``count`` distinct dense outputs that alias no input, and nothing to differentiate
    (as for torch's own out= functions, the result is not differentiable)."""
    if not isinstance(out, (tuple, list)) or len(out) != count:
        got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(f"out: expected a tuple of {count} tensors (P, V, A, J{', S' if count == 5 else ''}), got {got}")
    for k, t in enumerate(out):
        check_tensor(f"out[{k}]", t, shape, dtype, device)
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
