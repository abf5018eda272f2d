"""Tuned library choices on the GPU code path: per site, the library call or Ember's kernel.

Matmuls: every ``mm``, ``addmm`` (a bias with one value per column), ``bmm`` and
``ember::small_bmm`` left by the passes before this one, with bf16/fp16 operands of static sizes,
is a ``LibrarySite`` ("matmul"). Its first implementation is what the rules produced (``cublas``,
or ``small_bmm`` where that rule took the product); the others are ``cublas`` and ``tiled``
(``ember::tiled_matmul`` with a tile configuration).

Depthwise convolutions: every ``aten.convolution`` / ``convolution_backward`` that Ember's
depthwise kernels take (passes/depthwise.py's rule) and cuDNN runs, is a site ("conv" /
"conv_backward") whose implementations are ``cudnn`` (the rule) and ``ember``. Where
``EMBER_DEPTHWISE=1`` already gave them to Ember's kernels, they are not sites.

Each site is offered to the tuning database's chooser; a tuned answer replaces the node, no answer
keeps the rule's. Runs last among the GPU passes, so the calls it sees are those the program
would run (padded, merged, laid out channels_last, or Ember's small products).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ember.ops import tiled_matmul
from ember.passes import depthwise
from ember.passes.graph_edit import add_node, fake_mode_of, node_val
from ember.passes.library_sites import Choose, LibraryChoice, LibrarySite, tensor_sig

aten = torch.ops.aten
_PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _operands(node: fx.Node) -> tuple[object, object, object] | None:
    """(a, b, bias) of a product this pass may replace, or None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.addmm.default:
        return (node.args[1], node.args[2], node.args[0]) if len(node.args) == 3 else None
    if node.target in (aten.mm.default, aten.bmm.default, torch.ops.ember.small_bmm.default):
        return (node.args[0], node.args[1], None) if len(node.args) == 2 else None
    return None


def matmul_site(node: fx.Node, device_type: str) -> LibrarySite | None:
    """The site of one product, or None where only its rule's implementation may run."""
    operands = _operands(node)
    if operands is None:
        return None
    a, b, bias = (node_val(x) for x in operands)
    out = node_val(node)
    if not tiled_matmul.takes(a, b, bias) or not isinstance(out, torch.Tensor) or not out.is_contiguous():
        return None
    rule = "small_bmm" if node.target is torch.ops.ember.small_bmm.default else "cublas"
    impls = (rule, "tiled") if rule == "cublas" else (rule, "cublas", "tiled")
    return LibrarySite("matmul", tensor_sig(a), tensor_sig(b), tensor_sig(bias) if bias is not None else None, (),
                       "none", impls=impls, device_type=device_type)


_GRADS = ("input", "weight", "bias")


def conv_site(node: fx.Node, device_type: str) -> LibrarySite | None:
    """The site of a depthwise convolution or its backward that cuDNN runs and Ember's kernels
    take, or None."""
    if node.target is aten.convolution.default:
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
        op, grad, grads = "conv", None, "none"
    elif node.target is aten.convolution_backward.default:
        grad, x, weight, _, stride, padding, dilation, transposed, output_padding, groups, mask = node.args
        bias = None
        users = list(node.users)
        if not users or any(u.target is not operator.getitem or not mask[u.args[1]] for u in users):
            return None
        op, grads = "conv_backward", "grads:" + ",".join(_GRADS[i] for i in sorted({u.args[1] for u in users}))
    else:
        return None
    if not depthwise.takes(node_val(x), node_val(weight), stride, padding, dilation, transposed, output_padding,
                           groups):
        return None
    vals = [node_val(t) for t in (weight, bias, grad) if t is not None]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    sig = {name: tensor_sig(node_val(t)) if t is not None else None for name, t in
           (("bias", bias), ("grad", grad))}
    params = (tuple(stride), tuple(padding), tuple(dilation), groups)
    return LibrarySite(op, tensor_sig(node_val(x)), tensor_sig(node_val(weight)), sig["bias"], params, grads,
                       other=sig["grad"], impls=("cudnn", "ember"), device_type=device_type)


def _replace_product(gm: fx.GraphModule, mode: object, node: fx.Node, site: LibrarySite,
                     choice: LibraryChoice) -> bool:
    a, b, bias = _operands(node)  # type: ignore[misc]
    with gm.graph.inserting_before(node):
        if choice.impl == "tiled":
            new = add_node(gm.graph, mode, torch.ops.ember.tiled_matmul.default,
                           (a, b, bias, tiled_matmul.tiles_of(choice.config)))
        else:  # cuBLAS where the small-product rule took it
            new = add_node(gm.graph, mode, aten.bmm.default, (a, b))
    old = node_val(node)
    val = new.meta["val"]
    if val.shape != old.shape or val.stride() != old.stride() or val.dtype != old.dtype:
        gm.graph.erase_node(new)  # planned for other strides: keep the rule's product
        return False
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


def choose_gpu_library_implementations(gm: fx.GraphModule, choose: Choose, device_type: str) -> int:
    """Replace every matmul and depthwise convolution whose site has a tuned implementation;
    returns how many."""
    mode = None
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (*_PRODUCTS, torch.ops.ember.small_bmm.default):
            site = matmul_site(node, device_type)
        elif node.target in (aten.convolution.default, aten.convolution_backward.default):
            site = conv_site(node, device_type)
        else:
            continue
        choice = choose(site) if site is not None else None
        if choice is None or choice.impl == site.impls[0] or choice.impl not in site.impls:
            continue
        if mode is None:
            mode = fake_mode_of(gm)
        if site.op == "matmul":
            changed += _replace_product(gm, mode, node, site, choice)
        elif site.op == "conv":
            changed += depthwise.forward_to_ember(gm, mode, node)
        else:
            changed += depthwise.backward_to_ember(gm, mode, node)
    return changed
