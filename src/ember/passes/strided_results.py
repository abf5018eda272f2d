"""When a pass turns a value into a strided view of a larger result (a padded matmul's slice, one
of several matmuls merged into one): recompute the metadata of everything downstream, turn a
``view`` the new strides do not allow into ``reshape`` (a copy only where it must), feed ops the
fake mode cannot run copies in their captured strides, and copy graph outputs whose strides
changed back to what the caller expects. Shared by ``pad_matmul`` and ``sibling_matmuls``."""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.passes.graph_edit import add_node, node_val

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default}


def same_layout(val: torch.Tensor, stride: tuple[int, ...]) -> bool:
    return all(size == 1 or a == b for size, a, b in zip(val.shape, val.stride(), stride))


def refresh_downstream(gm: fx.GraphModule, fake: object, changed: set[fx.Node],
                       captured: dict[fx.Node, object], what: str) -> None:
    """Recompute ``meta['val']`` of the nodes that read a sliced result, directly or through others
    whose strides changed. A view the new strides do not allow becomes ``reshape`` (a copy only where
    it must); an op the fake mode cannot run reads copies in the strides it was captured with."""
    changed = set(changed)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in changed or not any(a in changed for a in node.all_input_nodes):
            continue
        old = node_val(node)
        new = _rerun(node, fake)
        if new is None:
            _feed_captured_strides(gm, fake, node, changed, captured, what)
            continue
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            if old.shape != new.shape or old.dtype != new.dtype:
                raise RuntimeError(f"{what} changed {node.name}'s shape or dtype: {old.shape}/{old.dtype} "
                                   f"-> {new.shape}/{new.dtype}")
            if not same_layout(new, old.stride()):
                changed.add(node)
        elif old is not None and not isinstance(old, torch.Tensor):
            changed.add(node)  # tuples (split, unbind ...): whatever they hold may have changed
        node.meta["val"] = new


def _args_vals(node: fx.Node) -> tuple[tuple, dict]:
    return fx.node.map_arg(node.args, node_val), fx.node.map_arg(node.kwargs, node_val)


def _rerun(node: fx.Node, fake: object) -> object:
    args, kwargs = _args_vals(node)
    try:
        with fake:
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a view the strides no longer allow, or an op without a fake kernel
        if node.target not in _VIEWS:
            return None
    node.target = aten.reshape.default
    with fake:
        return node.target(*args, **kwargs)


def _feed_captured_strides(gm: fx.GraphModule, fake: object, node: fx.Node, changed: set[fx.Node],
                           captured: dict[fx.Node, object], what: str) -> None:
    """Give ``node`` copies of its changed inputs in the strides their captured values had."""
    for arg in [a for a in node.all_input_nodes if a in changed]:
        before = captured.get(arg)
        if not isinstance(before, torch.Tensor) or not isinstance(node_val(arg), torch.Tensor):
            raise RuntimeError(f"{what}: {node.name} cannot be recomputed and reads {arg.name}")
        node.replace_input_with(arg, _copy_to(gm, fake, arg, node, tuple(before.stride())))


def _copy_to(gm: fx.GraphModule, fake: object, src: fx.Node, before: fx.Node, stride: tuple[int, ...]) -> fx.Node:
    val = node_val(src)
    with fake:
        want = torch.empty_strided(tuple(val.shape), tuple(stride), dtype=val.dtype, device=val.device)
    with gm.graph.inserting_before(before):
        if want.is_contiguous():
            return add_node(gm.graph, fake, aten.clone.default, (src,), {"memory_format": torch.contiguous_format},
                            val=want)
        return add_node(gm.graph, fake, aten.clone.default, (src,), val=want)


def restore_output_strides(gm: fx.GraphModule, fake: object, output: fx.Node, original: list[object]) -> int:
    """Copy graph outputs whose strides changed back to the captured strides; returns how many."""
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    copies: dict[tuple[fx.Node, tuple], fx.Node] = {}
    for i, (o, before) in enumerate(zip(outs, original)):
        val = node_val(o)
        if not (isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor)) or val.numel() <= 1:
            continue
        if same_layout(val, before.stride()):
            continue
        key = (o, tuple(before.stride()))
        if key not in copies:
            copies[key] = _copy_to(gm, fake, o, output, tuple(before.stride()))
        outs[i] = copies[key]
    if copies:
        output.args = (type(output.args[0])(outs) if isinstance(output.args[0], (list, tuple)) else outs[0],)
    return len(copies)
