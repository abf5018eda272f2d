"""Library-vs-generated-vs-fallback decisions, as explicit rules over ATen ops.

Each call_function node gets exactly one ``OpClass``. The scheduler groups POINTWISE,
REDUCTION and fusable VIEW nodes into Fused kernels; EXTERN nodes become library calls;
FALLBACK nodes run as ATen ops, each with the reason it was not lowered.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ember.schedule.op_support import FUSABLE_DTYPES, POINTWISE_OPS, pointwise_supported
from ember.schedule.range_select import RANGE_SELECT_OPS, range_select_supported

aten = torch.ops.aten
prims = torch.ops.prims


class OpClass(enum.Enum):
    EXTERN = "library"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    VIEW = "view"
    CONSTANT = "constant"
    GETITEM = "getitem"
    FROZEN = "frozen"  # computed from parameters only, once per parameter version (passes/freeze.py)
    FALLBACK = "fallback"


# Library calls: cuBLAS / cuDNN / flash attention through ATen; the kernel vendors beat us here.
EXTERN_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._addmm_activation.default,  # an activation in cuBLASLt's epilogue (passes/gpu_library_choices.py)
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    # oneDNN convolution / linear with fused epilogues (passes/cpu_library.py)
    torch.ops.mkldnn._convolution_pointwise.default, torch.ops.mkldnn._convolution_pointwise.binary,
    torch.ops.mkldnn._linear_pointwise.default,
}
if torch.backends.mkl.is_available():  # MKL's packed GEMM, a tuned choice for linear layers (passes/cpu_library.py)
    EXTERN_OPS.add(torch.ops.mkl._mkl_linear.default)

REDUCTION_OPS = {aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.mean.dim, aten.sum.default}

# Views the fuser can follow inside a kernel (they only rename, insert or drop size-1 dims,
# permute or broadcast); any other view runs as a zero-copy ATen view of a materialised buffer.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.expand.default, aten.alias.default, aten.t.default, aten.transpose.int,
    aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.unfold.default,
    aten.diagonal.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
    aten.chunk.default, aten.narrow.default, aten.view_as_real.default, aten.view_as_complex.default,
}

CONSTANT_OPS = {
    aten.full.default, aten.scalar_tensor.default, aten.full_like.default, aten.zeros_like.default,
    aten.ones_like.default, aten.zeros.default, aten.ones.default,
}

RANDOM_OPS = {
    aten.native_dropout.default, aten.bernoulli.p, aten.bernoulli.default, aten.rand.default,
    aten.rand_like.default, aten.randn.default, aten.randn_like.default, aten.randint.low,
    aten.uniform.default, aten.normal.Tensor_float, aten.randperm.default,
}

# Activations the CPU inference decomposition keeps whole (capture/decompositions.py).
KEPT_WHOLE_ON_CPU = {aten.gelu.default, aten.hardswish.default, aten.hardsigmoid.default, aten.silu.default}

@dataclass(frozen=True)
class Classification:
    cls: OpClass
    reason: str = ""


def node_value(node: fx.Node) -> object:
    return node.meta.get("val", None)


def _tensor_ok(value: object) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype in FUSABLE_DTYPES
            and not value.is_sparse and value.layout == torch.strided)


def _has_symbolic_shape(value: object) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return any(not isinstance(s, int) for s in value.shape) or any(not isinstance(s, int) for s in value.stride())


def _widening_sum(node: fx.Node, dtype: torch.dtype) -> bool:
    """A float32 (or same-dtype) reduction of a float tensor: what the kernels do anyway (they load
    half inputs as float32 and accumulate there). CUDA autocast gives every ``sum`` this dtype."""
    src = node_value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if not isinstance(src, torch.Tensor):
        return False
    return dtype == src.dtype or (dtype == torch.float32 and src.dtype in (torch.float16, torch.bfloat16))


def classify(node: fx.Node) -> Classification:
    """The one rule that decides how ``node`` is executed."""
    target = node.target
    if node.meta.get("ember_frozen"):
        return Classification(OpClass.FROZEN)
    if target is operator.getitem:
        return Classification(OpClass.GETITEM)
    if target in EXTERN_OPS:
        return Classification(OpClass.EXTERN)
    value = node_value(node)
    if _has_symbolic_shape(value):
        return Classification(OpClass.FALLBACK, "symbolic shape")
    if target in VIEW_OPS:
        return Classification(OpClass.VIEW)
    if target in RANDOM_OPS:
        return Classification(OpClass.FALLBACK, "random op: runs through ATen to share eager's RNG stream")
    tensor_inputs = [a for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]
    inputs_ok = all(_tensor_ok(node_value(a)) for a in tensor_inputs)
    if target in CONSTANT_OPS:
        if _tensor_ok(value):
            return Classification(OpClass.CONSTANT)
        return Classification(OpClass.FALLBACK, "constant of unsupported dtype/layout")
    if target in REDUCTION_OPS:
        if not (_tensor_ok(value) and inputs_ok):
            return Classification(OpClass.FALLBACK, "reduction over unsupported dtype")
        dtype = node.kwargs.get("dtype")
        if dtype is not None and not _widening_sum(node, dtype):
            return Classification(OpClass.FALLBACK, "reduction with explicit dtype")
        return Classification(OpClass.REDUCTION)
    if target in POINTWISE_OPS:
        if not (_tensor_ok(value) and inputs_ok):
            return Classification(OpClass.FALLBACK, "pointwise op over unsupported dtype/layout")
        why = pointwise_supported(node)
        if why:
            return Classification(OpClass.FALLBACK, why)
        return Classification(OpClass.POINTWISE)
    if target in RANGE_SELECT_OPS:
        # cat / slice_scatter: pointwise selects of shifted loads (schedule/range_select.py); the
        # planner keeps them on ATen where the target or the fuse_cat option says so.
        why = range_select_supported(node, _tensor_ok)
        return Classification(OpClass.FALLBACK, why) if why else Classification(OpClass.POINTWISE)
    name = getattr(target, "__name__", str(target))
    if getattr(target, "namespace", None) == "ember":
        return Classification(OpClass.FALLBACK, EMBER_OPS.get(name.split(".")[0], f"Ember's custom op {name}"))
    if target is aten.copy_.default and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder":
        return Classification(OpClass.FALLBACK, "writes a graph input (a kept input mutation: batch norm's running "
                                                "statistics, a buffer update); ATen's copy_ unless the kernel that "
                                                "computes the value stores it there (codegen/input_writes.py)")
    if target in KEPT_WHOLE_ON_CPU:
        return Classification(OpClass.FALLBACK, "kept whole for CPU inference: a oneDNN post-op after a convolution "
                                                "or linear layer, ATen's vectorised kernel elsewhere")
    return Classification(OpClass.FALLBACK, f"no Ember lowering for {name}")


# Ember's custom ops (opaque to the planner; each runs one kernel) and what runs behind them.
EMBER_OPS = {
    "attention_seeds": "memory-efficient attention's dropout seed and offset, on the host uncaptured and on the "
                       "device under CUDA-graph capture (passes/attention_seeds.py)",
    "upsample_nearest": "ATen's kernel behind Ember's custom op upsample_nearest (ops/upsample.py)",
    "upsample_nearest_backward": "ATen's kernel behind Ember's custom op upsample_nearest_backward "
                                 "(ops/upsample.py)",
    "max_pool2d": "Ember's Triton kernel for overlapping max-pool windows, int8 positions (ops/max_pool.py)",
    "max_pool2d_backward": "Ember's Triton gather kernel for the max-pool gradient (ops/max_pool.py)",
    "depthwise_conv2d": "Ember's Triton kernel for a depthwise convolution, NHWC (ops/depthwise_conv.py)",
    "depthwise_conv2d_backward_input": "Ember's Triton gather kernel for a depthwise convolution's input gradient "
                                       "(ops/depthwise_conv.py)",
    "depthwise_conv2d_backward_weight": "Ember's Triton kernel for a depthwise convolution's weight gradient, "
                                        "per-chunk sums without atomics (ops/depthwise_conv.py)",
    "reflection_pad2d": "Ember's Triton gather kernel for reflection padding (ops/reflection_pad.py)",
    "small_bmm": "Ember's Triton kernel for batched products of small matrices cuBLAS cannot load in vectors "
                 "(ops/small_bmm.py, passes/small_bmm.py)",
    "tiled_matmul": "Ember's tiled Triton matmul with a tuned tile configuration, where `ember tune` measured it "
                    "faster than the rule's implementation (ops/tiled_matmul.py, passes/gpu_library_choices.py)",
    "attention": "Ember's Triton attention kernel (online softmax, the scores kept on chip) with a tuned tile "
                 "configuration, where `ember tune` measured it faster than the rule's SDPA backend "
                 "(ops/attention.py, passes/gpu_library_choices.py)",
    "pad_zeros": "a copy into a zero-padded buffer in the source's layout, for an aligned matmul "
                 "(ops/pad_zeros.py, passes/pad_matmul.py)",
    "rnn": "ATen's RNN (cuDNN's LSTM / GRU on the GPU, oneDNN's on the CPU) as one call, for a long recurrence "
           "in an inference graph (ops/rnn.py)",
    "reflection_pad2d_backward": "Ember's Triton gather kernel for the reflection-padding gradient, no atomics "
                                 "(ops/reflection_pad.py)",
}


def constant_value(node: fx.Node) -> bool | int | float:
    """The fill value of a CONSTANT node, as a Python scalar of the node's dtype kind."""
    target, args = node.target, node.args
    if target in (aten.full.default, aten.full_like.default):
        value = args[1]
    elif target == aten.scalar_tensor.default:
        value = args[0]
    elif target in (aten.zeros_like.default, aten.zeros.default):
        value = 0
    else:
        value = 1
    dtype = node.meta["val"].dtype
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


# A scale a reduction's result may get and still be one ATen reduction (mean is sum / n).
_SCALES = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar}


def lone_reduction(group: object) -> str:
    """Why a fused group is better left to ATen on the CPU target ("" when it is not).

    A group that only reduces a buffer made elsewhere (a library call's output, a graph input),
    at most scaling the result by a number (``mean``), fuses nothing: ATen's own reduction makes
    the same single pass over memory. A generated kernel for it would still cost numba's import
    and set-up in every new process (~0.4 s on a 2-core CPU) and a numba compile on a cold start;
    for a network whose other work all goes to oneDNN (a CNN's global average pool after its last
    convolution), that is most of a warm first call."""
    members = [n for n in group.nodes if group.classes.get(n) != OpClass.VIEW]
    if getattr(group, "selects", None) or not members:
        return ""
    first, rest = members[0], members[1:]
    if group.classes.get(first) != OpClass.REDUCTION or not isinstance(first.args[0], fx.Node):
        return ""
    if first.args[0] in group.nodes:  # something is fused into the reduction's input
        return ""
    for node in rest:
        numbers = [a for a in node.args[1:] if isinstance(a, (int, float))]
        if node.target not in _SCALES or len(numbers) != len(node.args) - 1:
            return ""
    return ("a lone reduction of a buffer made elsewhere: ATen's reduction is the same single pass, "
            "without a generated kernel's load cost in every new process")
