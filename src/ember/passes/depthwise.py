"""Depthwise convolutions to Ember's Triton kernels (GPU targets, after the layout pass).

The rule (``takes``): a 4-D convolution with one filter per channel (``groups == C_in ==
C_out``), not transposed, whose activation is channels_last after the layout pass, in a dtype the
kernels take. Those run as ``ember::depthwise_conv2d`` and, in the backward, as
``ember::depthwise_conv2d_backward_input`` / ``_backward_weight`` plus a sum for the bias
gradient; every other convolution stays cuDNN's. Why (ops/depthwise_conv.py): cuDNN builds a
kernel for each NHWC depthwise shape at its first call, ~1.3 s per shape for forward and
backward on an H100, in every new process. NCHW depthwise convolutions already run ATen's own
kernels (no build) and are left alone. Off by default (``EMBER_DEPTHWISE=1`` turns it on): the
kernels are slower than cuDNN's once those are built (docs/compile_time.md).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ember.ops import depthwise_conv  # registers torch.ops.ember.depthwise_conv2d*
from ember.passes.graph_edit import add_node, fake_mode_of, fake_result, same_value

aten = torch.ops.aten


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def takes(x: object, weight: object, stride: list[int], padding: list[int], dilation: list[int],
          transposed: bool, output_padding: list[int], groups: int) -> bool:
    """Whether a convolution with these fake values and arguments runs as Ember's kernels."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous():
        return False
    return depthwise_conv.supported(x, weight, list(stride), list(padding), list(dilation), transposed,
                                    list(output_padding), groups)


def forward_to_ember(gm: fx.GraphModule, mode: object, node: fx.Node) -> bool:
    """``node`` (a convolution the rule takes) as ``ember::depthwise_conv2d``; False where it stays."""
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    if not takes(_val(x), _val(weight), stride, padding, dilation, transposed, output_padding, groups):
        return False
    args = (x, weight, bias, list(stride), list(padding), list(dilation))
    val = fake_result(mode, torch.ops.ember.depthwise_conv2d.default, args)
    if not same_value(val, node.meta.get("val")):
        return False
    with gm.graph.inserting_before(node):
        new = add_node(gm.graph, mode, torch.ops.ember.depthwise_conv2d.default, args, val=val)
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


def backward_to_ember(gm: fx.GraphModule, mode: object, node: fx.Node) -> bool:
    """``node`` (a convolution's backward the rule takes) as Ember's gradient kernels; False where it stays."""
    grad, x, weight, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = node.args
    if not takes(_val(x), _val(weight), stride, padding, dilation, transposed, output_padding, groups):
        return False
    users = list(node.users)
    if any(u.target is not operator.getitem or not mask[u.args[1]] for u in users):
        return False
    ops = torch.ops.ember
    x_val = _val(x)
    calls = {0: (ops.depthwise_conv2d_backward_input.default,
                 (grad, weight, list(x_val.shape), list(stride), list(padding), list(dilation))),
             1: (ops.depthwise_conv2d_backward_weight.default,
                 (grad, x, weight, list(stride), list(padding), list(dilation))),
             2: (aten.sum.dim_IntList, (grad, [0, 2, 3]))}
    # Only the gradients somebody reads, each with the layout the graph recorded for it.
    vals = {u.args[1]: fake_result(mode, *calls[u.args[1]]) for u in users}
    if any(not same_value(vals[u.args[1]], u.meta.get("val")) for u in users):
        return False
    made: dict[int, fx.Node] = {}
    with gm.graph.inserting_before(node):
        for index, val in vals.items():
            made[index] = add_node(gm.graph, mode, *calls[index], val=val)
    for user in users:
        made[user.args[1]].meta["stack_trace"] = node.meta.get("stack_trace")
        user.replace_all_uses_with(made[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return True


def generate_depthwise_convs(gm: fx.GraphModule) -> int:
    """Depthwise convolutions (forward and backward) the rule takes to Ember's kernels; returns
    how many (``ember.explain`` lists each as an Ember op with what runs behind it)."""
    mode = None
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.convolution.default,
                                                             aten.convolution_backward.default):
            continue
        if mode is None:
            mode = fake_mode_of(gm)
        done = (forward_to_ember if node.target is aten.convolution.default else backward_to_ember)(gm, mode, node)
        changed += done
    return changed
