"""What a compiled loss's graphs hold (the per-call work of a step under torch.compile), and the
`bench --compiled-loss` table that times it."""
from __future__ import annotations

import numpy as np
import torch
from click.testing import CliRunner
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import tensorstep as ts
from tensorstep.bench import compiled
from tensorstep.cli import main


def graphs_of(loss, *args):
    """The AOTAutograd forward and backward graphs of torch.compile(loss, fullgraph=True), and the
    compiled value and gradients."""
    found = {}

    def keep(name):
        def compiler(gm, example_inputs):
            found[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    value = torch.compile(loss, fullgraph=True, backend=backend)(*args)
    grads = torch.autograd.grad(value, [a for a in args if a.requires_grad])
    return found, value, grads


def calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_backward_asks_the_adjoint_only_for_needed_gradients_and_fills_no_zeros():
    """Only u requires a gradient and only P and J are used: the backward graph runs the adjoint
    once, asking for u's gradient alone, with V's and A's gradients absent (no zero tensors), and
    gives eager's gradient."""
    step = ts.load(ts.KernelSpec(horizon=8, dof=3, dtype="float64"))
    g = torch.Generator().manual_seed(1)
    u = torch.randn(4, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    starts = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    loss = compiled.losses(step)["loss"]
    found, value, (grad,) = graphs_of(loss, u, *starts)
    (eager,) = torch.autograd.grad(loss(u, *starts), u)
    np.testing.assert_allclose(grad.numpy(), eager.numpy(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(value, loss(u, *starts), rtol=1e-12)

    backward = calls(found["backward"])
    adjoints = [n for n in backward if "tensorstep" in str(n.target)]
    assert [str(n.target) for n in adjoints] == ["tensorstep.step_adjoint.needed"]
    key, batch, grads, dt, needed = adjoints[0].args
    assert needed == [True, False, False, False, False]  # u; not p0, v0, a0, j0
    assert grads[1] is None and grads[2] is None and grads[0] is not None and grads[3] is not None
    assert not [n for n in backward if n.target in (torch.ops.aten.zeros.default, torch.ops.aten.full.default)]
    forward_ops = [str(n.target) for n in calls(found["forward"]) if "tensorstep" in str(n.target)]
    assert forward_ops == ["tensorstep.step.default"]


def test_start_state_gradients_when_they_are_wanted():
    """p0 requiring a gradient too: the adjoint is asked for u's and p0's, which match eager."""
    step = ts.load(ts.KernelSpec(horizon=8, dof=3, dtype="float64"))
    g = torch.Generator().manual_seed(2)
    u = torch.randn(4, 7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    p0 = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v0, a0 = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    loss = compiled.losses(step)["loss"]
    found, _, grads = graphs_of(loss, u, p0, v0, a0)
    eager = torch.autograd.grad(loss(u, p0, v0, a0), (u, p0))
    for a, b in zip(grads, eager):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)
    (adjoint,) = [n for n in calls(found["backward"]) if "tensorstep" in str(n.target)]
    assert adjoint.args[-1] == [True, True, False, False, False]


def test_bench_compiled_loss_table():
    """The table runs end to end (a tiny budget: this checks the command, not speed): one row per
    batch, the shares being each loss minus its tiny loss."""
    lines: list[str] = []
    rows = compiled.run((2,), 8, lines.append, budget_s=0.01, repeats=1, compile_cost=False)
    assert [r["batch"] for r in rows] == [2]
    t = rows[0]
    assert all(t[k] > 0 for k in ("eager loss", "eager tiny", "compiled loss", "compiled tiny"))
    row = next(line for line in lines if line.startswith("| 2 |"))
    share = (t["compiled loss"] - t["compiled tiny"]) / (t["eager loss"] - t["eager tiny"])
    assert row.endswith(f"| {share:.2f}× |")


def test_bench_compiled_loss_refuses_options_it_does_not_take():
    result = CliRunner().invoke(main, ["bench", "--compiled-loss", "--scheme", "accel"])
    assert result.exit_code != 0
    assert "--compiled-loss times one float32 CPU loss" in result.output and "Traceback" not in result.output


def test_opcheck_adjoint_needed():
    """The overload a compiled backward calls passes torch.library.opcheck (schema, fake kernel
    against the real one, autograd registration, AOT dispatch), gradients requiring grad too."""
    from tensorstep.runtime import ops

    spec = ts.KernelSpec(horizon=8, dof=3, dtype="float64", difference="backward", start_index=True)
    step = ts.load(spec)
    ops.ops_for(step.launcher)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(4, 8, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    grads[2] = None
    dt = torch.tensor([0.1], dtype=torch.float64)
    op = torch.ops.tensorstep.step_adjoint.needed
    torch.library.opcheck(op, (step.op_key, 4, grads, dt, [True, False, True, False, False]))
    outs = op(step.op_key, 4, grads, dt, [True, False, True, False, False])
    full = torch.ops.tensorstep.step_adjoint.default(step.op_key, 4, grads, dt)
    assert len(outs) == 2 and torch.equal(outs[0], full[0]) and torch.equal(outs[1], full[2])
