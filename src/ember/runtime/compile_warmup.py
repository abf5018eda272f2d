"""A small kernel each compile worker compiles once at start-up.

A worker's first Triton compile is seconds slower than the next ones (the compiler's one-time
set-up: MLIR and LLVM contexts, libdevice, the ptxas tool), measured on the H100 as about 2.2 s
more for each worker's first kernel of ResNet-50. Compiling this kernel while Dynamo and
AOTAutograd still capture moves that cost off the critical path. It loads bf16, reduces, calls a
libdevice function and stores fp32, so the paths the generated kernels take are all set up.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _warmup_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + offs, offs < n, other=0).to(tl.float32)
    total = tl.sum(tl.exp(x), 0)
    tl.store(dst + offs, x * tl.rsqrt(total + 1.0), offs < n)


def compile_warmup_kernel() -> None:
    import torch

    _warmup_kernel.warmup(torch.bfloat16, torch.float32, 64, grid=(1,), BLOCK=64)
