"""Small helpers for passes that insert nodes: metadata by fake execution, frozen marks."""

from __future__ import annotations

import torch
import torch.fx as fx

from ember import compat
from ember.passes.freeze import FROZEN


def fake_mode_of(gm: fx.GraphModule) -> object:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return compat.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def node_val(node: object) -> object:
    """A node's recorded value (``meta['val']``: a fake tensor, a tuple, a symbol); None for anything else."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _fake_args(args: object) -> object:
    return fx.node.map_arg(args, node_val)


def same_value(new: object, old: object) -> bool:
    """A replacement's value matches the captured one in shape, dtype and strides (the nodes after
    it were planned for those)."""
    return (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new.shape == old.shape
            and new.dtype == old.dtype and new.stride() == old.stride())


def fake_result(mode: object, target: object, args: tuple, kwargs: dict | None = None) -> object:
    """What ``target`` returns for these node arguments, run on their fake values."""
    with mode:
        return target(*_fake_args(args), **_fake_args(kwargs or {}))


def add_node(graph: fx.Graph, mode: object, target: object, args: tuple, kwargs: dict | None = None,
             frozen: bool = False, val: object = None) -> fx.Node:
    """A call_function node (at the graph's current insertion point) with ``meta['val']``."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_result(mode, target, args, kwargs) if val is None else val
    node.meta[FROZEN] = frozen
    return node


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def refresh_metadata(gm: fx.GraphModule, mode: object) -> int:
    """Recompute ``meta['val']`` of every non-frozen node from its inputs (layouts change when a
    pass swaps an op for one that returns channels_last). Nodes the fake mode cannot run keep
    their value. Returns how many values changed strides."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get(FROZEN):
            continue
        old = node.meta.get("val")
        try:
            with mode:
                new = node.target(*_fake_args(node.args), **_fake_args(node.kwargs))
        except Exception:  # noqa: BLE001 - ops without fake kernels keep what capture recorded
            if node.target not in _VIEWS:
                continue
            # A view of a tensor whose layout changed (flatten of a channels_last activation) may
            # no longer be expressible as a view: reshape copies exactly when it must.
            node.target = torch.ops.aten.reshape.default
            with mode:
                new = node.target(*_fake_args(node.args), **_fake_args(node.kwargs))
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            if old.shape != new.shape or old.dtype != new.dtype:
                continue  # never trust a re-run that disagrees on more than layout
            changed += old.stride() != new.stride()
        node.meta["val"] = new
    return changed
