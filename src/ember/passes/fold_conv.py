"""Fold per-channel affine chains (inference batch norm, scales, biases) into convolutions.

An inference batch norm reaches the graph as ``(conv - mean) * invstd * weight + bias`` with
every operand a per-output-channel tensor computed from parameters (frozen, see
``passes.freeze``). Any such chain of add/sub/mul/div by frozen per-channel tensors or Python
numbers is ``conv * alpha + beta``, which equals a convolution with weight ``W * alpha`` and
bias ``b * alpha + beta``. The new weight and bias are frozen nodes: the program computes them
once per parameter version instead of normalising every activation on every call.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.passes.freeze import is_frozen
from ember.passes.graph_edit import add_node, fake_mode_of

aten = torch.ops.aten

_AFFINE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def _per_channel(operand: object, channels: int, rank: int, dtype: torch.dtype) -> bool:
    """A frozen tensor broadcasting along the channel dim only (or a plain number)."""
    if isinstance(operand, bool):
        return False
    if isinstance(operand, (int, float)):
        return True
    if not is_frozen(operand):
        return False
    val = operand.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != dtype or val.dim() > rank:
        return False
    off = rank - val.dim()
    return all(size == 1 or (j + off == 1 and size == channels) for j, size in enumerate(val.shape))


class _Affine:
    """``alpha`` and ``beta`` of ``y = conv * alpha + beta`` as frozen nodes, built step by step."""

    def __init__(self, graph: fx.Graph, mode: object, channels: int) -> None:
        self.graph, self.mode, self.c = graph, mode, channels
        self.alpha: fx.Node | None = None
        self.beta: fx.Node | None = None

    def op(self, target: object, a: object, b: object) -> fx.Node:
        return add_node(self.graph, self.mode, target, (a, b), frozen=True)

    def vector(self, operand: object) -> object:
        if not isinstance(operand, fx.Node):
            return operand
        flat = add_node(self.graph, self.mode, aten.reshape.default, (operand, [-1]), frozen=True)
        if flat.meta["val"].numel() == self.c:
            return flat
        return add_node(self.graph, self.mode, aten.expand.default, (flat, [self.c]), frozen=True)

    def scale(self, factor: object, divide: bool = False) -> None:
        mul = aten.div.Tensor if divide else aten.mul.Tensor
        if self.alpha is None:
            one = add_node(self.graph, self.mode, aten.ones.default, ([self.c],),
                           {"dtype": self.dtype, "device": self.device}, frozen=True)
            self.alpha = self.op(mul, one, factor)
        else:
            self.alpha = self.op(mul, self.alpha, factor)
        if self.beta is not None:
            self.beta = self.op(mul, self.beta, factor)

    def shift(self, term: object, negate_term: bool = False) -> None:
        if self.beta is None:
            zero = add_node(self.graph, self.mode, aten.zeros.default, ([self.c],),
                            {"dtype": self.dtype, "device": self.device}, frozen=True)
            self.beta = zero
        self.beta = self.op(aten.sub.Tensor if negate_term else aten.add.Tensor, self.beta, term)


def fold_conv_affine(gm: fx.GraphModule) -> int:
    """Fold chains of per-channel add/sub/mul/div after a frozen-weight convolution into it."""
    mode = fake_mode_of(gm)
    if mode is None:
        return 0
    graph = gm.graph
    folded = 0
    for conv in list(graph.nodes):
        if conv.op != "call_function" or conv.target != aten.convolution.default:
            continue
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = conv.args
        if transposed or not is_frozen(weight) or (bias is not None and not is_frozen(bias)):
            continue
        out = conv.meta["val"]
        if out.dim() < 3 or not out.dtype.is_floating_point:
            continue
        chain: list[tuple[fx.Node, object]] = []
        cur = conv
        while len(cur.users) == 1:
            user = next(iter(cur.users))
            if user.target not in _AFFINE or len(user.args) != 2 or user.kwargs:
                break
            a, b = user.args
            if (a is cur) == (b is cur) or user.meta["val"].dtype != out.dtype:
                break
            other = b if a is cur else a
            if not _per_channel(other, out.shape[1], out.dim(), out.dtype):
                break
            chain.append((user, other))
            cur = user
        if not chain:
            continue
        with graph.inserting_before(cur):
            aff = _Affine(graph, mode, out.shape[1])
            aff.dtype, aff.device = out.dtype, out.device
            for user, other in chain:
                vec = aff.vector(other)
                conv_first = user.args[0] is not other
                if user.target == aten.add.Tensor:
                    aff.shift(vec)
                elif user.target == aten.sub.Tensor:
                    if conv_first:
                        aff.shift(vec, negate_term=True)
                    else:  # other - y  =  y * -1 + other
                        aff.scale(-1.0)
                        aff.shift(vec)
                elif user.target == aten.mul.Tensor:
                    aff.scale(vec)
                elif conv_first:
                    aff.scale(vec, divide=True)
                else:
                    break  # other / y is not affine in y
            else:
                new_w, new_b = weight, bias
                if aff.alpha is not None:
                    shape = [out.shape[1]] + [1] * (weight.meta["val"].dim() - 1)
                    col = add_node(graph, mode, aten.reshape.default, (aff.alpha, shape), frozen=True)
                    new_w = add_node(graph, mode, aten.mul.Tensor, (weight, col), frozen=True)
                    if new_b is not None:
                        new_b = add_node(graph, mode, aten.mul.Tensor, (new_b, aff.alpha), frozen=True)
                if aff.beta is not None:
                    new_b = aff.beta if new_b is None else add_node(graph, mode, aten.add.Tensor,
                                                                    (new_b, aff.beta), frozen=True)
                new_conv = add_node(graph, mode, aten.convolution.default,
                                    (x, new_w, new_b, stride, padding, dilation, transposed,
                                     output_padding, groups))
                cur.replace_all_uses_with(new_conv)
                for user, _ in reversed(chain):
                    graph.erase_node(user)
                graph.erase_node(conv)
                folded += 1
    return folded
