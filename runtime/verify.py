"""`tensorstep check`: compiled kernels against the operator's dense float64 matrices.

A fused step (cost terms, or only some states written) is checked the same way: its written
states against the dense matrices, its cost against the terms' definitions (runtime/costs.py,
in float64) on those states, and its adjoint — no longer linear in the output gradients — against
the gradient of the same float64 reference (autograd through the dense matrices and the terms)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..codegen.arguments import INDEX, REQUIRED, ArgumentTable
from ..codegen.builders import build_operator
from ..codegen.spec import DERIVATIVE_NAMES, OUTPUT_NAMES
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


def _expected(spec: Any, values: dict[str, torch.Tensor], dt: torch.Tensor) -> torch.Tensor:
    """Outputs [K, B, H, D] from the operator's dense matrices, one per input it reads (one set per
    trajectory when each has its dt), applied to each trajectory's own rows of every input (float64
    tensors, differentiable in the values)."""
    op = build_operator(spec)
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"
    B = next(iter(values.values())).shape[0]
    out = []
    for b in range(B) if per_trajectory else [slice(None)]:
        matrices = op.dense_inputs([float(dt[b])] if per_trajectory else dt.tolist())
        y: Any = 0.0
        for name, M in matrices.items():
            x = values[name]
            x = x[b][None] if per_trajectory else x
            y = y + torch.einsum("khn,bnd->kbhd", torch.from_numpy(np.asarray(M, dtype=np.float64)),
                                 x if x.dim() == 3 else x[:, None, :])
        out.append(y)
    return torch.cat(out, dim=1)


def _parameters(table: ArgumentTable, values: dict[str, torch.Tensor], states: torch.Tensor,
                gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A fused step's cost parameters: weights (per trajectory and dof) and the inputs every
    trajectory shares (row weights, margins, limits), all >= 0 but the limits, whose lower and upper
    are quantiles 0.3 and 0.7 of the state's reference values, so that rows fall below, inside and
    above them."""
    out = {}
    for arg in table.tensors:
        if arg.role == "cost_weight":
            out[arg.name] = values[arg.name].abs()
        elif arg in table.parameters:
            shape = table.physical(arg, {})
            out[arg.name] = torch.rand(shape, generator=gen, dtype=torch.float64)
    for kind, state in table.costs:
        name = f"{kind}_{state}_limit"
        if name in out:
            y = states[DERIVATIVE_NAMES.index(state)].reshape(-1, states.shape[-1])
            out[name] = torch.quantile(y.detach(), torch.tensor([0.3, 0.7], dtype=torch.float64), dim=0)
            margin = f"{kind}_{state}_margin"
            if margin in out:
                out[margin] = out[margin] * 0.2 * (out[name][1] - out[name][0])
    return out


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
    every input of its argument table (a fused step: see the module's docstring; its row also has
    the cost's relative error, ``cost``).

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
    dense = spec.replace(costs=(), outputs=None) if table.fused else spec  # every state, no cost
    states = _expected(dense, gathered, dt64)
    if table.fused:
        parameters = _parameters(table, values, states, gen)
        values.update(parameters)
        gathered.update(parameters)
    reference = _reference(table, gathered, dt64, dense)
    expected = np.stack([y.numpy() for y, a in zip(reference(gathered), table.outputs) if a.role == "output"])
    to_layout = (lambda t: t) if spec.layout == "bhd" else (lambda t: t.transpose(1, 2))
    u = to_layout(values[table.action.name]).to(dtype).contiguous().to(device)
    dt = dt64.to(dtype).to(device)
    plain = _tensor_inputs(table, u, gathered, {}, dtype, device)
    runs = [plain] + ([_tensor_inputs(table, u, values, picks, dtype, device)] if picks else [])
    scale = max(1.0, float(np.abs(expected).max()))
    written = [i for i, a in enumerate(table.outputs) if a.role == "output"]
    forward_err = cost_err = 0.0
    for inputs in runs:
        outs = launcher.forward(inputs, dt)
        got = np.stack([to_layout(outs[i]).double().cpu().numpy() for i in written])
        forward_err = max(forward_err, float(np.abs(got - expected).max()) / scale)
        if table.costs:
            cost = reference(gathered)[-1].numpy()
            cost_err = max(cost_err, float(np.abs(outs[-1].double().cpu().numpy() - cost).max())
                           / max(1.0, float(np.abs(cost).max())))
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).to(device) for o in outs]
    # the adjoint's gradients are per trajectory, of the rows each read: the dot test takes the gathered rows
    gs = launcher.adjoint(grads, dt, B, (True,) * len(table.differentiable), plain)
    given = [x for x, a in zip(plain, table.tensors) if a.differentiable]
    if table.fused:  # not linear in the inputs: the gradient of the float64 reference instead
        adjoint_err = _gradient_error(table, reference, gathered, grads, gs)
    else:
        lhs = sum(float((o.double() * g.double()).sum()) for o, g in zip(outs, grads))
        rhs = sum(float((a.double() * b.double()).sum()) for a, b in zip(given, gs) if a is not None)
        adjoint_err = abs(lhs - rhs) / max(1.0, abs(lhs))
    tol = TOLERANCE[spec.dtype]
    row = {"name": spec.name, "device": device.type, "forward": forward_err, "adjoint": adjoint_err,
           "ok": forward_err <= tol and adjoint_err <= 10 * tol and cost_err <= 10 * tol}
    if table.costs:
        row["cost"] = cost_err
        row["costs"] = table.costs
    return row


def _reference(table: ArgumentTable, gathered: dict[str, torch.Tensor], dt: torch.Tensor, dense: Any
               ) -> Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """values → the outputs in the table's order, in float64 (bhd): the written states from the dense
    matrices, then the cost from the terms' definitions on every state."""
    from .costs import term_values

    def outputs(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        states = _expected(dense, values, dt)
        ys = [states[OUTPUT_NAMES.index(a.name)] for a in table.outputs if a.role == "output"]
        if table.costs:
            layout = [y if table.layout == "bhd" else y.transpose(1, 2) for y in states]
            ys.append(term_values(table, layout, values))
        return ys

    return outputs


def _gradient_error(table: ArgumentTable, reference: Callable, gathered: dict[str, torch.Tensor],
                    grads: list, gs: list) -> float:
    """The adjoint's largest deviation from the reference's vector-Jacobian product, relative to the
    largest entry of that product."""
    to_layout = (lambda t: t) if table.layout == "bhd" else (lambda t: t.transpose(1, 2))
    leaves = {a.name: gathered[a.name].clone().requires_grad_() for a in table.differentiable if a.name in gathered}
    ys = reference({**gathered, **leaves})
    g64 = [to_layout(g.double().cpu()) if a.role == "output" else g.double().cpu() for g, a in zip(grads, table.outputs)]
    wanted = [a for a in table.differentiable if a.name in leaves]
    ref = torch.autograd.grad(ys, [leaves[a.name] for a in wanted], g64, allow_unused=True)
    got = dict(zip((a.name for a in table.differentiable), gs))
    pairs = [(to_layout(got[a.name].double().cpu()) if a is table.action else got[a.name].double().cpu(),
              torch.zeros_like(leaves[a.name]) if r is None else r) for a, r in zip(wanted, ref)]
    scale = max(1.0, max(float(r.abs().max()) for _, r in pairs))
    return max(float((g - r).abs().max()) for g, r in pairs) / scale


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
