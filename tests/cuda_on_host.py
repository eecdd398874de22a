"""The generated CUDA source run on the host, a test double for the GPU (CI has none).

Every CUDA kernel is compiled as C with the CUDA keywords defined away, and each entry point
runs every (block, thread) of the launch grid the runtime would use, one after another. The
kernels' arithmetic and indexing can then be checked against the dense reference and by
gradcheck. Shared memory is one static array per kernel, which is faithful here: thread 0 of
each block, the one that fills it, runs first. One substitution: dt_vjp's warp reduction (a shuffle tree, then one atomic add per
warp) needs 32 threads in lockstep, so here every thread adds its own partial sums; the total
is the same sum in another order.
"""
from __future__ import annotations

from typing import Any

from tensorstep.codegen import abi
from tensorstep.codegen.arguments import table
from tensorstep.codegen.driver import generate
from tensorstep.codegen.render import CTYPES
from tensorstep.runtime.cuda_backend import THREADS

PRELUDE = f"""/* CUDA keywords for a sequential run on the host */
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ restrict
#define __shared__ static
#define __syncthreads()
#define __shfl_down_sync(mask, value, offset) 0.0
#define atomicAdd(address, value) (*(address) += (value))
typedef struct {{ long long x; }} ts_dim3;
static ts_dim3 blockIdx, threadIdx, blockDim = {{{THREADS}}};
"""
WARP_SUM = "if ((threadIdx.x & 31) == 0) atomicAdd"


def host_metadata(spec: Any) -> dict:
    """What the runtime keeps beside a build (the coefficient count for dt_vjp)."""
    return dict(generate(spec, targets=("cuda",)).metadata)


def host_source(spec: Any) -> str:
    """C source with every kernel of the ABI: the CUDA kernels, each looped over its launch grid."""
    source = generate(spec, targets=("cuda",)).source("cuda").replace('extern "C" ', "")
    per_trajectory = getattr(spec, "dt", "") == "per_trajectory"  # per-thread atomics, no warp sum
    assert per_trajectory or WARP_SUM in source, "the CUDA template's warp reduction changed: update this test double"
    source = source.replace(WARP_SUM, "atomicAdd")
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
            f"    for (long long b = 0; b < (blocks > 0 ? blocks : 1); ++b)\n"
            f"        for (long long t = 0; t < {THREADS}; ++t) {{\n"
            f"            blockIdx.x = b; threadIdx.x = t; {symbol}_thread({names});\n"
            f"        }}\n}}")
    entry_points.append(f"int64_t {abi.symbol(spec.name, 'n_coefficients')}(void) {{ return NC_; }}")
    return PRELUDE + source + "\n" + "\n\n".join(entry_points) + "\n"
