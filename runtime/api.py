"""The public API: load a compiled step, read its source, get its dense matrices."""
from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any, Optional, Sequence, Union

import torch
from torch.nn.modules import module as _nn_module

from ..codegen.arguments import unknown_keyword
from ..codegen.spec import KernelSpec, as_spec
from . import registry, validate
from .autograd import step_function
from .launch import DTYPES, CpuBackend, Launcher, capturing, warm_up_first
from .sources import source  # ts.source: torch-free, so it lives there

Tensor = torch.Tensor
TENSOR_TYPES = validate.TENSOR_TYPES
#: nn.Module's own __call__: Step.__call__ skips it only while it is not patched (as FX's tracer patches it)
_MODULE_CALL = getattr(torch.nn.Module, "_wrapped_call_impl", torch.nn.Module.__call__)
#: the tensor arguments of forward's signature, in its order
PLAIN_ARGUMENTS = ("u", "p0", "v0", "a0", "j0", "start_index")


class Step(torch.nn.Module):
    """A compiled trajectory step: ``P, V, A, J = step(u, p0, v0, a0, dt=..., j0=..., start_index=...)``.

    With ``end="goal"`` the goal state is a keyword: ``goal=(gp, gv, ga[, gj])`` (each [B, D], or
    [G, D] picked by ``goal_index=`` [B] when the spec sets ``goal_index=True``).

    ``out=(P, V, A, J)`` writes the forward into caller-owned tensors instead (rollouts under
    ``torch.no_grad()``; not differentiable, like PyTorch's own ``out=`` functions).

    A step with cost terms can hold its cost parameters (``step.set_costs(**tensors)``): they are
    then its buffers, and a call that leaves a keyword out uses the held tensor.

    ``step.to(torch.float64)``, ``.double()``, ``.float()``, ``.to("cuda")`` and ``.cpu()`` work as
    on any module: in place, they load this module with the kernels of ``spec.replace(dtype=...)``
    and/or for the new device, and return it. Other dtypes (float16, ...) raise a TypeError.
    """

    def __init__(self, spec: Any, device: torch.device, launcher: Launcher):
        super().__init__()
        self.spec = spec
        self.device = device
        self.launcher = launcher
        self.table = launcher.table
        self.dtype = DTYPES[spec.dtype]
        self._names = tuple(a.name for a in self.table.tensors)
        self._known = frozenset(self._names)
        self._plain = self._names == PLAIN_ARGUMENTS
        #: the table rows after forward's parameters, all given by keyword (None: the table does not
        #: begin with those parameters)
        n = len(PLAIN_ARGUMENTS)
        self._keywords = self._names[n:] if self._names[:n] == PLAIN_ARGUMENTS else None
        #: the names a call may pass by keyword straight to _forward (__call__): those rows, not
        #: forward's own keywords (j0, start_index, out, goal) nor its positional parameters
        self._keyword_set = frozenset(self._keywords) if self._keywords is not None else None
        self.op_key = registry.register(launcher, device)
        self._dt_cache: dict[float, Tensor] = {}
        self.native: Optional[int] = None  # handle of the native autograd node, once built
        self._native_step = self._native_step_out = None
        #: where the native node keeps a fused step's cost parameters that passed the Python checks
        #: (runtime/native.py Slot; -1: none): those of calls that pass them, and the held ones
        #: (set_costs), each in a slot of its own so that calls alternating the two keep both
        self._slot: Any = None
        self._slot_id = -1
        self._held_slot: Any = None
        self._held_slot_id = -1
        # (CUDA steps: unless TENSORSTEP_CUDA_NATIVE=0)
        self._native_pending = device.type == "cpu" or (device.type == "cuda" and native_cuda_enabled())
        if self._native_pending:
            self._take_native()
        #: a fused step's plain twin (every state, no cost) for its composite form: loaded when first
        #: needed (``plain``), not with the step, whose common call never runs it
        self._twin: Optional[Twin] = None
        if self.table.fused:
            from . import costs

            self._twin = twin_of(spec.replace(costs=(), outputs=None), device)
            #: the held cost parameters (set_costs), as the module's buffers
            self._buffers = costs.HeldParameters()
            #: the rows the native node keeps (cost parameters); the other keyword rows (a target),
            #: which a call with held parameters passes to the node after forward's tensors
            self._kept_names = frozenset(a.name for a in self.table.tensors if validate.cost_parameter(a))
            self._loose = tuple(n for n in self._keywords or () if n not in self._kept_names)
            #: the cost parameters that passed every check, kept while passed unchanged
            self._kept_costs = costs.CheckedParameters(self.table, self.dtype, self.device)
            #: the composite form of this launcher's kernels, for their gradients through it (autograd.py
            #: ``_recomputed``): its own spec's twin, whichever step the launcher serves later (native.py)
            launcher.composite = functools.partial(_composite, self._twin, self.table)

    def _take_native(self) -> None:
        """Use the native node once built. While it builds (in the background), calls take the
        Python path and each checks again (runtime/native.py)."""
        from . import native

        settled = native.ready()  # asked first: a build that ends in between is taken on the next call
        handle = native.handle(self.launcher)
        if handle is not None:
            self._native_step = _unwrapped(torch.ops.tensorstep_native.step.default)
            self._native_step_out = _unwrapped(torch.ops.tensorstep_native.step_out.default)
            if self.table.fused:
                self._slot, self._held_slot = native.Slot(), native.Slot()
                self._slot_id, self._held_slot_id = self._slot.id, self._held_slot.id
        self.native = handle
        self._native_pending = handle is None and not settled

    def extra_repr(self) -> str:
        return f"{self.spec.name}, device={self.device}"

    @property
    def plain(self) -> Optional["Step"]:
        """A fused step's plain twin (every state, no cost), which its composite form runs (runtime/costs.py:
        dt gradients, double backward, forward mode, functorch transforms, torch.compile, torch.export);
        None for a step without cost terms. Loaded (or built) on first use, once: the common call never
        runs it. Inside a CUDA graph capture that first use raises (``prepare`` loads it ahead); while
        torch.compile traces, it is loaded outside the graph."""
        if self._twin is None:
            return None
        _load_twin(self._twin)
        return self._twin.step

    def _apply(self, fn: Any, recurse: bool = True) -> "Step":
        """Module conversions (``to``, ``double``, ``cuda``, ...): the kernel is fixed per spec and
        device, so a new dtype or device loads that kernel into this module (there are no tensors
        to convert). ``fn`` is applied to a probe tensor to see what the conversion asks for."""
        try:
            probe = fn(torch.zeros((), dtype=self.dtype, device=self.device))
        except (AssertionError, RuntimeError) as err:
            # PyTorch's bare "Torch not compiled with CUDA enabled" (or no driver): load's message
            if torch.cuda.is_available() or not any(word in str(err) for word in ("CUDA", "NVIDIA")):
                raise
            raise _cuda_unavailable("cuda") from None
        if probe.dtype != self.dtype or probe.device != self.device:
            name = {v: k for k, v in DTYPES.items()}.get(probe.dtype)
            if name is None:
                raise TypeError(f"Step cannot convert to {probe.dtype}: tensorstep kernels are float32 or "
                                f"float64 (KernelSpec.dtype); use .float() or .double()")
            used = self._twin is not None and self._twin.step is not None
            fresh = load(dataclasses.replace(self.spec, dtype=name), probe.device)
            module_state = vars(torch.nn.Module())
            self.__dict__.update({k: v for k, v in vars(fresh).items() if k not in module_state})
            if used:  # a twin in use follows now, as when it was a submodule (else loaded when needed)
                self._twin.get()
        return super()._apply(fn, recurse)

    def __reduce__(self):
        # pickle and deepcopy by spec (loaded libraries and ops are per process), and held cost parameters
        if self._buffers:
            return _held_step, (self.spec, str(self.device), dict(self._buffers))
        return load, (self.spec, str(self.device))

    def set_costs(self, **tensors: Optional[Tensor]) -> "Step":
        """Hold cost parameters (weights, row weights, limits, margins, the target, by their keyword
        names): a call that leaves a keyword out uses the held tensor, and one that passes it uses
        the call's. Each is checked as a call checks it, before any is held; ``None`` stops holding
        one. Held tensors are the module's buffers (``state_dict``, ``.to()``), held as given (not
        copied): writing into one in place is seen by the next call, as for keyword tensors. Returns
        the step."""
        if not self.table.fused:
            raise TypeError("set_costs: this step has no cost terms (its spec sets no costs or outputs)")
        from . import costs

        costs.check_held(self.table, tensors, self.dtype, self.device, self.spec.order)
        for name in costs.holdable(self.table):  # in table order
            if name in tensors:
                if tensors[name] is None:
                    self._buffers.pop(name, None)
                else:
                    self.register_buffer(name, tensors[name])
        return self

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        # a cost parameter held by the saved step and not by this one is held (as a copy, set_costs'
        # checks); those held by both are copied in place, as nn.Module loads any buffer
        if self.table.fused:
            from . import costs

            new = {n: state_dict[prefix + n] for n in costs.holdable(self.table)
                   if prefix + n in state_dict and n not in self._buffers}
            if new:
                try:
                    self.set_costs(**{n: t.detach().to(self.device, self.dtype if t.is_floating_point() else t.dtype,
                                                       copy=True) for n, t in new.items()})
                except (TypeError, ValueError) as err:
                    error_msgs.append(str(err))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _dt_tensor(self, dt: Union[float, Tensor], batch: Optional[int] = None) -> Tensor:
        """The kernel's dt vector; tensors for repeated Python floats are reused (cheap calls).

        Inside a CUDA graph capture a new float's tensor would only be recorded, never filled, and
        later eager calls would read it: such a call raises (``prepare`` caches it beforehand)."""
        dt = validate.python_number(dt)
        if self.launcher.per_trajectory:
            return validate.dt_tensor(dt, self.table, self.dtype, self.device, batch)
        if isinstance(dt, float) and not torch.compiler.is_compiling():
            cached = self._dt_cache.get(dt)
            if cached is None:
                if capturing():
                    raise warm_up_first(f"the tensor for dt={dt!r} would be created")
                cached = validate.dt_tensor(dt, self.table, self.dtype, self.device)
                if len(self._dt_cache) < 64:
                    self._dt_cache[dt] = cached
            return cached
        return validate.dt_tensor(dt, self.table, self.dtype, self.device)

    def prepare(self, dt: Optional[float] = None, dt_grad: bool = False, composite: bool = False) -> "Step":
        """Do ahead of time what a first call does lazily, so that later calls can be captured in
        a CUDA graph: cache the tensor for a float ``dt``, and with ``dt_grad=True`` load the dt
        kernels (gradients and tangents with respect to dt). A step with cost terms loads its
        plain twin (``plain``) with ``dt_grad=True`` (a dt gradient runs it), and with
        ``composite=True`` (double backward, forward mode and transforms run it). Returns the step."""
        if capturing():
            raise warm_up_first("prepare was called")
        if self.table.fused and (dt_grad or composite):
            self.plain.prepare(dt_grad=dt_grad)
        if dt is not None:
            dt = validate.python_number(dt)
            if not isinstance(dt, float):
                raise TypeError(f"dt: prepare takes the float dt later calls pass, got {type(dt).__name__}")
            if dt not in self._dt_cache:
                self._dt_cache[dt] = validate.dt_tensor(dt, self.table, self.dtype, self.device)
        self.launcher.prepare(dt_grad)
        return self

    def action_shape(self, batch: int) -> tuple[int, ...]:
        """Shape the actions u must have for a batch of ``batch`` trajectories."""
        return self.launcher.action_shape(batch)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        # nn.Module.__call__ passes the keyword tensors through two more functions, each copying
        # them into a new dict, to find no hook to run: a call goes to forward directly while
        # nothing of that machinery is in use (hooks, jit tracing, Module.compile, a patched
        # Module.__call__, torch.compile)
        if (self._compiled_call_impl is None and torch.nn.Module.__call__ is _MODULE_CALL
                and not (self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks
                         or self._backward_hooks or _nn_module._global_forward_pre_hooks
                         or _nn_module._global_forward_hooks or _nn_module._global_backward_pre_hooks
                         or _nn_module._global_backward_hooks)
                and not torch._C._get_tracing_state() and not torch.compiler.is_compiling()):
            # a call of (u, p0, v0, a0, dt) and none but the table's keyword rows (a fused step's
            # cost parameters) goes to forward's body: binding them to forward's signature copies
            # the keywords into one more dict and compares each name with its parameters' names.
            # Anything else, or a forward overridden (a subclass, an instance attribute), is bound
            # by forward.
            if (len(args) == 5 and type(self) is Step and "forward" not in self.__dict__
                    and (not kwargs or (self._keyword_set is not None and self._keyword_set.issuperset(kwargs)))):
                u, p0, v0, a0, dt = args  # (no list of the arguments is built)
                return self._forward(u, p0, v0, a0, dt, None, None, None, None, kwargs, True)
            return self.forward(*args, **kwargs)
        return torch.nn.Module.__call__(self, *args, **kwargs)

    def forward(
        self,
        u: Tensor,
        p0: Tensor,
        v0: Tensor,
        a0: Tensor,
        dt: Union[float, Tensor],
        *,
        j0: Optional[Tensor] = None,
        start_index: Optional[Tensor] = None,
        out: Optional[Sequence[Tensor]] = None,
        goal: Optional[Sequence[Tensor]] = None,
        **more: Optional[Tensor],
    ) -> tuple[Tensor, ...]:
        return self._forward(u, p0, v0, a0, dt, j0, start_index, out, goal, more, False)

    def _forward(self, u: Tensor, p0: Tensor, v0: Tensor, a0: Tensor, dt: Union[float, Tensor], j0: Optional[Tensor],
                 start_index: Optional[Tensor], out: Optional[Sequence[Tensor]], goal: Optional[Sequence[Tensor]],
                 more: dict[str, Optional[Tensor]], known: bool) -> tuple[Tensor, ...]:
        """forward's body; ``known``: every name in ``more`` is one of the table's keyword rows."""
        if self._native_pending and not torch.compiler.is_compiling():
            self._take_native()
        generation = -1  # the held parameters' generation, where this call's kept rows are they
        if self._plain and goal is None and not more:  # the table's tensors are these parameters, in order
            values = [u, p0, v0, a0, j0, start_index]
        elif self._keywords is not None and goal is None:
            # the table's tensors are these parameters, then the keyword rows (a fused step's cost
            # parameters): read from the call's keywords by name, in table order
            if not known and not self._known.issuperset(more):
                _more_arguments(self.table, more, self.spec)  # raises, naming the first unknown one
            held = self._buffers if self.table.fused else None
            if not held:
                values = [u, p0, v0, a0, j0, start_index, *map(more.get, self._keywords)]
            else:
                # held cost parameters (set_costs) where the call gives none; the generation of the
                # held tensors read before them, kept with them when no kept row is the call's
                generation = held.changes if self._kept_names.isdisjoint(more) else -1
                if (generation >= 0 and self.native is not None and not torch.compiler.is_compiling()
                        and not _transformed()):
                    # the node takes the kept rows from the step's slot, each held tensor compared
                    # with its stamp there: only forward's tensors and a target cross per call
                    loose = ([more[n] if n in more else held.get(n) for n in self._loose] if more
                             else map(held.get, self._loose))
                    done = self._native_held(u, p0, v0, a0, j0, start_index, loose, dt, out, generation)
                    if done is not None:
                        return done
                values = [u, p0, v0, a0, j0, start_index,
                          *(more[n] if n in more else held.get(n) for n in self._keywords)]
        else:
            named = {"u": u, "p0": p0, "v0": v0, "a0": a0, "j0": j0, "start_index": start_index}
            if goal is not None:
                named.update(_goal_arguments(self.table, goal))
            if more:  # the kernel family's other arguments, by their names in the argument table
                if not self._known.issuperset(more):
                    _more_arguments(self.table, more, self.spec)  # raises, naming the first unknown one
                named.update(more)
            if self.table.fused and self._buffers:  # held cost parameters where the call gives none
                named.update((n, t) for n, t in self._buffers.items() if n not in named)
            values = list(map(named.get, self._names))
        if self.native is not None and not torch.compiler.is_compiling() and not _transformed():
            # the common call: the native op checks the tensors against the table itself (with the
            # same messages); a float dt comes as the tensor cached for it. An empty or false result
            # means a value is off (dt, index entries), and the checks below say which. A fused step's
            # cost parameters must be those kept in its slot, unchanged, since they passed the Python
            # checks (runtime/costs.py: their values are checked there); else the node gives no
            # result, and this call takes the Python path, which checks them and keeps them.
            dt_k = dt if type(dt) is Tensor else self._dt_cache.get(dt) if type(dt) is float else None
            if (dt_k is not None and _tensors_or_none(values)
                    and not (dt_k.requires_grad and torch.is_grad_enabled())):
                slot = self._held_slot_id if generation >= 0 else self._slot_id
                if out is None:
                    outs = self._native_step(self.native, [*values, dt_k], slot)
                    if outs:
                        return tuple(outs)
                elif (type(out) in (tuple, list) and all(type(y) is Tensor for y in out)
                      and self._native_step_out(self.native, [*values, dt_k], out, slot)):
                    return tuple(out)
        inputs, dt_k, kept = self._checked(values, dt)
        if self.table.fused:
            if kept and self._slot is not None and self.native is not None and _tensors_or_none(values):
                (self._held_slot if generation >= 0 else self._slot).keep(self.native, [*values, dt_k],
                                                                         [*inputs, dt_k], generation)
            if (out is None and (dt_k.requires_grad or _transformed() or _forward_mode_active()
                                 or torch.compiler.is_compiling())):
                return self._composite(inputs, dt_k)
        if out is not None:
            return self._into(out, inputs, dt_k)
        if torch.compiler.is_compiling():
            if _forward_mode_active():
                # torch.library custom ops carry no forward-mode rule: never return a silent zero
                raise RuntimeError(
                    "tensorstep: forward-mode AD (jvp, jacfwd, hessian) inside torch.compile is not supported; "
                    "call the step outside the compiled region for forward mode (eager jvp is exact)"
                )
            return tuple(_compiled_step(self.op_key, self.table.family, inputs, dt_k))
        if self.native is not None and not dt_k.requires_grad and not _transformed():
            return tuple(self._native_step(self.native, [*inputs, dt_k]))
        return step_function(self.launcher, inputs, dt_k)

    def _native_held(self, u: Tensor, p0: Tensor, v0: Tensor, a0: Tensor, j0: Optional[Tensor],
                     start_index: Optional[Tensor], loose: Any, dt: Any, out: Any, generation: int) -> Any:
        """A call whose cost parameters are all held, on the native node: the outputs (``out``
        written), or None when the node does not take it (held tensors changed or never kept at
        this generation, a value to explain): the caller then passes every row."""
        dt_k = dt if type(dt) is Tensor else self._dt_cache.get(dt) if type(dt) is float else None
        if dt_k is None or (dt_k.requires_grad and torch.is_grad_enabled()):
            return None
        given = [u, p0, v0, a0, j0, start_index, *loose, dt_k]
        if not _tensors_or_none(given):
            return None
        if out is None:
            outs = self._native_step(self.native, given, self._held_slot_id, generation)
            return tuple(outs) if outs else None
        if (type(out) in (tuple, list) and all(type(y) is Tensor for y in out)
                and self._native_step_out(self.native, given, out, self._held_slot_id, generation)):
            return tuple(out)
        return None

    def _checked(self, values: list, dt: Any) -> tuple[list, Tensor, bool]:
        """The Python path's checks of a call's tensors (in table order) and dt, before any kernel
        runs: the tensors as the kernels read them (a fused step's cost parameters as kept while
        passed unchanged, runtime/costs.py CheckedParameters), the kernel's dt vector, and whether a
        fused step's cost parameters were kept (not while traced or transformed)."""
        kept = only = taken = None
        if self.table.fused:
            if torch.compiler.is_compiling() or _transformed():  # traced or transformed: nothing kept
                values = self._kept_costs.arguments(values)
            else:
                kept = self._kept_costs
                values, only, taken = kept.take(values)
        inputs, dims = validate.check_inputs(self.table, values, self.dtype, self.device, only)
        dt_k = self._dt_tensor(dt, dims["B"])
        if self.table.fused:
            from . import costs

            if kept is None:
                costs.check_parameters(self.table, inputs)
            else:
                kept.keep(inputs, taken)
        return inputs, dt_k, kept is not None

    def _composite(self, inputs: list, dt: Tensor) -> tuple[Tensor, ...]:
        """This call's outputs through the composite form, its twin reached through ``plain``, which
        torch.compile loads outside the graph (the launcher's ``composite``, module-level
        ``_composite``, serves eager backwards and calls ``Twin.get`` directly)."""
        from . import costs

        plain = self.plain  # (first: it makes the twin's cost functions, outside torch.compile's graph)
        return costs.composite(plain, self.table, inputs, dt, self._twin.kinds)

    def _into(self, out: Any, inputs: list, dt_k: Tensor) -> tuple[Tensor, ...]:
        """The forward written into caller-owned outputs (rollouts: no allocation, no page faults)."""
        named = {a.name: t for a, t in zip(self.table.tensors, inputs)}
        named["dt"] = dt_k
        shapes = self.launcher.output_shapes(inputs[0].shape[0])
        out = validate.check_out(out, self.table, shapes, self.dtype, self.device, named)
        if torch.compiler.is_compiling():
            for y, value in zip(out, _compiled_step(self.op_key, self.table.family, inputs, dt_k)):
                y.copy_(value)
            return out
        self.launcher.forward(inputs, dt_k, out=out)
        for y in out:  # the kernel wrote through raw pointers: tell autograd the tensors changed
            torch.autograd.graph.increment_version(y)
        return out


class Twin:
    """The plain step of ``spec`` (a fused spec's twin) on ``device``, shared by the fused steps of that
    spec in a process (``twin_of``): loaded (or built) by the first call that needs it (``get``), with the
    PyTorch function of each cost kind (``kinds``, runtime/costs.py ``every_kind``: SymPy's lambdify, kept
    in the kernel cache, so SymPy is imported then only where that is not there)."""

    def __init__(self, spec: Any, device: torch.device):
        self.spec, self.device = spec, device
        self.step: Optional[Step] = None
        self.kinds: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self) -> Step:
        """The plain step, loaded now unless loaded (by one thread; the others wait for it). A CUDA
        graph capture cannot load it: a first use there raises."""
        if self.step is None:
            if capturing():
                raise warm_up_first("the plain step that a fused step's dt gradient, double backward, forward "
                                    "mode or transform runs would be loaded")
            with self._lock:
                if self.step is None:
                    from . import costs

                    self.kinds = costs.every_kind()
                    self.step = load(self.spec, self.device)
        return self.step


#: (spec, device) → the Twin its fused steps share, while one holds it (each step and its launcher's
#: composite form do): dropped with the last, and its plain step with it
_TWINS: "weakref.WeakValueDictionary[tuple[Any, torch.device], Twin]" = weakref.WeakValueDictionary()


def twin_of(spec: Any, device: torch.device) -> Twin:
    """The process's ``Twin`` of a plain spec on a device (nothing loaded yet where it is new)."""
    found = _TWINS.get((spec, device))
    if found is None:
        found = _TWINS.setdefault((spec, device), Twin(spec, device))  # (one Twin where threads race)
    return found


def _load_twin(twin: Twin) -> bool:
    """``twin.get()`` for ``Step.plain``. Marked constant for Dynamo (below): torch.compile calls it while
    tracing, outside the graph (guarded on the ``Twin``, which the steps of a spec share), then traces
    the plain step."""
    twin.get()
    return True


# what torch.compiler.assume_constant_result(_load_twin) sets (as for _custom_ops below)
_load_twin._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _composite(twin: Twin, table: Any, inputs: list, dt: Tensor) -> tuple[Tensor, ...]:
    """A fused launcher's composite form (``Launcher.composite``): its outputs through its spec's twin."""
    from . import costs

    return costs.composite(twin.get(), table, inputs, dt, twin.kinds)


def _held_step(spec: Any, device: str, held: dict[str, Tensor]) -> Step:
    """A step loaded by spec that holds ``held`` (Step.__reduce__: pickle, deepcopy)."""
    return load(spec, device).set_costs(**held)


def _unwrapped(op: Any) -> Any:
    """An op overload's C++ callable: its Python ``__call__`` only forwards to it (a frame less per call)."""
    return getattr(op, "_op", op)


def _tensors_or_none(values: list) -> bool:
    """Every value one of ``validate.TENSOR_TYPES`` or None, as the native op takes them. A loop
    that tests a plain Tensor (most values) before the set: as cheap per call as two identity tests,
    where all() over a generator, the set alone or its issuperset over the types are not."""
    for v in values:
        if v is not None and type(v) is not Tensor and type(v) not in TENSOR_TYPES:
            return False
    return True


def _goal_arguments(table: Any, goal: Any) -> dict[str, Any]:
    """goal=(gp, gv, ga[, gj]) onto the table's goal rows, by name."""
    rows = [a.name for a in table.tensors if a.role == "goal"]
    if not rows:
        raise TypeError("goal: this kernel takes no goal state (its spec does not set end='goal'), got "
                        + type(goal).__name__)
    if not isinstance(goal, (tuple, list)) or not len(rows) - 1 <= len(goal) <= len(rows):
        got = f"{type(goal).__name__} of length {len(goal)}" if isinstance(goal, (tuple, list)) else type(goal).__name__
        raise TypeError(f"goal: expected a tuple ({', '.join(rows[:-1])}[, {rows[-1]}]), got {got}")
    return dict(zip(rows, goal))


def _more_arguments(table: Any, more: dict[str, Any], spec: Any = None) -> dict[str, Any]:
    """``more`` where every name is one of the table's tensors; else a TypeError naming the first
    unknown one, and what the spec lacks where it names a cost term (arguments.py ``unknown_keyword``)."""
    known = {a.name for a in table.tensors}
    unknown = sorted(set(more) - known)
    if unknown:
        raise TypeError(f"{unknown[0]}: this kernel takes no argument of that name; "
                        + unknown_keyword(unknown[0], [a.name for a in table.inputs], table.costs,
                                          getattr(spec, "order", None)))
    return more


def _custom_ops(key: str) -> bool:
    """Registers the torch.library ops that torch.compile traces for a loaded kernel's family,
    once per process and family.

    Dynamo calls a function marked as a constant while tracing, outside the graph, so the
    registration's cost falls on a process's first compilation, not on every load.
    """
    from . import ops

    ops.ops_for(registry.launcher(key))
    return True


# what torch.compiler.assume_constant_result(_custom_ops) sets, without importing Dynamo (and
# SymPy with it) on every load; tests/runtime/test_compile.py checks the two stay the same
_custom_ops._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _compiled_step(key: str, family: str, inputs: list, dt: Tensor) -> list[Tensor]:
    """The forward as the custom op torch.compile traces."""
    _custom_ops(key)
    return getattr(torch.ops.tensorstep, family)(key, *inputs, dt)


def native_cuda_enabled() -> bool:
    """CUDA steps take the native node (runtime/native.py ``cuda_enabled``)."""
    from . import native

    return native.cuda_enabled()


def _transformed() -> bool:
    """A functorch transform (vmap, grad, jvp, ...) or a forward-AD dual level is live: the call
    needs the Python Functions, which carry the vmap and forward-mode rules."""
    # (both predicates also evaluate correctly while dynamo traces)
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


def _forward_mode_active() -> bool:
    """Forward-mode AD is live: a dual level, or a jvp transform (jvp, jacfwd, hessian)."""
    return torch.autograd.forward_ad._current_level >= 0 or _jvp_transform()


def _jvp_transform() -> bool:
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


# Dynamo cannot trace the interpreter stack; marked constant, it calls this while tracing and
# sees the live transforms (vmap alone compiles; a jvp is refused, never a silent zero tangent)
_jvp_transform._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _cuda_unavailable(device: Union[str, torch.device]) -> Exception:
    """The error for a CUDA device asked of a PyTorch that sees none (ts.load, Step.to)."""
    from .cuda_backend import CudaUnavailable

    return CudaUnavailable(
        f"device={str(device)!r}: this PyTorch build sees no CUDA device (torch.cuda.is_available() is False); "
        "install a CUDA build of PyTorch and the CuPy of its CUDA version (pip install 'tensorstep[cuda12]' "
        "or 'tensorstep[cuda13]', as torch.version.cuda says) on a machine with an NVIDIA GPU"
    )


def _device(device: Union[str, torch.device]) -> torch.device:
    allowed = "allowed 'cpu', 'cuda', 'cuda:N' or a torch.device"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device={device!r} is invalid: {allowed}, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise ValueError(f"device={device!r} is invalid: {allowed}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise _cuda_unavailable(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid: {allowed}")
    return dev


def load(spec: Any, device: Union[str, torch.device] = "cpu") -> Step:
    """Compile (or load from the cache) the kernels of a spec (or a dict of its fields) for a device."""
    spec = as_spec(spec, "load")
    dev = _device(device)
    if dev.type == "cpu":
        backend: Any = CpuBackend(spec)
    else:
        from .cuda_backend import CudaBackend

        backend = CudaBackend(spec, dev)
    return Step(spec, dev, Launcher(spec, backend))


def _load_launcher(spec: Any, device: str) -> Launcher:
    """The launcher of a kernel key this process has not loaded (a graph saved by torch.export)."""
    return load(spec, device).launcher


registry.set_loader(_load_launcher)


def register_ops() -> None:
    """Register tensorstep's torch.library ops (``tensorstep::step`` and the others) in this
    process. ``torch.compile`` registers them itself when it first traces a step; call this
    before ``torch.export.load`` of a program that calls a step. The program's kernels are
    loaded (or built) from its graph on their first call."""
    from . import ops

    ops.register_all()


def operator_matrices(spec: Any, dt: Union[float, Sequence[float]]) -> dict[str, Any]:
    """Dense float64 matrices of the operator at the given step durations.

    Returns ``{"u": M_u [K, H, N], "start": M_s [K, H, 4]}`` with
    ``Y_k = M_u[k] @ u + M_s[k] @ (p0, v0, a0, j0)`` for one (batch, dof) column; with
    ``end="goal"`` also ``"goal": M_g [K, H, 4]``, the term ``M_g[k] @ (gp, gv, ga, gj)``; and
    any other input of the spec's argument table by its name, ``M [K, H, 1]`` (one row per column).
    A per-trajectory dt spec takes one trajectory's dt (a float).
    """
    from ..codegen.arguments import GOAL_NAMES, START_NAMES
    from ..codegen.builders import build_operator
    from ..codegen.operator import ACTION, step_matrices

    spec = as_spec(spec, "operator_matrices")
    values = [float(dt)] if isinstance(dt, (int, float)) else [float(x) for x in dt]
    if len(values) != spec.n_dt:
        raise ValueError(f"dt: expected {spec.n_dt} value(s) for dt={getattr(spec, 'dt', '?')!r}, got {len(values)}")
    for v in values:
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"dt: expected finite, positive step durations, got {v!r}")
    by_input = build_operator(spec).dense_inputs(values)
    m_u, m_s, m_g = step_matrices(by_input)
    others = {name: m for name, m in by_input.items() if name not in (ACTION, *START_NAMES, *GOAL_NAMES)}
    return {"u": m_u, "start": m_s, **({"goal": m_g} if m_g.shape[-1] else {}), **others}


__all__ = ["KernelSpec", "Step", "load", "source", "operator_matrices"]
