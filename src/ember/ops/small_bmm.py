"""Batched products of small matrices whose sizes cuBLAS cannot load in 16-byte vectors
(``ember::small_bmm``, GPU targets).

Swin's window attention multiplies 49-token windows with 32-wide heads: [49, 32] @ [32, 49] for
the scores, [49, 49] @ [49, 32] for the output, and four such products in the backward, over
12,288 windows x heads at batch 64 in its first stage. A row of 49 bf16 elements is 98 bytes, so
cuBLAS (and Inductor, which calls it) runs ``cutlass_75 ... align1`` kernels that load one element
at a time: 3.05 ms of swin_t's 15.7 ms training step on an H200, for products that move about 0.65
GB per kind and step. Padding the rows' strides does not help (the sizes decide cuBLAS's
kernel, ``gpu_matmul_row_alignment.py``), and padding the sizes adds a copy per operand.

Here one Triton program computes one tile (up to 64 x 64) of one product from the operands'
own strides, float32 sums rounded once, as cuBLAS does. Which products take it is the rule
``takes``; the pass is ``passes/small_bmm.py``. CPU tensors (the interpreter in CI) run the same
kernel through Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
import triton

from ember.runtime import precompile
from ember.runtime.kernels import load_module

MATMUL_KERNELS = Path(__file__).with_name("matmul_kernels.py")
DTYPES = (torch.float16, torch.bfloat16)  # float32 stays cuBLAS's (TF32 or not is its choice)
# Measured on an H200 against cuBLAS (bf16, gpu_small_bmm.py): Swin's 49 x 32 x 49 products 1.78-2.65x
# faster; 100 x 64 x 100 1.31x, 128 x 32 x 128 1.05x, but 120 x 256 x 120 0.51x (four 64-wide K
# steps per tile): K stays at most one tile.
MAX_MN = 128  # rows and columns of one product at most (two 64-wide tiles a side)
MAX_K = 64
ALIGN = 8  # elements of bf16/fp16 in 16 bytes: cuBLAS's vector loads need each size a multiple


def product_dims(a: object, b: object) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of ``a @ b`` where Ember's matmul kernels can compute it: bf16/fp16
    operands of one dtype and device, both 2-D or both 3-D with one batch, static sizes and
    strides, nothing empty, every tensor under 2**31 elements; else None."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim() \
            or a.dim() not in (2, 3):
        return None
    if not all(type(s) is int for t in (a, b) for s in (*t.shape, *t.stride())):
        return None  # symbolic sizes (dynamic shapes): the kernel's launch needs numbers, cuBLAS takes them
    batch, batch_b = (a.shape[0], b.shape[0]) if a.dim() == 3 else (1, 1)
    m, k, k_b, n = a.shape[-2], a.shape[-1], b.shape[-2], b.shape[-1]
    if a.dtype not in DTYPES or b.dtype != a.dtype or batch != batch_b or k != k_b or a.device != b.device:
        return None
    if min(batch, m, n, k) < 1 or max(a.numel(), b.numel(), batch * m * n) >= 2**31:
        return None
    return batch, m, n, k


def takes(a: object, b: object) -> bool:
    """Whether ``bmm(a, b)`` runs as ``ember::small_bmm``: 3-D operands the kernels take
    (``product_dims``), products of at most MAX_MN x MAX_MN with K at most MAX_K (one tile), and a
    size that is not a multiple of 8 (an aligned product keeps cuBLAS's vector kernels)."""
    product = product_dims(a, b) if getattr(a, "dim", lambda: 0)() == 3 else None
    if product is None:
        return False
    _, m, n, k = product
    return max(m, n) <= MAX_MN and k <= MAX_K and any(size % ALIGN for size in (m, n, k))


def blocks(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes: each side the next power of two of its size, 16 to 64 (``tl.dot``'s smallest is 16)."""
    def side(size: int) -> int:
        return max(16, min(64, triton.next_power_of_2(size)))
    return {"BLOCK_M": side(m), "BLOCK_N": side(n), "BLOCK_K": side(k)}


def _kernels(interpret: bool) -> ModuleType:
    return load_module(MATMUL_KERNELS, interpret)


def _ints(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, meta: dict[str, int]) -> list[int]:
    """The kernel's integer arguments after the three pointers."""
    _, m, k = a.shape
    n = b.shape[2]
    return [m, n, k, triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), *a.stride(), *b.stride(),
            *c.stride()]


@torch.library.custom_op("ember::small_bmm", mutates_args=())
def small_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` for small products (see ``takes``); the result is contiguous, as bmm's."""
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel():
        meta = blocks(m, n, k)
        ints = _ints(a, b, c, meta)
        interpret = a.device.type != "cuda"
        _kernels(interpret).small_bmm[(batch * ints[3] * ints[4],)](a, b, c, *ints, **meta, UPCAST=interpret)
    return c


@small_bmm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def compile_jobs(gm: torch.fx.GraphModule) -> list[precompile.CompileJob]:
    """The kernels a graph's ``ember::small_bmm`` calls launch, as compile jobs for the workers (the
    kernel specialises on its sizes and strides, so each job carries the values of its launch)."""
    jobs = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.ember.small_bmm.default):
        a, b = (x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in node.args[:2])
        c = node.meta.get("val")
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (a, b, c)):
            continue
        meta = blocks(a.shape[1], b.shape[2], a.shape[2])
        jobs.append(precompile.job_for(MATMUL_KERNELS, "small_bmm",
                                       [a.dtype, b.dtype, c.dtype, *map(precompile.int_arg, _ints(a, b, c, meta))],
                                       {**meta, "UPCAST": False}))
    return jobs
