"""Depthwise convolution through Ember's own Triton kernels (GPU targets).

MobileNet's, EfficientNet's and ConvNeXt's depthwise convolutions (one filter per channel,
``groups == in_channels == out_channels``) are memory-bound, and cuDNN (9.19, H100) has no
ready kernel for them in NHWC bf16: the first call of each shape builds one, about 0.4 s for the
forward and 0.9 s for the backward. mobilenet_v3 has 12 such shapes, so 10 of the 13 s of its
training step's warm first call went there, and the same in every new process (Inductor calls
the same cuDNN kernels). NCHW tensors take ATen's own depthwise kernels (no build, but 3x
slower at batch 128). These kernels compile ahead in the compile workers and come from Triton's
cache in later processes.

``ember::depthwise_conv2d`` is the forward (bias added in float32 before rounding), ``ember::depthwise_conv2d_backward_input`` a gather over the taps that read each
input element, ``ember::depthwise_conv2d_backward_weight`` per-chunk float32 partial sums over
the output positions, summed by ATen afterwards (no atomics, so the result does not depend on
scheduling). Which convolutions take them: ``passes/depthwise.py``. CPU tensors (the interpreter
in CI) run the same kernels through Triton's interpreter.
"""

from __future__ import annotations

import math

import torch
import triton

from ember.ops.windows import KERNEL_DTYPES, WINDOW_KERNELS, empty_like_layout, window_kernels
from ember.runtime import precompile

MAX_TAPS = 64  # a 7x7 window (ConvNeXt) fits; the weight kernel keeps TAPS x BLOCK_C sums
TILE = 2048  # BLOCK_P * BLOCK_C: output elements per program
TARGET_PROGRAMS = 1056  # weight-gradient chunks x channel blocks: 8 per SM on an H100
WEIGHT_TILE = 4096  # TAPS * BLOCK_P * BLOCK_C of the weight-gradient kernel


def supported(x: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> bool:
    """Whether a convolution is depthwise in a form these kernels take."""
    if x.dim() != 4 or weight.dim() != 4 or transposed or any(output_padding):
        return False
    c = x.shape[1]
    kh, kw = weight.shape[2], weight.shape[3]
    return (groups == c and weight.shape[0] == c and weight.shape[1] == 1 and c > 1
            and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype
            and len(stride) == 2 and len(padding) == 2 and len(dilation) == 2
            and min(stride) >= 1 and min(dilation) >= 1 and min(padding) >= 0
            and kh * kw <= MAX_TAPS and 0 < x.numel() < 2**31
            and x.shape[2] + 2 * padding[0] >= dilation[0] * (kh - 1) + 1
            and x.shape[3] + 2 * padding[1] >= dilation[1] * (kw - 1) + 1)


def output_size(x_size: list[int], weight_size: list[int], stride: list[int], padding: list[int],
                dilation: list[int]) -> list[int]:
    n, c, h, w = x_size
    kh, kw = weight_size[2], weight_size[3]
    return [n, c, (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1,
            (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1]


def blocks(c: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C): up to 64 channels per program, the rest of the tile in positions."""
    block_c = min(64, triton.next_power_of_2(c))
    return TILE // block_c, block_c


def _meta(weight_size: list[int], stride: list[int], padding: list[int], dilation: list[int],
          c: int) -> dict[str, int]:
    block_p, block_c = blocks(c)
    return {"KH": weight_size[2], "KW": weight_size[3], "SH": stride[0], "SW": stride[1], "PH": padding[0],
            "PW": padding[1], "DH": dilation[0], "DW": dilation[1], "BLOCK_P": block_p, "BLOCK_C": block_c}


def vec(*tensors: torch.Tensor) -> int:
    """The largest power of two dividing every position offset of these NHWC tensors, below 16:
    the kernels' alignment hint (1: none; Triton knows divisibility by 16 of its integer
    arguments itself, and a channel stride other than 1 gets no vector loads anyway)."""
    out = 16
    for t in tensors:
        if t.stride(1) != 1 and t.shape[1] > 1:
            return 1
        for d in (0, 2, 3):
            if t.shape[d] > 1:
                out = math.gcd(out, t.stride(d))
    return 1 if out == 16 else out & -out


def _interpret(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def _grid(positions: int, c: int) -> tuple[int, int]:
    block_p, block_c = blocks(c)
    return triton.cdiv(positions, block_p), triton.cdiv(c, block_c)


def _forward_ints(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> list[int]:
    n, c, oh, ow = y.shape
    return [n * oh * ow, c, x.shape[2], x.shape[3], oh, ow, *x.stride(), weight.stride(0), weight.stride(2),
            weight.stride(3), *y.stride()]


@torch.library.custom_op("ember::depthwise_conv2d", mutates_args=())
def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                     padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The depthwise convolution of ``x`` (N, C, H, W) with ``weight`` (C, 1, KH, KW) and an optional
    ``bias`` (C), in ``x``'s memory format."""
    y = empty_like_layout(tuple(output_size(list(x.shape), list(weight.shape), stride, padding, dilation)), x, x.dtype)
    if y.numel():
        interpret = _interpret(x)
        window_kernels(interpret).depthwise_forward[_grid(y.shape[0] * y.shape[2] * y.shape[3], y.shape[1])](
            x, weight, weight if bias is None else bias, y, *_forward_ints(x, weight, y),
            **_meta(list(weight.shape), stride, padding, dilation, x.shape[1]), HAS_BIAS=bias is not None,
            ROUND_BF16=interpret and y.dtype == torch.bfloat16, VEC=vec(x, y))
    return y


@depthwise_conv2d.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int]) -> torch.Tensor:
    return empty_like_layout(tuple(output_size(list(x.shape), list(weight.shape), stride, padding, dilation)), x, x.dtype)


def _backward_input_ints(grad: torch.Tensor, weight: torch.Tensor, dx: torch.Tensor) -> list[int]:
    n, c, h, w = dx.shape
    return [n * h * w, c, h, w, grad.shape[2], grad.shape[3], *grad.stride(), weight.stride(0), weight.stride(2),
            weight.stride(3), *dx.stride()]


@torch.library.custom_op("ember::depthwise_conv2d_backward_input", mutates_args=())
def depthwise_conv2d_backward_input(grad: torch.Tensor, weight: torch.Tensor, input_size: list[int],
                                    stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The input gradient of ``depthwise_conv2d``, in the output gradient's memory format."""
    dx = empty_like_layout(tuple(input_size), grad, grad.dtype)
    if dx.numel():
        interpret = _interpret(grad)
        window_kernels(interpret).depthwise_backward_input[_grid(dx.shape[0] * dx.shape[2] * dx.shape[3], dx.shape[1])](
            grad, weight, dx, *_backward_input_ints(grad, weight, dx),
            **_meta(list(weight.shape), stride, padding, dilation, dx.shape[1]),
            ROUND_BF16=interpret and dx.dtype == torch.bfloat16, VEC=vec(grad, dx))
    return dx


@depthwise_conv2d_backward_input.register_fake
def _(grad: torch.Tensor, weight: torch.Tensor, input_size: list[int], stride: list[int], padding: list[int],
      dilation: list[int]) -> torch.Tensor:
    return empty_like_layout(tuple(input_size), grad, grad.dtype)


def weight_blocks(c: int, taps: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of the weight-gradient kernel."""
    block_c = blocks(c)[1]  # the forward's channel block
    return max(1, WEIGHT_TILE // (taps * block_c)), block_c


def weight_chunks(positions: int, c: int, taps: int) -> tuple[int, int]:
    """(chunks, tiles per chunk) of the weight gradient's reduction over the output positions:
    enough programs to fill the GPU, each summing whole tiles."""
    block_p, block_c = weight_blocks(c, taps)
    tiles = triton.cdiv(positions, block_p)
    chunks = max(1, min(tiles, TARGET_PROGRAMS // triton.cdiv(c, block_c)))
    per_chunk = triton.cdiv(tiles, chunks)
    return triton.cdiv(tiles, per_chunk), per_chunk


def _taps(weight_size: list[int]) -> int:
    return triton.next_power_of_2(weight_size[2] * weight_size[3])


def _weight_meta(weight_size: list[int], stride: list[int], padding: list[int],
                 dilation: list[int]) -> dict[str, int]:
    taps = _taps(weight_size)
    block_p, block_c = weight_blocks(weight_size[0], taps)
    return {**_meta(weight_size, stride, padding, dilation, weight_size[0]), "TAPS": taps, "BLOCK_P": block_p,
            "BLOCK_C": block_c}


def _backward_weight_ints(grad: torch.Tensor, x: torch.Tensor, per_chunk: int) -> list[int]:
    n, c, oh, ow = grad.shape
    return [n * oh * ow, c, x.shape[2], x.shape[3], oh, ow, per_chunk, *grad.stride(), *x.stride()]


@torch.library.custom_op("ember::depthwise_conv2d_backward_weight", mutates_args=())
def depthwise_conv2d_backward_weight(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                     stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The weight gradient of ``depthwise_conv2d``, shaped and typed like ``weight``, in ``x``'s memory
    format (as ATen's convolution_backward returns it)."""
    weight_size = list(weight.shape)
    c, _, kh, kw = weight_size
    positions = grad.shape[0] * grad.shape[2] * grad.shape[3]
    taps = _taps(weight_size)
    chunks, per_chunk = weight_chunks(positions, c, taps)
    part = torch.empty((chunks, taps, c), dtype=torch.float32, device=grad.device)
    if positions:
        block_c = weight_blocks(c, taps)[1]
        window_kernels(_interpret(grad)).depthwise_backward_weight[(chunks, triton.cdiv(c, block_c))](
            grad, x, part, *_backward_weight_ints(grad, x, per_chunk),
            **_weight_meta(weight_size, stride, padding, dilation), VEC=vec(grad, x))
    else:
        part.zero_()
    out = empty_like_layout(tuple(weight_size), x, weight.dtype)
    out.copy_(part.sum(0)[: kh * kw].t().reshape(weight_size))
    return out


@depthwise_conv2d_backward_weight.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int],
      dilation: list[int]) -> torch.Tensor:
    return empty_like_layout(tuple(weight.shape), x, weight.dtype)


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def compile_jobs(gm: torch.fx.GraphModule) -> list[precompile.CompileJob]:
    """The depthwise kernels a graph launches, as compile jobs for the workers: the kernels
    specialise on their integer arguments (sizes and strides), so each job carries the values the
    launch will pass."""
    jobs = []
    ops = torch.ops.ember
    for node in gm.graph.find_nodes(op="call_function", target=ops.depthwise_conv2d.default):
        (x, weight, bias), y = (_val(a) for a in node.args[:3]), node.meta.get("val")
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (x, weight, y)):
            continue
        ints = _forward_ints(x, weight, y)
        b_dtype = weight.dtype if bias is None else bias.dtype
        jobs.append(precompile.job_for(WINDOW_KERNELS, "depthwise_forward",
                                       [x.dtype, weight.dtype, b_dtype, y.dtype, *map(precompile.int_arg, ints)],
                                       {**_meta(list(weight.shape), *node.args[3:6], x.shape[1]),
                                        "HAS_BIAS": bias is not None, "ROUND_BF16": False, "VEC": vec(x, y)}))
    for node in gm.graph.find_nodes(op="call_function", target=ops.depthwise_conv2d_backward_input.default):
        grad, weight, dx = _val(node.args[0]), _val(node.args[1]), node.meta.get("val")
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (grad, weight, dx)):
            continue
        ints = _backward_input_ints(grad, weight, dx)
        jobs.append(precompile.job_for(WINDOW_KERNELS, "depthwise_backward_input",
                                       [grad.dtype, weight.dtype, dx.dtype, *map(precompile.int_arg, ints)],
                                       {**_meta(list(weight.shape), *node.args[3:6], dx.shape[1]), "ROUND_BF16": False,
                                        "VEC": vec(grad, dx)}))
    for node in gm.graph.find_nodes(op="call_function", target=ops.depthwise_conv2d_backward_weight.default):
        grad, x, weight = (_val(a) for a in node.args[:3])
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in (grad, x, weight)):
            continue
        weight_size = list(weight.shape)
        _, per_chunk = weight_chunks(grad.shape[0] * grad.shape[2] * grad.shape[3], weight_size[0], _taps(weight_size))
        ints = _backward_weight_ints(grad, x, per_chunk)
        jobs.append(precompile.job_for(WINDOW_KERNELS, "depthwise_backward_weight",
                                       [grad.dtype, x.dtype, torch.float32, *map(precompile.int_arg, ints)],
                                       {**_weight_meta(weight_size, *node.args[3:6]), "VEC": vec(grad, x)}))
    return jobs
