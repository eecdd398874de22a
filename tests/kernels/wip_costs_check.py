import numpy as np, sys, torch
sys.path.insert(0, "/tmp/wtF/tensorstep/tests")
import tensorstep as ts, reference, reference_costs
from tensorstep.runtime import native
terms = (("bound", "velocity"), ("squared", "position"), ("squared", "jerk"))
spec = ts.KernelSpec(horizon=8, dof=2, dtype="float64", costs=terms, outputs=("P",))
plain = ts.KernelSpec(horizon=8, dof=2, dtype="float64")
step = ts.load(spec); step.native = None
B, D = 3, 2
g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
u = r(B, spec.n_actions, D).requires_grad_(); p0, v0, a0 = r(B, D), r(B, D), r(B, D)
params = {"bound_velocity_weight": r(B, D).abs(), "bound_velocity_limit": torch.tensor([[-0.5, -0.4], [0.6, 0.3]], dtype=torch.float64),
          "bound_velocity_margin": torch.tensor([0.05, 0.1], dtype=torch.float64), "bound_velocity_row_weight": r(8).abs(),
          "squared_position_weight": r(B, D).abs(), "squared_position_target": r(B, D).requires_grad_(),
          "squared_jerk_weight": r(B, D).abs()}
P, cost = step(u, p0, v0, a0, 0.1, **params)
Y = ts.load(plain)(u, p0, v0, a0, 0.1)
states = {n: Y[k].detach().numpy() for k, n in enumerate(("position", "velocity", "acceleration", "jerk"))}
ref = reference_costs.costs(terms, states, {k: v.detach().numpy() for k, v in params.items()})
print("P err", float((P - Y[0]).abs().max()), "cost err", np.abs(cost.detach().numpy() - ref).max(), ref[0])
# gradient vs unfused torch composite
w = r(B, 3)
(cost * w).sum().backward() ; gu = u.grad.clone(); gt = params["squared_position_target"].grad.clone()
u.grad = None; params["squared_position_target"].grad = None
Y = ts.load(plain)(u, p0, v0, a0, 0.1)
def tcost(kind, y, p):
    wgt = p["w"][:, None, :] * (p.get("rw") if p.get("rw") is not None else torch.ones(8, dtype=torch.float64))[None, :, None]
    if kind == "squared":
        t = p.get("t"); t = torch.zeros_like(p["w"]) if t is None else t
        return (wgt * (y - t[:, None, :])**2).sum((1, 2))
    lo, hi = p["lim"][0], p["lim"][1]; m = p["m"]
    return (wgt * (torch.clamp(y - (hi - m), min=0)**2 + torch.clamp((lo + m) - y, min=0)**2)).sum((1, 2))
c = torch.stack([tcost("bound", Y[1], dict(w=params["bound_velocity_weight"], rw=params["bound_velocity_row_weight"], lim=params["bound_velocity_limit"], m=params["bound_velocity_margin"])),
                 tcost("squared", Y[0], dict(w=params["squared_position_weight"], t=params["squared_position_target"])),
                 tcost("squared", Y[3], dict(w=params["squared_jerk_weight"]))], 1)
print("torch cost err", float((c - cost).abs().max()))
(c * w).sum().backward()
print("gu err", float((u.grad - gu).abs().max()), "gt err", float((params["squared_position_target"].grad - gt).abs().max()))
