"""`tensorstep check`: compiled kernels against the operator's dense float64 matrices."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .api import load, operator_matrices
from .cbackend import CompileError
from .launch import DTYPES, CpuBackend, Launcher

TOLERANCE = {"float32": 2e-5, "float64": 1e-10}


def _inputs(spec: Any, B: int, rows: dict[str, int], seed: int = 0):
    """Random float64 inputs: u [B, N, D]; start and goal states [rows, 4, D] (``rows["start"]``,
    ``rows["goal"]``: B, or a table's row count when an index picks them); dt."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[spec.dtype]
    N, D = spec.n_actions, spec.dof
    u = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    s = torch.randn(rows["start"], 4, D, generator=gen, dtype=torch.float64)
    g = torch.randn(rows["goal"], 4, D, generator=gen, dtype=torch.float64)  # the goal state (end="goal")
    n_dt = B if getattr(spec, "dt", "") == "per_trajectory" else spec.n_dt
    dt = torch.full((1,), 0.05, dtype=torch.float64) if n_dt == 1 else 0.03 + 0.04 * torch.rand(n_dt, generator=gen, dtype=torch.float64)
    return u, s, g, dt, dtype


def _indices(launcher: Launcher, B: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """A row per trajectory for each index the spec takes (start_index, goal_index), keyed by the
    role of the states it picks: rows of a table of B + 2, shuffled, some picked twice."""
    gen = torch.Generator().manual_seed(seed)
    picks = {}
    for arg in launcher.table.tensors:
        if arg.role in ("start", "goal") and arg.index and arg.role not in picks:
            idx = torch.randint(0, B + 2, (B,), generator=gen)
            picks[arg.role] = idx if B < 2 or not torch.equal(idx, torch.arange(B)) else idx.flip(0)
    return picks


def _expected(spec: Any, u: torch.Tensor, s: torch.Tensor, g: torch.Tensor, dt: torch.Tensor) -> np.ndarray:
    """Outputs [K, B, H, D] from the dense matrices (one set per trajectory when each has its dt),
    for each trajectory's own start and goal rows s, g [B, 4, D]."""
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"
    rows = []
    for b in range(u.shape[0]) if per_trajectory else [slice(None)]:
        M = operator_matrices(spec, float(dt[b]) if per_trajectory else dt.tolist())
        y = np.einsum("khn,bnd->kbhd", M["u"], u[b].numpy()[None] if per_trajectory else u.numpy())
        y = y + np.einsum("khm,bmd->kbhd", M["start"], s[b].numpy()[None] if per_trajectory else s.numpy())
        if "goal" in M:
            y = y + np.einsum("khm,bmd->kbhd", M["goal"], g[b].numpy()[None] if per_trajectory else g.numpy())
        rows.append(y)
    return np.concatenate(rows, axis=1)


def _tensor_inputs(launcher: Launcher, u: torch.Tensor, states: dict[str, torch.Tensor],
                   picks: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> list:
    """The launcher's tensor inputs in table order: states [rows, 4, D] one column per argument;
    an index where ``picks`` has one for its states, else None (each trajectory reads its own row)."""
    count = {"start": 0, "goal": 0}
    inputs: list = []
    for arg in launcher.table.tensors:
        if arg.role in states:
            inputs.append(states[arg.role][:, count[arg.role]].to(dtype).contiguous().to(device))
            count[arg.role] += 1
        elif arg.role == "index":
            role = next((a.role for a in launcher.table.tensors if a.index == arg.name), "")
            inputs.append(picks[role].to(device) if role in picks else None)
        else:
            inputs.append(u if arg.role == "action" else None)
    return inputs


def verify_launcher(spec: Any, launcher: Launcher, device: torch.device, B: int = 3) -> dict[str, Any]:
    """Relative forward error and adjoint dot-test error of one spec's kernels on a device.

    With start_index or goal_index, the states are tables of B + 2 rows and the forward runs twice:
    through the index, and on the rows it picks gathered beforehand without an index (the form
    double backward uses); both against the dense matrices applied to the gathered rows."""
    picks = _indices(launcher, B)
    u64, s64, g64, dt64, dtype = _inputs(spec, B, {r: B + 2 if r in picks else B for r in ("start", "goal")})
    gathered = {"start": s64[picks["start"]] if "start" in picks else s64,
                "goal": g64[picks["goal"]] if "goal" in picks else g64}
    expected = _expected(spec, u64, gathered["start"], gathered["goal"], dt64)
    to_layout = (lambda t: t) if spec.layout == "bhd" else (lambda t: t.transpose(1, 2))
    u = to_layout(u64).to(dtype).contiguous().to(device)
    dt = dt64.to(dtype).to(device)
    plain = _tensor_inputs(launcher, u, gathered, {}, dtype, device)
    runs = [plain] + ([_tensor_inputs(launcher, u, {"start": s64, "goal": g64}, picks, dtype, device)] if picks else [])
    scale = max(1.0, float(np.abs(expected).max()))
    forward_err = 0.0
    for inputs in runs:
        outs = launcher.forward(inputs, dt)
        got = np.stack([to_layout(o).double().cpu().numpy() for o in outs])
        forward_err = max(forward_err, float(np.abs(got - expected).max()) / scale)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).to(device) for o in outs]
    # the adjoint's gradients are per trajectory, of the rows each read: the dot test takes the gathered rows
    gs = launcher.adjoint(grads, dt, B, (True,) * len(launcher.table.differentiable))
    lhs = sum(float((o.double() * g.double()).sum()) for o, g in zip(outs, grads))
    given = [x for x, a in zip(plain, launcher.table.tensors) if a.differentiable]
    rhs = sum(float((a.double() * b.double()).sum()) for a, b in zip(given, gs) if a is not None)
    adjoint_err = abs(lhs - rhs) / max(1.0, abs(lhs))
    tol = TOLERANCE[spec.dtype]
    return {"name": spec.name, "device": device.type, "forward": forward_err, "adjoint": adjoint_err,
            "ok": forward_err <= tol and adjoint_err <= 10 * tol}


def check_folder(folder: Path, progress: Callable[[list], Iterable] = lambda items: items) -> list[dict[str, Any]]:
    """Verify a generated folder: compile its own .c files."""
    from ..codegen.emit import read_manifest
    from ..codegen.spec import spec_from_dict

    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder}: no tensorstep manifest.json here")
    rows = []
    for kernel in progress(manifest["kernels"]):
        spec = spec_from_dict(kernel["spec"])
        c_file = kernel["files"].get("c")
        if c_file is None:
            raise ValueError(f"{folder}: kernel {kernel['name']} has no C source (generated with --target cuda)")
        source = (folder / c_file["path"]).read_text()
        try:
            backend = CpuBackend(spec, source, kernel.get("metadata", {}))
            rows.append(verify_launcher(spec, Launcher(spec, backend), torch.device("cpu")))
        except CompileError as err:
            err.source = str(folder / c_file["path"])  # the user's file, not the cache's copy
            raise
    return rows


def check_specs(specs: Iterable[Any], progress: Callable[[list], Iterable] = lambda items: items) -> list[dict[str, Any]]:
    """Verify freshly generated kernels of specs (a config's), on CPU and, if present, CUDA."""
    rows = []
    for spec in progress(list(specs)):
        rows.append(verify_launcher(spec, load(spec, "cpu").launcher, torch.device("cpu")))
        if torch.cuda.is_available():
            rows.append(verify_launcher(spec, load(spec, "cuda").launcher, torch.device("cuda")))
    return rows
