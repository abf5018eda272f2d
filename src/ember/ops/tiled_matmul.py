"""Ember's tiled matrix product (``ember::tiled_matmul``): the generated alternative to cuBLAS that
``ember tune`` may choose for one matmul of a GPU graph (passes/gpu_library_choices.py).

``tiled_matmul(a, b, bias, tiles)`` is ``mm`` / ``bmm`` (2-D or 3-D operands) or ``addmm`` (a
bias with one value per column) computed by the Triton kernel ``tiled_matmul`` of
ops/matmul_kernels.py with the tile configuration ``tiles`` (``TILE_KEYS``, in that order; a list
without the last key, ``SPLIT_K``, means 1). With ``SPLIT_K`` > 1 the K loop is cut into that many
slices run by programs of their own, for products of few tiles and a long K (batch-1 inference:
128 x 768 x 3072 is 24 tiles of 64 x 64 for 132 SMs); their float32 sums are added in a fixed order
by ``split_k_sum``, so the result is the same on every run. No
rule picks it: a graph holds it only where the tuning database measured it faster than the
rule's implementation at that site, after checking its result. The result is contiguous, as
cuBLAS's. CPU tensors (the interpreter in CI) run the same kernel through Triton's interpreter.

``candidates`` ranks tile configurations with a cheap model (the tensor cores' work with padded
tiles, the bytes each tile reads, the waves of programs over the SMs); the tuner times the best few.
"""

from __future__ import annotations

import math

import torch
import triton

from ember.ops.small_bmm import MATMUL_KERNELS, _kernels, product_dims
from ember.runtime import precompile

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K")
SPLITS = (1, 2, 4, 8)
SUM_BLOCK = 1024  # elements per program of split_k_sum
# Tile shapes, warps and pipeline stages to rank (those of common Triton GEMM tunings on sm80+).
_CONFIGS = (
    (16, 64, 64, 4, 3), (32, 32, 64, 4, 3), (32, 64, 32, 4, 4), (64, 32, 32, 4, 4), (64, 64, 32, 4, 3),
    (64, 64, 64, 4, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
    (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 256, 32, 8, 3), (256, 64, 32, 8, 3), (128, 256, 64, 8, 3),
)
GPU_DOT_FLOPS = 800e12  # bf16 tensor-core rate an H100's Triton GEMM reaches at best
GPU_BANDWIDTH = 3.0e12


def dims(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of ``a @ b`` for 2-D or 3-D operands."""
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch, a.shape[-2], b.shape[-1], a.shape[-1]


def takes(a: object, b: object, bias: object = None) -> bool:
    """Whether ``tiled_matmul`` computes this product: operands the matmul kernels take
    (``small_bmm.product_dims``), a bias (if any) 1-D with one value per column, of their dtype,
    device and static size."""
    product = product_dims(a, b)
    if product is None or bias is None:
        return product is not None
    return (isinstance(bias, torch.Tensor) and bias.dim() == 1
            and all(type(s) is int for s in (*bias.shape, *bias.stride())) and bias.shape[0] == product[2]
            and bias.dtype == a.dtype and bias.device == a.device)  # type: ignore[union-attr]


def tiles_of(config: dict) -> list[int]:
    return [int(config.get(key, 1)) for key in TILE_KEYS]  # SPLIT_K is 1 in records made before it


def _meta(tiles: list[int], k: int) -> dict[str, int]:
    """The launch meta of ``tiles``: SPLIT_K 1 where it is absent, or where its slices of whole
    BLOCK_K steps would leave one empty."""
    meta = {"SPLIT_K": 1, **dict(zip(TILE_KEYS, tiles))}
    steps = triton.cdiv(k, meta["BLOCK_K"])
    meta["SPLIT_K"] = max(1, min(meta["SPLIT_K"], steps))
    while meta["SPLIT_K"] > 1 and triton.cdiv(steps, meta["SPLIT_K"]) * (meta["SPLIT_K"] - 1) >= steps:
        meta["SPLIT_K"] -= 1
    return meta


def _launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor,
            meta: dict[str, int]) -> tuple[tuple[int, int], list, dict]:
    """(grid, arguments, launch meta) of one product with ``meta`` (``_meta``); with SPLIT_K > 1,
    ``c`` is the float32 slices' buffer ``[SPLIT_K, *result]``, contiguous."""
    batch, m, n, k = dims(a, b)
    split = meta["SPLIT_K"]
    tiles_m, tiles_n = triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])
    k_slice = triton.cdiv(triton.cdiv(k, meta["BLOCK_K"]), split) * meta["BLOCK_K"]

    def strides(t: torch.Tensor, lead: int) -> list[int]:
        return list(t.stride()[lead:]) if t.dim() == 3 + lead else [0, *t.stride()[lead:]]
    c_strides = [c.stride(0) if split > 1 else 0, *strides(c, 1 if split > 1 else 0)]
    args = [a, b, bias if bias is not None else a, c, m, n, k, k_slice, tiles_m, tiles_n, *strides(a, 0),
            *strides(b, 0), bias.stride(0) if bias is not None else 0, *c_strides]
    return (batch * tiles_m * tiles_n, split), args, {**meta, "HAS_BIAS": bias is not None}


def _result(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, m, n, _ = dims(a, b)
    return torch.empty((batch, m, n) if a.dim() == 3 else (m, n), dtype=a.dtype, device=a.device)


def _slices(c: torch.Tensor, split: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.empty((split, *c.shape), dtype=torch.float32, device=device or c.device)


@torch.library.custom_op("ember::tiled_matmul", mutates_args=())
def tiled_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tiles: list[int]) -> torch.Tensor:
    """``a @ b (+ bias)`` with the tile configuration ``tiles``; the result is contiguous."""
    c = _result(a, b)
    if not c.numel():
        return c
    interpret = a.device.type != "cuda"
    kernels = _kernels(interpret)
    meta = _meta(tiles, a.shape[-1])
    split = meta["SPLIT_K"]
    out = _slices(c, split) if split > 1 else c
    grid, args, launch_meta = _launch(a, b, bias, out, meta)
    kernels.tiled_matmul[grid](*args, **launch_meta, UPCAST=interpret)
    if split > 1:
        kernels.split_k_sum[(triton.cdiv(c.numel(), SUM_BLOCK),)](*_sum_args(out, bias, c), **_sum_meta(split, bias))
    return c


def _sum_args(slices: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor) -> list:
    return [slices, bias if bias is not None else c, c, c.numel(), c.shape[-1],
            bias.stride(0) if bias is not None else 0]


def _sum_meta(split: int, bias: torch.Tensor | None) -> dict[str, int]:
    return {"SPLIT_K": split, "HAS_BIAS": bias is not None, "BLOCK": SUM_BLOCK, "num_warps": 4}


@tiled_matmul.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tiles: list[int]) -> torch.Tensor:
    batch, m, n, _ = dims(a, b)
    return a.new_empty((batch, m, n) if a.dim() == 3 else (m, n))


def compile_jobs(gm: torch.fx.GraphModule) -> list[precompile.CompileJob]:
    """The kernels a graph's ``ember::tiled_matmul`` calls launch, as compile jobs for the workers."""
    jobs = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.ember.tiled_matmul.default):
        vals = [x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in node.args[:3]]
        c = node.meta.get("val")
        a, b, bias = vals
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (a, b, c)):
            continue
        jobs += job(a, b, bias, c, list(node.args[3]))
    return jobs


def job(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor,
        tiles: list[int]) -> list[precompile.CompileJob]:
    """The compile jobs of one product's launches (the kernels specialise on sizes and strides)."""
    meta = _meta(tiles, a.shape[-1])
    split = meta["SPLIT_K"]
    slices = _slices(c, split, "meta") if split > 1 else c  # its strides and dtype only
    _, args, meta = _launch(a, b, bias, slices, meta)

    def arg_types(args: list) -> list:
        return [x.dtype if isinstance(x, torch.Tensor) else precompile.int_arg(x) for x in args]
    jobs = [precompile.job_for(MATMUL_KERNELS, "tiled_matmul", arg_types(args), {**meta, "UPCAST": False})]
    if split > 1:
        jobs.append(precompile.job_for(MATMUL_KERNELS, "split_k_sum", arg_types(_sum_args(slices, bias, c)),
                                       _sum_meta(split, bias)))
    return jobs


def estimate_s(batch: int, m: int, n: int, k: int, itemsize: int, config: tuple[int, ...], sms: int,
               split: int = 1) -> float:
    """The model's time for one configuration: the padded tiles' tensor-core work at a rate that
    falls with smaller tiles, or the bytes the tiles read (B's tiles shared within a group), which
    ever is longer, stretched by the last wave's idle SMs. A split K runs ``split`` times the
    programs, each over a slice, and pays for the float32 slices' round trip and a second launch."""
    bm, bn, bk, warps, stages = config
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    steps = math.ceil(math.ceil(k / bk) / split)  # K steps of one program
    programs = batch * tiles_m * tiles_n * split
    shared = stages * (bm + bn) * bk * itemsize  # the pipeline's buffers of A and B tiles
    per_sm = max(1, min(16 // warps, 200_000 // shared))  # programs resident per SM
    waves = programs / (sms * per_sm)
    tail = math.ceil(waves) / waves if waves > 0 else 1.0
    efficiency = min(1.0, math.sqrt(bm * bn / (128.0 * 128.0))) * min(1.0, bk / 32.0)
    work = 2.0 * programs * bm * bn * steps * bk / (GPU_DOT_FLOPS * efficiency)
    traffic = batch * (tiles_n * m * k + tiles_m * n * k / 4 + m * n) * itemsize / GPU_BANDWIDTH
    if split == 1:
        return max(work, traffic) * tail + 2e-6
    slices = batch * m * n * (8 * split + itemsize) / GPU_BANDWIDTH  # written, read back, the result
    return max(work, traffic) * tail + slices + 5e-6


def candidates(batch: int, m: int, n: int, k: int, itemsize: int, sms: int = 132, top: int = 6
               ) -> list[dict[str, int]]:
    """The model's best ``top`` tile configurations (tiles no larger than the padded product; K
    split only into slices of at least two BLOCK_K steps)."""
    def fits(size: int, block: int) -> bool:
        return block <= max(16, triton.next_power_of_2(size))
    fit = [c for c in _CONFIGS if fits(m, c[0]) and fits(n, c[1]) and fits(k, c[2])] or list(_CONFIGS[:1])
    options = [(c, split) for c in fit for split in SPLITS if split == 1 or math.ceil(k / c[2]) >= 2 * split]
    ranked = sorted(options, key=lambda o: estimate_s(batch, m, n, k, itemsize, o[0], sms, o[1]))
    return [dict(zip(TILE_KEYS, (bm, bn, bk, 8, warps, stages, split)))
            for (bm, bn, bk, warps, stages), split in ranked[:top]]
