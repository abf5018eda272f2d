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
    """Compile the kernel for Triton's active target. Raises where Triton did not type its
    arguments as bf16 and fp32 pointers: a worker then leaves its torch-free driver
    (``worker_triton``) for Triton's own."""
    from ember.runtime.worker_triton import pointer_arg, typed_arguments

    compiled = _warmup_kernel.warmup(pointer_arg("bfloat16"), pointer_arg("float32"), 64, grid=(1,), BLOCK=64)
    typed = typed_arguments(compiled)
    if (typed.get("src"), typed.get("dst")) != ("*bf16", "*fp32"):
        raise RuntimeError(f"Triton typed the warm-up kernel's pointers {typed}, not *bf16 and *fp32")
