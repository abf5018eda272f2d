"""Tuned matmul implementations on the GPU code path: per site, cuBLAS or Ember's tiled kernel.

Every ``mm``, ``addmm`` (a bias with one value per column), ``bmm`` and ``ember::small_bmm`` left
by the passes before this one, with bf16/fp16 operands of static sizes, is a ``LibrarySite``
("matmul") offered to the tuning database's chooser. The site's first implementation is what the
rules produced (``cublas``, or ``small_bmm`` where that rule took the product); the others are
``cublas`` and ``tiled`` (``ember::tiled_matmul`` with a tile configuration). A tuned answer
replaces the node; no answer keeps the rule's. Runs last among the GPU passes, so the products it
sees are those the program would run (padded, merged, or Ember's small products).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.ops import tiled_matmul
from ember.passes.graph_edit import add_node, fake_mode_of, node_val
from ember.passes.library_sites import Choose, LibrarySite, tensor_sig

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


def choose_matmul_implementations(gm: fx.GraphModule, choose: Choose, device_type: str) -> int:
    """Replace every product whose site has a tuned implementation; returns how many."""
    mode = None
    changed = 0
    for node in list(gm.graph.nodes):
        if node.target not in (*_PRODUCTS, torch.ops.ember.small_bmm.default):
            continue
        site = matmul_site(node, device_type)
        choice = choose(site) if site is not None else None
        if choice is None or choice.impl == site.impls[0] or choice.impl not in site.impls:
            continue
        a, b, bias = _operands(node)  # type: ignore[misc]
        if mode is None:
            mode = fake_mode_of(gm)
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
            continue
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    return changed
