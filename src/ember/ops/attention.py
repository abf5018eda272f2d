"""Ember's attention (``ember::attention``): the generated alternative to the SDPA backends that
``ember tune`` may choose for one attention call of an inference graph
(passes/gpu_library_choices.py), beside flash, memory-efficient, cuDNN and ATen's composite.

``attention(q, k, v, mask, causal, scale, tiles)`` is ``scaled_dot_product_attention`` without
dropout for ``[batch, heads, tokens, dim]`` operands (keys and values of the queries' heads), an
optional additive or boolean mask that broadcasts to ``[batch, heads, queries, keys]``, a causal
flag (top-left aligned, as SDPA's) and a scale (None: ``dim ** -0.5``). It returns the output, laid
out ``[batch, tokens, heads, dim]`` as the flash backends' is (so the usual transpose and reshape
after it is a view), and the rows' log-sum-exp. The kernel is ``attention_forward`` of
ops/attention_kernels.py, tiled by ``tiles`` (``TILE_KEYS``). No rule picks it: a graph holds it
only where the tuning database measured it faster than the rule's backend there, after checking
its result. CPU tensors (the interpreter in CI) run the same kernel through Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
import triton

from ember.runtime import precompile
from ember.runtime.kernels import load_module

ATTENTION_KERNELS = Path(__file__).with_name("attention_kernels.py")
DTYPES = (torch.float16, torch.bfloat16)
MAX_DIM = 256  # head dims up to this (one tile of them in registers)
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
# Query rows x keys per step, warps, stages: those of common Triton flash-attention tunings on sm80+.
_CONFIGS = ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3), (32, 64, 4, 2), (16, 64, 4, 2))


def takes(q: object, k: object, v: object, mask: object) -> bool:
    """Whether ``ember::attention`` computes this call: 4-D bf16/fp16 q, k, v of one dtype and
    device with static sizes, the queries' batch and heads in k and v, head dims up to MAX_DIM, and
    a mask (if any) of their device, boolean or floating, that broadcasts to the scores."""
    tensors = (q, k, v) + ((mask,) if mask is not None else ())
    if not all(isinstance(t, torch.Tensor) and all(type(s) is int for s in (*t.shape, *t.stride())) for t in tensors):
        return False
    if any(t.dim() != 4 for t in (q, k, v)) or q.dtype not in DTYPES or {k.dtype, v.dtype} != {q.dtype}:
        return False  # (and tensors, by the check above)
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3] or \
            max(q.shape[3], v.shape[3]) > MAX_DIM or min(*q.shape, k.shape[2]) < 1:
        return False
    if any(t.device != q.device for t in tensors[1:]):
        return False
    if mask is None:
        return True
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return (mask.dtype == torch.bool or mask.is_floating_point()) and mask.dim() <= 4 and \
        all(m in (1, s) for m, s in zip(mask.shape[::-1], scores[::-1]))


def _mask_strides(mask: torch.Tensor | None, scores: tuple[int, ...]) -> list[int]:
    """The mask's strides over the scores' four dims (0 where it broadcasts)."""
    if mask is None:
        return [0, 0, 0, 0]
    shape, strides = [1] * (4 - mask.dim()) + list(mask.shape), [0] * (4 - mask.dim()) + list(mask.stride())
    return [0 if size == 1 and full != 1 else stride for size, stride, full in zip(shape, strides, scores)]


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
            causal: bool, scale: float | None, tiles: list[int]) -> tuple[tuple[int, int], list, dict]:
    """(grid, integer arguments after the six pointers, launch meta) of one call."""
    meta = dict(zip(TILE_KEYS, tiles))
    batch, heads, lq, dim = q.shape
    lk, dv = k.shape[2], v.shape[3]
    ints = [heads, lq, lk, dim, dv, *q.stride(), *k.stride(), *v.stride(),
            *_mask_strides(mask, (batch, heads, lq, lk)), *out.stride()]
    meta.update(SCALE=float(scale) if scale is not None else dim ** -0.5,
                BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                MASK=0 if mask is None else 2 if mask.dtype == torch.bool else 1, CAUSAL=bool(causal))
    return (triton.cdiv(lq, meta["BLOCK_M"]), batch * heads), ints, meta


def _out(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, lq, _ = q.shape
    out = q.new_empty((batch, lq, heads, v.shape[3])).transpose(1, 2)  # heads inside tokens, as flash's
    return out, q.new_empty((batch, heads, lq), dtype=torch.float32)


def _kernels(interpret: bool) -> ModuleType:
    return load_module(ATTENTION_KERNELS, interpret)


@torch.library.custom_op("ember::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float | None, tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of attention without dropout with the tile configuration ``tiles``."""
    out, lse = _out(q, v)
    if out.numel():
        grid, ints, meta = _launch(q, k, v, mask, out, causal, scale, tiles)
        interpret = q.device.type != "cuda"
        mask_arg = mask if mask is not None else q
        _kernels(interpret).attention_forward[grid](q, k, v, mask_arg, out, lse, *ints, **meta, UPCAST=interpret)
    return out, lse


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
      scale: float | None, tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _out(q, v)


def candidates(lq: int, lk: int, top: int = 4) -> list[dict[str, int]]:
    """Up to ``top`` tile configurations, those whose blocks the tokens fill best first (a block of
    queries or keys mostly past the end is work thrown away)."""
    def waste(config: tuple[int, ...]) -> float:
        bm, bn = config[:2]
        return (triton.cdiv(lq, bm) * bm - lq) / lq + (triton.cdiv(lk, bn) * bn - lk) / lk
    return [dict(zip(TILE_KEYS, c)) for c in sorted(_CONFIGS, key=waste)[:top]]


def tiles_of(config: dict) -> list[int]:
    """``config``'s tiles in TILE_KEYS order; the first configuration's where it has none (a probe
    of the output's shape)."""
    return [int(config.get(key, default)) for key, default in zip(TILE_KEYS, _CONFIGS[0])]


def compile_jobs(gm: torch.fx.GraphModule) -> list[precompile.CompileJob]:
    """The kernels a graph's ``ember::attention`` calls launch, as compile jobs for the workers."""
    jobs = []
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.ember.attention.default):
        q, k, v, mask = (x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in node.args[:4])
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (q, k, v)):
            continue
        jobs.append(job(q, k, v, mask, *node.args[4:7]))
    return jobs


def job(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
        scale: float | None, tiles: list[int]) -> precompile.CompileJob:
    """The compile job of one call (the kernel specialises on its sizes and strides)."""
    out, lse = _out(q, v)  # (fake tensors in a graph's values: no memory)
    _, ints, meta = _launch(q, k, v, mask, out, causal, scale, tiles)
    pointers = [q.dtype, k.dtype, v.dtype, (mask if mask is not None else q).dtype, out.dtype, lse.dtype]
    return precompile.job_for(ATTENTION_KERNELS, "attention_forward", pointers + [precompile.int_arg(x) for x in ints],
                              {**meta, "UPCAST": False})
