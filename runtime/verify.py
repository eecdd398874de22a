"""`tensorstep check`: compiled kernels against the operator's dense float64 matrices."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..codegen.arguments import INDEX, REQUIRED, ArgumentTable
from ..codegen.builders import build_operator
from .api import load
from .cbackend import CompileError
from .launch import DTYPES, CpuBackend, Launcher

TOLERANCE = {"float32": 2e-5, "float64": 1e-10}


def _dt(spec: Any, B: int, gen: torch.Generator) -> torch.Tensor:
    """Step durations: one value, or random ones (per step or per trajectory)."""
    n_dt = B if getattr(spec, "dt", "") == "per_trajectory" else spec.n_dt
    if n_dt == 1:
        return torch.full((1,), 0.05, dtype=torch.float64)
    return 0.03 + 0.04 * torch.rand(n_dt, generator=gen, dtype=torch.float64)


def _values(table: ArgumentTable, B: int, picks: dict[str, torch.Tensor], gen: torch.Generator
            ) -> dict[str, torch.Tensor]:
    """Random float64 values of every input the operator reads, by name: the actions [B, N, D] (bhd),
    and each [rows, D] input, a table of B + 2 rows where an index picks its rows, else B."""
    D = table.size("D")
    values = {table.action.name: torch.randn(B, table.size("N"), D, generator=gen, dtype=torch.float64)}
    for arg in table.columns:
        values[arg.name] = torch.randn(B + 2 if arg.index in picks else B, D, generator=gen, dtype=torch.float64)
    return values


def _indices(table: ArgumentTable, B: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """A row per trajectory for each index the spec takes (start_index, goal_index), by the index's
    name: rows of a table of B + 2, shuffled, some picked twice."""
    gen = torch.Generator().manual_seed(seed)
    picks = {}
    for arg in table.indices:
        if arg.presence == REQUIRED:
            idx = torch.randint(0, B + 2, (B,), generator=gen)
            picks[arg.name] = idx if B < 2 or not torch.equal(idx, torch.arange(B)) else idx.flip(0)
    return picks


def _expected(spec: Any, values: dict[str, torch.Tensor], dt: torch.Tensor) -> np.ndarray:
    """Outputs [K, B, H, D] from the operator's dense matrices, one per input it reads (one set per
    trajectory when each has its dt), applied to each trajectory's own rows of every input."""
    op = build_operator(spec)
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"
    B = next(iter(values.values())).shape[0]
    out = []
    for b in range(B) if per_trajectory else [slice(None)]:
        matrices = op.dense_inputs([float(dt[b])] if per_trajectory else dt.tolist())
        y = 0.0
        for name, M in matrices.items():
            x = values[name].numpy()
            x = x[b][None] if per_trajectory else x
            y = y + np.einsum("khn,bnd->kbhd", M, x if x.ndim == 3 else x[:, None, :])
        out.append(y)
    return np.concatenate(out, axis=1)


def _tensor_inputs(table: ArgumentTable, u: torch.Tensor, values: dict[str, torch.Tensor],
                   picks: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> list:
    """The launcher's tensor inputs in table order: the actions ``u`` (in the spec's layout), each
    other input's values, an index where ``picks`` has one (else None: each trajectory reads its own row)."""
    inputs: list = []
    for arg in table.tensors:
        if arg is table.action:
            inputs.append(u)
        elif arg.dtype == INDEX:
            inputs.append(picks[arg.name].to(device) if arg.name in picks else None)
        else:
            inputs.append(values[arg.name].to(dtype).contiguous().to(device))
    return inputs


def verify_launcher(spec: Any, launcher: Launcher, device: torch.device, B: int = 3) -> dict[str, Any]:
    """Relative forward error and adjoint dot-test error of one spec's kernels on a device, for
    every input of its argument table.

    With an index (start_index, goal_index), the rows it picks come from tables of B + 2 rows and
    the forward runs twice: through the index, and on the rows it picks gathered beforehand without
    an index (the form double backward uses); both against the dense matrices applied to the
    gathered rows."""
    table = launcher.table
    picks = _indices(table, B)
    gen = torch.Generator().manual_seed(0)
    values = _values(table, B, picks, gen)
    dt64, dtype = _dt(spec, B, gen), DTYPES[spec.dtype]
    gathered = {name: x[picks[arg.index]] if arg.index in picks else x
                for name, x in values.items() for arg in [table.input(name)]}
    expected = _expected(spec, gathered, dt64)
    to_layout = (lambda t: t) if spec.layout == "bhd" else (lambda t: t.transpose(1, 2))
    u = to_layout(values[table.action.name]).to(dtype).contiguous().to(device)
    dt = dt64.to(dtype).to(device)
    plain = _tensor_inputs(table, u, gathered, {}, dtype, device)
    runs = [plain] + ([_tensor_inputs(table, u, values, picks, dtype, device)] if picks else [])
    scale = max(1.0, float(np.abs(expected).max()))
    forward_err = 0.0
    for inputs in runs:
        outs = launcher.forward(inputs, dt)
        got = np.stack([to_layout(o).double().cpu().numpy() for o in outs])
        forward_err = max(forward_err, float(np.abs(got - expected).max()) / scale)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).to(device) for o in outs]
    # the adjoint's gradients are per trajectory, of the rows each read: the dot test takes the gathered rows
    gs = launcher.adjoint(grads, dt, B, (True,) * len(table.differentiable))
    lhs = sum(float((o.double() * g.double()).sum()) for o, g in zip(outs, grads))
    given = [x for x, a in zip(plain, table.tensors) if a.differentiable]
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
