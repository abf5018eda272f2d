"""Ember's matrix-product kernels: ``small_bmm`` behind ``ember::small_bmm`` (ops/small_bmm.py),
many small products, and ``tiled_matmul`` behind ``ember::tiled_matmul`` (ops/tiled_matmul.py),
the tuned alternative to cuBLAS, with ``split_k_sum`` after it where the K loop is split.

One program computes one ``BLOCK_M x BLOCK_N`` tile of one product of the batch, looping over K
(or over one of ``SPLIT_K`` slices of it) in ``BLOCK_K`` steps with float32 sums on the tensor
cores (``tl.dot``), rounded once to the output dtype. Every operand is read through its own strides, so transposed views (the backward's
``grad @ k`` and ``q^T @ grad``) need no copy. ``UPCAST`` is for Triton's interpreter only: the
operands go to float32 first, so the products are exact there, and bfloat16 results are
truncated, not rounded. Load this file with ``runtime.kernels.load_module``.
"""

import triton
import triton.language as tl


@triton.jit
def tile_product(a_base, b_base, rm, rn, M, N, k_lo, K, sam, sak, sbk, sbn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """The float32 sums of one tile: rows ``rm`` of A times columns ``rn`` of B over ``k_lo <= k < K``,
    in BLOCK_K steps."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(k_lo, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_base + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_base + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bfloat16 operands' bits, not their values
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def small_bmm(a_ptr, b_ptr, c_ptr, M, N, K, TILES_M, TILES_N,
              sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    tiles = TILES_M * TILES_N
    batch = pid // tiles
    tile = pid % tiles
    rm = (tile // TILES_N) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % TILES_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tile_product(a_ptr + batch.to(tl.int64) * sab, b_ptr + batch.to(tl.int64) * sbb, rm, rn, M, N, 0, K,
                       sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    c = c_ptr + batch.to(tl.int64) * scb + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def tiled_matmul(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, K_SLICE, TILES_M, TILES_N,
                 sab, sam, sak, sbb, sbk, sbn, sbias, scs, scb, scm, scn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """``ember::tiled_matmul`` (ops/tiled_matmul.py): one ``BLOCK_M x BLOCK_N`` tile of one product,
    tiles visited ``GROUP_M`` rows at a time so that neighbouring programs share B's tiles in L2;
    ``bias`` (one value per column, float32 sums) added before the single rounding, as cuBLAS's addmm.
    With ``SPLIT_K`` > 1, program ``(pid, s)`` sums the K slice ``[s * K_SLICE, (s + 1) * K_SLICE)``
    and stores its float32 sums at ``c + s * scs``; ``split_k_sum`` adds the slices, then the bias."""
    pid = tl.program_id(0)
    tiles = TILES_M * TILES_N
    batch = pid // tiles
    tile = pid % tiles
    width = GROUP_M * TILES_N
    first_m = (tile // width) * GROUP_M
    rows = tl.minimum(TILES_M - first_m, GROUP_M)
    tile_m = first_m + (tile % width) % rows
    tile_n = (tile % width) // rows
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * K_SLICE
        k_hi = tl.minimum(k_lo + K_SLICE, K)
    acc = tile_product(a_ptr + batch.to(tl.int64) * sab, b_ptr + batch.to(tl.int64) * sbb, rm, rn, M, N, k_lo, k_hi,
                       sam, sak, sbk, sbn, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    if HAS_BIAS and SPLIT_K == 1:
        acc += tl.load(bias_ptr + rn * sbias, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + tl.program_id(1).to(tl.int64) * scs + batch.to(tl.int64) * scb + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def split_k_sum(part_ptr, bias_ptr, c_ptr, TOTAL, N, sbias,
                SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """The ``SPLIT_K`` float32 slices of a split product (contiguous, ``TOTAL`` elements each) added
    in a fixed order (the same result every run), the bias added, rounded once into contiguous ``c``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < TOTAL
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * TOTAL + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + (offs % N) * sbias, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
