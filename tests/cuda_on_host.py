"""The generated CUDA source run on the host, a test double for the GPU (CI has none).

Every CUDA kernel is compiled as C with the CUDA keywords defined away, and each entry point
runs every (block, thread) of the launch grid the runtime would use, one after another. The
kernels' arithmetic and indexing can then be checked against the dense reference and by
gradcheck. Shared memory is one static array per kernel, which is faithful here: thread 0 of
each block, the one that fills it, runs first.

dt_vjp's block reduction needs a block's threads in lockstep (warp shuffles, barriers), which a
sequential run cannot give: here each thread leaves its partial sums in a per-block buffer, and
after the block's last thread the reduction runs as the GPU runs it, shuffle step by shuffle
step across each warp's 32 lanes, then the warps' sums in turn, into the block's row of gc. The
sums are the same, in the same order, as on the GPU; dt_vjp_finish runs unchanged.
"""
from __future__ import annotations

from typing import Any

from tensorstep.codegen import abi
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate
from tensorstep.codegen.render import CTYPES
from tensorstep.runtime.cuda_backend import THREADS, grid_blocks
from tensorstep.runtime.launch import CpuBackend

PRELUDE = f"""/* CUDA keywords for a sequential run on the host */
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ restrict
#define __shared__ static
#define __syncthreads()
#define atomicAdd(address, value) (*(address) += (value)) /* per-trajectory dt_vjp: one thread at a time */
#define __shfl_down_sync(mask, value, offset) 0.0
typedef struct {{ long long x; }} ts_dim3;
static ts_dim3 blockIdx, threadIdx, blockDim = {{{THREADS}}};
"""
REDUCTION = ("    /* block reduction: each block", "    /* block reduction: end */")


def _block_reduction(symbol: str) -> str:
    """The dt_vjp reduction of one block as 32 lanes in lockstep run it (see the module docstring)."""
    return f"""static double ts_lanes[{THREADS}][NC_];
static void {symbol}_block(double* gc)
{{
    double warp_sums[{THREADS} / 32];
    for (int i = 0; i < NC_; ++i) {{
        for (int w = 0; w < {THREADS} / 32; ++w) {{
            double v[32], before[32];
            for (int lane = 0; lane < 32; ++lane) v[lane] = ts_lanes[w * 32 + lane][i];
            for (int off = 16; off > 0; off >>= 1) {{
                for (int lane = 0; lane < 32; ++lane) before[lane] = v[lane];
                /* __shfl_down_sync: a lane past the warp's end reads its own value */
                for (int lane = 0; lane < 32; ++lane) v[lane] += before[lane + off < 32 ? lane + off : lane];
            }}
            warp_sums[w] = v[0];
        }}
        double s = 0.0;
        for (int w = 0; w < {THREADS} / 32; ++w) s += warp_sums[w];
        gc[(long long)blockIdx.x * NC_ + i] = s;
    }}
}}
"""


def host_metadata(spec: Any) -> dict:
    """What the runtime keeps beside a build (the coefficient count for dt_vjp)."""
    return dict(generate(spec, targets=("cuda",)).metadata)


def host_source(spec: Any) -> str:
    """C source with every kernel of the ABI: the CUDA kernels, each looped over its launch grid."""
    source = generate(spec, targets=("cuda",)).source("cuda").replace('extern "C" ', "")
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"  # per-thread atomics, no block sums
    dt_vjp = abi.symbol(spec.name, "dt_vjp")
    if not per_trajectory:
        start, end = source.find(REDUCTION[0]), source.find(REDUCTION[1])
        assert 0 <= start < end, "the CUDA template's dt_vjp reduction changed: update this test double"
        source = (source[:start] + "    for (int i = 0; i < NC_; ++i) ts_lanes[threadIdx.x][i] = acc[i];\n"
                  + source[end + len(REDUCTION[1]):])
        source = source.replace(f"void {dt_vjp}(", _block_reduction(dt_vjp) + f"void {dt_vjp}(")
    ctype = CTYPES[spec.dtype]
    entry_points = []
    for kernel in abi.PARTS["all"]:
        symbol = abi.symbol(spec.name, kernel)
        source = source.replace(f"void {symbol}(", f"void {symbol}_thread(")
        names = ", ".join(name for _, name in abi.arguments(kernel, table(spec)))
        columns = "B" if kernel == "dt_vjp_finish" and per_trajectory else "1" if kernel == "dt_vjp_finish" \
            else "B * D_"  # as runtime/cuda_backend.py launches (launch_columns)
        entry_points.append(
            f"void {symbol}({abi.signature(kernel, table(spec), ctype, 'restrict')})\n{{\n"
            f"    const long long blocks = ({columns} + {THREADS} - 1) / {THREADS};\n"
            f"    for (long long b = 0; b < (blocks > 0 ? blocks : 1); ++b) {{\n"
            f"        for (long long t = 0; t < {THREADS}; ++t) {{\n"
            f"            blockIdx.x = b; threadIdx.x = t; {symbol}_thread({names});\n"
            f"        }}\n"
            + (f"        {symbol}_block(gc);\n" if kernel == "dt_vjp" and not per_trajectory else "")
            + "    }\n}")
    entry_points.append(f"int64_t {abi.symbol(spec.name, 'n_coefficients')}(void) {{ return NC_; }}")
    return PRELUDE + source + "\n" + "\n\n".join(entry_points) + "\n"


class HostCudaBackend(CpuBackend):
    """The CUDA kernels run on the host, with the CUDA launch's buffers (one row of dt_vjp
    partial sums per block)."""

    def __init__(self, spec: Any):
        super().__init__(spec, host_source(spec), host_metadata(spec))

    def dt_vjp_rows(self, B: int) -> int:
        return grid_blocks(B, self.spec.dof)
