"""The argument table: every argument of a kernel family, described once.

Each row says what an argument is (name, role, shape in the symbols B, N, H, D, S, NDT, dtype
rule, whether it may be omitted, whether it has a gradient). Everything that handles arguments
is derived from these rows: the C/CUDA parameter lists of the five kernels (codegen/abi.py),
the Python checks and their messages (runtime/validate.py), the native node's checks (the rows
are handed to C++ at registration), the launcher's shapes, and the custom ops' schemas and
fake kernels. Adding an argument is a row here plus its meaning in a builder.

Shape symbols: B trajectories, N action rows (a B-spline's knots), H output rows, D dof, S start-table rows (the
rows ``start_index`` picks from; S = B without an index), G goal-table rows (likewise for
``goal_index``), NDT step durations the kernel reads (dt is [B] when per trajectory).
Rows flagged ``layout`` are [B, rows, D] in layout "bhd" and [B, D, rows] in "bdh".

An integrator (a recurrence: each row reads earlier rows) has ``values`` rows too: the forward's
outputs, which its dt_vjp kernel reads (the launcher runs the forward first) so that its reverse
sweep is a loop over the rows instead of a recomputation of every row.

Import-light (no SymPy, no PyTorch): the runtime reads the table on the cached-load path.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Iterator, Mapping, Optional, Sequence

from .spec import COST_KINDS, DERIVATIVE_NAMES, unknown_name

#: dtype rules: the kernel's floating type, an integer index, the kernel's type for dt
KERNEL, INDEX, STEP = "kernel", "index", "dt"
#: when an argument may be passed: always, may be None, or must be None (for this spec)
REQUIRED, OPTIONAL, ABSENT = "required", "optional", "absent"

#: Error messages shared by the Python checks and the native node (same wording on both paths).
#: Placeholders: {name}, {expected}, {got}, {rows}, {count}, {max}.
MESSAGES: Mapping[str, str] = {
    "missing": "{name}: this kernel needs a {name} argument ({expected}), got None",
    "unexpected": "{name}: this kernel takes no {name} argument (its spec does not set {expected}), got a tensor",
    "type": "{name}: expected a torch.Tensor of shape {expected}, got {got}",
    "layout": "{name}: expected a dense (strided) tensor, got layout {got}",
    "dims": "{name}: expected {count} dims, shape {expected}, got shape {got}",
    "shape": "{name}: expected shape {expected}, got shape {got}",
    "dtype": "{name}: expected dtype {expected} (the kernel's dtype), got {got}",
    "index_dtype": "{name}: expected dtype torch.int32 or torch.int64, got {got}",
    "device": "{name}: expected device {expected} (the kernel's device), got {got}",
    "empty": "{name}: batch size is 0; expected at least one trajectory",
    "no_rows": "{name}: expected at least one row, got shape {got}",
    "range": "{name}: entry {got} is out of range: the rows it picks ({rows}) number {count} (allowed 0..{max})",
    "dt_value": "{name}: expected finite, positive step durations, got {got}",
}


def message(key: str, **fields: Any) -> str:
    """One error message, formatted (Python side; the native node formats the same templates)."""
    return MESSAGES[key].format(**fields)


@dataclasses.dataclass(frozen=True)
class Argument:
    """One argument of a kernel family."""

    name: str  # Python keyword, error-message name
    c_name: str  # parameter name in the generated C
    role: str  # action | start | index | dt | output | value (an output dt_vjp reads)
    shape: tuple[str, ...]  # symbols or sizes, logical order (batch, rows, dof)
    dtype: str = KERNEL
    presence: str = REQUIRED
    nullable: bool = False  # some specs of the family go without it (None in the op schema)
    differentiable: bool = True
    layout: bool = False  # [B, rows, D] follows the spec's layout
    index: str = ""  # the index argument that picks this argument's rows per trajectory
    meaning: str = ""  # for messages: what the argument is
    grad: str = ""  # C name of its gradient (default g<c_name>: gu, gp0, ...)
    tangent: str = ""  # C name of its tangent (default d<c_name>: du, dp0, ...)
    #: the stem of its kernel macros: a [rows, D] input's value is macro <stem> and local <stem lowercased>,
    #: its tangent D<stem>, its gradient store G<stem> (default IN_<C NAME>); an index row's stem names
    #: the row it picks and that row's column base (<stem>row, <stem>o)
    stem: str = ""
    #: a [rows, D] input's index row: the index argument whose entry, when given, picks its row (else b)
    group: str = ""
    #: what a kernel reads for an optional per-dof or per-row parameter that is not given
    default: str = "0"
    #: the runtime passes a tensor of ``default`` where the caller gives None, so the kernels read it
    #: without a test (a test per load kept gcc from vectorising the dof loop)
    filled: bool = False

    @property
    def macro(self) -> str:
        return self.stem or "IN_" + self.c_name.upper()

    @property
    def grad_name(self) -> str:
        return self.grad or "g" + self.c_name

    @property
    def tangent_name(self) -> str:
        return self.tangent or "d" + self.c_name


@dataclasses.dataclass(frozen=True)
class ArgumentTable:
    """A kernel family's arguments for one spec: inputs in call order (dt last), then outputs."""

    family: str
    inputs: tuple[Argument, ...]
    outputs: tuple[Argument, ...]
    sizes: tuple[tuple[str, int], ...]  # the symbols fixed by the spec (N, H, D, NDT)
    layout: str = "bhd"
    values: tuple[Argument, ...] = ()  # the forward's outputs that dt_vjp reads (integrators)
    costs: tuple[tuple[str, str], ...] = ()  # the cost terms (kind, state): the cost output's columns
    #: cost terms, or only some states written: the adjoint recomputes the rows, so it reads the inputs
    fused: bool = False

    def __iter__(self) -> Iterator[Argument]:
        return iter(self.inputs)

    def input(self, name: str) -> Argument:
        return next(a for a in self.inputs if a.name == name)

    @functools.cached_property  # read several times by every call's checks
    def tensors(self) -> tuple[Argument, ...]:
        """The inputs other than dt (what the kernels read besides the step durations)."""
        return tuple(a for a in self.inputs if a.role != "dt")

    @property
    def differentiable(self) -> tuple[Argument, ...]:
        """Inputs whose gradient the adjoint kernel writes (dt's comes from dt_vjp)."""
        return tuple(a for a in self.tensors if a.differentiable)

    @functools.cached_property  # read by every backward (runtime/rules.py)
    def gradient_places(self) -> tuple[tuple[int, Optional[int]], ...]:
        """For each ``differentiable`` input, in order: its position among the inputs, and that of
        the index that picks its rows (None where no index does)."""
        position = {a.name: i for i, a in enumerate(self.inputs)}
        return tuple((position[a.name], position[a.index] if a.index else None) for a in self.differentiable)

    @property
    def dt(self) -> Argument:
        return next(a for a in self.inputs if a.role == "dt")

    @property
    def action(self) -> Argument:
        """The input whose rows follow the layout (the actions, or a B-spline's knots)."""
        return next(a for a in self.inputs if a.layout)

    @property
    def columns(self) -> tuple[Argument, ...]:
        """The inputs of one row of D per trajectory (the start and goal states, ...): each read once per
        (batch, dof) column."""
        return tuple(a for a in self.tensors if a.dtype == KERNEL and not a.layout and len(a.shape) == 2
                     and isinstance(a.shape[0], str) and self.size(a.shape[0]) is None and a.shape[1] == "D")

    @property
    def parameters(self) -> tuple[Argument, ...]:
        """The inputs shared by every trajectory: per dof ([D], or [R, D] for R values per dof) or per
        output row ([H]) (a cost term's limits, margin and row weights)."""
        return tuple(a for a in self.tensors if a.dtype == KERNEL and not a.layout and a not in self.columns)

    @property
    def indices(self) -> tuple[Argument, ...]:
        return tuple(a for a in self.tensors if a.dtype == INDEX)

    @property
    def written(self) -> tuple[int, ...]:
        """The states the outputs write, by derivative (0 for P, 1 for V, ...), in output order."""
        return tuple(OUTPUT_NAMES.index(a.name) for a in self.outputs if a.role == "output")

    def base(self, arg: Argument) -> str:
        """The C name of a column input's element offset: its index row's (``so``, ``go``), or ``bo``
        (row b) for an input no index picks."""
        return self.input(arg.group).stem + "o" if arg.group else "bo"

    def size(self, symbol: str) -> int | None:
        return dict(self.sizes).get(symbol)

    def physical(self, arg: Argument, dims: Mapping[str, int]) -> tuple[int, ...]:
        """The tensor shape of an argument, given sizes for the free symbols (B, S, ...)."""
        known = {**dict(self.sizes), **dims}
        shape = tuple(s if isinstance(s, int) else known[s] for s in arg.shape)
        if arg.layout and self.layout == "bdh":
            shape = (shape[0], shape[2], shape[1])
        return shape

    def symbolic(self, arg: Argument) -> tuple:
        """The shape with the spec's sizes filled in and free symbols (B, S) left as names."""
        known = dict(self.sizes)
        shape = tuple(known.get(s, s) if isinstance(s, str) else s for s in arg.shape)
        if arg.layout and self.layout == "bdh":
            shape = (shape[0], shape[2], shape[1])
        return shape

    def schema(self, extra: str = "", returns: str = "Tensor[]") -> str:
        """The torch.library schema of an op taking a kernel key, the inputs, then ``extra``."""
        params = ["str key"]
        for a in self.inputs:
            params.append(f"Tensor{'?' if a.nullable else ''} {a.name}")
        return f"({', '.join(params + ([extra] if extra else []))}) -> {returns}"


START_NAMES = ("p0", "v0", "a0", "j0")
GOAL_NAMES = ("gp", "gv", "ga", "gj")
OUTPUT_NAMES = ("P", "V", "A", "J", "S")


def _state(names: tuple[str, ...], role: str, index: str, indexed: bool, symbol: str, meaning: str,
           index_c_name: str, stems: tuple[str, str]) -> list[Argument]:
    """A boundary state (start or goal): four [rows, D] tensors (the fourth optional), each picked
    per trajectory by an index row when ``indexed``, then that index row. ``stems``: the state's
    macro stem, numbered per entry (S0..S3), and the index row's (s: srow, so)."""
    rows = symbol if indexed else "B"
    state = [Argument(name, name, role, (rows, "D"), presence=OPTIONAL if m == 3 else REQUIRED, nullable=m == 3,
                      index=index if indexed else "", meaning=meaning, stem=f"{stems[0]}{m}", group=index)
             for m, name in enumerate(names)]
    return state + [Argument(index, index_c_name, "index", ("B",), dtype=INDEX,
                             presence=REQUIRED if indexed else ABSENT, nullable=True, differentiable=False,
                             meaning=f"{index}=True", stem=stems[1])]


def step_table(spec: Any) -> ArgumentTable:
    """The arguments of a step: actions, start state (optionally indexed), the goal state with
    end="goal" (optionally indexed), step durations (one per trajectory with dt="per_trajectory")."""
    bspline = getattr(spec, "control", "") == "bspline"  # u holds the n knots: N = n rows
    inputs = [Argument("u", "u", "action", ("B", "N", "D"), layout=True, stem="U",
                       meaning="knots (B-spline control points)" if bspline else "actions")]
    inputs += _state(START_NAMES, "start", "start_index", bool(getattr(spec, "start_index", False)), "S",
                     "start state", "idx", ("S", "s"))
    goal = getattr(spec, "end", "") == "goal"
    if goal:
        inputs += _state(GOAL_NAMES, "goal", "goal_index", spec.goal_index, "G", "goal state", "gidx", ("E", "g"))
    costs = tuple(getattr(spec, "costs", ()))
    inputs += _cost_parameters(costs, bool(getattr(spec, "goal_index", False)))
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"
    inputs.append(Argument("dt", "dt_in", "dt", ("B",) if per_trajectory else ("NDT",), dtype=STEP,
                           meaning="step durations"))
    written = getattr(spec, "outputs", OUTPUT_NAMES[: spec.order + 1])
    outputs = tuple(Argument(OUTPUT_NAMES[k], f"y{k}", "output", ("B", "H", "D"), layout=True,
                             grad=f"g{k}", tangent=f"ty{k}") for k in range(spec.order + 1) if OUTPUT_NAMES[k] in written)
    if costs:
        outputs += (Argument("cost", "cost", "cost", ("B", "T"), grad="gcost", tangent="tcost",
                             meaning="cost terms"),)
    sizes = (("N", spec.n_actions), ("H", spec.horizon), ("D", spec.dof), ("NDT", spec.n_dt), ("T", len(costs)))
    # a fused step (cost terms, or some states not written) has no dt kernels of its own
    # (abi.part_kernels): nothing for a dt_vjp to read
    fused = bool(costs) or len(written) < spec.order + 1
    values = tuple(Argument(y.name, y.c_name, "value", y.shape, layout=True, differentiable=False,
                            meaning=f"the forward's {y.name}") for y in outputs) \
        if getattr(spec, "integrates", False) and not fused else ()
    family = "step_goal" if goal else "step"
    if fused:  # a schema of its own: the outputs written and the cost parameters
        family += "_" + "".join(written).lower() + "".join(f"_{k[0]}{s[0]}" for k, s in costs)
    return ArgumentTable(family, tuple(inputs), outputs, sizes, spec.layout, values, costs, fused)


def _cost_parameters(costs: tuple[tuple[str, str], ...], goal_index: bool) -> list[Argument]:
    """The keyword tensors of cost terms (kind, state), term t's with macro stems numbered t: its
    weight per dof ([B, D]; a [D] weight applies to every trajectory), an optional weight per row
    ([H], default ones), the limits ([2, D]: lower, upper) and optional margin ([D], default 0)
    of a kind that reads them (spec.COST_KINDS: a bound's), and a squared position term's optional target ([B, D], or [G, D] picked by goal_index)."""
    rows: list[Argument] = []
    for t, (kind, state) in enumerate(costs):
        prefix = f"{kind}_{state}"
        rows.append(Argument(f"{prefix}_weight", f"w{t}", "cost_weight", ("B", "D"), differentiable=False,
                             meaning=f"the weight per dof of cost term {prefix}", stem=f"CW{t}"))
        rows.append(Argument(f"{prefix}_row_weight", f"rw{t}", "cost_row_weight", ("H",), presence=OPTIONAL,
                             nullable=True, differentiable=False, meaning=f"the weight per row of cost term {prefix}",
                             stem=f"CRW{t}", default="1", filled=True))
        if "limit" in COST_KINDS[kind]:
            rows.append(Argument(f"{prefix}_limit", f"lim{t}", "cost_limit", (2, "D"), differentiable=False,
                                 meaning=f"the limits (lower, upper) of {state}", stem=f"CLIM{t}"))
        if "margin" in COST_KINDS[kind]:
            rows.append(Argument(f"{prefix}_margin", f"m{t}", "cost_margin", ("D",), presence=OPTIONAL,
                                 nullable=True, differentiable=False, meaning=f"the margin inside the limits of {state}",
                                 stem=f"CMAR{t}", filled=True))
        if (kind, state) == ("squared", "position"):
            rows.append(Argument("squared_position_target", "tgt", "cost_target", ("G" if goal_index else "B", "D"),
                                 presence=OPTIONAL, nullable=True, index="goal_index" if goal_index else "",
                                 group="goal_index" if goal_index else "", meaning="the target position",
                                 stem="CTGT"))
    return rows


def term_keywords(kind: str, state: str) -> tuple[str, ...]:
    """The keywords a cost term (kind, state) takes: the names of its rows (``_cost_parameters``)."""
    return tuple(a.name for a in _cost_parameters(((kind, state),), False))


def cost_parameter_names() -> frozenset[str]:
    """The parameter names a cost keyword can end with (weight, row_weight, limit, margin, target): those of
    every kind's keywords on every state (``term_keywords``)."""
    return frozenset(n[len(f"{k}_{s}_"):] for k in COST_KINDS for s in DERIVATIVE_NAMES for n in term_keywords(k, s))


def cost_term_of(name: str) -> Optional[tuple[str, str]]:
    """The cost term a keyword ``<kind>_<state>_<parameter>`` is of, the kind one of spec.COST_KINDS and
    the state one of spec.DERIVATIVE_NAMES (whatever the parameter); None for any other name."""
    return next(((kind, state) for kind in COST_KINDS for state in DERIVATIVE_NAMES
                 if name.startswith(f"{kind}_{state}_")), None)


def unknown_keyword(name: str, allowed: Sequence[str], costs: Sequence[tuple[str, str]],
                    order: Optional[int] = None) -> str:
    """What to tell a caller who passed a keyword that is not one of ``allowed``: the closest allowed
    (spec.unknown_name); for a cost term's keyword (``cost_term_of``), what that term takes, and where
    the spec's ``costs`` (the terms, with the spec's ``order``) lack it, that, and where a term is added."""
    term = cost_term_of(name)
    if term is None:
        return unknown_name(name, allowed)
    kind, state = term
    takes = term_keywords(kind, state)
    parameter = name[len(f"{kind}_{state}_"):]
    # a parameter some term takes (a bound's limit, a squared position's target): said, not guessed at
    if parameter in cost_parameter_names() and name not in takes:
        what = f"the {term!r} term takes no {parameter}; it takes: {', '.join(takes)}"
    else:
        close = difflib.get_close_matches(name, takes, n=1) if name not in takes else []
        what = (f"did you mean {close[0]!r}? " if close else "") + f"the {term!r} term takes: {', '.join(takes)}"
    if term in costs:
        return what
    lacks = (f"the spec's costs have no {term!r} term (its terms: {', '.join(map(repr, costs))})" if costs
             else f"the spec has no cost terms (no {term!r} term)")
    needs = DERIVATIVE_NAMES.index(state)
    beyond = f"; {state} needs order={needs}, the spec's order is {order}" if order is not None and needs > order \
        else ""
    return f"{lacks}; a term is added in KernelSpec.costs (or a YAML config's costs:){beyond}; {what}"


#: kernel family → table builder (a spec names its family; native and legacy specs are steps)
FAMILIES = {"step": step_table}  # "step_goal" (end="goal") is built by step_table too


def table(spec: Any) -> ArgumentTable:
    """The argument table of a spec."""
    return FAMILIES[getattr(spec, "family", "step")](spec)
