"""The rule that decides whether a matmul's dimensions are padded to the alignment cuBLAS wants.

cuBLAS's fast tensor-core kernels (``nvjet_sm90``, ``*_align8`` CUTLASS kernels) load 16-byte
vectors, so every dimension that sets a leading dimension or a pointer offset must be a multiple
of 16 bytes: 8 elements of bf16/fp16. A GPT-2 language-model head (vocabulary 50257) is not,
and cuBLAS falls back to ``*_align1`` kernels: on the H100 (torch 2.11, bf16, batch 16 x 512
tokens) its three matmuls per training step took 6.70, 4.54 and 4.31 ms, where an aligned
matmul of that size runs in about 1 ms. Padding with zeros gives the same results: zeros along
K add nothing to the sums; rows (M) or columns (N) of zeros give extra output rows/columns that
are sliced off.

The rule, in order (``decide``):

1. Dtype: bf16/fp16 align to 8 elements; float32 to 4 only while TF32 matmuls are allowed
   (``torch.backends.cuda.matmul.allow_tf32``: TF32 runs on tensor cores, full-precision fp32 on
   CUDA cores, where the alignment matters little). Inductor's ``pad_mm`` uses the same sizes.
   Other dtypes: never.
2. Which dims: each of M, K, N that is not a multiple of the alignment, except a dim of 1 (a
   matrix-vector product, which pads to 8x the work).
3. ``mode="always"`` (``EMBER_PAD_MATMUL=always``; tests): pad those now, any size, fp32 to 4
   whether or not TF32 is on.
4. ``mode="auto"``: only where it pays, by an estimate from the H100 numbers above:
   - the padded matmul does at most 1/8 more work than the original (dims of 57 and more);
   - it is big enough that the saved time exceeds the extra kernels' launches
     (``pad_matmul_min_gflop``, default 1 GFLOP);
   - and its FLOPs per byte the padding copies (operands copied into padded buffers, read and
     written, plus a sliced result that must be copied back to eager's layout because the caller
     sees it) are at least ``pad_matmul_min_flops_per_byte`` (default 128). Why 128: padding wins
     when (s - 1) * flops / R > bytes / B, with R ~ 790 TFLOP/s (dense bf16) and B ~ 3.0 TB/s
     (copy bandwidth) as measured on the H100, and s the align-1 slowdown, measured at 4.5-7x on
     the GPT-2 head; with a cautious s = 3 that is flops / bytes > 790 / 3.0 / 2 = 132, rounded to
     128. Inductor's own test is similar (arithmetic intensity above half the machine balance),
     followed by a benchmark of both versions.

This is a rule of thumb, not a measurement: ``benchmarks/scripts/gpu_pad_matmul.py`` times
padded against unpadded matmuls of the shapes the rule decides, and whole training steps with
the pass on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("auto", "always", "off")
_HALF = (torch.float16, torch.bfloat16)
MAX_EXTRA_WORK = 1 / 8  # the padded matmul may do at most this much more work


def tf32_matmuls() -> bool:
    """Whether float32 matmuls may run as TF32 now (``allow_tf32`` or ``set_float32_matmul_precision``)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def alignment(dtype: torch.dtype, mode: str, tf32: bool) -> int:
    """Elements per 16 bytes where cuBLAS's fast kernels need that alignment; 0: never pad ``dtype``."""
    if dtype in _HALF:
        return 8
    if dtype == torch.float32 and (tf32 or mode == "always"):
        return 4
    return 0


def round_up(size: int, align: int) -> int:
    return -(-size // align) * align


@dataclass(frozen=True)
class MatmulDims:
    """One (batched) matmul: ``batch`` products of [m, k] @ [k, n]."""

    batch: int
    m: int
    k: int
    n: int
    dtype: torch.dtype

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


@dataclass(frozen=True)
class PaddingDecision:
    """The padded sizes (equal to the originals where a dim stays) or why nothing is padded."""

    m: int
    k: int
    n: int
    align: int = 0
    declined: str = ""  # the reason when nothing is padded

    @property
    def pads(self) -> bool:
        return not self.declined


def padded_dims(dims: MatmulDims, align: int) -> tuple[int, int, int]:
    """(m, k, n) rounded up to ``align`` where not aligned already; a dim of 1 stays."""
    return tuple(d if d == 1 or d % align == 0 else round_up(d, align)  # type: ignore[return-value]
                 for d in (dims.m, dims.k, dims.n))


def decide(dims: MatmulDims, copy_bytes: Callable[[int, int, int], int], mode: str = "auto",
           tf32: bool | None = None, min_flops_per_byte: float = 128.0, min_gflop: float = 1.0) -> PaddingDecision:
    """The rule (module docstring). ``copy_bytes(m, k, n)``: what padding to those sizes would copy
    (bytes read plus bytes written); the pass works it out from the graph."""
    keep = PaddingDecision(dims.m, dims.k, dims.n)
    if mode == "off":
        return PaddingDecision(dims.m, dims.k, dims.n, declined="padding off (EMBER_PAD_MATMUL=off)")
    if tf32 is None:
        tf32 = tf32_matmuls()
    align = alignment(dims.dtype, mode, tf32)
    if not align:
        why = ("float32 without TF32 (CUDA-core kernels)" if dims.dtype == torch.float32
               else f"{dims.dtype} (not a tensor-core float)")
        return PaddingDecision(dims.m, dims.k, dims.n, declined=why)
    m, k, n = padded_dims(dims, align)
    if (m, k, n) == (dims.m, dims.k, dims.n):
        return PaddingDecision(m, k, n, align, declined=f"aligned to {align} already")
    decision = PaddingDecision(m, k, n, align)
    if mode == "always":
        return decision
    extra = m * k * n / (dims.m * dims.k * dims.n) - 1
    if extra > MAX_EXTRA_WORK:
        return _declined(keep, align, f"padding adds {extra:.0%} to the work (small dim)")
    if dims.flops < min_gflop * 1e9:
        return _declined(keep, align, f"small: {dims.flops / 1e9:.2g} GFLOP < {min_gflop:g}")
    copied = copy_bytes(m, k, n)
    if copied and dims.flops / copied < min_flops_per_byte:
        return _declined(keep, align, f"copies too much: {dims.flops / copied:.0f} FLOP per byte copied "
                                      f"< {min_flops_per_byte:g}")
    return decision


def _declined(keep: PaddingDecision, align: int, why: str) -> PaddingDecision:
    return PaddingDecision(keep.m, keep.k, keep.n, align, declined=why)
