"""Ember's tiled matrix product (``ember::tiled_matmul``): the generated alternative to cuBLAS that
``ember tune`` may choose for one matmul of a GPU graph (passes/gpu_library_choices.py).

``tiled_matmul(a, b, bias, tiles)`` is ``mm`` / ``bmm`` (2-D or 3-D operands) or ``addmm`` (a
bias with one value per column) computed by the Triton kernel ``tiled_matmul`` of
ops/matmul_kernels.py with the tile configuration ``tiles`` (``TILE_KEYS``, in that order). No
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

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
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
    return [int(config[key]) for key in TILE_KEYS]


def _launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor,
            tiles: list[int]) -> tuple[int, list, dict]:
    """(grid size, arguments, launch meta) of one product."""
    meta = dict(zip(TILE_KEYS, tiles))
    batch, m, n, k = dims(a, b)
    tiles_m, tiles_n = triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    def strides(t: torch.Tensor) -> list[int]:
        return list(t.stride()) if t.dim() == 3 else [0, *t.stride()]
    args = [a, b, bias if bias is not None else a, c, m, n, k, tiles_m, tiles_n, *strides(a), *strides(b),
            bias.stride(0) if bias is not None else 0, *strides(c)]
    return batch * tiles_m * tiles_n, args, {**meta, "HAS_BIAS": bias is not None}


@torch.library.custom_op("ember::tiled_matmul", mutates_args=())
def tiled_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, tiles: list[int]) -> torch.Tensor:
    """``a @ b (+ bias)`` with the tile configuration ``tiles``; the result is contiguous."""
    batch, m, n, _ = dims(a, b)
    c = torch.empty((batch, m, n) if a.dim() == 3 else (m, n), dtype=a.dtype, device=a.device)
    if c.numel():
        grid, args, meta = _launch(a, b, bias, c, tiles)
        interpret = a.device.type != "cuda"
        _kernels(interpret).tiled_matmul[(grid,)](*args, **meta, UPCAST=interpret)
    return c


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
        jobs.append(job(a, b, bias, c, list(node.args[3])))
    return jobs


def job(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, c: torch.Tensor,
        tiles: list[int]) -> precompile.CompileJob:
    """The compile job of one launch (the kernel specialises on its sizes and strides)."""
    _, args, meta = _launch(a, b, bias, c, tiles)
    arg_types = [t.dtype for t in args[:4]] + [precompile.int_arg(v) for v in args[4:]]
    return precompile.job_for(MATMUL_KERNELS, "tiled_matmul", arg_types, {**meta, "UPCAST": False})


def estimate_s(batch: int, m: int, n: int, k: int, itemsize: int, config: tuple[int, ...], sms: int) -> float:
    """The model's time for one configuration: the padded tiles' tensor-core work at a rate that
    falls with smaller tiles, or the bytes the tiles read (B's tiles shared within a group), which
    ever is longer, stretched by the last wave's idle SMs."""
    bm, bn, bk, warps, stages = config
    tiles_m, tiles_n, steps = math.ceil(m / bm), math.ceil(n / bn), math.ceil(k / bk)
    programs = batch * tiles_m * tiles_n
    shared = stages * (bm + bn) * bk * itemsize  # the pipeline's buffers of A and B tiles
    per_sm = max(1, min(16 // warps, 200_000 // shared))  # programs resident per SM
    waves = programs / (sms * per_sm)
    tail = math.ceil(waves) / waves if waves > 0 else 1.0
    efficiency = min(1.0, math.sqrt(bm * bn / (128.0 * 128.0))) * min(1.0, bk / 32.0)
    work = 2.0 * programs * bm * bn * steps * bk / (GPU_DOT_FLOPS * efficiency)
    traffic = batch * (tiles_n * m * k + tiles_m * n * k / 4 + m * n) * itemsize / GPU_BANDWIDTH
    return max(work, traffic) * tail + 2e-6


def candidates(batch: int, m: int, n: int, k: int, itemsize: int, sms: int = 132, top: int = 6
               ) -> list[dict[str, int]]:
    """The model's best ``top`` tile configurations (tiles no larger than the padded product)."""
    def fits(size: int, block: int) -> bool:
        return block <= max(16, triton.next_power_of_2(size))
    fit = [c for c in _CONFIGS if fits(m, c[0]) and fits(n, c[1]) and fits(k, c[2])]
    ranked = sorted(fit or _CONFIGS[:1], key=lambda c: estimate_s(batch, m, n, k, itemsize, c, sms))
    return [dict(zip(TILE_KEYS, (bm, bn, bk, 8, warps, stages))) for bm, bn, bk, warps, stages in ranked[:top]]
