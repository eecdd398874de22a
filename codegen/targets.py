"""The code generator's targets: everything that differs between C, CUDA and the C header.

A ``Target`` owns its template, its ABI entry points, the form of its coefficient programs
(straight-line code, monomials or tapes), its choice among a kernel's lowered variants and, for
CUDA, its launch plan. The renderer (codegen/render.py) asks the target and never tests a
target's name; a new target is a Target plus a template. The CLI and the public API name targets
by string ("c", "cuda", "header"): ``target(name)`` maps a name to its Target, here only.

A launch plan says what each entry point of the C ABI runs: its launches (kernel, grid, block,
dynamic shared memory, arguments) and the temporaries they use, as a function of the batch size.
It is part of the generated result (``Generated.launch_plan``) and is rebuilt from a cached
build's metadata by ``Target.launch_plan``, so the runtime never derives a launch of its own.
Import-light: the runtime reads plans on the cached-load path (no SymPy, no Jinja2).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Collection, Mapping, Optional, Union

from . import abi
from .arguments import ArgumentTable, table as argument_table

#: CUDA threads per block: a multiple of the warp size (dt_vjp's sums are over whole warps); the
#: per-element kernels' largest block
CUDA_BLOCK = 256
CUDA_WARP = 32
#: the most warps a block has (dt_vjp keeps a row of partial sums per warp of its block)
CUDA_WARPS = CUDA_BLOCK // CUDA_WARP
#: the SMs a plan sets out to fill (an H100 SXM has 132): below this many blocks of CUDA_BLOCK
#: threads, the per-element kernels take smaller blocks, down to a warp, so that more SMs get work
CUDA_FILL_BLOCKS = 132

#: 32-bit registers of an SM (sm_70 to sm_90) and the most a per-element kernel's thread may use:
#: its ``__launch_bounds__`` ask for CUDA_MIN_BLOCKS resident blocks of CUDA_BLOCK threads, which
#: caps ptxas at CUDA_MAX_REGISTERS (without it ptxas may take 255, one block per SM)
CUDA_SM_REGISTERS = 65536
CUDA_MAX_REGISTERS = 128
CUDA_MIN_BLOCKS = CUDA_SM_REGISTERS // (CUDA_BLOCK * CUDA_MAX_REGISTERS)
#: per-element kernels of a fused spec that ask for more resident blocks (a lower register cap: 80
#: at 3 blocks of CUDA_BLOCK threads, 64 at 4), as data: (dtype, kernel, the kind of its column
#: (``cuda_column_kind``), the most ``cuda_row_terms`` of the spec, blocks), the first that holds.
#: The fused kernels wait on L1 hits (their terms' weights and limits) at 2 blocks an SM: a GPU ran
#: the costs bench's (a row loop, order 3, seven terms: 28) faster at 3, forward and adjoint in both
#: dtypes, its forward slower at 4 than at 3. A kernel asks for 3 only where ptxas kept every surveyed
#: one of its dtype, kind and size within 80 registers unspilled (BENCHMARKS.md, "Launch bounds per
#: kernel" and "Thirteenth run"): float32 row-loop forwards up to 28; float32 row-loop adjoints and
#: float64 row-loop forwards up to 10, as some of 24 and 28 spilled at 80 (the bench's did not). Float64
#: adjoints (spilling at 80 from 24, the bench's too) and B-spline forwards (their spans within 80
#: registers up to 16, spilling from 20; not timed on a GPU) keep 2.
CUDA_MORE_BLOCKS: tuple[tuple[str, str, str, int, int], ...] = (
    ("float32", "forward", "rows", 28, 3),
    ("float32", "adjoint", "rows", 10, 3),
    ("float64", "forward", "rows", 10, 3),
)


def cuda_column_kind(control: str) -> str:
    """The kind of a fused column's loop: a B-spline's over knot spans ("spans"), else over rows
    (stencils and integrators: "rows")."""
    return "spans" if control == "bspline" else "rows"


def cuda_row_terms(n_costs: int, steps: Optional[int], order: int) -> int:
    """A fused column's size for CUDA_MORE_BLOCKS: its cost terms, times the rows of its loop's
    body (a B-spline's rows a span, ``steps``; one row otherwise), times the states a row holds
    (order + 1)."""
    return n_costs * (steps or 1) * (order + 1)


def cuda_column_size(spec: Any) -> tuple[str, int]:
    """A spec's fused column as the CUDA rules read it: its kind (``cuda_column_kind``) and
    ``cuda_row_terms`` (0 without cost terms: the compat specs have none)."""
    costs = getattr(spec, "costs", ())
    size = cuda_row_terms(len(costs), getattr(spec, "steps", None), spec.order) if costs else 0
    return cuda_column_kind(getattr(spec, "control", "")), size


def cuda_late_inputs(itemsize: int, spec: Any) -> tuple[str, ...]:
    """The kinds of input a spec's fused forward reads where first used: CUDA_LATE_INPUTS' of its
    element size, none where CUDA_INPUTS_FIRST keeps its column's inputs first."""
    kind, size = cuda_column_size(spec)
    first = CUDA_INPUTS_FIRST.get((kind, getattr(spec, "layout", "bhd")), -1)
    return () if size <= first else tuple(CUDA_LATE_INPUTS[itemsize])


def cuda_min_blocks(kernel: str, dtype: str, kind: str, row_terms: int) -> int:
    """The resident blocks a per-element kernel's ``__launch_bounds__`` ask for: CUDA_MORE_BLOCKS'
    first rule that holds for a fused spec (``row_terms`` > 0: ``cuda_row_terms``; ``kind``:
    ``cuda_column_kind``), else CUDA_MIN_BLOCKS."""
    for rule_dtype, rule_kernel, rule_kind, most, blocks in CUDA_MORE_BLOCKS:
        if (rule_dtype, rule_kernel, rule_kind) == (dtype, kernel, kind) and 0 < row_terms <= most:
            return blocks
    return CUDA_MIN_BLOCKS


#: CUDA keeps every row's gradients of a straight-line integrator adjoint live in registers
#: (ptxas, sm_90: accel float32 160 registers at H=32, 254 at H=60 and spilling beyond;
#: float64 spills from H=40), while the rolled column needs about 40-60 at any H. Adjoint bodies
#: whose values exceed this many bytes (lines x element size: float32 from H=22, float64 from
#: H=11; order 4 from H=18 and H=9) are rolled, which keeps every kernel within 128 registers;
#: shorter ones keep straight-line, which has more loads in flight.
CUDA_ROLL_ABOVE_BYTES = 800

#: a CUDA block's static shared memory, where a tape's registers live
CUDA_TAPE_SHARED_BYTES = 48 * 1024
#: the kernel that runs each program's tapes (codegen/tape.py ``Tape.program``) on CUDA
CUDA_TAPE_KERNELS = {"value": "coefficients", "tangent": "coefficients_jvp", "reverse": "dt_vjp_finish"}

#: the kernels that run the coefficient table's program in C, each library's its own (on CUDA the
#: table kernel of a spec's core module fills it; a dt module's dt_vjp reads it)
TABLE_KERNELS = ("forward", "adjoint", "dt_vjp")

#: dt_vjp's warps keep their rows of partial sums in shared memory when a block's rows fit in this
#: many bytes (CUDA_WARPS rows of the coefficient count's doubles), else in gc
CUDA_WARP_ROWS_SHARED_BYTES = 32 * 1024


#: layout "bdh": a column's rows are contiguous and a warp's 32 columns 32 rows apart, so a warp's
#: store of a row touches 32 sectors. The per-element kernels that store rows (CUDA_STAGED) stage
#: their block's rows in this many bytes of shared memory, then the block stores them in order
#: (contiguous addresses): a block then has at most ``cuda_stage_columns`` threads
CUDA_STAGE_BYTES = 32 * 1024
#: the per-element kernels that stage their stores with layout "bdh": the rows they store
CUDA_STAGED = {"forward": "outputs", "adjoint": "actions", "dt_jvp": "outputs"}


def cuda_stage_columns(layout: str, horizon: int, n_actions: int, order: int, itemsize: int) -> int:
    """Columns (threads) of a block whose stored rows fit CUDA_STAGE_BYTES (a multiple of the warp,
    at most CUDA_BLOCK): 0 where the layout is not "bdh" or a warp's rows do not fit (no staging)."""
    if layout != "bdh":
        return 0
    per_column = max((order + 1) * horizon, n_actions) * itemsize
    return min(CUDA_BLOCK, CUDA_STAGE_BYTES // per_column) // CUDA_WARP * CUDA_WARP


#: a sector, the unit of a global memory transaction (bytes)
CUDA_SECTOR = 32


def cuda_tiles(layout: str, horizon: int, n_actions: int, order: int, itemsize: int) -> dict[str, tuple[int, int]]:
    """Layout "bdh" where not even a warp's whole rows fit CUDA_STAGE_BYTES (``cuda_stage_columns``
    is 0): each staging kernel's (CUDA_STAGED) row tiles, (rows of a tile, most threads a block has).
    Each warp stages, for each array it stores, a window of its columns' rows, and stores it when a
    store leaves the window. Where a column's rows are whole sectors, a window is a sector of a
    column (8 float32 rows, 4 float64): a warp's store is 32 / rows columns of a sector each, and a
    block keeps CUDA_BLOCK threads (order + 1 arrays of a KB a warp, up to order 3); else a window
    is 32 rows, a warp's store one column's 32 neighbouring elements (the ideal sectors, one more
    where unaligned), in smaller blocks (16 rows where not even a warp's 32 fit)."""
    if layout != "bdh" or cuda_stage_columns(layout, horizon, n_actions, order, itemsize):
        return {}
    sector_rows = CUDA_SECTOR // itemsize
    found = {}
    for kernel, stored in CUDA_STAGED.items():
        rows, arrays = (horizon, order + 1) if stored == "outputs" else (n_actions, 1)
        tile = sector_rows if rows % sector_rows == 0 else CUDA_WARP
        while tile > sector_rows and arrays * CUDA_WARP * tile * itemsize > CUDA_STAGE_BYTES:
            tile //= 2
        warps = CUDA_STAGE_BYTES // (arrays * CUDA_WARP * tile * itemsize)
        found[kernel] = (tile, min(CUDA_BLOCK, warps * CUDA_WARP))
    return found


def cuda_warp_rows_shared(n_coefficients: int) -> bool:
    """Whether dt_vjp's warps keep their rows of partial sums in shared memory (else in gc)."""
    return CUDA_WARPS * n_coefficients * 8 <= CUDA_WARP_ROWS_SHARED_BYTES


#: an unfused step's per-element kernels that read the monomials' factors from the block's copy in
#: shared memory where each thread computes its coefficients (``cuda_volatile_coefficients``), by
#: the bytes of the dtype's element
CUDA_THREAD_FACTOR_KERNELS = {8: ("adjoint", "dt_jvp", "dt_vjp"), 4: ("dt_vjp",)}

#: bytes of an element of each dtype
ITEMSIZE = {"float32": 4, "float64": 8}

#: a CUDA per-element kernel keeps its step coefficients in shared memory up to this many bytes
#: (its table, or its two with a dt tangent); larger tables (long per-step horizons) are read from
#: global memory, where every thread reads the same address, or computed in each thread (monomials)
CUDA_SHARED_COEF_BYTES = 16384


def inline_coefficients(table: ArgumentTable, form: str) -> bool:
    """Whether CUDA's per-element kernels compute their coefficients in each thread, with no table
    kernel: monomials of a dt per trajectory (a B×NC table would be read once, at a per-trajectory
    stride)."""
    return form == "monomials" and table.dt.shape == ("B",)


def cuda_coefficients(kernel: str, table: ArgumentTable, form: str, n_coefficients: int, itemsize: int) -> str:
    """Where a CUDA per-element kernel gets its step coefficients:

    - "none": it reads none (a stencil's dt_vjp: ``abi.cuda_table``);
    - "block": its block runs the table's program into shared memory, its threads sharing the
      slots or rows, before its columns (no table launch): monomials of a uniform dt, and a
      per-step program of row loops only ('rows': a few lines a row), where they fit;
    - "thread": each thread computes them from its powers of its trajectory's dt (monomials with
      a dt per trajectory: ``inline_coefficients``);
    - "shared" / "global": a table kernel fills the table, which the block copies into shared
      memory where it fits (a per-step program with boundary rows), else reads from global memory."""
    if abi.cuda_table(kernel, table) is None:
        return "none"
    tables = 2 if kernel == "dt_jvp" else 1
    fits = n_coefficients * itemsize * tables <= CUDA_SHARED_COEF_BYTES
    per_trajectory = table.dt.shape == ("B",)
    if inline_coefficients(table, form):
        return "thread"
    if form in ("monomials", "rows") and fits:
        return "block"
    return "shared" if fits and not per_trajectory else "global"


def cuda_volatile_coefficients(kernel: str, where: str, fused: bool, stencil: bool, per_step: bool,
                               itemsize: int, factors: int = 0, spans: bool = False) -> str:
    """Where a CUDA per-element kernel reads each step coefficient from its table through a
    ``volatile`` pointer, at the statement that uses it: "column" (its loops and straight-line
    body), "body" (the straight-line body only) or "" (nowhere). Else ptxas hoists those loads
    ahead of the rows that use them (merged: ``LDS.128``) and keeps the values live, which spilled
    at the register cap:

    - a fused forward and adjoint (long bodies of rows), wherever its table is: in shared memory;
      in global memory (a table too large to share, or one per trajectory); or, monomials of a dt
      per trajectory ("thread", ``factors`` of them: those the column reads, codegen/render.py
      ``factors_read``), as each coefficient's factor, which the block copies into shared memory in
      T where the factors fit (``CUDA_SHARED_COEF_BYTES``),
      times the thread's power of its dt: with the factors as constants the compiler folded each
      coefficient into a product of the powers and kept the products live (B-spline degree 5,
      float64: 460 and 684 bytes spilled). In float32 the product is a float one, of the factor
      and the thread's power both rounded to float, the powers kept in the block's shared memory
      (a column a thread) and read where used too: with double products a B-spline's spills were
      smaller but not gone, with the powers in registers a B-spline degree 4 still spilled 16 bytes;
    - an unfused step's adjoint, dt_jvp and dt_vjp with a dt per trajectory ("thread": each thread
      computes its coefficients, and dt_vjp their dt derivatives, from its powers of its dt): the
      same copy of the factors, as doubles (each product a double one, as with the factors as
      constants: the same values), where they fit. With constants ptxas folded them into products
      of the powers, hoisted out of the rows' loops (a B-spline's knots, dt_vjp's dof columns) and
      kept live: 12 to 856 bytes spilled in float64 (B-splines of degree 3 to 5, wide stencils of
      order 4), 120 to 392 in float32's dt_vjp. float32's adjoint and dt_jvp take no copy: there
      it spilled where the constants did not (8 to 40 bytes: B-splines of degree 3 to 5, position
      central at H=32); their coefficients are float products (``cuda_float_powers``). dt_jvp
      holds two sets of powers, the coefficients' and their dt derivatives': ``cuda_shared_powers``;
    - the boundary rows of a float64 stencil's adjoint and tangent (dt_jvp) with a duration per
      step: each coefficient is read once, so none is worth keeping, and each takes two
      registers; the table may be in global memory (``ld.volatile``: from L2, not L1), where the
      loops' reads, most of a long column's, stay cached. In float32 the same bodies fit with the
      loads merged (four to a load), which volatile reads would split. With one duration
      (monomials), or an integrator's rows, a few coefficients serve many rows and are better
      kept in registers. A float64 B-spline's forward and adjoint (``spans``: span loops only) are
      the exception: their straight-line spans at the clamped ends read each of many coefficients
      once or twice (degree 5, 32 knots, 2 rows a span, uniform dt: forward 96 and adjoint 36 bytes
      spilled with them in registers); a float32 B-spline's forward too (the same spec: 24 bytes),
      whose adjoint fits with them in registers."""
    if fused and kernel in ("forward", "adjoint"):
        if where == "thread":
            return "column" if 0 < factors * itemsize <= CUDA_SHARED_COEF_BYTES else ""
        return "column" if where in ("shared", "block", "global") else ""
    if where == "thread" and kernel in CUDA_THREAD_FACTOR_KERNELS[itemsize]:
        return "column" if 0 < factors * 8 <= CUDA_SHARED_COEF_BYTES else ""
    if where not in ("shared", "block", "global") or fused:
        return ""
    if stencil and per_step and itemsize == 8:
        return "body" if kernel in ("adjoint", "dt_jvp") else ""
    return "body" if spans and (itemsize == 8 and kernel == "adjoint" or kernel == "forward") else ""


#: the column inputs a fused CUDA forward reads where it first uses them, through a volatile read
#: (codegen/fused.py ``inputs_where_used``), by element size: each term's per-dof weight ("weights",
#: read once, where the column's sum is scaled after its last row), and in float64 the inputs first read
#: after the column's loop ("after_loop": a goal's state, two registers a value). Loaded first they
#: held registers through the column, and ptxas loaded them early: at the 128 cap, B-splines of many
#: terms spilled up to 96 bytes (BENCHMARKS.md "Fused forwards' late inputs read where used"). A
#: float32 goal's state stays first: moved, a surveyed B-spline went from 0 to 16 bytes.
CUDA_LATE_INPUTS = {4: ("weights",), 8: ("weights", "after_loop")}
#: the fused forwards that keep every input first, as data: (kind of column (``cuda_column_kind``),
#: layout) -> the most ``cuda_row_terms`` (CUDA_LATE_INPUTS applies to the others). A volatile read at
#: the column's end is a trip to L2 after the loop where a load first rode with the others: a GPU ran
#: the costs bench's forwards (rows, bhd, 28; no spill either way) slower read late. With every input
#: first, surveyed row-loop forwards in layout bhd up to 28 kept within their caps (float32's 80 at 3
#: blocks, float64's 128), where in layout bdh (row tiles) float32 ones of 28 spilled at 80 unless read
#: late (BENCHMARKS.md, "Thirteenth run"); B-splines spilled at 128 from 24 (degree 6, a row a span).
CUDA_INPUTS_FIRST: dict[tuple[str, str], int] = {("rows", "bhd"): 28}

#: the rows between fences of a fused CUDA forward's straight-line spans around its knots' loop (a clamped
#: B-spline's first and last spans; codegen/fences.py ``rows_fenced``), by element size (0: none).
#: Unfenced, ptxas interleaved many rows' loads there and float32 B-splines of 64 knots with seven terms
#: spilled 8 to 24 bytes at the 128 cap; fences every 2 rows cleared them, every 4, by span or the last
#: spans only did not all (BENCHMARKS.md "The straight-line spans fenced"). float64: an order-4 forward of
#: eight terms spilled 4 bytes (a word of b * D + d held through the loop); fenced every 2 rows, none
#: (BENCHMARKS.md "The last float64 B-spline forward that spilled").
CUDA_FENCED_ROWS = {4: 2, 8: 2}


#: the fused CUDA kernels, by element size, whose column works out its bases anew after its first loop
#: of CUDA_COLUMN_AGAIN_LOOPS
#: (codegen/column_again.py): held through the loop, the bases a float64 B-spline adjoint of
#: many terms uses after it (the action's, the gradients', a goal's row) were spilled at the 128 cap
#: (BENCHMARKS.md "Float64 B-spline adjoints: the column's bases worked out again after the knots' loop")
CUDA_COLUMN_AGAIN = {8: ("adjoint",)}
#: the loops (by their variable) after which it does: a B-spline's over its knot spans
CUDA_COLUMN_AGAIN_LOOPS = ("kn",)


#: float32's unfused per-element kernels whose coefficients of a dt per trajectory are float products
#: (``cuda_float_powers``), and the unroll factor of their interior row loops (0: ptxas's choice)
CUDA_FLOAT_POWER_KERNELS = {"adjoint": 0, "dt_jvp": 2}


def cuda_float_powers(kernel: str, where: str, fused: bool, itemsize: int) -> bool:
    """Whether an unfused float32 kernel whose threads compute their coefficients from their powers
    of the trajectory's dt ("thread") makes each coefficient a float product: the factor rounded to
    float times the thread's power rounded to float (dt_jvp's tangents: the factor rounded to float
    times the power's dt derivative times dt's tangent, rounded to float), the powers in registers
    as floats. The double product of a constant factor and a double power (the rounding float64 and
    float32's forward keep) held 2 x width registers of powers (4 x in dt_jvp) through the column,
    and ptxas kept the products it folded live across rows: float32's dt_jvp spilled 4 to 60 bytes
    (B-splines of degree 3 and 5, wide stencils of order 4, position central at H=200), its adjoint 4
    and 8 (B-splines of degree 5 with 2 steps a span), and the copied factors
    (``CUDA_THREAD_FACTOR_KERNELS``) did worse. Each coefficient moves by a rounding of float (about
    1e-7 relative)."""
    return where == "thread" and not fused and itemsize == 4 and kernel in CUDA_FLOAT_POWER_KERNELS


def cuda_row_unroll(kernel: str, where: str, fused: bool, itemsize: int) -> int:
    """How far ptxas may unroll a kernel's interior row loops (``#pragma unroll``; 0: its choice):
    2 for float32's dt_jvp with float products, whose stencil loops, unrolled as ptxas chose, still
    spilled (position central at H=200: 4 bytes; none unrolled by 2 or 1)."""
    return CUDA_FLOAT_POWER_KERNELS[kernel] if cuda_float_powers(kernel, where, fused, itemsize) else 0


def cuda_shared_powers(kernel: str, where: str, fused: bool, itemsize: int) -> bool:
    """Whether an unfused per-element kernel whose threads compute their coefficients from their
    powers of the trajectory's dt ("thread", with the factors copied: ``cuda_volatile_coefficients``)
    keeps the powers the coefficients use in the thread's column of the block's shared memory
    (``width`` doubles a thread), read where used, in place of registers: a float64 dt_jvp, which
    holds both the powers and their dt derivatives (4 x width registers; B-splines of degree 5
    spilled 20 to 84 bytes with both in registers). Its derivatives' powers stay in registers
    (dt_jvp's loads would double), and float32's too: its wide stencils spilled more with either
    set shared."""
    return where == "thread" and not fused and kernel == "dt_jvp" and itemsize == 8


#: CUDA: per-column values of a fused kernel kept in the thread's column of the block's shared memory
#: (``cuda_shared_column``): (the values' name, ``<name><t>`` for cost term t; the slot macro; its type)
CUDA_SHARED_COLUMN = {"adjoint": ("cgw", "TS_CGW", "T")}
#: a float64 fused adjoint's scaled weights go to shared memory where its loop reads this many values
#: defined before it or more (the most of tests/cuda/test_ptxas.py's float64 adjoints within the cap: 30)
CUDA_SHARED_WEIGHTS_LIVE = 32


def cuda_shared_column(kernel: str, statements: list, itemsize: int) -> tuple[tuple[str, str, str], ...]:
    """The per-column values a fused CUDA kernel (``statements``: its column as lowered) keeps in the
    thread's column of the block's shared memory, each read where used (volatile), in place of
    registers held from the column's start to its end (codegen/shared_column.py): a float64 adjoint's scaled weight of each term (``cgw<t>``)
    where its loop reads ``CUDA_SHARED_WEIGHTS_LIVE`` values defined before it or more (a central
    stencil of accuracy 8, order 4, with a squared position term, spilled 8 bytes with them in
    registers). The weights are read, not summed, so no add waits on shared memory.

    Forwards keep their cost sums in registers: in shared memory each add to a sum is a load and a
    store in its term's chain, which by the SASS model cost 2.5 times the row's cycles on the
    B-spline forwards it would clear of 8 to 32 bytes of spills outside their loop (BENCHMARKS.md,
    "The last four CUDA spills"). Layout "bdh", whose staging holds the shared memory, keeps the
    weights in a local array."""
    from .shared_column import loop_live_in  # code generation only (SymPy)

    if kernel not in CUDA_SHARED_COLUMN:
        return ()
    needed = itemsize == 8 and loop_live_in(statements) >= CUDA_SHARED_WEIGHTS_LIVE
    return (CUDA_SHARED_COLUMN[kernel],) if needed else ()


def cuda_shared_slots(kernel: str, statements: list) -> tuple[tuple[str, str, str], ...]:
    """The kernel's per-column values (``CUDA_SHARED_COLUMN``) whose slots its statements hold
    (``CudaTarget.codes`` put them there: ``cuda_shared_column``)."""
    from .statements import Read, walk  # code generation only (SymPy)

    value = CUDA_SHARED_COLUMN.get(kernel)
    used = value is not None and any(isinstance(n, Read) and n.macro == value[1] for n in walk(tuple(statements)))
    return (value,) if used else ()


def tape_files(tapes: list) -> dict[str, int]:
    """The doubles of shared memory each CUDA kernel that runs tapes declares for their registers,
    by kernel (``CUDA_TAPE_KERNELS``): its tapes run one after another, so they share one file, a
    row tape's a part per warp of the block (each warp runs a row)."""
    files: dict[str, int] = {}
    for t in tapes:
        kernel = CUDA_TAPE_KERNELS[t.program]
        files[kernel] = max(files.get(kernel, 0), t.registers * (CUDA_WARPS if t.row else 1))
    return files


def coefficient_form(coefs: Any) -> str:
    """The form of a spec's coefficient programs (codegen/coefficients.py), the same on every
    target: with one duration (uniform, or one per trajectory) every slot is a monomial c·dt^p,
    and the programs are loops over the table of c and p ('monomials'; a 'tape' where a slot is
    not one); with a duration per step, a long straight-line part is a 'tape', a program of row
    loops only (integrators: a few lines a row, no boundary slots) 'rows', else 'code'."""
    if len(coefs.dt_syms) == 1:
        return "monomials" if coefs.monomials is not None else "tape"
    if coefs.long:
        return "tape"
    return "rows" if not coefs.straight and not coefs.copies else "code"


#: (kernel, B) pairs whose launches a CUDA plan keeps (B varies from call to call: the oldest goes)
CUDA_LAUNCHES_KEPT = 256


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``grid`` blocks of ``block`` threads, ``shared`` bytes of dynamic shared
    memory, and its arguments after B, each the name of an argument of the entry point's C ABI
    (codegen/abi.py ``arguments``), the name of a temporary, or an integer."""

    kernel: str
    grid: int
    block: int
    shared: int
    args: tuple[Union[str, int], ...]


@dataclasses.dataclass(frozen=True)
class Temporary:
    """A buffer one call allocates for its launches: ``size`` elements of ``dtype``."""

    name: str
    size: int
    dtype: str  # "float32" or "float64"


@dataclasses.dataclass(frozen=True)
class Launches:
    """What one entry point of the C ABI runs, in order, the temporaries its launches share, and
    the names of the entry point's arguments after B (what a call's arguments bind to)."""

    launches: tuple[Launch, ...]
    temporaries: tuple[Temporary, ...]
    parameters: tuple[str, ...]

    @functools.cached_property
    def positions(self) -> tuple[tuple[tuple[str, int, int, int, tuple[int, ...]], ...], tuple[int, ...]]:
        """Where each launch's arguments come from, worked out once (a call's values are its
        arguments, then its temporaries' addresses, then ``constants``): each launch as (kernel,
        grid, block, shared, the positions of its arguments among those values), and the integers
        the launches pass. A name is an argument's position unless a temporary has it."""
        n, names = len(self.parameters), {}
        names.update((name, i) for i, name in enumerate(self.parameters))
        names.update((t.name, n + j) for j, t in enumerate(self.temporaries))
        constants: dict[int, int] = {}
        at = n + len(self.temporaries)
        placed = []
        for launch in self.launches:
            positions = tuple(names[a] if isinstance(a, str) else at + constants.setdefault(a, len(constants))
                              for a in launch.args)
            placed.append((launch.kernel, launch.grid, launch.block, launch.shared, positions))
        return tuple(placed), tuple(constants)

    @functools.cached_property
    def binding(self) -> tuple[tuple[tuple[str, int, int, int, Callable[[list], tuple]], ...], tuple[int, ...]]:
        """``positions`` with each launch's positions as a function of the call's values that picks
        its arguments."""
        placed, constants = self.positions
        return tuple((kernel, grid, block, shared, _picker(at)) for kernel, grid, block, shared, at in placed), constants


def _picker(positions: tuple[int, ...]) -> Callable[[list], tuple]:
    """The values at ``positions``, as a tuple (operator.itemgetter, which gives a lone value bare)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda values: tuple(values[i] for i in positions)


def _blocks(threads: int, block: int) -> int:
    return max(1, -(-threads // block))


def _filling_block(threads: int) -> int:
    """CUDA_BLOCK, halved down to a warp while a grid over ``threads`` would have fewer than
    CUDA_FILL_BLOCKS blocks."""
    block = CUDA_BLOCK
    while block > CUDA_WARP and _blocks(threads, block) < CUDA_FILL_BLOCKS:
        block //= 2
    return block


@dataclasses.dataclass(frozen=True)
class CudaLaunchPlan:
    """The CUDA launches of a spec's entry points. Each call first runs the coefficient program
    once (or once per trajectory), in a kernel of its own, into a table the per-element kernels
    then read (one thread per (batch, dof) column); a stencil's dt_vjp reads no table (its
    coefficient gradients hold no coefficient), so it runs alone. dt_vjp writes its partial sums
    itself (no zero fill): with one run, a row per block of a grid of at most CUDA_FILL_BLOCKS x
    CUDA_MIN_BLOCKS blocks (each thread strides over the columns); with a dt per trajectory, a
    thread per trajectory adds its dof columns in turn into the trajectory's own sums.
    dt_vjp_finish adds the block rows (a fixed tree: each warp a coefficient, its lanes rows
    lane, lane + 32, ... in turn, then a shuffle tree) and runs the reverse program, writing the
    gradient in the spec's dtype (no cast). A backward with a dt gradient is then the adjoint's
    two launches and dt_vjp's one or two, and the finish. By the programs' ``form``
    (codegen/targets.py ``coefficient_form``): monomials fill the table a thread per slot and
    finish the dt gradient a block per run (a fixed-shape sum over the slots), and with a dt per
    trajectory no table is kept at all: each thread of a per-element kernel (dt_vjp's thread per
    trajectory too) computes its coefficients from the powers of its trajectory's dt. Otherwise (a
    dt per step) the program runs a block, whose threads share a tape's levels and the rows of its
    loops (codegen/statements.py ``For.shared``), so its serial part does not grow with the
    horizon."""

    table: ArgumentTable
    dof: int
    dtype: str
    n_coefficients: int
    form: str
    #: layout "bdh": the most threads a block of a staging kernel (CUDA_STAGED) has; 0: no staging
    stage_columns: int = 0
    #: layout "bdh" with row tiles (``cuda_tiles``): (kernel, rows of a tile, most threads a block has)
    tiles: tuple[tuple[str, int, int], ...] = ()
    #: (kernel, resident blocks its ``__launch_bounds__`` ask for) where not CUDA_MIN_BLOCKS
    more_blocks: tuple[tuple[str, int], ...] = ()
    # worked out once per plan (every call asks; the plan never changes): not part of its value
    _parameters: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                compare=False)
    _launches: dict[tuple[str, int], Launches] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                   compare=False)

    #: dt_vjp writes its partial sums before it adds to them (no zero fill); dt_vjp_finish writes
    #: the gradient in the spec's dtype (no cast)
    zeroed_sums = False

    @property
    def per_trajectory(self) -> bool:
        return self.table.dt.shape == ("B",)

    @property
    def gradient_dtype(self) -> str:
        return self.dtype

    def coefficients(self, kernel: str) -> str:
        """Where a per-element kernel gets its step coefficients (``cuda_coefficients``)."""
        return cuda_coefficients(kernel, self.table, self.form, self.n_coefficients, ITEMSIZE[self.dtype])

    def min_blocks(self, kernel: str) -> int:
        """The resident blocks of CUDA_BLOCK threads a per-element kernel's ``__launch_bounds__``
        ask for (``cuda_min_blocks``), which cap its registers at 65,536 / (CUDA_BLOCK x blocks)."""
        return dict(self.more_blocks).get(kernel, CUDA_MIN_BLOCKS)

    def block(self, B: int) -> int:
        """Threads per block of the per-element kernels over a batch of B (one thread per column):
        CUDA_BLOCK, halved down to a warp while the grid would have fewer than CUDA_FILL_BLOCKS
        blocks. A function of B alone, so dt_vjp's sums are the same on every run."""
        return _filling_block(B * self.dof)

    def runs(self, B: int) -> int:
        """Runs of the once-per-call programs: one per trajectory, or one."""
        return B if self.per_trajectory else 1

    def dt_vjp_block(self, B: int) -> int:
        """Threads per block of dt_vjp: ``block``'s, or with a dt per trajectory (a thread per
        trajectory) the same rule over B threads."""
        return _filling_block(B) if self.per_trajectory else self.block(B)

    def dt_vjp_grid(self, B: int) -> int:
        """Blocks of dt_vjp: one per block of threads with a dt per trajectory; else at most
        CUDA_FILL_BLOCKS x its resident blocks (as many as an H100 holds at once), whose threads
        stride over the columns, so that the rows of partial sums do not grow with the batch."""
        if self.per_trajectory:
            return _blocks(B, self.dt_vjp_block(B))
        return min(_blocks(B * self.dof, self.dt_vjp_block(B)), CUDA_FILL_BLOCKS * self.min_blocks("dt_vjp"))

    def dt_vjp_rows(self, B: int) -> int:
        """Rows of dt_vjp's partial sums: one per trajectory with its own dt (a row of one double,
        the dt gradient, where its threads compute their coefficients: ``inline_coefficients``),
        else one per block of dt_vjp (none for an empty batch, where dt_vjp is not launched)."""
        return B if self.per_trajectory else (self.dt_vjp_grid(B) if B else 0)

    def dt_vjp_stride(self, B: int) -> int:
        """Doubles from one of dt_vjp's block rows to the next in gc: a row, or where a block's warp
        rows do not fit in shared memory, the block's warp rows (its row is its first warp's)."""
        if cuda_warp_rows_shared(self.n_coefficients):
            return self.n_coefficients
        return self.n_coefficients * (self.dt_vjp_block(B) // CUDA_WARP)

    def dt_vjp_size(self, B: int) -> int:
        """Doubles of dt_vjp's partial sums (gc), which dt_vjp writes before it adds to them: a
        coefficient-major row per trajectory (one double, its dt gradient, where each thread adds
        its terms times their coefficients' dt derivatives), or ``dt_vjp_stride`` per block."""
        if self.per_trajectory:
            return B * (1 if inline_coefficients(self.table, self.form) else self.n_coefficients)
        return self.dt_vjp_rows(B) * self.dt_vjp_stride(B)

    def parameters(self, kernel: str) -> tuple[str, ...]:
        """The names of an entry point's arguments after B (codegen/abi.py ``arguments``), once per kernel."""
        found = self._parameters.get(kernel)
        if found is None:
            found = self._parameters[kernel] = tuple(name for _, name in abi.arguments(kernel, self.table))[1:]
        return found

    def launches(self, kernel: str, B: int) -> Launches:
        """The launches of one entry point of the C ABI over a batch of B, and their temporaries:
        worked out on a (kernel, B) pair's first call, the same object on the next ones (the
        CUDA_LAUNCHES_KEPT latest pairs are kept)."""
        kept = self._launches
        found = kept.get((kernel, B))
        if found is None:
            found = kept[(kernel, B)] = self._plan(kernel, B)
            if len(kept) > CUDA_LAUNCHES_KEPT:
                kept.pop(next(iter(kept)), None)  # the oldest
        return found

    def _plan(self, kernel: str, B: int) -> Launches:
        """The launches of one entry point over a batch of B. A per-element kernel that reads the
        coefficient table first has it filled (``abi.cuda_table``), unless its block or its threads
        compute their coefficients (``coefficients``). The once-per-call kernels keep
        CUDA_BLOCK threads (a tape's block shares its levels among them; dt_vjp_finish's threads
        first add dt_vjp's rows)."""
        block, runs = self.block(B), self.runs(B)
        once = runs  # grid of a once-per-call kernel: a block per run
        dt = self.table.dt.c_name
        names = self.parameters(kernel)
        if kernel == "dt_vjp_finish":
            if inline_coefficients(self.table, self.form):  # a thread per trajectory casts its gradient
                return Launches((Launch(kernel, _blocks(B, CUDA_BLOCK), CUDA_BLOCK, 0, (*names, B, 0, 0)),), (), names)
            one_run = not self.per_trajectory
            sums = (Temporary("sums", self.n_coefficients, "float64"),) if one_run else ()
            stride = 0 if self.per_trajectory else self.dt_vjp_stride(B)
            return Launches((Launch(kernel, once, CUDA_BLOCK, 0,
                                    (*names, self.dt_vjp_rows(B), stride, "sums" if one_run else 0)),), sums, names)
        if kernel not in abi.CUDA_TABLES:
            raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(abi.KERNELS)}")
        if kernel in CUDA_STAGED and self.stage_columns:
            block = min(block, self.stage_columns)
        for tiled, _, columns in self.tiles:
            if kernel == tiled:
                block = min(block, columns)
        grid = _blocks(B * self.dof, block)
        if kernel == "dt_vjp":
            grid, block = self.dt_vjp_grid(B), self.dt_vjp_block(B)
        fill = abi.cuda_table(kernel, self.table)
        if fill is None:
            return Launches((Launch(kernel, grid, block, 0, names),), (), names)
        partials: tuple = ()  # a fused forward's: each column's term sums, then each trajectory's (cost_sum)
        if kernel == "forward" and self.table.costs:
            terms = len(self.table.costs)
            partials = (Temporary("cpart", B * self.dof * terms, "float64"),
                        Launch("cost_sum", _blocks(B * terms, CUDA_BLOCK), CUDA_BLOCK, 0, ("cpart", "cost")))
        extra = ("cpart",) if partials else ()
        if self.coefficients(kernel) in ("block", "thread"):  # it computes them: no table (coef_g gets null)
            return Launches((Launch(kernel, grid, block, 0, (*names, 0, *extra)), *partials[1:]), partials[:1], names)
        fill_grid = once
        inputs = (dt, "ddt_in") if fill == "coefficients_jvp" else (dt,)
        coef = Temporary("coef", runs * len(inputs) * self.n_coefficients, self.dtype)
        return Launches((Launch(fill, fill_grid, CUDA_BLOCK, 0, (*inputs, "coef")),
                         Launch(kernel, grid, block, 0, (*names, "coef", *extra)), *partials[1:]),
                        (coef, *partials[:1]), names)


@dataclasses.dataclass(frozen=True)
class CLaunchPlan:
    """The C entry points run as called (OpenMP threads over the batch); dt_vjp writes its partial
    sums a row per chunk of batch elements, added in order, so the dt gradient is the same for
    any number of threads."""

    per_trajectory: bool
    n_coefficients: int
    chunk: int = abi.C_DT_VJP_CHUNK
    #: dt_vjp adds to its rows of partial sums, which the runtime zeroes; the gradient is float64
    zeroed_sums = True
    gradient_dtype = "float64"

    def dt_vjp_rows(self, B: int) -> int:
        """Rows of dt_vjp's partial sums: one per trajectory with its own dt, else one per chunk."""
        return B if self.per_trajectory else max(1, -(-B // self.chunk))

    def dt_vjp_size(self, B: int) -> int:
        """Doubles of dt_vjp's partial sums (gc)."""
        return self.dt_vjp_rows(B) * self.n_coefficients


@dataclasses.dataclass(frozen=True)
class Target:
    """A target's template and ABI, with the defaults of plain C (the header's)."""

    name: str
    template: str  # file in templates/
    extension: str  # of its source files
    restrict: str = "restrict"  # qualifier of every pointer parameter
    device: str = ""  # qualifier of the tapes' constant arrays
    #: a tape runs level by level, a block's threads sharing each level (else a loop)
    block_tapes: bool = False
    #: the coefficient programs' straight-line parts and runs of long rows run as tapes, whatever
    #: their length (codegen/coefficients.py ``taped_for``, ``row_tapes``: a block's threads share
    #: a level, its warps the rows), else as code where short
    tape_programs: bool = False
    #: the C template's forms (codegen/render.py): all-dof vector lanes, long once-per-call
    #: programs split for the compiler, preprocessor guards per translation unit
    lanes: bool = False
    split_programs: bool = False
    unit_guards: bool = False
    #: (most threads a block, fewest resident blocks an SM) of each per-element kernel, or None
    launch_bounds: Optional[tuple[int, int]] = None

    def entry_points(self, kernels: tuple[str, ...], table: ArgumentTable, form: str) -> tuple[str, ...]:
        """The entry points a source with these kernels defines, its coefficient programs of this
        ``form`` (``coefficient_form``)."""
        return kernels

    def signature(self, kernel: str, table: ArgumentTable, ctype: str) -> str:
        """One entry point's parameter list (codegen/abi.py)."""
        return abi.signature(kernel, table, ctype, self.restrict)

    def coefficient_form(self, coefs: Any) -> str:
        """The form of the coefficient programs (codegen/coefficients.py) this target runs: one
        choice for every target (``coefficient_form``)."""
        return coefficient_form(coefs)

    def table_fillers(self) -> tuple[str, ...]:
        """The kernels that run the coefficient table's program (each library its own)."""
        return TABLE_KERNELS

    def codes(self, code: Any, kernels: tuple[str, ...], itemsize: int, spec: Any = None) -> dict[str, Any]:
        """Each kernel's lowered variant: the adjoint's gathers each in one pass; a fused forward and
        adjoint in C's form (``LoweredOperator.c_fused``). ``spec``: the spec the code is of (CUDA's
        choices read its size)."""
        if code.fused:
            return {k: code.c_fused(k, itemsize) if k in ("forward", "adjoint") else getattr(code, k) for k in kernels}
        return {k: code.gathered_adjoint if k == "adjoint" else getattr(code, k) for k in kernels}

    def form_codes(self, code: Any, kernels: tuple[str, ...], itemsize: int,
                   only: Optional[Collection[int]] = None) -> dict[str, dict[str, Any]]:
        """Variants of a fused forward and adjoint by suffix (codegen/fused.py ``forms``: each cost kind
        in its narrow form, no row weights), which the entry point runs where a call's parameters
        allow them: C's only. ``only``: the forms (from 1, in ``forms``' order) lowered; the others'
        codes are None (a source that leaves their batch functions out: codegen/render.py)."""
        return {}

    def check(self, spec: Any, tapes: list) -> None:
        """Raise where the target cannot run the spec's programs."""

    def launch_plan(self, spec: Any, metadata: Mapping[str, Any]) -> Any:
        """The launch plan of a spec's build from its metadata (codegen/driver.py ``metadata``)."""
        return None

    def min_blocks(self, spec: Any) -> dict[str, int]:
        """The per-element kernels whose ``launch_bounds`` ask for other than its resident blocks,
        and theirs."""
        return {}


class CTarget(Target):
    """C: entry points looping over the batch, compiled by the C backend."""

    def form_codes(self, code: Any, kernels: tuple[str, ...], itemsize: int,
                   only: Optional[Collection[int]] = None) -> dict[str, dict[str, Any]]:
        if not code.fused:
            return {}
        return {form.suffix: {k: code.c_fused(k, itemsize, form) if only is None or i in only else None
                              for k in ("forward", "adjoint") if k in kernels}
                for i, form in enumerate(code.fused_forms(), 1)}

    def launch_plan(self, spec: Any, metadata: Mapping[str, Any]) -> CLaunchPlan:
        return CLaunchPlan(argument_table(spec).dt.shape == ("B",), int(metadata.get("n_coefficients", 0)))


class CudaTarget(Target):
    """CUDA: a thread per (batch, dof) column, the coefficient programs in kernels of their own."""

    def entry_points(self, kernels: tuple[str, ...], table: ArgumentTable, form: str) -> tuple[str, ...]:
        return abi.cuda_kernels(kernels, table, inline_coefficients(table, form))

    def signature(self, kernel: str, table: ArgumentTable, ctype: str) -> str:
        return abi.signature(kernel, table, ctype, self.restrict, cuda=True)

    def table_fillers(self) -> tuple[str, ...]:
        """The core module's table kernel fills it; a dt module's dt_vjp reads it."""
        return ("forward", "adjoint")

    def codes(self, code: Any, kernels: tuple[str, ...], itemsize: int, spec: Any = None) -> dict[str, Any]:
        """A fused stencil's forward and adjoint with their interior steps (a B-spline's: knot spans)
        one loop each at every horizon (``fused_rolled``: NVVM's time on a straight-line column grows
        about as H², and the adjoint's passed 3 s at H=32), the adjoint's start-state gradients summed
        step by step (``start_sums``: gathered at their last reader, a float64 central stencil of
        accuracy 8, order 4, spilled 36 bytes); an integrator's long adjoint rolled
        (``CUDA_ROLL_ABOVE_BYTES``), a fused one's recomputed in segments from checkpoints
        (``adjoint_checkpointed``); a stencil's adjoint
        reads each output gradient where it is used (held in locals, the boundary rows of a wide
        per-step stencil took 144 registers, order 4, H=64, float32), its straight-line stores
        as accumulations that read each gradient once (codegen/reads.py); with a period above 1
        (B-splines) the forward and adjoint are span loops only, as in C (lower._spans_only); a fused
        forward reads the inputs it uses only at its end where it first uses them (``CUDA_LATE_INPUTS``;
        not one whose column CUDA_INPUTS_FIRST keeps first, ``spec``'s; every one without ``spec``), its
        straight-line spans fenced every few rows (``CUDA_FENCED_ROWS``); a float64 fused adjoint works out
        its column's bases again after its knots' loop (``CUDA_COLUMN_AGAIN``); the tangent and reverse
        programs as tapes (``tape_programs``), dt_jvp's inputs read once."""
        from . import reads  # code generation only: this module stays importable without SymPy
        from .column_again import column_again
        from .fences import rows_fenced
        from .shared_column import in_shared_column

        codes = {k: getattr(code.as_tapes, k) if k in ("dt_jvp", "dt_vjp_finish") else getattr(code, k)
                 for k in kernels}
        adjoint = codes.get("adjoint")
        rolled = {k: code.cuda_fused_rolled(k) for k in ("forward", "adjoint") if k in codes and code.fused}
        if rolled.get("forward") or rolled.get("adjoint"):  # a fused stencil: its interior steps one loop
            codes.update({k: v for k, v in rolled.items() if v is not None})
        elif adjoint is not None and code.adjoint_reads is not None:
            codes["adjoint"] = dataclasses.replace(code.adjoint_reads,
                                                   statements=reads.in_read_order(code.adjoint_reads.statements))
        elif adjoint is not None and code.adjoint_checkpointed(itemsize) is not None:
            codes["adjoint"] = code.adjoint_checkpointed(itemsize)
        elif adjoint is not None and len(adjoint.body) * itemsize > CUDA_ROLL_ABOVE_BYTES:
            rolled = code.adjoint_rolled  # None for stencils, whose columns hold few values
            if rolled:
                codes["adjoint"] = dataclasses.replace(adjoint, statements=rolled)
        late = CUDA_LATE_INPUTS[itemsize] if spec is None else cuda_late_inputs(itemsize, spec)
        if code.fused and "forward" in codes and late:
            codes["forward"] = code.inputs_where_used(codes["forward"], late)
        if code.fused and "forward" in codes:
            codes["forward"] = dataclasses.replace(
                codes["forward"], statements=rows_fenced(codes["forward"].statements, CUDA_FENCED_ROWS[itemsize]))
        if "dt_jvp" in codes:
            codes["dt_jvp"] = dataclasses.replace(codes["dt_jvp"], statements=reads.loaded_once(codes["dt_jvp"].statements))
        for k in (k for k in CUDA_SHARED_COLUMN if k in codes and code.fused):
            for value, slot, _ in cuda_shared_column(k, codes[k].statements, itemsize):
                codes[k] = dataclasses.replace(codes[k], statements=in_shared_column(codes[k].statements, value, slot))
        for k in (k for k in CUDA_COLUMN_AGAIN.get(itemsize, ()) if k in codes and code.fused):
            codes[k] = dataclasses.replace(codes[k], statements=column_again(codes[k].statements,
                                                                             CUDA_COLUMN_AGAIN_LOOPS))
        return codes

    def check(self, spec: Any, tapes: list) -> None:
        """A kernel's tape registers must fit in a block's shared memory (else NVRTC fails on the source)."""
        for kernel, doubles in tape_files(tapes).items():
            if doubles * 8 > CUDA_TAPE_SHARED_BYTES:
                raise ValueError(
                    f"{spec.name}: its coefficient program ({kernel}) needs {doubles * 8 // 1024} KB of shared "
                    f"memory on CUDA, above the {CUDA_TAPE_SHARED_BYTES // 1024} KB a block has: use fewer rows per "
                    "knot span or a shorter horizon, or device='cpu'")

    def launch_plan(self, spec: Any, metadata: Mapping[str, Any]) -> CudaLaunchPlan:
        shape = (spec.layout, spec.horizon, spec.n_actions, spec.order, ITEMSIZE[spec.dtype])
        tiles = tuple((kernel, rows, columns) for kernel, (rows, columns) in cuda_tiles(*shape).items())
        return CudaLaunchPlan(argument_table(spec), spec.dof, spec.dtype, int(metadata["n_coefficients"]),
                              str(metadata["coefficients"]), cuda_stage_columns(*shape), tiles,
                              tuple(self.min_blocks(spec).items()))

    def min_blocks(self, spec: Any) -> dict[str, int]:
        """The per-element kernels that ask for other than CUDA_MIN_BLOCKS (``cuda_min_blocks``)."""
        kind, size = cuda_column_size(spec)
        found = {k: cuda_min_blocks(k, spec.dtype, kind, size) for k in ("forward", "adjoint", "dt_vjp", "dt_jvp")}
        return {k: blocks for k, blocks in found.items() if blocks != CUDA_MIN_BLOCKS}


C = CTarget("c", "kernel.c.j2", "c", lanes=True, split_programs=True, unit_guards=True)
CUDA = CudaTarget("cuda", "kernel.cu.j2", "cu", restrict="__restrict__", device="__device__ ", block_tapes=True,
                  tape_programs=True, launch_bounds=(CUDA_BLOCK, CUDA_MIN_BLOCKS))
HEADER = Target("header", "header.h.j2", "h")
#: every target by the name the CLI and the API use
TARGETS: Mapping[str, Target] = {t.name: t for t in (C, CUDA, HEADER)}


def target(name: str) -> Target:
    """The target of a name ('c', 'cuda', 'header')."""
    found: Optional[Target] = TARGETS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"target={name!r} is invalid: allowed {', '.join(TARGETS)}")
    return found
