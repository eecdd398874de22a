"""The `tensorstep` command line (click): generate, show, plot, list, check, stencil, run, bench."""
from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import click

from .codegen.spec import (CONTROLS, DERIVATIVE_NAMES, DIFFERENCES, DT_MODES, DTYPES, ENDS, INTEGRATORS, LAYOUTS,
                           KernelSpec)


TASK_HELP = ("cuRobo task file, with a cuRobo robot file as CONFIG: v0.7's (settings under model:) or v2's "
             "transition file (under transition_model_cfg:); examples in examples/curobo and examples/curobo_v2")
DEVICE_HELP = "cpu, cuda or cuda:N (CUDA needs a CUDA build of PyTorch, CuPy and an NVIDIA GPU)"


class UserError(click.ClickException):
    """An error worth one line, not a traceback."""

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def friendly(fn: Callable) -> Callable:
    """Turn expected failures (bad config, bad spec, refused overwrite) into one-line errors."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from .codegen.emit import OverwriteError
        from .config import ConfigError
        from .runtime.cache import CacheError
        from .runtime.cbackend import CompileError, CompilerNotFound

        try:
            return fn(*args, **kwargs)
        except (ConfigError, OverwriteError, CacheError, CompilerNotFound, ValueError) as err:
            raise UserError(str(err)) from None
        except CompileError as err:
            raise UserError(err.summary()) from None
        except OSError as err:  # an unreadable input, an unwritable output folder
            raise UserError(f"{err.filename + ': ' if err.filename else ''}{err.strerror or err}") from None
        except RuntimeError as err:
            # CudaUnavailable, matched by name: importing its module here would import torch
            cuda = sys.modules.get(f"{__package__}.runtime.cuda_backend")
            if cuda is not None and isinstance(err, cuda.CudaUnavailable):
                raise UserError(str(err)) from None
            raise

    return wrapper


def positive(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Option callback: each given number is finite and positive (batch sizes, seconds)."""
    for number in value if isinstance(value, tuple) else () if value is None else (value,):
        if not (math.isfinite(number) and number > 0):
            kind = "integer" if isinstance(number, int) else "number"
            raise UserError(f"{param.opts[0]}={number}: expected a positive {kind}")
    return value


def check_device(device: str) -> None:
    """--device: cpu, cuda or cuda:N, and for CUDA a PyTorch that sees a GPU (one line otherwise)."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise UserError(f"--device={device!r} is invalid: allowed cpu, cuda, cuda:N")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"--device={device}: this PyTorch build sees no CUDA device; install a CUDA build of "
                            "PyTorch and the CuPy of its CUDA version (pip install 'tensorstep[cuda12]' or "
                            "'tensorstep[cuda13]', as torch.version.cuda says) on a machine with an NVIDIA GPU")


def progress(items: list, label: str) -> Iterable:
    """A progress bar on a terminal; plain lines otherwise."""
    if sys.stderr.isatty():
        with click.progressbar(items, label=label, file=sys.stderr) as bar:
            yield from bar
    else:
        for i, item in enumerate(items, 1):
            name = item.get("name") if isinstance(item, dict) else getattr(item, "name", item)
            click.echo(f"{label} [{i}/{len(items)}] {name}", err=True)
            yield item


def load_config(path: str, task: Optional[str]) -> Any:
    from .config import load_config as _load

    return _load(path, task)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensorstep")
def main() -> None:
    """Generate, inspect, verify and benchmark trajectory step kernels."""


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--task", type=click.Path(dir_okay=False), help=TASK_HELP)
@click.option("-o", "--output", default="generated", show_default=True, type=click.Path(file_okay=False))
@click.option("--target", type=click.Choice(["c", "cuda", "all"]), default="all", show_default=True)
@click.option("--force", is_flag=True, help="Overwrite files tensorstep did not write.")
@friendly
def generate(config: str, task: Optional[str], output: str, target: str, force: bool) -> None:
    """Emit C/CUDA sources, headers and manifest.json for a robot CONFIG."""
    from .codegen import emit

    cfg = load_config(config, task)
    report = emit.write(Path(output), _planned(cfg, target, progress(list(cfg.specs), "deriving")), force=force)
    click.echo(f"{report.summary()} for {cfg.robot} ({cfg.dof} dof, {len(cfg.specs)} kernels) in {output}/")
    for line in report.notes():
        click.echo(line)


def _planned(cfg: Any, target: str, specs: Iterable[Any]) -> dict[str, bytes]:
    """The files `generate` and `run` write for a config's ``specs`` (each kernel's sources and the
    manifest), the sources as the kernel cache keeps them (runtime/sources.py: a warm process
    writes the same bytes without running the generator)."""
    import dataclasses

    from .codegen import emit
    from .runtime.sources import kept

    files: dict[str, bytes] = {}
    for spec in specs:
        planned = emit.plan(dataclasses.replace(cfg, specs=(spec,)), target, kept)
        files.update({k: v for k, v in planned.items() if k != emit.MANIFEST})
    files[emit.MANIFEST] = emit.plan_manifest(cfg, target, files)
    return files


def spec_options(fn: Callable, skip: tuple[str, ...] = ()) -> Callable:
    """KernelSpec fields as options (for `show` without a config), but those named in ``skip``."""
    options = [
        click.option("--horizon", type=int, default=None, help="output rows [default: 32; derived for bspline]"),
        click.option("--dof", type=int, default=7, show_default=True),
        click.option("--control", type=click.Choice(CONTROLS), default="position", show_default=True),
        click.option("--difference", type=click.Choice(DIFFERENCES), default="central", show_default=True),
        click.option("--accuracy", type=str, default=None, help="int, or comma-separated per derivative"),
        click.option("--integrator", type=click.Choice(INTEGRATORS), default="semi_implicit_euler", show_default=True),
        click.option("--end", type=click.Choice(ENDS), default="hold", show_default=True),
        click.option("--dt", "dt_mode", type=click.Choice(DT_MODES), default="uniform", show_default=True),
        click.option("--start-index", is_flag=True),
        click.option("--goal-index", is_flag=True, help="with --end goal: goal rows picked by an index"),
        click.option("--layout", type=click.Choice(LAYOUTS), default="bhd", show_default=True),
        click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True),
        click.option("--order", type=click.Choice(["3", "4"]), default="3", show_default=True),
        click.option("--degree", type=int, default=None, help="bspline: the degree, 3 to 7 [default: 4]"),
        click.option("--knots", type=int, default=None, help="bspline: free control points"),
        click.option("--steps", type=int, default=None, help="bspline: output rows per span"),
    ]
    for option in reversed(options):
        if option(lambda: None).__click_params__[0].opts[0] not in skip:
            fn = option(fn)
    return fn


def parse_accuracy(text: Optional[str]) -> Any:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--accuracy={text!r}: expected an int or comma-separated ints") from None
    return values[0] if len(values) == 1 else values


def spec_from_options(o: dict[str, Any]) -> KernelSpec:
    bspline = o["control"] == "bspline"  # horizon derived (a given one is checked); the B-spline fields
    horizon = o["horizon"] if o["horizon"] is not None or bspline else 32
    return KernelSpec(
        horizon=horizon, dof=o["dof"], control=o["control"], difference=o["difference"],
        accuracy=parse_accuracy(o["accuracy"]), integrator=o["integrator"], end=o["end"], dt=o["dt_mode"],
        start_index=o["start_index"], goal_index=o["goal_index"], layout=o["layout"], dtype=o["dtype"], order=int(o["order"]),
        degree=o["degree"], knots=o["knots"], steps=o["steps"],
    )


def specs_from(config: Optional[str], task: Optional[str], options: dict[str, Any], verb: str) -> tuple:
    """A CONFIG's specs, or the one spec the options give (refusing spec options with a CONFIG)."""
    if config:
        ctx = click.get_current_context()
        given = [p.opts[0] for p in ctx.command.params
                 if p.name in options and ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
        if given:
            raise UserError(f"{', '.join(given)} cannot be combined with CONFIG: the config's kernels are {verb} as "
                            f"it defines them (edit the config, or drop CONFIG to use the spec the options give)")
        return load_config(config, task).specs
    if task:
        raise UserError("--task needs a cuRobo robot file as CONFIG")
    return (spec_from_options(options),)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--task", type=click.Path(dir_okay=False), help=TASK_HELP)
@click.option("--target", type=click.Choice(["c", "cuda", "header"]), default="c", show_default=True)
@click.option("--kernel", type=click.Choice(["all", "core", "dt", "forward", "backward", "adjoint", "dt_vjp", "dt_jvp"]),
              default="all", show_default=True,
              help="core = forward + adjoint (backward); dt = the dt derivatives (dt_vjp, dt_jvp)")
@click.option("--stage", type=click.Choice(["operator", "lowered", "c", "cuda"]), default=None,
              help="print a stage of the code generator instead: the operator's rows, the lowered statements "
                   "of the kernels --kernel picks, or a target's source (c, cuda: as --target) [default: --target's source]")
@spec_options
@friendly
def show(config: Optional[str], task: Optional[str], target: str, kernel: str, stage: Optional[str],
         **options: Any) -> None:
    """Print generated source for a CONFIG, or for the spec given by options (a B-spline's derived
    basis matrix and boundary coefficients first, as a comment); --stage prints another stage."""
    source = stage in (None, "c", "cuda")
    if stage in ("c", "cuda"):
        given = click.get_current_context().get_parameter_source("target") != click.core.ParameterSource.DEFAULT
        if given and target != stage:
            raise UserError(f"--stage {stage} prints the {stage} source: it cannot be combined with --target {target}")
        target = stage
    specs = specs_from(config, task, options, "shown")
    for spec in specs:
        if source and getattr(spec, "control", None) == "bspline":  # cuRobo's kernels have no control field
            from .codegen.bspline import describe

            click.echo("/*\n" + "\n".join(" * " + line for line in
                                           describe(spec.degree, spec.knots, spec.steps, spec.end)) + "\n */")
        if source:  # as the kernel cache keeps it (runtime/sources.py: no generator where it does)
            from .runtime.sources import kept

            click.echo(kept(spec, (target,), kernel)[target])
        else:
            from .codegen.driver import generate

            click.echo(generate(spec, targets=(target,), parts=(kernel,), keep=True).stages.text(stage), nl=False)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--task", type=click.Path(dir_okay=False), help=TASK_HELP)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="the picture (FILE.png)")
@click.option("--step-dt", type=float, default=None, callback=positive,
              help="step duration in seconds [default: a CONFIG's dt, else 0.02]")
@spec_options
@friendly
def plot(config: Optional[str], task: Optional[str], output: str, step_dt: Optional[float], **options: Any) -> None:
    """Draw P, V, A, J of a sample trajectory through each kernel of a CONFIG (or the spec the options
    give) into a picture, with the config's limits dashed and its cost terms' values on the sample.
    Needs matplotlib: pip install 'tensorstep[plot]'."""
    from . import plot as pictures

    specs = specs_from(config, task, options, "drawn")
    compat = [s for s in specs if not hasattr(s, "control")]
    if compat:
        raise UserError(f"plot draws tensorstep's own kernels; this task gives cuRobo's ({compat[0].kind}), whose "
                        "steps take cuRobo's arguments: call them through tensorstep.compat")
    try:
        pictures.pyplot()
    except ImportError as err:
        raise UserError(str(err)) from None
    cfg = load_config(config, task) if config else None
    dt = step_dt if step_dt is not None else cfg.dt if cfg else 0.02
    if not dt > 0:
        raise UserError(f"--step-dt={dt}: expected a positive step duration in seconds")
    limits = dict(cfg.limits) if cfg else None
    pictures.trajectories(specs, dt, output, joints=cfg.joints if cfg else None, limits=limits,
                          keywords=cfg.cost_keywords if cfg else None)
    # a state's panel is drawn where some kernel's order reaches it (snap: order=4)
    drawn = DERIVATIVE_NAMES[: max(spec.order for spec in specs) + 1]
    limited = [state for state, _ in cfg.limits] if cfg else []
    unseen = [state for state in limited if state not in drawn]
    shown = [state for state in limited if state in drawn]
    click.echo(f"{output}: {len(specs)} kernel(s), dt={dt} s"
               + (f"; limits drawn on {', '.join(shown)}" if shown else "")
               + (f"; {', '.join(unseen)} limits not drawn (no kernel has order={DERIVATIVE_NAMES.index(unseen[0])})"
                  if unseen else ""))
    for spec in specs:
        if getattr(spec, "costs", ()):
            click.echo(f"  {spec.name}: cost terms {', '.join(f'{k}_{s}' for k, s in spec.costs)} (their values on "
                       "the sample in its title)")


@main.command(name="list")
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@friendly
def list_(directory: str) -> None:
    """List the variants in a generated DIRECTORY."""
    from .codegen.emit import read_manifest

    manifest = read_manifest(Path(directory))
    if manifest is None:
        raise UserError(f"{directory}: no tensorstep manifest.json here")
    click.echo(f"{manifest['robot']}: {manifest['dof']} dof, tensorstep {manifest['version']}")
    for k in manifest["kernels"]:
        s = k["spec"]
        if "control" in s:
            control, dt = s["control"], s["dt"]
            scheme = {"position": s["difference"], "bspline": f"degree {s.get('degree')} n={s.get('knots')} "
                      f"s={s.get('steps')}"}.get(s["control"], s["integrator"])
        else:  # a cuRobo kernel (tensorstep.compat): its kind
            control, scheme, dt = "curobo" + ("_v2" if "curobo_v2" in (s.get("spec"), s.get("family")) else ""), s["kind"], "-"
        files = ", ".join(v["path"] for v in k["files"].values())
        click.echo(f"  H={s['horizon']:<4} {control:<12} {scheme:<20} dt={dt:<8} {s['dtype']:<8} {files}")


@main.command()
@click.argument("target", type=click.Path(exists=True))
@click.option("--task", type=click.Path(dir_okay=False), help=TASK_HELP)
@friendly
def check(target: str, task: Optional[str]) -> None:
    """Compile a generated DIR (or a CONFIG) and verify it against the dense reference (and a
    kernel's cost terms against their definitions)."""
    specs = None if Path(target).is_dir() else load_config(target, task).specs
    from .runtime import verify

    def checking(items: list) -> Iterable:
        return progress(items, "checking")

    rows = verify.check_folder(Path(target), checking) if specs is None else verify.check_specs(specs, checking)
    ok = all(r["ok"] for r in rows)
    click.echo(f"{'kernel':<60} {'device':<6} {'forward err':>12} {'adjoint err':>12}  result")
    for r in rows:
        click.echo(f"{r['name']:<60} {r['device']:<6} {r['forward']:>12.2e} {r['adjoint']:>12.2e}  {'PASS' if r['ok'] else 'FAIL'}")
        if "cost" in r:  # a fused step: its cost against the terms' definitions (float64)
            terms = ", ".join(f"{kind}_{state}" for kind, state in r["costs"])
            click.echo(f"  cost terms {terms}: cost err {r['cost']:.2e}")
    click.echo("all passed" if ok else "FAILED")
    if not ok:
        sys.exit(1)


@main.command()
@click.option("--difference", type=click.Choice(DIFFERENCES), default="central", show_default=True)
@click.option("--accuracy", type=int, default=4, show_default=True)
@click.option("--derivative", type=click.IntRange(1, 4), multiple=True, help="default: 1, 2, 3")
@friendly
def stencil(difference: str, accuracy: int, derivative: tuple[int, ...]) -> None:
    """Print the derived finite-difference weights (exact rationals, unit spacing)."""
    from .codegen.spec import MAX_ACCURACY
    from .codegen.stencils import stencil_offsets, uniform_weights

    if not 1 <= accuracy <= MAX_ACCURACY:
        raise UserError(f"--accuracy={accuracy}: expected 1 to {MAX_ACCURACY} (as KernelSpec allows)")
    if difference == "central" and accuracy % 2:
        raise UserError(f"--accuracy={accuracy}: central differences need an even accuracy")
    for k in derivative or (1, 2, 3):
        offsets = stencil_offsets(k, accuracy, difference)
        weights = uniform_weights(tuple(offsets), k)
        click.echo(f"derivative {k} ({difference}, accuracy {accuracy}, {len(offsets)} points), times 1/dt^{k}:")
        for o, w in zip(offsets, weights):
            click.echo(f"  {o:+d}: {str(w):>10}  ({float(w):+.12g})")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--task", type=click.Path(dir_okay=False), help=TASK_HELP)
@click.option("-o", "--output", default="generated-run", show_default=True, type=click.Path(file_okay=False))
@click.option("--batch", type=int, default=400, show_default=True, callback=positive)
@click.option("--device", default="cpu", show_default=True, help=DEVICE_HELP)
@friendly
def run(config: str, task: Optional[str], output: str, batch: int, device: str) -> None:
    """Generate a CONFIG's kernels, run forward+backward on each (with the config's limits and cost
    weights where a kernel has cost terms: the cost per term after the run), say where the source is."""
    check_device(device)
    import torch

    import tensorstep as ts

    from .codegen import emit

    cfg = load_config(config, task)
    for line in emit.write(Path(output), _planned(cfg, "all", cfg.specs)).notes():
        click.echo(line)
    click.echo(f"{cfg.robot}: {cfg.dof} dof, dt={cfg.dt}, batch={batch}, device={device}")
    threads = torch.get_num_threads()  # the kernels' OpenMP threads too (one runtime)
    if not device.startswith("cuda"):
        click.echo(f"CPU threads: {threads} (torch.get_num_threads(), set by OMP_NUM_THREADS; on a machine other "
                   "busy processes share, OMP_NUM_THREADS=1 can be many times faster: README, 'CPU kernels')")
    for spec in cfg.specs:
        t0 = time.perf_counter()
        step = ts.load(spec, device)
        load_s = time.perf_counter() - t0
        dtype = step.dtype
        S = batch
        u = torch.randn(step.action_shape(batch), dtype=dtype, device=step.device, requires_grad=True)
        start = [torch.randn(S, spec.dof, dtype=dtype, device=step.device) for _ in range(3)]
        kw: dict[str, Any] = {"start_index": torch.arange(batch, device=step.device)} if spec.start_index else {}
        if getattr(spec, "end", "") == "goal":  # (cuRobo's kernels have no end field)
            kw["goal"] = tuple(torch.randn(batch, spec.dof, dtype=dtype, device=step.device) for _ in range(3))
            if spec.goal_index:
                kw["goal_index"] = torch.arange(batch, device=step.device)
        n_dt = {"uniform": 0, "per_step": spec.horizon, "per_trajectory": batch}[spec.dt]
        dt: Any = torch.full((n_dt,), cfg.dt, dtype=dtype, device=step.device) if n_dt else cfg.dt
        kw.update(_cost_tensors(cfg, spec, step.dtype, step.device))
        outs = step(u, *start, dt, **kw)
        grads = [torch.randn_like(o) for o in outs]  # stand-in for a cost's output gradients
        if getattr(spec, "costs", ()):
            grads[-1] = torch.ones_like(outs[-1])  # the loss adds the cost terms up
        _backward(outs, grads)
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            u.grad = None  # as optimizer.zero_grad() does
            _backward(step(u, *start, dt, **kw), grads)
        if step.device.type == "cuda":
            torch.cuda.synchronize()
        per_call = (time.perf_counter() - t0) / reps * 1e6
        shapes = " ".join("x".join(map(str, o.shape)) for o in outs)
        path = "native node" if step.native is not None else "Python autograd path"
        if step.device.type == "cpu":
            path += f", {threads} thread{'s' if threads > 1 else ''}"
        click.echo(f"  {spec.name}\n    outputs {shapes}; load {load_s * 1e3:.0f} ms; "
                   f"forward+backward {per_call:.0f} us/call ({path}); grad u {tuple(u.grad.shape)}")
        if getattr(spec, "costs", ()):
            click.echo(f"    cost per term, mean over the {batch} trajectories: " + _cost_terms(spec.costs, outs[-1]))
        click.echo(f"    source: {Path(output) / (spec.name + '.c')} and {Path(output) / (spec.name + '.cu')}")
    click.echo(f"manifest: {Path(output) / emit.MANIFEST}")


@functools.lru_cache(maxsize=1)
def _seed() -> Any:
    """An autograd function of (gradients, *outputs) whose value is a scalar 0 and whose backward hands
    each output its gradient (``_backward``)."""
    import torch

    class Seed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, grads: list, *outs: Any) -> Any:
            ctx.grads = grads
            return outs[0].new_zeros(())

        @staticmethod
        def backward(ctx: Any, _: Any) -> tuple:
            return (None, *ctx.grads)

    return Seed


def _backward(outs: Any, grads: list) -> None:
    """``torch.autograd.backward(outs, grads)``, but as a scalar's backward: PyTorch's check of given
    output gradients imports torch.fx's symbolic shapes, and SymPy with them, which a warm `run`
    otherwise never imports."""
    _seed().apply(grads, *outs).backward()


def _cost_tensors(cfg: Any, spec: Any, dtype: Any, device: Any) -> dict[str, Any]:
    """A config's cost parameters for a kernel's terms (``limits:``, ``costs:``) as keyword tensors."""
    import torch

    return {k: torch.tensor(v, dtype=dtype, device=device) for k, v in cfg.cost_keywords(spec).items()}


def _cost_terms(terms: Iterable[tuple[str, str]], cost: Any) -> str:
    """`kind_state value, ...` for a cost [B, T] (its mean over trajectories)."""
    means = cost.detach().double().mean(dim=0).tolist()
    return ", ".join(f"{kind}_{state} {value:.4g}" for (kind, state), value in zip(terms, means))


@main.command()
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--quick", is_flag=True, help="fewer sizes (B up to 4000)")
@click.option("--scheme", type=click.Choice(["central", "backward", "accel", "bspline", "costs"]), multiple=True,
              help="bspline: degree 4, 8 knots, 4 rows per span, 7 dof (B=4000 unless --batch); costs: a step "
                   "with fused joint-space costs against the unfused step plus the same costs (B=400 and 40000 "
                   "unless --batch)")
@click.option("--batch", type=int, multiple=True, callback=positive, help="batch sizes (default: the standard set)")
@click.option("--horizon", type=int, multiple=True, help="horizons (default: 32, plus 8/128/256 at B=400)")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), multiple=True)
@click.option("--budget", type=float, default=0.6, show_default=True, callback=positive,
              help="seconds of timing per case")
@click.option("--codegen/--no-codegen", default=True, show_default=True, help="also time cold and warm loads")
@click.option("--inductor/--no-inductor", default=True, show_default=True,
              help="also time the slicing baseline under torch.compile (compiled per case before timing)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="draw time per call against batch into FILE.png (needs matplotlib)")
@click.option("--compiled-loss", is_flag=True,
              help="only the step inside a loss, eager and under torch.compile, against a tiny loss's floor "
                   "(B=8 and 400 unless --batch), and its first compile in fresh processes unless --no-codegen")
@click.option("--steady-malloc/--system-malloc", default=True, show_default=True,
              help="keep freed memory in the process (fixed glibc thresholds, so no method's outputs are "
                   "page-faulted in on some runs and not others), or leave glibc's defaults")
@click.option("--cuda-plan", is_flag=True,
              help="no timing and no GPU: the CUDA launches of a forward, a backward and a backward with a dt "
                   "gradient for the spec the spec options give (B=400 and 40000 unless --batch), the bytes of "
                   "temporaries, and ptxas's registers, spills and stack per kernel")
@click.option("--profile", is_flag=True,
              help="no timing table: torch.profiler over 20 forward+backward calls of each method of --scheme "
                   "costs (B=400 unless --batch; --horizon, --dtype, --device), each op's self host time per "
                   "call (and self device time on CUDA)")
@click.option("--json", "as_json", is_flag=True, help="with --cuda-plan: print JSON")
@click.option("--ptxas/--no-ptxas", default=True, show_default=True,
              help="with --cuda-plan: compile each library with nvcc for ptxas's figures")
@functools.partial(spec_options, skip=("--horizon", "--dtype"))
@friendly
def bench(device: str, quick: bool, scheme: tuple, batch: tuple, horizon: tuple, dtype: tuple,
          budget: float, codegen: bool, inductor: bool, plot_path: Optional[str], compiled_loss: bool,
          steady_malloc: bool, cuda_plan: bool, profile: bool, as_json: bool, ptxas: bool, **options: Any) -> None:
    """Time forward+backward against the dense-matrix and slicing PyTorch baselines (eager and under
    torch.compile) and the copy bound, then the forward alone (rollouts) into new and into reused
    outputs (out=). With --cuda-plan, the spec options (and --horizon, --dtype) choose the spec."""
    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params
             if ctx.get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
    plan_only = {p.opts[0] for p in ctx.command.params if p.name in options or p.name in ("as_json", "ptxas")}
    if cuda_plan:
        allowed = plan_only | {"--cuda-plan", "--batch", "--horizon", "--dtype"}
        if set(given) - allowed:
            raise UserError(f"--cuda-plan takes the spec options, --batch and --json, not "
                            f"{', '.join(g for g in given if g not in allowed)}")
        _cuda_plan(batch or (400, 40000), horizon, dtype, as_json, ptxas, options)
        return
    if set(given) & plan_only:
        raise UserError(f"{', '.join(g for g in given if g in plan_only)}: only with --cuda-plan (the spec whose "
                        "launches it reports)")
    check_device(device)
    from .bench import allocator, bspline, harness

    if profile:
        allowed = {"--profile", "--device", "--scheme", "--batch", "--horizon", "--dtype", "--steady-malloc"}
        if set(given) - allowed or set(scheme) - {"costs"}:
            extra = [g for g in given if g not in allowed] + [f"--scheme {s}" for s in scheme if s != "costs"]
            raise UserError(f"--profile profiles the costs bench's methods: it takes --batch, --horizon, --dtype "
                            f"and --device, not {', '.join(extra)}")
        from .bench import costs, profile as profiler

        click.echo(allocator.keep_freed_memory() if steady_malloc else allocator.leave_as_is())
        profiler.run_cases([costs.CostCase(b, d, h, device) for h in (horizon or (32,)) for b in (batch or (400,))
                            for d in (dtype or ("float32",))], click.echo)
        return

    if compiled_loss:
        if device != "cpu" or scheme or dtype or plot_path or len(horizon) > 1:
            raise UserError("--compiled-loss times one float32 CPU loss: it takes --batch, one --horizon, --budget "
                            "and --no-codegen, not --device, --scheme, --dtype or --plot")
        from .bench import compiled

        click.echo(allocator.keep_freed_memory() if steady_malloc else allocator.leave_as_is())
        compiled.run(batch or (8, 400), horizon[0] if horizon else 32, click.echo, budget,
                     compile_cost=codegen)
        return

    if plot_path:
        from . import plot as pictures

        try:  # before the timings, not after them
            pictures.pyplot()
        except ImportError as err:
            raise UserError(str(err)) from None

    click.echo(allocator.keep_freed_memory() if steady_malloc else allocator.leave_as_is())
    own_tables = {"bspline", "costs"}  # schemes with a table of their own
    others = tuple(s for s in scheme if s not in own_tables)
    filtered = bool(scheme or batch or horizon or dtype)
    if others or (filtered and not own_tables & set(scheme)):
        cases = [harness.Case(s, h, b, d, device) for s in (others or ("central",)) for h in (horizon or (32,))
                 for b in (batch or (1, 400, 4000, 40000)) for d in (dtype or ("float32",))]
    else:  # the standard set, or none with --scheme bspline or costs alone
        cases = [] if filtered else harness.default_cases(device, quick)
    splines = [bspline.BSplineCase(batch=b, dtype=d, device=device) for b in (batch or (4000,))
               for d in (dtype or ("float32",))] if "bspline" in scheme or not filtered else []
    rows = harness.run_cases(cases, click.echo, budget, inductor) if cases else []
    if splines:
        bspline.run_cases(splines, click.echo, budget, inductor)
    if "costs" in scheme:
        from .bench import costs

        costs.run_cases([costs.CostCase(b, d, h, device) for h in (horizon or (32,)) for b in (batch or (400, 40000))
                         for d in (dtype or ("float32",))], click.echo, budget, inductor)
    if plot_path:
        pictures.bench_times(rows, plot_path, harness.machine())
        click.echo(f"\nplot: {plot_path}")
    rollouts = [c for c in cases if c.horizon == 32 and c.dtype == "float32"]
    if rollouts:
        harness.run_rollouts(rollouts, click.echo, budget)
    if codegen:
        harness.codegen_cost(click.echo)


def _cuda_plan(batches: tuple[int, ...], horizons: tuple, dtypes: tuple, as_json: bool, with_ptxas: bool,
               options: dict[str, Any]) -> None:
    """`bench --cuda-plan`: a report per spec (each --horizon and --dtype given), as tables or JSON."""
    import json

    from .bench import cuda_plan

    specs = [spec_from_options({**options, "horizon": h, "dtype": d})
             for h in (horizons or (None,)) for d in (dtypes or ("float32",))]
    reports = [cuda_plan.report(spec, batches, with_ptxas) for spec in specs]
    click.echo(json.dumps(reports, indent=1) if as_json else cuda_plan.tables(reports))


if __name__ == "__main__":  # pragma: no cover
    main()
