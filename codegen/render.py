"""Rendering, the driver's last stage: a lowered operator → C source, CUDA source, header (Jinja2)."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Collection, Optional

import jinja2
import jinja2.bccache

from ..version import __version__
from . import abi, fused, macros, monomials, roll, tape, whole
from .arguments import ArgumentTable
from .lower import TABLE_CALL, KernelCode, LoweredOperator
from .printer import COLUMN, lane_printer
from .statements import Read, Shift, walk
from .targets import (CUDA_BLOCK, CUDA_STAGED, CUDA_WARPS, ITEMSIZE, TABLE_KERNELS, Target, cuda_coefficients,
                      cuda_float_powers, cuda_row_unroll, cuda_shared_powers, cuda_shared_slots, cuda_stage_columns,
                      cuda_tiles, cuda_volatile_coefficients, cuda_warp_rows_shared, inline_coefficients, tape_files)

CTYPES = {"float32": "float", "float64": "double"}


#: where the compiled templates are kept first: beside them, as Python keeps a module's bytecode in its
#: ``__pycache__`` (a new kernel cache, as CI and a first use have, then compiles none); where that folder
#: cannot be written, in the kernel cache (``keep_templates``)
PACKAGE_KEPT = Path(__file__).resolve().parent.parent / "templates" / "__pycache__"


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        extensions=["jinja2.ext.loopcontrols"],
        loader=jinja2.PackageLoader("tensorstep", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=_KeptTemplates(str(PACKAGE_KEPT)) if _writable(PACKAGE_KEPT) else None,
    )


def _writable(folder: Path) -> bool:
    """Whether ``folder`` exists or can be made, and this process may write in it."""
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


class _KeptTemplates(jinja2.FileSystemBytecodeCache):
    """Jinja2's compiled templates kept in a folder (by the template source's checksum and the Python
    version): a process that generates code skips compiling kernel.c.j2 and the others (about a tenth
    of a second) where an earlier one kept them. A folder that cannot be read or written: compiled
    as without it."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # noqa: BLE001 (unreadable or damaged, whichever way: compiled again)
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError:
            pass


def keep_templates(folder: Path) -> None:
    """Keep the compiled templates in ``folder`` (the runtime's kernel cache: ``_KeptTemplates``),
    unless this process keeps them somewhere already (beside the templates: ``PACKAGE_KEPT``)."""
    environment = _environment()
    if environment.bytecode_cache is None:
        environment.bytecode_cache = _KeptTemplates(str(folder))


def strides(layout: str, rows: int, dof: int) -> tuple[int, int, int]:
    """(batch, row, dof) element strides of a [B, rows, D] ('bhd') or [B, D, rows] ('bdh') tensor."""
    if layout == "bhd":
        return rows * dof, dof, 1
    return rows * dof, 1, rows


#: Vector widths (bits) tried for the all-dof lane form, smallest first: AVX-512 masked loads
#: and stores (VL for 256 bits) cover D dof in one vector when D fits.
LANE_BITS = (256, 512)
#: Bodies with a longer straight-line stretch (``roll.longest_stretch``: a rolled column's stretches before,
#: inside and after its loops counted apart) keep the per-dof loop: gcc's time on the lane form grows with a
#: block's length, on some blocks superlinearly (a plain integrator's straight-line adjoint, which loads every
#: gradient row first: 17 s at 2,307 lines against 0.9 s per-dof; ``ROLL_ABOVE_LINES`` rolls those first).
#: The fused columns past 1,000 lines (B-splines of degree 3-7 with up to 8 rows a span, rolled or
#: straight-line; stencils at H=40 with eight terms: to 4,512 lines) compiled in 0.21-0.49x the per-dof
#: loop's gcc time on an adjoint (5.5 s at 3,908 lines against 24 s), 0.03-0.06x on a forward, and their
#: adjoints ran in 0.12-0.39x its time; past the longest measured, the per-dof loop (BENCHMARKS.md,
#: issue 39, "C's lane form past 1,000 lines")
LANE_MAX_LINES = 4600
#: Integrator bodies longer than this use their rolled form (codegen/roll.py) for the lanes: straight-line,
#: their lane form's gcc time grows superlinearly past it (above); up to it they stay straight-line
#: (``_lane_bodies``)
ROLL_ABOVE_LINES = 1000


def lanes(spec: Any) -> dict | None:
    """The C template's all-dof vector form: one masked vector holds a row's D dof values.

    Only for layout 'bhd' (a row's dof are contiguous) and D up to 16 (float32) / 8 (float64);
    the generated code still falls back to the per-dof loop where AVX-512 is unavailable.
    """
    if spec.layout != "bhd":
        return None
    size = ITEMSIZE[spec.dtype]
    for bits in LANE_BITS:
        width = bits // (8 * size)
        if spec.dof <= width:
            return dict(bits=bits, bytes=bits // 8, width=width, mask=f"0x{(1 << spec.dof) - 1:X}",
                        mask_type="unsigned short" if width == 16 else "unsigned char",  # __mmask16 / __mmask8
                        suffix="ps" if size == 4 else "pd",
                        vector=f"__m{bits}" + ("" if size == 4 else "d"))
    return None


#: the most batch elements a thread runs two trajectories a vector (``paired``): their rows stay in
#: cache there, where the paired loop is the faster; on rows from memory it was the slower (two
#: trajectories' rows read in turn defeat the hardware prefetcher; BENCHMARKS.md, "The fused C
#: adjoint's pairs: rows loaded by halves, and why pairs are slow on rows from memory")
PAIR_MAX_BATCH = 2048


def paired(lane_form: dict | None, table: ArgumentTable, bodies: dict, codes: dict, stencil: bool) -> tuple[str, ...]:
    """The lane bodies that also run two trajectories per vector (``lane_pairs``), for a thread's share
    of at most ``PAIR_MAX_BATCH``: a fused adjoint (a stencil's, with one set of step coefficients for
    every trajectory) whose lanes fill at most half of a 512-bit vector, in the form that the most
    specific call runs (codegen/fused.py ``forms``; the others keep one form: compile time). Its
    instructions are about half as many per trajectory, and its spills too (the column's constants are
    the same for both halves); the arithmetic is the same lane by lane, so the results are the same
    bits. The fused forward is left single: its sums per dof in double take two conversions and two
    stores a term for a pair, and it was slower paired."""
    if (lane_form is None or 2 * lane_form["bits"] > max(LANE_BITS) or not table.fused or not stencil
            or table.dt.shape == ("B",)):
        return ()
    forms = fused.forms(table)
    body = "adjoint" + (forms[0].suffix if forms else "")
    return (body,) if body in bodies and not codes[body].loops else ()


#: the most bytes a thread's share of the batch moves (the output gradients it is given, the action
#: gradients it writes) for which an integrator's plain C adjoint runs its column with each gradient row
#: loaded where it is first used (``late_loads``): on rows in cache the reverse sweep starts at once (a
#: quarter to a third less time); on rows from memory the column that loads them all first keeps more
#: loads in flight (loaded where used was 1.5-2x slower there). Measured on the 2-core machine (32 MB
#: of L3), float32 and float64, P's gradient only and all four: faster up to about 14 MB a thread,
#: slower from about 18 MB (BENCHMARKS.md, "The integrators' plain C adjoint: gradient rows loaded
#: where first used")
LATE_LOADS_MAX_BYTES = 12 << 20


def late_loads(code: LoweredOperator, codes: dict, lane_bodies: dict[str, tuple[Any, list[str]]]
               ) -> dict[str, dict[str, list[str]]]:
    """The C adjoint of a recurrence (``LoweredOperator.adjoint_loaded_late``) whose lane body is
    straight-line, with each gradient row loaded where it is first used: its lane column lines by
    body, for the batch function a thread runs on a share of at most ``LATE_LOADS_MAX_BYTES``
    (templates/kernel.c.j2; the lane form only: the per-dof loop, which gcc vectorises across the
    dof, took 0.96-1.03x of its time in that order). The same statements in another order, so the
    same bits. None elsewhere: a stencil carries nothing along its column, a rolled lane body
    (long horizons) loads each row in its loop already, and a fused adjoint has its own forms."""
    late = code.adjoint_loaded_late
    if late is None or "adjoint" not in lane_bodies or lane_bodies["adjoint"][0] is not codes["adjoint"].statements:
        return {}
    lines = lane_printer(macros.lane_names(code.arguments)).lines(late.statements)
    return {"adjoint": {"lanes": lines}} if len(lines) <= LANE_MAX_LINES else {}


def pair_vector(lane_form: dict | None) -> dict | None:
    """The paired lane form's vector: twice the lane form's bits, its lanes in two halves (b, b1)."""
    if lane_form is None:
        return None
    bits, half = 2 * lane_form["bits"], lane_form["width"]
    width = 2 * half
    return dict(bits=bits, bytes=bits // 8, width=width, half=half, suffix=lane_form["suffix"],
                mask_type="unsigned short" if width == 16 else "unsigned char",
                low=lane_form["mask"], high=f"0x{int(lane_form['mask'], 16) << half:X}", max_batch=PAIR_MAX_BATCH,
                vector=f"__m{bits}" + ("" if lane_form["suffix"] == "ps" else "d"))


#: how many trajectories ahead a C kernel asks for the rows it reads and writes (``prefetches``)
PREFETCH_AHEAD = 4
#: the fewest bytes of the rows a kernel asks for (``macros.prefetch_elements``: every one it is passed)
#: in a thread's share for which it asks: below, they stay in cache from call to call and the requests
#: only took time (B=400: the fused forward's 0.8 MB, an integrator's 1.8 MB, a B-spline's 2.5 MB).
#: Measured: BENCHMARKS.md "The fused C kernels at B=40000: rows asked for ahead" and "The plain step's
#: C kernels at B=40000: rows asked for ahead"
PREFETCH_FROM_BYTES = 5 << 19


def prefetches(table: ArgumentTable, codes: dict, kernels: tuple[str, ...],
               whole: Collection[str] = ()) -> dict[str, list[str]]:
    """A C forward's and adjoint's requests for a later trajectory's rows (codegen/macros.py
    ``prefetches``), by kernel, for each whose rows are all read and written by its column (a fused
    kernel's, an integrator's, a B-spline's): a straight-line column loads and stores each row of a
    trajectory from its own instructions, a pattern the hardware's prefetchers may not follow, and on
    rows from memory each trajectory then waited for its loads (BENCHMARKS.md, "The fused C kernels at
    B=40000: rows asked for ahead", "The plain step's C kernels at B=40000: rows asked for ahead"). A
    kernel with loops over rows (a stencil's interior), which stream them, asks for none: there the
    requests only took time. A forward in ``whole`` (``whole_rows``) does not ask for its outputs' rows to
    be written: its whole-vector stores were faster without (BENCHMARKS.md, "The integrators' forward
    at B=40000: rows stored as whole vectors")."""
    return {k: [line for line in macros.prefetches(table, k) if not (k in whole and _output_write(table, line))]
            for k in ("forward", "adjoint") if k in kernels and not codes[k].loops}


def _output_write(table: ArgumentTable, line: str) -> bool:
    """Whether a request (``macros.prefetches``) asks for an output's row to be written."""
    return any(line.startswith(f"TS_PREFETCH_ROW_WRITE({y.c_name} + ") for y in table.outputs)


def _output_store(macro: str) -> bool:
    """An output row's store (``Y<k>``; not a tangent's, ``TY<k>``)."""
    return macro[:1] == "Y" and macro[1:].isdigit()


def _gradient_load(macro: str) -> bool:
    """An output gradient row's load (``G<k>``)."""
    return macro[:1] == "G" and macro[1:].isdigit()


def whole_rows(code: LoweredOperator, codes: dict, bodies: dict[str, tuple[Any, list[str]]], horizon: int) -> set[str]:
    """The lane bodies that store each output row as a whole vector, the lanes past its D dof included,
    where that vector stays inside the trajectory's rows (codegen/whole.py, templates/kernel.c.j2
    ``VYW``): those lanes fall on the output's next rows, which the same column stores after it. So each
    output's stores must be at literal rows 0 .. H-1, each once, in that order (``whole.stored_in_order``):
    a plain straight-line integrator's forward (a rolled column's rows are a loop's, a B-spline's in
    loops, a stencil's interior rows written by its loops). A masked store's lanes past the row were
    each a separate partial write of a line: from memory the integrators' forward took about 1.5x its
    time with them (BENCHMARKS.md, "The integrators' forward at B=40000: rows stored as whole vectors").
    Measured and left masked: a plain adjoint's stores of u's gradient rows, which it makes in the same
    order (0 .. N-1), whole were as fast or slower (BENCHMARKS.md, "u's gradient rows stored whole, and
    the fused adjoint's gradient rows loaded whole: measured")."""
    return _plain_straight_line("forward", code, codes, bodies,
                                lambda statements: whole.stored_in_order(statements, _output_store, horizon))


#: the dtypes whose fused adjoint loads its gradient rows as whole vectors (``whole_loads``): float32's
#: were faster on rows from memory, float64's not (BENCHMARKS.md, "u's gradient rows stored whole, and the
#: fused adjoint's gradient rows loaded whole: measured", "The fused C adjoint at B=40000: gradient rows
#: loaded whole, and u's gradient rows stored whole")
FUSED_WHOLE_LOADS = frozenset({"float32"})


def whole_loads(code: LoweredOperator, codes: dict, bodies: dict[str, tuple[Any, list[str]]],
                dtype: str) -> set[str]:
    """The lane bodies that load an output gradient's row as a whole vector, the lanes past its D dof
    included, where that vector stays inside the trajectory's rows (codegen/whole.py,
    templates/kernel.c.j2 ``VGW``): a plain straight-line adjoint's, every row it loads a literal one
    (an integrator's; ``whole.loaded_literal``). Those lanes hold the next row's values, which only
    lane-wise arithmetic and masked stores meet, so no value changes; the last rows, whose vector would
    reach past the trajectory's (and the buffer's) end, stay masked loads. A masked load of part of a
    line was slow from memory (BENCHMARKS.md, "The plain C adjoint at B=40000: gradient rows loaded as
    whole vectors"). Measured and left masked: the column that loads each row where first used
    (``late_loads``: rows in cache; whole loads were slower there), a rolled column's and a B-spline's
    loads at a loop's row (slower), and a stencil's, whose lane body loads its boundary rows only (no
    change). A fused adjoint's forms (``adjoint`` and each ``adjoint_<form>``, codegen/fused.py ``forms``)
    in a dtype of ``FUSED_WHOLE_LOADS``, each with every gradient row loaded at a literal row: its cost
    terms meet the gradient rows lane by lane too (their sums over the dof are the forward's). Its paired
    function (two trajectories a vector, ``paired``) prints the same body with ``VGW`` as its own masked
    ``VG`` (``_pair_macros``)."""
    literal: Callable[[Any], bool] = lambda statements: whole.loaded_literal(statements, _gradient_load)
    if code.fused:
        return _fused_adjoint_forms(codes, bodies, literal) if dtype in FUSED_WHOLE_LOADS else set()
    return _plain_straight_line("adjoint", code, codes, bodies, literal)


#: the rows of u's gradient a fused adjoint holds before it stores them in row order, by dtype
#: (``whole.in_row_order``'s block; None: every row, until its reverse sweep completes row 0): float32 in
#: blocks of 8 rows, each block's last rows masked, was faster from memory than holding every row and as
#: fast in cache; float64's blocks were slower in cache (BENCHMARKS.md, "A recurrence's fused C adjoint:
#: u's gradient rows held and stored whole")
HELD_ROWS: dict[str, Optional[int]] = {"float32": 8, "float64": None}


def whole_actions(code: LoweredOperator, codes: dict, bodies: dict[str, tuple[Any, list[str]]],
                  table: ArgumentTable, n_actions: int) -> set[str]:
    """The lane bodies that store each action gradient's row as a whole vector where that vector stays
    inside the trajectory's rows (codegen/whole.py, templates/kernel.c.j2 ``VGUW``), as ``whole_rows``
    stores the forward's outputs: a fused adjoint's forms (``adjoint``, ``adjoint_<form>``) whose stores of
    them make rows 0 .. N-1, each once, at literal rows or a loop's rows relative to r (``whole.stored_once``).
    A stencil adds each row up and stores it once it is complete, in order; a recurrence's reverse sweep
    completes them last row first, and holds them (``HELD_ROWS``, ``whole.in_row_order``, which
    ``_whole_lines`` applies) to store them in row order; a rolled one (above C's straight-line horizon)
    holds each loop iteration's rows (two) and the rows between loops. A row is whole where the rows its
    lanes past reach are stored after it (``whole.marked``): a rolled sweep's iteration stores its top row
    masked (BENCHMARKS.md, "A rolled recurrence's fused C adjoint: each iteration's rows stored in row
    order"). From memory, whole stores were faster there in float32 and float64
    (BENCHMARKS.md, "The fused C adjoint at B=40000: gradient rows loaded whole, and u's gradient rows
    stored whole", "A recurrence's fused C adjoint: u's gradient rows held and stored whole"), the held
    rows as fast in cache. A plain adjoint's stay masked: whole, they were as fast or slower
    (BENCHMARKS.md, "u's gradient rows stored whole, and the fused adjoint's gradient rows loaded whole:
    measured"). The paired function stores them masked (``_pair_macros``)."""
    if not code.fused:
        return set()
    stores = _action_store(table)
    return _fused_adjoint_forms(codes, bodies, lambda statements: whole.stored_once(statements, stores, n_actions))


def _action_store(table: ArgumentTable) -> Callable[[str], bool]:
    """An action gradient row's store (``GU``)."""
    return lambda macro: macro == "G" + table.action.macro


def _pair_macros(table: ArgumentTable, outputs: int, loads: Collection[str], actions: Collection[str]
                 ) -> list[tuple[str, str]]:
    """The paired lane form's macros (``macros.lane_pairs``), with each gradient row's whole load (``VGW<k>``,
    ``whole_loads``) its masked paired load and an action gradient row's whole store (``VGUW``,
    ``whole_actions``) its masked paired store: a paired vector's upper half is another trajectory's row."""
    pairs = macros.lane_pairs(table, outputs)
    return (pairs + ([("VGW" + name[2:], definition) for name, definition in pairs if _gradient_load(name[1:])]
                     if loads else [])
            + ([("VGUW", definition) for name, definition in pairs if name == "VGU"] if actions else []))


def _fused_adjoint_forms(codes: dict, bodies: dict[str, tuple[Any, list[str]]],
                         rows_whole: Callable[[Any], bool]) -> set[str]:
    """A fused adjoint's forms (``adjoint``, ``adjoint_<form>``: codegen/fused.py ``forms``) whose lane
    body has no loops over rows and whose statements ``rows_whole`` accepts."""
    return {k for k in bodies if (k == "adjoint" or k.startswith("adjoint_")) and not codes[k].loops
            and rows_whole(bodies[k][0])}


def _plain_straight_line(kernel: str, code: LoweredOperator, codes: dict, bodies: dict[str, tuple[Any, list[str]]],
                         rows_whole: Callable[[Any], bool]) -> set[str]:
    """{kernel} where its lane body is an unfused one with no loops over rows whose statements
    ``rows_whole`` accepts, else {}."""
    if kernel in bodies and not code.fused and not codes[kernel].loops and rows_whole(bodies[kernel][0]):
        return {kernel}
    return set()


def _whole_lines(bodies: dict[str, tuple[Any, list[str]]], stores: dict[str, Callable[[str], bool]],
                 loads: dict[str, Callable[[str], bool]], table: ArgumentTable, held: Optional[int], reach: int
                 ) -> dict[str, list[str]]:
    """The lines of each lane body, with the stores through its macros in ``stores`` in row order (held in
    blocks of ``held`` rows where made in another order: ``whole.in_row_order``) and marked whole where
    the ``reach`` rows after theirs are stored later, and the loads through those in ``loads`` marked
    whole (codegen/whole.py)."""
    printer = lane_printer(macros.lane_names(table))
    none: Callable[[str], bool] = lambda _: False
    return {k: printer.lines(whole.marked(whole.in_row_order(statements, stores[k], held) if k in stores else statements,
                                          stores.get(k, none), loads.get(k, none), reach))
            if k in stores or k in loads else lines
            for k, (statements, lines) in bodies.items()}


def _rereads_actions(statements: Any, n_actions: int) -> bool:
    """Whether a lane body reads most action rows several times each: a knot loop's rows (read at
    every knot), or straight-line reads of at least half of the rows, twice or more per row."""
    reads = []
    for node in walk(tuple(statements)):
        if isinstance(node, Read) and node.macro == "U":
            if isinstance(node.args[0], Shift):
                return True
            reads.append(node.args[0])
    rows = {j for j in reads if isinstance(j, int)}
    return 2 * len(rows) >= n_actions > 0 and len(reads) >= 2 * len(rows)


def _lane_actions(bodies: dict[str, tuple[Any, list[str]]], n_actions: int) -> tuple[str, ...]:
    """The lane bodies that load every action row once, up front, into a local array: those that
    read most rows several times. GCC takes a masked store for one that may alias any later
    load, so a row read where it is used was loaded again after every store (docs/benchmarks-history.md,
    nineteenth session)."""
    return tuple(k for k, (statements, _) in bodies.items() if _rereads_actions(statements, n_actions))


def _lane_bodies(code: LoweredOperator, codes: dict, kernels: tuple, table: ArgumentTable
                 ) -> dict[str, tuple[Any, list[str]]]:
    """The forward and adjoint columns in the lane form: straight-line where that is short
    enough, else (an integrator's long horizon) rolled into a loop over the rows; a body whose
    longest stretch outside its loops passes ``LANE_MAX_LINES`` keeps the per-dof loop. Straight-line
    is preferred: all of a column's loads are known up front, which keeps more memory traffic
    in flight (the rolled adjoint is 5-25% slower at B=4000-40000 for H=32, faster at B=400).
    A stencil's dt_jvp column too (its span loops over rows: GCC's vectoriser leaves the dof
    loop around them scalar); an integrator's, rolled by the lowering, stays the per-dof loop,
    which GCC vectorises (its lane form was slower)."""
    bodies = {}
    for k in ("forward", "adjoint", "dt_jvp"):
        if k in kernels and (k != "dt_jvp" or code.stencil):
            statements = codes[k].statements  # the target's variant (codegen/targets.py ``codes``)
            if len(codes[k].body) > ROLL_ABOVE_LINES and k != "dt_jvp":
                statements = getattr(code, f"{k}_rolled") or statements  # built on demand
            printer = lane_printer(macros.lane_names(table))
            lines = printer.lines(statements)
            if len(lines) <= LANE_MAX_LINES or roll.longest_stretch(statements, printer.lines) <= LANE_MAX_LINES:
                bodies[k] = statements, lines
    return bodies




def factors_read(kernel: KernelCode, size: int) -> int:
    """How many leading slots of a ``size``-slot table a fused column reads: one past the highest
    slot of its ``C(q)`` reads, each a fixed slot (a B-spline's rolled spans read one span's slots,
    the first of each distinct value, however many copies the table holds for the unfused loops);
    the whole table where a read's slot moves with a loop (``Strided``)."""
    highest = -1
    for node in walk((tuple(kernel.setup), tuple(kernel.statements), tuple(kernel.loops))):
        if isinstance(node, Read) and node.macro == "C":
            if not all(isinstance(a, int) for a in node.args):
                return size
            highest = max(highest, *node.args)
    return highest + 1


def _uses(codes: Any, *macros: str) -> bool:
    """Whether a line of the kernels' bodies (``codes``: KernelCodes, None for a kernel left out) calls
    one of ``macros`` (each given with its opening parenthesis): the template defines them only then."""
    return any(m in line for c in codes if c is not None and hasattr(c, "body") for line in c.body for m in macros)


def _codes(code: LoweredOperator, kernels: tuple[str, ...], itemsize: int, target: Target,
           variants: dict[str, dict[str, Any]], general: bool, spec: Any) -> dict[str, Any]:
    """Each kernel's lowered general form (codegen/targets.py ``codes``); where the source leaves the
    general form out (``general`` false), a kernel with variants gets a column without statements,
    its entry point's setup alone (every C fused column's is the table call): its batch functions are
    not compiled, and lowering the column was most of a fused core's codegen."""
    formed = {k for v in variants.values() for k in v} if not general else set()
    codes = target.codes(code, tuple(k for k in kernels if k not in formed), itemsize, spec)
    return {k: KernelCode(TABLE_CALL, []) if k in formed else codes[k] for k in kernels}


def _form_checks(table: ArgumentTable, forms: list[fused.Form]) -> tuple[list[str], dict[str, str]]:
    """C lines that set what a call's parameters allow (``narrow``: every dof allows the cost kinds'
    narrow forms; ``unit_rows``: every row weight is 1), and each variant's test of them by suffix."""
    lines = []
    if any(f.narrow for f in forms):
        loads, conditions = fused.narrow_check(table)
        test = " && ".join(f"({COLUMN.expr(c)})" for c in conditions)
        lines += ["int narrow = 1; /* every dof allows the cost kinds' narrow forms */",
                  "for (int64_t d = 0; d < D_; ++d) {", *(f"    {line}" for line in COLUMN.lines(loads)),
                  f"    narrow &= {test};", "}"]
    if any(f.unit_rows for f in forms):
        test = " && ".join(f"({a.macro}(h) == {a.default})" for a in fused.unit_rows_check(table))
        lines += ["int unit_rows = 1; /* every row weight is 1 (as where none is given) */",
                  f"for (int64_t h = 0; h < H_; ++h) unit_rows &= {test};"]
    tests = {f.suffix: " && ".join(n for n in ("narrow", "unit_rows") if getattr(f, n)) for f in forms}
    return lines, tests


#: C kernels with at most this many step coefficients (one dt per call) give each thread its own
#: copy of the table (an array in the batch function: a few KB per call), so gcc keeps a loop's
#: coefficients in registers; longer tables (per-step durations) are read where used, each row
#: its own entries.
C_PRIVATE_COEFFICIENTS = 1024


#: Once-per-call coefficient programs (the table, dt_jvp's tangent, dt_vjp_finish's reverse) longer
#: than this many lines (per-step durations) are split for the C compiler: the straight-line part
#: (the boundary rows, a fixed size) unoptimised, the loops over the interior rows at -O2
#: (-O3's vectoriser takes seconds on their long bodies, for no gain on a loop run once per call).
LONG_PROGRAM_LINES = 200


@dataclasses.dataclass(frozen=True)
class SplitProgram:
    """A once-per-call program's lines: the straight-line part, then its loops (the rows it rolls)."""

    straight: list[str]
    loops: list[str]


def _long_programs(code: LoweredOperator, kernels: tuple, per_trajectory: bool) -> dict[str, SplitProgram]:
    """The C template's long once-per-call programs by function (none with one dt or per trajectory)."""
    if per_trajectory or (len(code.coefficient_lines) <= LONG_PROGRAM_LINES and not code.coefs.taped):
        return {}
    programs = {"coefficients": code.coefficient_lines}
    if "dt_jvp" in kernels:
        programs["coefficients_jvp"] = code.dt_jvp.preamble
    if "dt_vjp_finish" in kernels:
        programs["dt_vjp_finish"] = code.dt_vjp_finish.body
    out = {}
    for name, lines in programs.items():
        loop = ("for (", "TS_ROLLED", "TS_BARRIER")  # a loop's first line, or the barrier before it
        first = next((i for i, line in enumerate(lines) if line.startswith(loop)), len(lines))
        assert all(line.startswith((*loop, " ", "}")) for line in lines[first:]), f"{name}: statements after its loops"
        out[name] = SplitProgram(lines[:first], lines[first:])
    return out


def _tapes(code: LoweredOperator, kernels: tuple, taped: bool, target: Target) -> list[tape.Tape]:
    """The tapes the kernels run (see codegen/tape.py): the table's where a kernel fills it (in C
    each library's kernels fill their own; a CUDA dt module's dt_vjp reads the table the core
    module's kernel fills), dt_jvp's tangent program, dt_vjp_finish's reverse program: their
    straight-line parts where long (on CUDA wherever a dt per step has them), and on CUDA their
    long rows' row tapes."""
    programs = (["value"] if set(kernels) & set(target.table_fillers()) else []) + \
        (["tangent"] if "dt_jvp" in kernels else []) + (["reverse"] if "dt_vjp_finish" in kernels else [])
    return [t for p in programs for t in [*([code.coefs.tape(p)] if taped else []),
                                           *(code.coefs.row_tapes(p).values() if target.tape_programs else ())]]


def _unit_guards(kernels: tuple, programs: dict, units: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """The C preprocessor lines around what only some units use (each unit then parses and
    compiles only its own; the tapes are tens of thousands of initializers): the table's program
    and value tape (the kernels that fill the table), the tangent tape (the dt tangent's program),
    the reverse tape and program (dt_vjp_finish). Nothing where every unit uses it."""
    users = {"table": [k for k in kernels if k in TABLE_KERNELS],
             "tangent": ["coefficients_jvp" if "coefficients_jvp" in programs else "dt_jvp"],
             "reverse": ["dt_vjp_finish"]}
    guards = {}
    for what, names in users.items():
        numbers = [units.index(n) + 1 for n in names if n in units]
        if numbers and len(numbers) < len(units):
            guards[what] = ("#if !defined(TS_UNIT) || " + " || ".join(f"TS_UNIT == {n}" for n in numbers), "#endif")
    return guards


def render(spec: Any, code: LoweredOperator, table: ArgumentTable, target: Target, part: str = "all",
           forms: Optional[Collection[int]] = None) -> str:
    """Source text of one spec's kernels for a target (codegen/targets.py).

    ``part`` selects the kernels: 'core' (forward, adjoint), 'dt' (dt derivatives) or 'all'.
    ``forms``: the forms of a fused C forward and adjoint whose batch functions the source holds: 0 the
    general one, the variants from 1 (codegen/fused.py ``forms``); None: every one. A source without
    some compiles only where the switches of templates/kernel.c.j2 leave them out (the runtime's,
    runtime/cbackend.py ``Forms``).
    Called by the driver (codegen/driver.py), which validates target and part.
    """
    kernels = abi.part_kernels(part, table)
    form = target.coefficient_form(code.coefs)
    taped = code.coefs.taped_for(target.tape_programs)  # (form "tape", or CUDA's choice)
    tapes = _tapes(code, kernels, taped, target)
    target.check(spec, tapes)
    ctype = CTYPES[spec.dtype]
    itemsize = ITEMSIZE[spec.dtype]
    u = strides(spec.layout, spec.n_actions, spec.dof)
    y = strides(spec.layout, spec.horizon, spec.dof)
    lane_form = lanes(spec) if target.lanes else None
    variants = target.form_codes(code, kernels, itemsize, forms)  # by suffix (codegen/fused.py ``forms``)
    codes = _codes(code, kernels, itemsize, target, variants, forms is None or 0 in forms, spec)
    lane_bodies = _lane_bodies(code, codes, kernels, table) if lane_form else {}
    for suffix, variant in variants.items() if lane_form else ():
        held = {k: v for k, v in variant.items() if v is not None}
        lane_bodies.update({k + suffix: v for k, v in _lane_bodies(code, held, tuple(held), table).items()})
    every_code = {**codes, **{k + suffix: c for suffix, v in variants.items() for k, c in v.items() if c is not None}}
    pairs = paired(lane_form, table, lane_bodies, every_code, code.stencil)
    late = late_loads(code, codes, lane_bodies) if lane_form else {}
    stores = whole_rows(code, codes, lane_bodies, spec.horizon)
    prefetch = prefetches(table, codes, kernels, stores)
    loads = whole_loads(code, every_code, lane_bodies, spec.dtype)
    actions = whole_actions(code, every_code, lane_bodies, table, spec.n_actions)
    assert not (late and pairs), "an adjoint has one batch-chosen form"
    form_checks, form_tests = _form_checks(table, fused.forms(table)) if variants else ([], {})
    programs = _long_programs(code, kernels, table.dt.shape == ("B",)) if target.split_programs else {}
    units = abi.units(part, table)
    if not table.fused and bool(table.values) == code.stencil:
        raise ValueError(f"{spec.name}: the argument table {'gives' if table.values else 'lacks'} the forward's values "
                         f"for dt_vjp, but the operator is {'a stencil' if code.stencil else 'a recurrence'}: "
                         "the spec's 'integrates' must say whether its rows read earlier rows")
    # CUDA: where each per-element kernel gets its step coefficients (a table, its block, its threads)
    where = {k: cuda_coefficients(k, table, form, code.n_coefficients, itemsize) for k in kernels}
    thread = {k: "thread" for k in kernels} if inline_coefficients(table, form) else {}
    # CUDA, monomials: the factors each per-element kernel's copy in shared memory holds (a fused
    # column's: those it reads, a prefix of the table; others' every slot)
    n_factors = len(code.coefs.monomials.factors) if form == "monomials" else 0
    factors = {k: factors_read(codes[k], n_factors) if code.fused and k in ("forward", "adjoint") else n_factors
               for k in kernels}
    context = dict(
        banner=f"generated by tensorstep {__version__} -- do not edit",
        spec_json=json.dumps(spec.to_dict(), sort_keys=True),
        name=spec.name,
        ctype=ctype,
        H=spec.horizon, N=spec.n_actions, D=spec.dof, n_dt=code.n_dt, n_coef=code.n_coefficients,
        order=spec.order,
        column_macros=macros.column(table),
        parameter_macros=macros.parameters(table),
        costs=len(table.costs),
        fused=code.fused,
        # C: a fused recurrence's rolled adjoint keeps its checkpoints in a local array (TS_CK) and reads
        # actions again (TS_REREAD), either without the other (no checkpoint where only actions are reread)
        checkpoints=_uses([*codes.values(), *(c for v in variants.values() for c in v.values())],
                          "TS_CHECKPOINTS(", "TS_REREAD("),
        # CUDA: fences between rows (codegen/fences.py)
        fences=_uses(codes.values(), "TS_FENCE("),
        written=list(table.written),
        lane_macros=macros.lanes(table) + macros.lane_parameters(table),
        zero_tangent_macros=macros.zero_tangents(table),
        lane_zero_tangent_macros=macros.lane_zero_tangents(table),
        tangent_bases=macros.tangent_bases(table, target.restrict),
        index_rows=macros.rows(table),
        null_indices=macros.null_indices(table, "0" if target.device else "NULL"),
        base_lines=macros.bases(table),
        per_trajectory=table.dt.shape == ("B",),
        layout=spec.layout,
        u_sb=u[0], u_sh=u[1], u_sd=u[2], y_sb=y[0], y_sh=y[1], y_sd=y[2],
        kernels=kernels,
        units=units,
        codes=codes,
        variants={k: [(suffix, v[k]) for suffix, v in variants.items() if k in v] for k in kernels
                  if any(k in v for v in variants.values())},
        form_checks=form_checks,
        form_tests=form_tests,
        private_coefficients=table.dt.shape != ("B",) and code.n_coefficients <= C_PRIVATE_COEFFICIENTS,
        lanes=lane_form,
        lane_bodies=_whole_lines(lane_bodies, {**{k: _output_store for k in stores},
                                               **{k: _action_store(table) for k in actions}},
                                 {k: _gradient_load for k in loads}, table, HELD_ROWS[spec.dtype],
                                 -(-(lane_form["width"] - spec.dof) // spec.dof) if lane_form else 1),
        lane_actions=_lane_actions(lane_bodies, spec.n_actions),
        paired=pairs,
        late_loads=late,
        late_loads_max_bytes=LATE_LOADS_MAX_BYTES,
        prefetch=prefetch,
        whole_rows=stores,
        whole_loads=loads,
        whole_actions=actions,
        prefetch_elements={k: macros.prefetch_elements(table, k) for k in prefetch},
        prefetch_ahead=PREFETCH_AHEAD,
        prefetch_from_bytes=PREFETCH_FROM_BYTES,
        pair=pair_vector(lane_form) if pairs else None,
        pair_macros=_pair_macros(table, spec.order + 1, loads, actions) if pairs else [],
        pair_bases=macros.pair_bases(table) if pairs else [],
        coefficient_lines=((code.as_tapes if target.tape_programs else code).coefficient_lines
                           if set(kernels) & set(TABLE_KERNELS) else None),
        programs=programs,
        guards=_unit_guards(kernels, programs, units) if target.unit_guards else {},
        signatures={k: target.signature(k, table, ctype) for k in target.entry_points(kernels, table, form)},
        argument_names={k: ", ".join(n for _, n in abi.arguments(k, table)) for k in kernels},
        itemsize=itemsize,
        coefficients_in=where,
        # CUDA: which part of each per-element kernel reads its coefficients through a volatile pointer
        # (with a dt per trajectory every per-element kernel computes its coefficients or their dt
        # derivatives in each thread: "thread", a stencil's dt_vjp too)
        volatile_coefficients={k: cuda_volatile_coefficients(k, thread.get(k, where[k]), code.fused, code.stencil,
                                                            len(code.coefs.dt_syms) > 1, itemsize, factors[k],
                                                            code.only)
                               for k in kernels},
        shared_factors=factors,
        # CUDA: the kernels that keep the thread's powers of its dt in shared memory
        shared_powers={k: cuda_shared_powers(k, thread.get(k, where[k]), code.fused, itemsize) for k in kernels},
        # CUDA: the kernels whose coefficients are float products of the factors and the thread's powers
        float_powers={k: cuda_float_powers(k, thread.get(k, where[k]), code.fused, itemsize) for k in kernels},
        row_unroll={k: cuda_row_unroll(k, thread.get(k, where[k]), code.fused, itemsize) for k in kernels},
        # CUDA: the per-column values each kernel keeps in the thread's column of shared memory
        shared_column={k: cuda_shared_slots(k, codes[k].statements) for k in kernels},
        dt_chunk=abi.C_DT_VJP_CHUNK,
        stencil=code.stencil,
        values=bool(table.values) and "dt_vjp" in kernels,  # the YV<k> macros of dt_vjp
        taped=taped,
        tapes=tapes,
        tape_math=any("powc" in t.ops for t in tapes),
        tape_files=tape_files(tapes) if target.block_tapes else {},
        monomials=code.coefs.monomials if form == "monomials" else None,
        inline_coefficients=inline_coefficients(table, form),
        coefficient_form=form,
        once_block=CUDA_BLOCK,
        c_double=tape.c_double,
        shuffle_width=monomials.SHUFFLE_WIDTH,
        block_tapes=target.block_tapes,
        device=target.device,
        launch_bounds=target.launch_bounds,
        min_blocks=target.min_blocks(spec),  # CUDA: per-element kernels asking for more resident blocks
        dt_vjp_table=abi.cuda_table("dt_vjp", table) is not None,  # CUDA: dt_vjp reads the table
        warps=CUDA_WARPS,  # CUDA: dt_vjp's rows of partial sums, per warp, in shared memory or in gc
        warp_rows_shared=cuda_warp_rows_shared(code.n_coefficients),
        # CUDA, layout "bdh": a block's columns (at most this many) stage their stored rows
        stage_columns=cuda_stage_columns(spec.layout, spec.horizon, spec.n_actions, spec.order, itemsize),
        staged=CUDA_STAGED,
        # CUDA, layout "bdh" where a warp's whole rows do not fit: each warp stages row tiles, per kernel
        # (rows of a tile, most threads a block has)
        tiles=cuda_tiles(spec.layout, spec.horizon, spec.n_actions, spec.order, itemsize),
        # CUDA: a kernel works out its column again after its knots' loop (codegen/column_again.py)
        column_again=_uses(codes.values(), "TS_COLUMN_AGAIN();"),
    )
    return _environment().get_template(target.template).render(**context)
