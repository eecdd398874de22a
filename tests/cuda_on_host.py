"""The generated CUDA source run on the host, a test double for the GPU (CI has none).

The CUDA forward and adjoint kernels are compiled as C with the CUDA keywords defined away,
and each entry point runs every (block, thread) of the launch grid the runtime would use, in
turn. Their arithmetic and indexing can then be checked against the dense reference. The dt
kernels use warp shuffles, which a sequential run cannot reproduce: they are stubs that abort.
"""
from __future__ import annotations

from typing import Any

from tensorstep.codegen import abi
from tensorstep.codegen.render import CTYPES, render
from tensorstep.runtime.cuda_backend import THREADS

PRELUDE = f"""/* CUDA keywords for a sequential run on the host */
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ restrict
#include <stdlib.h>
typedef struct {{ long long x; }} ts_dim3;
static ts_dim3 blockIdx, threadIdx, blockDim = {{{THREADS}}};
"""


def host_source(spec: Any) -> str:
    """C source with every kernel of the ABI: CUDA's core kernels looped over their grid, dt stubs."""
    source = render(spec, "cuda", "core").replace('extern "C" ', "")
    ctype = CTYPES[spec.dtype]
    entry_points = []
    for kernel in abi.PARTS["all"]:
        symbol = abi.symbol(spec.name, kernel)
        params = abi.signature(kernel, spec.order, ctype, "restrict")
        if kernel in abi.PARTS["core"]:
            source = source.replace(f"void {symbol}(", f"void {symbol}_thread(")
            names = ", ".join(name for _, name in abi.arguments(kernel, spec.order))
            body = (f"const long long blocks = (B * D_ + {THREADS} - 1) / {THREADS};\n"
                    f"    for (long long b = 0; b < (blocks > 0 ? blocks : 1); ++b)\n"
                    f"        for (long long t = 0; t < {THREADS}; ++t) {{\n"
                    f"            blockIdx.x = b; threadIdx.x = t; {symbol}_thread({names});\n"
                    f"        }}")
        else:
            body = "abort();"
        entry_points.append(f"void {symbol}({params})\n{{\n    {body}\n}}")
    entry_points.append(f"int64_t {abi.symbol(spec.name, 'n_coefficients')}(void) {{ abort(); }}")
    return PRELUDE + source + "\n" + "\n".join(entry_points) + "\n"
