"""The generated CUDA source run on the host, a test double for the GPU (CI has none).

Every CUDA kernel is compiled as C with the CUDA keywords defined away, and each entry point
runs every (block, thread) of its launch grid one after another. The calls go through the
generated launch plan (codegen/targets.py, ``Generated.launch_plan``), its grids and blocks, bound
through the CUDA backend's own call (runtime/cuda_backend.py ``CudaBackend.call``: parameters packed
for the driver, read back here as each kernel's C signature declares them): the coefficient table is
filled by its kernel, the per-element kernels read it, dt_vjp's partial sums are added and
finished by dt_vjp_finish. The kernels' arithmetic and indexing can then be
checked against the dense reference and by gradcheck. Shared memory is one static array per
kernel; each thread copies the whole table into it, or runs the whole of the table's program
where the block computes its table (on the GPU the block's threads share the copy or the
program: TS_THREAD), so the first thread of a block, which runs first, finds it filled.

The once-per-call programs (the table, its tangent, the dt gradient's reverse) run a block per
run whose threads share the work: a tape's levels (codegen/tape.py), the rows of its loops (each
thread a stride of them, with barriers between phases that need them), the monomials' dt gradient
(each thread a stride of the slots, then a tree). Here each block is one thread, thread 0, with
a block size of one: every level, loop and sum runs in full, in order (the GPU adds a monomial
gradient's terms in another fixed order). That a level's instructions are independent, and
registers are reused only from the level after their last read, is tests/kernels/test_tape.py's to
check, and that a phase's rows add to distinct durations. A row tape (a warp per row, its lanes
sharing a level) runs here as one warp of one lane: every row, every instruction, in order.

dt_vjp's sums need a warp's lanes in lockstep (warp shuffles), which a sequential run cannot give:
here each thread records the value of each of its ACC statements, in order, and after the block's
last thread the sums run as the GPU runs them: for each statement, a warp's 32 values added shuffle
step by shuffle step into its lane 0, which adds the sum to the warp's row; then the block's warp
rows added in order into its row of gc. dt_vjp_finish's sum of the block rows runs the same way
(each coefficient's lanes, then the shuffle tree), by its thread 0 before the reverse program.
The sums are the same, in the same order, as on the GPU.

With layout "bdh" the per-element kernels stage their rows in shared memory, and after a barrier
(TS_STAGE_BARRIER) the block's threads store the block's rows in order, each a stride of them. A
block then runs in two passes: in the first every thread runs up to the barrier and returns (its
rows staged), in the second every thread runs again in full, restaging the same rows (the work
before the barrier only reads inputs and writes the thread's own stage) and then storing its
stride of the whole block's stage, which every thread of the block has written.

Where a warp's whole rows do not fit, each warp stages row tiles (a window of rows per array) and
stores a tile between two syncs of its lanes (TS_TILE_SYNC) whenever a store leaves the window:
the regions between syncs alternate between the threads writing their tile elements and storing
the warp's tile (each thread a stride of its elements), the same regions for every thread of a
warp. A block then runs in a pass per region: in pass p every thread runs in full, but only its
region p writes its tile (elsewhere, a spare element) or stores, so a store reads the tile that
every thread of the warp wrote in the pass before, and no thread has yet overwritten.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any
from unittest import mock

import cffi
import torch

from tensorstep.codegen import abi
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate, lowered
from tensorstep.codegen.render import CTYPES
from tensorstep.codegen.targets import CUDA, inline_coefficients
from tensorstep.runtime import cbackend
from tensorstep.runtime.api import Step
from tensorstep.runtime.cache import BuildCache, digest
from tensorstep.runtime.cuda_backend import CudaBackend
from tensorstep.runtime.launch import Launcher

#: CUDA's largest block (a launch plan's blocks may be any size up to it)
MAX_BLOCK = 1024
PRELUDE = f"""/* CUDA keywords for a sequential run on the host */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ restrict
#define __shared__ static
#define __syncthreads()
#define __launch_bounds__(threads, blocks)
typedef struct {{ long long x; }} ts_dim3;
static ts_dim3 blockIdx, threadIdx, blockDim, gridDim; /* set by each launch */
#define TS_MAX_BLOCK {MAX_BLOCK}
/* a loop whose iterations a block's threads share: each thread runs all of them (see the module docstring) */
#define TS_THREAD 0LL
#define TS_THREADS 1LL
/* a row tape's rows and a level's instructions: the one thread runs them all (one warp of one lane) */
#define TS_BLOCK_WARP 0LL
#define TS_BLOCK_WARPS 1LL
#define TS_LANE 0
#define TS_LANES 1
#define __syncwarp()
/* layout "bdh"'s barrier between staging rows and storing them: a block runs in two passes, the
 * first each thread up to the barrier, the second each thread in full (see the module docstring) */
static int ts_pass, ts_staged;
#define TS_STAGE_BARRIER() do {{ if (ts_pass == 0) {{ ts_staged = 1; return; }} }} while (0)
/* layout "bdh"'s row tiles: a block runs in a pass per region between a warp's syncs, pass p each
 * thread's region p only writing its tile and storing (see the module docstring) */
static int ts_region, ts_regions;
#define TS_TILE_SYNC(lanes) ((void)(lanes), ++ts_region)
#define TS_TILE_LIVE (ts_region == ts_pass)
#define TS_TILE_ELEMENT(t, i) (TS_TILE_LIVE ? &(t)->tile[(i)] : &(t)->spare)
#define TS_TILE_LANE() ((int)(threadIdx.x & 31))
#define TS_TILE_WARP() ((int)(threadIdx.x >> 5))
#define TS_MONO_KEEP(v) ((void)(v))
#define TS_TILE_FIRST() ((int64_t)(blockIdx.x * blockDim.x + (threadIdx.x & ~31LL)))
/* a column's thread read again after its first loop (codegen/column_again.py) */
#define TS_COLUMN() ((int64_t)(blockIdx.x * blockDim.x + threadIdx.x))
/* each store of a tile, where ts_stores_kept: (block, thread, region, the warp's k-th store, address, bytes) */
typedef struct {{ long long block, thread, region, k, address, bytes; }} ts_store;
static ts_store* ts_stores;
static long long ts_stores_n, ts_stores_cap;
static int ts_stores_kept;
static void ts_keep(const void* p, long long bytes, long long k)
{{
    if (!ts_stores_kept) return;
    if (ts_stores_n == ts_stores_cap) {{
        ts_stores_cap = ts_stores_cap ? 2 * ts_stores_cap : 4096;
        ts_stores = realloc(ts_stores, ts_stores_cap * sizeof *ts_stores);
    }}
    ts_stores[ts_stores_n++] = (ts_store){{blockIdx.x, threadIdx.x, ts_region, k, (long long)(intptr_t)p, bytes}};
}}
#define TS_TILE_PUT(p, v, k) (ts_keep((p), sizeof *(p), (k)), *(p) = (v))
/* the stores kept since the last call (at most cap of them), which starts keeping them afresh */
long long ts_take_stores(int keep, ts_store* out, long long cap)
{{
    long long n = ts_stores_n < cap ? ts_stores_n : cap;
    if (out) memcpy(out, ts_stores, n * sizeof *out);
    ts_stores_n = 0;
    ts_stores_kept = keep;
    return n;
}}
"""
#: the host double's record of tile stores (layout "bdh" row tiles), for cffi
STORES_DECLARATION = """typedef struct { long long block, thread, region, k, address, bytes; } ts_store;
long long ts_take_stores(int keep, ts_store* out, long long cap);"""
#: kernels run once per call (or per trajectory), a block per run whose threads share the work
ONCE_PER_CALL = ("coefficients", "coefficients_jvp", "dt_vjp_finish")
ACCUMULATOR = ("/* dt_vjp's accumulator: begin */", "/* dt_vjp's accumulator: end */")
#: per thread: the slot and value of each ACC statement it runs (a column past the end records 0);
#: the warp and block sums run after the block (``_block_reduction``), dt_vjp_finish's in ts_sum_rows
HOST_ACCUMULATOR = """#include <stdlib.h>
#include <assert.h>
static struct { long long n, cap; long long* q; double* v; } ts_calls[TS_MAX_BLOCK];
static double ts_discard;
static double* ts_record(long long q, bool active)
{
    __typeof__(ts_calls[0])* c = &ts_calls[threadIdx.x];
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 1024;
        c->q = realloc(c->q, c->cap * sizeof *c->q);
        c->v = realloc(c->v, c->cap * sizeof *c->v);
    }
    c->q[c->n] = q;
    c->v[c->n] = 0.0;
    return active ? &c->v[c->n++] : (c->n++, &ts_discard);
}
#undef ACC
#define ACC(q) (*ts_record((q), active))
#define ts_rows_begin(gc) ((double*)0)
#define ts_rows_end(gc) ((void)0)
/* a warp's 32 values added as __shfl_down_sync adds them: into lane 0 (a lane past the end reads its own) */
static double ts_shuffle_tree(double* v)
{
    double before[32];
    for (int off = 16; off > 0; off >>= 1) {
        for (int lane = 0; lane < 32; ++lane) before[lane] = v[lane];
        for (int lane = 0; lane < 32; ++lane) v[lane] += before[lane + off < 32 ? lane + off : lane];
    }
    return v[0];
}
static void ts_sum_rows(const double* gc, long long rows, long long stride, double* sums)
{
    if (threadIdx.x != 0) return;
    for (int q = 0; q < NC_; ++q) {
        double v[32];
        for (int lane = 0; lane < 32; ++lane) {
            v[lane] = 0.0;
            for (long long k = lane; k < rows; k += 32) v[lane] += gc[k * stride + q];
        }
        sums[q] = ts_shuffle_tree(v);
    }
}
"""


def _block_reduction(symbol: str) -> str:
    """dt_vjp's sums of one block as lanes in lockstep run them (see the module docstring)."""
    return f"""static void {symbol}_block(double* gc)
{{
    const int warps = (int)(blockDim.x / 32);
    const long long n = ts_calls[0].n;
    double* rows = calloc((size_t)warps * NC_, sizeof *rows);
    for (int w = 0; w < warps; ++w) {{
        for (long long k = 0; k < n; ++k) {{
            double v[32];
            for (int lane = 0; lane < 32; ++lane) {{
                assert(ts_calls[w * 32 + lane].n == n && ts_calls[w * 32 + lane].q[k] == ts_calls[0].q[k]);
                v[lane] = ts_calls[w * 32 + lane].v[k];
            }}
            rows[w * NC_ + ts_calls[0].q[k]] += ts_shuffle_tree(v);
        }}
    }}
    for (int q = 0; q < NC_; ++q) {{
        double s = rows[q];
        for (int w = 1; w < warps; ++w) s += rows[w * NC_ + q];
        gc[(long long)blockIdx.x * TS_ROW + q] = s;
    }}
    free(rows);
    for (int t = 0; t < (int)blockDim.x; ++t) ts_calls[t].n = 0;
}}
"""


def _entry_point(spec: Any, kernel: str, reduce_blocks: bool, one_thread: bool) -> tuple[str, str]:
    """(C definition, cffi declaration) of one kernel's host entry point: its CUDA parameters after
    the launch's grid and block, every (block, thread) run in turn (``one_thread``: thread 0 only,
    of a block of one thread, see the module docstring)."""
    args = table(spec)
    symbol = abi.symbol(spec.name, kernel)
    names = ", ".join(name for _, name in abi.cuda_arguments(kernel, args))
    signature = abi.signature(kernel, args, CTYPES[spec.dtype], "restrict", cuda=True)
    definition = (
        f"void {symbol}(long long grid, long long block, {signature})\n{{\n"
        f"    blockDim.x = {'1' if one_thread else 'block'}; gridDim.x = grid;\n"
        f"    for (long long b = 0; b < grid; ++b) {{\n"
        f"        ts_staged = 0; ts_regions = 0;\n"
        f"        for (ts_pass = 0; ts_pass == 0 || (ts_pass == 1 && ts_staged) || ts_pass <= ts_regions; ++ts_pass) {{\n"
        f"            for (long long t = 0; t < {'1' if one_thread else 'block'}; ++t) {{\n"
        f"                blockIdx.x = b; threadIdx.x = t; ts_region = 0; {symbol}_thread({names});\n"
        f"                if (ts_region > ts_regions) ts_regions = ts_region;\n"
        f"            }}\n"
        f"        }}\n"
        + (f"        {symbol}_block(gc);\n" if reduce_blocks else "")
        + "    }\n}")
    params = ", ".join(("intptr_t" if "*" in t else t) + f" {n}" for t, n in abi.cuda_arguments(kernel, args))
    return definition, f"void {symbol}(long long grid, long long block, {params});"


def host_source(spec: Any) -> tuple[str, str]:
    """(C source, cffi declarations): every CUDA kernel, each looped over its launch grid."""
    source = generate(spec, targets=("cuda",)).source("cuda").replace('extern "C" ', "")
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"  # a thread's own sums, no warp sums
    form = lowered(spec).coefs.form  # the once-per-call kernels: a block per run, its threads sharing the work
    shared_runs = ("dt_vjp_finish",) if form == "monomials" else ONCE_PER_CALL
    if inline_coefficients(table(spec), form):  # dt_vjp_finish: a thread per trajectory
        shared_runs = ()
    dt_vjp = abi.symbol(spec.name, "dt_vjp")
    if not per_trajectory and "dt_vjp" in abi.part_kernels("all", table(spec)):  # (a fused step has none)
        start, end = source.find(ACCUMULATOR[0]), source.find(ACCUMULATOR[1])
        assert 0 <= start < end, "the CUDA template's dt_vjp accumulator changed: update this test double"
        source = source[:start] + HOST_ACCUMULATOR + source[end + len(ACCUMULATOR[1]):]
        source = source.replace(f"void {dt_vjp}(", _block_reduction(dt_vjp) + f"void {dt_vjp}(")
    # the table copy into shared memory: every thread copies all of it (see the module docstring)
    source = source.replace("int i = threadIdx.x; i < ", "int i = 0; i < ").replace("; i += blockDim.x)", "; ++i)")
    definitions, declarations = [], []
    # the entry points the CUDA backend binds by name (a missing one is the driver's "named symbol
    # not found" on a GPU; here, this assertion)
    for kernel in CUDA.entry_points(abi.part_kernels("all", table(spec)), table(spec), form):
        symbol = abi.symbol(spec.name, kernel)
        assert f"void {symbol}(" in source, f"{spec.name}: the CUDA source does not define the entry point {symbol}"
        source = source.replace(f"void {symbol}(", f"void {symbol}_thread(")
        definition, declaration = _entry_point(spec, kernel, kernel == "dt_vjp" and not per_trajectory,
                                               kernel in shared_runs)
        definitions.append(definition)
        declarations.append(declaration)
    return PRELUDE + source + "\n" + "\n\n".join(definitions) + "\n", "\n".join([STORES_DECLARATION, *declarations])


@functools.lru_cache(maxsize=None)
def _library(source: str, declarations: str) -> tuple[Any, Any]:
    """(cffi.FFI, library): the host source built by the C backend's compiler (cached by content),
    loaded through cffi."""
    path = BuildCache().build(digest(source, cbackend.environment_key()), "so", source, cbackend._compile, {})
    ffi = cffi.FFI()
    ffi.cdef(declarations)
    return ffi, ffi.dlopen(str(path))


#: the stream the host double's launches go on (any handle: the host runs them in turn)
HOST_STREAM = 0x5EED
#: the driver's cuLaunchKernel as a C function type (CUresult, CUfunction, grid xyz, block xyz, shared
#: bytes, CUstream, kernelParams, extra), for the native node's launches (runtime/native_node.cpp)
LAUNCH_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p)
#: the node's stream function: the raw handle of the current stream on a device (by index)
STREAM_OF = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)
#: what the launch double returns when a launch failed here (any CUresult but 0)
LAUNCH_FAILED = 999


class HostCudaBackend(CudaBackend):
    """The CUDA kernels run on the host, launched by the generated launch plan (or ``plan``)
    through the CUDA backend's own call (runtime/cuda_backend.py ``CudaBackend.call``): its
    parameters packed for the driver (``Packed``), and this double's ``cuLaunchKernel`` reading
    each parameter back as the kernel's C signature declares it before it runs the kernel. The
    native node (runtime/native_node.cpp) launches through the same double, as a C function
    (``native_launch``: the launch and stream functions' addresses)."""

    def __init__(self, spec: Any, plan: Any = None):  # no CuPy, no GPU: CudaBackend's state set here
        self.spec = spec
        self.table = table(spec)
        generated = generate(spec, targets=("cuda",))
        self.metadata = dict(generated.metadata)
        self.plan = plan or generated.launch_plan("cuda")
        self.ffi, self.lib = _library(*host_source(spec))
        self.launched: list[tuple[str, int, int]] = []  # (kernel, grid, block)
        self.device, self.index = torch.device("cpu"), 0
        kernels = CUDA.entry_points(abi.part_kernels("all", self.table), self.table, lowered(spec).coefs.form)
        self.functions = {k: None for k in kernels}
        self.handles = {k: i + 1 for i, k in enumerate(kernels)}  # the host's function "handles"
        self._kernels = {h: k for k, h in self.handles.items()}
        self._packed = {}
        self._raw_stream = lambda index: HOST_STREAM
        self._launch_kernel = self._host_launch
        self._get_device = lambda: 0
        self._contexts = threading.local()
        self._contexts.__dict__[0] = True  # no context to make current
        self.direct = True
        #: each launch's parameters after the grid and block, as the kernel read them (``launched``'s order)
        self.parameters: list[tuple[int, ...]] = []
        self.errors: list[BaseException] = []  # what failed in a launch from C (a callback cannot raise)
        # kept: the node calls them by address
        self._native_functions = (LAUNCH_KERNEL(self._native_host_launch), STREAM_OF(lambda index: HOST_STREAM))
        self.native_launch = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._native_functions)

    def load_part(self, part: str) -> None:
        """Every kernel is built at once."""

    def empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """Buffers are filled with NaN: a kernel that reads what no kernel wrote shows up."""
        return torch.full((size,), float("nan"), dtype=dtype)

    def _host_launch(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                     stream: int, params: int, extra: int) -> None:
        """cuLaunchKernel on the host: each parameter read from where ``params`` points, as the
        kernel's C signature declares it (an int64_t or a pointer), then every (block, thread) run."""
        kernel = self._kernels[f]
        assert (gy, gz, by, bz, extra, stream) == (1, 1, 1, 1, 0, HOST_STREAM)
        assert shared == 0 and bx % 32 == 0 and 0 < bx <= MAX_BLOCK, "a launch the host run cannot model"
        declared = abi.cuda_arguments(kernel, self.table)
        lengths = {ctypes.addressof(p): len(p) for packed in self._packed.values() for p in packed._pointers}
        n = lengths.get(params, len(declared))  # (the native node's arrays are its own: one per declared parameter)
        assert n == len(declared), f"{kernel}: {n} parameters packed, {len(declared)} declared"
        pointers = (ctypes.c_void_p * len(declared)).from_address(params)
        values = []
        for (ctype, _), at in zip(declared, pointers):
            if ctype == "int64_t":
                values.append(ctypes.c_int64.from_address(at).value)
            else:
                assert "*" in ctype, f"{kernel}: a parameter of type {ctype}"
                values.append(ctypes.c_void_p.from_address(at).value or 0)
        self.launched.append((kernel, gx, bx))
        self.parameters.append(tuple(values))
        getattr(self.lib, abi.symbol(self.spec.name, kernel))(gx, bx, *values)

    def _native_host_launch(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                            stream: Any, params: int, extra: Any) -> int:
        """The launch double as the native node calls it (a C function): ``_host_launch``, a failure
        kept in ``errors`` and returned as a CUresult (an exception cannot cross the C call)."""
        try:
            self._host_launch(f, gx, gy, gz, bx, by, bz, shared, stream or 0, params, extra or 0)
            return 0
        except BaseException as err:  # noqa: B036 (kept for the test, which raises it)
            self.errors.append(err)
            return LAUNCH_FAILED


def host_step(spec: Any, native: bool = False) -> Step:
    """A CPU Step whose calls run the CUDA kernels on the host: on the Python autograd path, or with
    ``native`` on the native node's CUDA launches (TENSORSTEP_CUDA_NATIVE=1 while it is loaded; the
    step's ``native`` is None where the node is unavailable)."""
    if native:
        from tensorstep.runtime.native import CUDA_SWITCH

        with mock.patch.dict(os.environ, {CUDA_SWITCH: "1"}):
            return Step(spec, torch.device("cpu"), Launcher(spec, HostCudaBackend(spec)))
    with mock.patch.object(Step, "_take_native", lambda self: None):
        step = Step(spec, torch.device("cpu"), Launcher(spec, HostCudaBackend(spec)))
    step.native, step._native_pending = None, False
    return step
