"""One library call whose implementation may be chosen, described as data.

A ``LibrarySite`` is what the choice between implementations depends on: the op, the shapes,
strides and dtypes of its operands, its parameters, the elementwise epilogue the rule would fuse
and the device type. Its ``key`` (a hash of that description) is the tuning database's key for
the choice; ``impls`` are the implementations Ember can emit for it, the fixed rule's first:

  linear  onednn     mkldnn._linear_pointwise, epilogue (ReLU, GELU) fused as a oneDNN post-op (CPU)
          mkl        mkl._mkl_linear with the weight packed once (frozen); epilogue a separate kernel
          aten       addmm / mm as captured (MKL through ATen); epilogue a separate kernel
  conv    onednn     mkldnn._convolution_pointwise with the weight reordered once, post-ops fused
          aten       aten.convolution as captured; epilogue a separate kernel
  matmul  cublas     mm / addmm / bmm as captured (GPU code path, passes/gpu_library_choices.py)
          small_bmm  ember::small_bmm, where its rule takes the product
          tiled      ember::tiled_matmul with a tile configuration (the choice's ``config``)
          cublaslt   aten._addmm_activation: an addmm whose only reader is a ReLU (the site's
                     epilogue), the ReLU computed in cuBLASLt's epilogue
  conv, conv_backward (GPU code path: a depthwise convolution, its gradients)
          cudnn      aten.convolution / convolution_backward as captured
          ember      Ember's depthwise kernels (ops/depthwise_conv.py)
  attention (GPU code path, inference: the output alone read)
          the backend picked at capture first, then flash / efficient / cudnn / math (GPU), or
          flash_cpu / math (CPU tensors)

A pass asks a chooser (``Choose``) for each site; ``None`` keeps the rule. For a matmul site,
``x`` is the left operand, ``weight`` the right one and ``bias`` addmm's; for attention ``x``,
``weight``, ``other`` and ``bias`` are the queries, keys, values and mask.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

TensorSig = tuple[tuple[int, ...], tuple[int, ...], str]  # shape, stride, dtype name


def tensor_sig(val: torch.Tensor) -> TensorSig:
    return tuple(val.shape), tuple(val.stride()), str(val.dtype).removeprefix("torch.")


def _channels_last_sig(sig: TensorSig) -> TensorSig:
    shape, _, dtype = sig
    if len(shape) != 4:
        return sig
    n, c, h, w = shape
    return shape, (h * w * c, 1, w * c, c), dtype


@dataclass(frozen=True)
class LibrarySite:
    op: str  # "linear", "conv", "matmul", "conv_backward" or "attention"
    x: TensorSig
    weight: TensorSig
    bias: TensorSig | None
    # conv, conv_backward: (stride, padding, dilation, groups); linear, matmul: (); attention: (causal, scale)
    params: tuple
    # "none", "relu", "gelu:none", "gelu:tanh", "hardswish", ..., "add", "add+relu"; conv_backward:
    # the gradients asked for ("grads:input,weight")
    epilogue: str
    # the added tensor of an "add" epilogue; conv_backward: the gradient; attention: the values
    other: TensorSig | None = None
    x_is_graph_input: bool = False  # a convolution's input that keeps the caller's layout
    impls: tuple[str, ...] = ()
    device_type: str = "cpu"  # where the call runs ("cuda"; "cpu" for CPU tensors and the interpreter)

    def describe(self) -> dict:
        described = {"op": self.op, "x": self.x, "weight": self.weight, "bias": self.bias, "params": self.params,
                     "epilogue": self.epilogue, "other": self.other, "x_is_graph_input": self.x_is_graph_input}
        if self.gpu_code_path:  # ``{}`` in the database means the rule: a key per rule
            described.update(device_type=self.device_type, rule=self.impls[0])
        return described

    @property
    def gpu_code_path(self) -> bool:
        """A site of the GPU code path's passes (passes/gpu_library_choices.py), not a CPU library call's."""
        return self.op in ("matmul", "conv_backward", "attention") or self.impls[:1] == ("cudnn",)

    @property
    def key(self) -> str:
        """The tuning database's key of this choice (independent of which impls exist)."""
        text = json.dumps(self.describe(), sort_keys=True, default=list)
        return f"library-{self.op}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    @property
    def label(self) -> str:
        dtype = self.x[2]
        epi = "" if self.epilogue == "none" else f" +{self.epilogue}"
        if self.op == "matmul":
            bias = " +bias" if self.bias is not None else ""
            a, b = ("x".join(map(str, sig[0])) for sig in (self.x, self.weight))
            return f"{'bmm' if len(self.x[0]) == 3 else 'mm'} {a} @ {b}{bias} ({dtype}, rule {self.impls[0]})"
        if self.op == "attention":
            mask = f" mask {'x'.join(map(str, self.bias[0]))} {self.bias[2]}" if self.bias is not None else ""
            causal = " causal" if self.params[0] else ""
            return (f"attention q {'x'.join(map(str, self.x[0]))} kv {'x'.join(map(str, self.weight[0]))}{mask}"
                    f"{causal} ({dtype}, rule {self.impls[0]})")
        if self.op == "linear":
            (m, k), n = self.x[0], self.weight[0][0]
            return f"linear {m}x{k}->{n}{epi} ({dtype})"
        shape = "x".join(map(str, self.x[0]))
        co, _, kh, kw = self.weight[0]
        stride, _, _, groups = self.params
        extra = f" s{stride[0]}" + (f" g{groups}" if groups != 1 else "")
        if self.op == "conv_backward":
            return f"conv backward {shape} {kh}x{kw}->{co}{extra} {self.epilogue.removeprefix('grads:')} ({dtype})"
        return f"conv {shape} {kh}x{kw}->{co}{extra}{epi} ({dtype})"

    def measured_x(self) -> TensorSig:
        """The input layout the program will feed: a convolution's input inside a network is
        channels_last (oneDNN's convolutions return it), whatever the captured strides say."""
        if self.op == "conv" and not self.x_is_graph_input and not self.gpu_code_path:
            return _channels_last_sig(self.x)
        return self.x  # (a GPU site's strides are those its pass laid out)

    def measured_other(self) -> TensorSig | None:
        if self.other is not None and self.op == "conv" and not self.gpu_code_path:
            return _channels_last_sig(self.other)
        return self.other


@dataclass(frozen=True)
class LibraryChoice:
    """A tuned answer for a site: the implementation and its whole configuration (a tiled
    kernel's tile sizes beside ``impl``)."""

    impl: str
    config: dict
    # Called by a pass that could not apply the answer at one site (its result planned in other
    # strides), so that explain does not list a choice the program does not run.
    declined: Callable[[], None] | None = field(default=None, compare=False)


# A chooser: the tuned choice for a site, or None for the fixed rule.
Choose = Callable[[LibrarySite], "LibraryChoice | None"]
