"""`tensorstep bench --scheme costs`: a step with fused joint-space costs (KernelSpec.costs,
outputs=("P",)) against what users write without it, forward+backward, interleaved in one run.

Every method computes P and the cost [B, T] of the same seven terms (a bound on position,
velocity, acceleration and jerk; a squared velocity, acceleration and jerk) and takes the
gradient of the scalar loss ``sum(P · W) + sum(cost)`` to u: the outputs' gradients (W for P,
ones for the cost) are handed to ``torch.autograd.backward``, as the main table does.

* fused: ``P, cost = step(u, p0, v0, a0, dt, **parameters)``;
* fused, cost parameters held by the step: ``step.set_costs(**parameters)`` once, then
  ``P, cost = step(u, p0, v0, a0, dt)`` (a planner's loop: the node takes the held parameters from
  the step's slot, and no cost parameter crosses per call);
* unfused + eager costs: the plain step (every state) and the terms written here in PyTorch from
  their definitions (not tensorstep's composite form);
* slicing + costs, torch.compile: bench/baselines.py's slicing step and the same terms, compiled
  for the case's shapes before any timing;
* step alone, gradient on P only: the plain step, backward of ``sum(P · W)``;
* copy bound: a clone of as many elements as the fused op moves each way (u, P and the cost);
* copy bound, outputs as the fused op's: the same copy into a new tensor allocated the way the
  runtime allocates the fused op's outputs (runtime/memory.py: large ones blocks of the runtime's
  output cache, reused from call to call as the fused op's are, and in huge pages where the system
  has them; clone's are PyTorch's, page-faulted in 4 KiB at a time).

Where the fused call's time goes is timed in the same run: its argument checks in Python, its
forward and adjoint kernels launched directly, a forward under no_grad, and the plain step's
two kernels (what (d) launches) for comparison.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch

import tensorstep as ts
from tensorstep.runtime import costs as runtime_costs
from tensorstep.runtime import memory, native
from tensorstep.runtime.launch import DTYPES

from .baselines import copy_source, slicing_step
from .harness import COMPILE_BACKEND, DT, format_time, machine, time_interleaved

STATES = ("position", "velocity", "acceleration", "jerk")
#: the issue's case: four bound terms and three squared terms
TERMS = tuple(("bound", s) for s in STATES) + tuple(("squared", s) for s in STATES[1:])
#: limits per state (lower = -upper): some rows of the bench's trajectories cross each of them
LIMITS = {"position": 1.0, "velocity": 1.0, "acceleration": 50.0, "jerk": 2000.0}
#: the largest relative difference of the cost and of u's gradient between the methods
AGREEMENT = {"float32": 1e-4, "float64": 1e-10}


@dataclasses.dataclass
class CostCase:
    batch: int
    dtype: str = "float32"
    horizon: int = 32
    device: str = "cpu"
    dof: int = 7

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def plain(self) -> ts.KernelSpec:
        return ts.KernelSpec(horizon=self.horizon, dof=self.dof, dtype=self.dtype)

    @property
    def fused(self) -> ts.KernelSpec:
        return self.plain.replace(costs=TERMS, outputs=("P",))


def parameters(case: CostCase, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-dof weights [D], limits [2, D] and margins [D] of every term (no row weights)."""
    D = case.dof
    r = lambda *shape: torch.rand(*shape, generator=gen, dtype=case.torch_dtype).to(case.device)
    params = {}
    for kind, state in TERMS:
        params[f"{kind}_{state}_weight"] = 0.1 + r(D)
        if kind == "bound":
            upper = LIMITS[state] * (0.8 + 0.4 * r(D))
            params[f"bound_{state}_limit"] = torch.stack([-upper, upper])
            params[f"bound_{state}_margin"] = 0.05 * upper
    return params


def eager_costs(states: tuple, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The cost [B, T] from the definitions (y [B, H, D] each of P, V, A, J; w the per-dof weight):
    bound w·(max(0, y − (upper − margin))² + max(0, (lower + margin) − y)²), squared w·y²,
    each summed over rows and dof."""
    out = []
    for kind, state in TERMS:
        y = states[STATES.index(state)]
        w = params[f"{kind}_{state}_weight"]
        if kind == "bound":
            lower, upper = params[f"bound_{state}_limit"]
            margin = params[f"bound_{state}_margin"]
            term = torch.relu(y - (upper - margin)).square() + torch.relu((lower + margin) - y).square()
        else:
            term = y.square()
        out.append((w * term).sum(dim=(1, 2)))
    return torch.stack(out, dim=1)


def slicing_with_costs(case: CostCase, params: dict[str, torch.Tensor]) -> Callable:
    """bench/baselines.py's slicing step and the terms above: (u, p0, v0, a0) → (P, cost)."""
    slicing = slicing_step(case.plain, DT)

    def step(u, p0, v0, a0):
        states = slicing(u, p0, v0, a0)
        return states[0], eager_costs(states, params)

    return step


def _inputs(case: CostCase) -> tuple[torch.Generator, torch.Tensor, list[torch.Tensor]]:
    """Smooth trajectories (random walks from the start position), so that the bound terms are
    active on some rows and not on others."""
    gen = torch.Generator().manual_seed(0)
    dtype = case.torch_dtype
    B, N, D = case.batch, case.horizon - 1, case.dof
    p0 = 0.9 * (2 * torch.rand(B, D, generator=gen, dtype=dtype) - 1)
    u = p0.unsqueeze(1) + (0.02 * torch.randn(B, N, D, generator=gen, dtype=dtype)).cumsum(1)
    v0, a0 = (torch.randn(B, D, generator=gen, dtype=dtype) for _ in range(2))
    return gen, u.to(case.device), [x.to(case.device) for x in (p0, v0, a0)]


def case_callables(case: CostCase, inductor: bool = True,
                   echo: Optional[Callable[[str], None]] = None) -> dict[str, Callable[[], None]]:
    """Each method's forward+backward as a no-argument callable, and the pieces of the fused call;
    the methods' costs and gradients are compared first (``echo`` prints how closely they agree)."""
    dev = torch.device(case.device)
    gen, u, starts = _inputs(case)
    u.requires_grad_(True)
    params = parameters(case, gen)
    W = torch.randn(case.batch, case.horizon, case.dof, generator=gen, dtype=case.torch_dtype).to(dev)
    ones = torch.ones(case.batch, len(TERMS), dtype=case.torch_dtype, device=dev)
    fused = ts.load(case.fused, dev)
    held = ts.load(case.fused, dev).set_costs(**params)  # a step of its own: (a)'s calls keep their slot
    plain = ts.load(case.plain, dev)
    native.wait()  # the plain step's eager calls take the native node, as they do once it is built

    def with_costs(fn: Callable) -> Callable[[], tuple]:
        def run() -> tuple:
            u.grad = None  # as optimizer.zero_grad(set_to_none=True)
            outs = fn()
            torch.autograd.backward(outs, (W, ones))
            return outs

        return run

    def unfused() -> tuple:
        states = plain(u, *starts, DT)
        return states[0], eager_costs(states, params)

    def step_alone() -> None:
        u.grad = None
        torch.autograd.backward(plain(u, *starts, DT)[:1], (W,))

    methods: dict[str, Callable] = {
        "fused": with_costs(lambda: fused(u, *starts, DT, **params)),
        "fused_held": with_costs(lambda: held(u, *starts, DT)),
        "unfused": with_costs(unfused),
        "plain": step_alone,
    }
    if inductor:
        torch._dynamo.reset()  # one compiled graph per case: no recompile limit, no stale guards
        compiled = torch.compile(slicing_with_costs(case, params), backend=COMPILE_BACKEND, dynamic=False)
        methods["compiled"] = with_costs(lambda: compiled(u, *starts))
    _check_agreement(case, methods, u, echo)

    src = copy_source(copy_elements(case), case.torch_dtype, dev)
    methods["copy"] = lambda: src.clone()
    methods["copy_as_outputs"] = lambda: memory.empty(src.shape, src.dtype, src.device).copy_(src)
    methods.update(_pieces(fused, u, starts, params, W, ones))
    plain_launcher = plain.launcher
    dt = plain._dt_tensor(DT)
    no_grads = (None,) * case.plain.order  # V, A, J take no gradient, as in (d)

    def plain_kernels() -> None:  # (d)'s two kernels launched directly: the fused kernels' counterpart
        plain_launcher.forward([u.detach(), *starts, None, None], dt)
        plain_launcher.adjoint((W, *no_grads), dt, case.batch, (False,) * len(plain.table.differentiable))

    methods["plain_kernels"] = plain_kernels
    return methods


def copy_elements(case: CostCase) -> int:
    """Elements the fused op moves each way: u, P and the cost (forward), their gradients (backward)."""
    return case.batch * (case.dof * (case.horizon - 1 + case.horizon) + len(TERMS))


def _check_agreement(case: CostCase, methods: dict[str, Callable], u: torch.Tensor,
                     echo: Optional[Callable[[str], None]]) -> None:
    """Run each method once (compiling the compiled one) and compare its P, cost and u's gradient
    with the unfused step's; raises beyond AGREEMENT[dtype]."""
    got = {}
    for name in ("fused", "fused_held", "unfused", "compiled"):
        if name in methods:
            P, cost = methods[name]()
            got[name] = (P.detach(), cost.detach(), u.grad.clone())
    rel = lambda x, y: float((x - y).abs().max() / y.abs().max().clamp(min=1e-30))
    reference = got["unfused"]
    for name in ("fused", "fused_held", "compiled"):
        if name not in got:
            continue
        errors = [rel(x, y) for x, y in zip(got[name], reference)]
        if echo is not None:
            echo(f"  B={case.batch} {case.dtype} {name} against unfused + eager costs, largest relative difference: "
                 f"P {errors[0]:.1e}, cost {errors[1]:.1e}, grad u {errors[2]:.1e}")
        if max(errors) > AGREEMENT[case.dtype]:
            raise AssertionError(f"{name} disagrees with the unfused step plus eager costs: {errors}")


def table_values(table, u, starts, params) -> list:
    """The fused call's tensor arguments in table order (None where not given)."""
    named = {"u": u, "p0": starts[0], "v0": starts[1], "a0": starts[2], **params}
    return [named.get(a.name) for a in table.tensors]


def kernel_inputs(fused, values: list) -> list:
    """What the fused kernels read, as the Python path checks and passes it (``table_values``
    through Step's own checks, ``_checked``: [D] weights as their kept [B, D] rows, defaults where
    not given)."""
    return fused._checked(values, DT)[0]


def _pieces(fused, u, starts, params, W, ones) -> dict[str, Callable[[], None]]:
    """The fused call's parts, each callable alone: the checks of its Python path (Step's
    ``_checked``, what Step.forward runs in Python before the kernels, here on cost parameters
    passed unchanged: one stamp each and their kept inputs ([D] weights' [B, D] rows), the argument
    table's checks of the other arguments, the dt tensor); the value checks of every cost parameter
    (weights and margins >= 0, finite limits with lower <= upper: what a call whose parameters are
    all new adds to those checks; a call that passes them unchanged runs none, and with the native
    node it runs neither), its forward and adjoint kernels launched directly, and the forward
    under no_grad (checks + kernel + Function.apply)."""
    table = fused.table
    values = table_values(table, u, starts, params)
    B = u.shape[0]

    def table_checks() -> list:
        return kernel_inputs(fused, values)

    inputs = table_checks()  # checked and kept: the timed calls find them unchanged
    inputs = [None if x is None else x.detach() for x in inputs]
    dt = fused._dt_tensor(DT, B)
    launcher = fused.launcher
    needed = (True,) + (False,) * (len(table.differentiable) - 1)

    def forward_no_grad() -> None:
        with torch.no_grad():
            fused(u, *starts, DT, **params)

    return {
        "table_checks": table_checks,
        "parameter_checks": lambda: runtime_costs.check_parameters(table, inputs),
        "kernel_forward": lambda: launcher.forward(inputs, dt),
        "kernel_adjoint": lambda: launcher.adjoint((W, ones), dt, B, needed, inputs),
        "forward_no_grad": forward_no_grad,
    }


HEADER = ("| H | B | dtype | (a) fused | (a') fused, cost parameters held by the step | (b) unfused + eager costs "
          "| (c) slicing + costs, torch.compile | (d) step alone, grad on P | (e) copy bound "
          "| (f) copy bound, outputs as (a)'s | (b) / (a) | (c) / (a) | (a) / (d) | (a') / (d) | (a) / (e) | (a) / (f) |")
BREAKDOWN = ("| H | B | dtype | fused call (a) | Python path: checks, parameters unchanged | Python path: value "
             "checks of all-new cost parameters | forward kernel | adjoint kernel | forward, no_grad "
             "| rest: the call around its kernels (a − kernels) | (d)'s kernels (forward + adjoint) |")


def _signed_time(seconds: float) -> str:
    """A difference of medians, which noise can make negative."""
    return format_time(seconds) if seconds >= 0 else "−" + format_time(-seconds)


def _ratio(t: dict[str, float], num: str, den: str) -> str:
    return f"{t[num] / t[den]:.2f}×" if num in t and den in t else "n/a"


def run_cases(cases: Iterable[CostCase], echo: Callable[[str], None], budget_s: float = 0.6,
              inductor: bool = True) -> list[dict]:
    """The fused-costs table, then the breakdown of the fused call, from one interleaved run per case."""
    from .compiled import clock

    timer, timer_name = clock()
    echo(f"\nFused joint-space costs, forward+backward (machine: {machine()}; {timer_name}):")
    echo(f"terms: {', '.join(f'{k} {s}' for k, s in TERMS)}; outputs=('P',); loss sum(P·W) + sum(cost); "
         f"median of 7 interleaved rounds")
    cases = list(cases)
    timed = []
    for case in cases:
        methods = case_callables(case, inductor, echo)
        timed.append((case, time_interleaved(methods, case.device, budget_s, clock=timer)))
    echo("")
    echo(HEADER)
    echo("|---" * (HEADER.count("|") - 1) + "|")
    rows = []
    for case, t in timed:
        rows.append(dict(dataclasses.asdict(case), **t))
        co = t.get("compiled")
        echo(f"| {case.horizon} | {case.batch} | {case.dtype} | {format_time(t['fused'])} | "
             f"{format_time(t['fused_held'])} | {format_time(t['unfused'])} | {format_time(co) if co else 'n/a'} | "
             f"{format_time(t['plain'])} | {format_time(t['copy'])} | {format_time(t['copy_as_outputs'])} | "
             f"{_ratio(t, 'unfused', 'fused')} | {_ratio(t, 'compiled', 'fused')} | {_ratio(t, 'fused', 'plain')} | "
             f"{_ratio(t, 'fused_held', 'plain')} | {_ratio(t, 'fused', 'copy')} | "
             f"{_ratio(t, 'fused', 'copy_as_outputs')} |")
    echo("\nWhere the fused call's time goes (the same runs):")
    echo("")
    echo(BREAKDOWN)
    echo("|---" * (BREAKDOWN.count("|") - 1) + "|")
    for case, t in timed:
        rest = t["fused"] - t["kernel_forward"] - t["kernel_adjoint"]
        echo(f"| {case.horizon} | {case.batch} | {case.dtype} | {format_time(t['fused'])} | "
             f"{format_time(t['table_checks'])} | {format_time(t['parameter_checks'])} | "
             f"{format_time(t['kernel_forward'])} | {format_time(t['kernel_adjoint'])} | "
             f"{format_time(t['forward_no_grad'])} | {_signed_time(rest)} | {format_time(t['plain_kernels'])} |")
    return rows
