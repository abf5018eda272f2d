"""Freezing: mark the part of an inference graph that depends only on parameters and buffers.

In an inference graph, folded convolution weights, packed weights, batch-norm scales and the
like are functions of the model's parameters alone. Recomputing them on every call costs as
much as the work they save, so the program computes them once, in a function of its own
(``_prepare``), and keeps the results (``runtime.frozen.FrozenValues``). The cache is keyed by
the address and the version counter of every parameter it read: an optimizer step, a
``load_state_dict`` or any in-place update under ``torch.no_grad()`` bumps the version and the
next call recomputes. (Writes through ``param.data`` bypass version counters; ``freeze=False``
turns freezing off for code that mutates parameters that way.)

A node is frozen when every tensor input is a static graph input (a parameter or buffer, as
AOTAutograd reports through ``fw_metadata.static_input_indices``), a module constant or another
frozen node, and the op is deterministic and does not write to its inputs. A buffer the graph
itself writes (``copy_`` into it: a counter, kept in the graph by capture/backend.py) changes on
every call: what is computed from it is not frozen, or every call would recompute the whole set.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember import compat
from ember.passes.cleanup import _is_pure

FROZEN = "ember_frozen"


def is_frozen(node: object) -> bool:
    return isinstance(node, fx.Node) and bool(node.meta.get(FROZEN))


def static_input_indices() -> set[int]:
    """Indices of the graph inputs AOTAutograd knows to be parameters or buffers (empty when unknown)."""
    try:
        meta = compat.aot_forward_metadata()
        return set(getattr(meta, "static_input_indices", None) or ())
    except Exception:  # noqa: BLE001 - without the information nothing is frozen
        return set()


def mark_frozen(gm: fx.GraphModule, static_inputs: set[int]) -> int:
    """Mark (``node.meta['ember_frozen']``) every node computed from parameters/buffers only."""
    frozen = 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default}
    for i, p in enumerate(placeholders):
        p.meta[FROZEN] = i in static_inputs and isinstance(p.meta.get("val"), torch.Tensor) and p not in written
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            node.meta[FROZEN] = True
            continue
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        ok = bool(inputs) and all(is_frozen(a) for a in inputs) and _is_pure(node)
        node.meta[FROZEN] = ok
        frozen += bool(ok)
    return frozen


def extend_frozen(gm: fx.GraphModule) -> int:
    """Mark the nodes later passes added (the CPU library calls' linears and output views) whose
    inputs are all frozen: a frozen node must read only frozen ones, as ``_prepare`` computes them
    apart from the program. Marks are only added, never taken: a pass may freeze a value by design
    (``fold_conv_affine``'s folded weights). Returns how many nodes it marked."""
    added = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_frozen(node):
            continue
        inputs = node.all_input_nodes
        if inputs and all(is_frozen(a) for a in inputs) and _is_pure(node):
            node.meta[FROZEN] = True
            added += 1
    return added


def frozen_compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The frozen call_function nodes in graph order (what ``_prepare`` computes)."""
    return [n for n in graph.nodes if n.op == "call_function" and is_frozen(n)]
