"""Cleanup passes: dead-code elimination, common-subexpression elimination, constant folding,
functional copies as clones."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ember.schedule.rules import RANDOM_OPS

aten = torch.ops.aten

# Folding a fill into a tensor constant trades a free inline constant for memory; only
# fold results this small.
FOLD_MAX_NUMEL = 64


def _is_pure(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target in RANDOM_OPS:
        return False
    target = node.target
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def eliminate_dead_code(gm: fx.GraphModule) -> int:
    """Remove nodes whose results nothing uses (random ops too: their stream position is not observable)."""
    before = len(gm.graph.nodes)
    changed = True
    while changed:
        changed = False
        for node in reversed(gm.graph.nodes):
            if node.op in ("call_function", "get_attr") and not node.users and (
                    node.op == "get_attr" or _is_pure(node) or node.target in RANDOM_OPS):
                gm.graph.erase_node(node)
                changed = True
    return before - len(gm.graph.nodes)


def _key(value: object) -> object:
    if isinstance(value, fx.Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", repr(value))  # keeps 0.0 / -0.0 / nan distinct and hashable
    if isinstance(value, (int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    return ("id", id(value))


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Replace a pure node by an earlier identical one (same op, same arguments)."""
    seen: dict[object, fx.Node] = {}
    replaced = 0
    for node in list(gm.graph.nodes):
        if not _is_pure(node):
            continue
        key = (node.target, _key(node.args), _key(node.kwargs))
        prior = seen.get(key)
        if prior is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(prior)
        gm.graph.erase_node(node)
        replaced += 1
    return replaced


def fold_constants(gm: fx.GraphModule) -> int:
    """Evaluate nodes whose tensor inputs are all constants (get_attr or small fills).

    The result becomes a new module attribute. Random ops are never folded.
    """
    constant: dict[fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor):
                constant[node] = value
    folded = 0
    for node in list(gm.graph.nodes):
        if not _is_pure(node) or node.target is operator.getitem:
            continue
        inputs = node.all_input_nodes
        if not inputs or not all(i in constant for i in inputs):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > FOLD_MAX_NUMEL:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: constant[n])
        with torch.no_grad():
            result = node.target(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            continue
        name = f"_ember_folded_{folded}_{node.name}"
        gm.register_buffer(name, result)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta["val"] = val
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
        constant[attr] = result
        folded += 1
    return folded


def _dense_format(t: torch.Tensor) -> torch.memory_format | None:
    if t.is_contiguous():
        return torch.contiguous_format
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def replace_functional_copies(gm: fx.GraphModule) -> int:
    """``copy(dst, src)`` of a same-shape ``src`` becomes ``clone`` / ``_to_copy`` of ``src``.

    Functionalization writes an in-place op's result back as ``copy(dst, src)`` (ReLU(inplace)
    in a backward: ``copy(new_empty_strided(...), grad)``): the value is ``src`` in ``dst``'s
    dtype and layout, and ``dst`` is only read for its metadata. As ``clone`` the op is pointwise
    and fuses with its producer, and the ``new_empty_strided`` behind it dies. Only done where
    ``dst`` is dense contiguous or channels_last, so ATen's clone gives the same strides."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.copy.default or len(node.args) < 2:
            continue
        dst, src = node.args[0], node.args[1]
        if not (isinstance(dst, fx.Node) and isinstance(src, fx.Node)) or (len(node.args) > 2 and node.args[2]):
            continue
        d, v, out = dst.meta.get("val"), src.meta.get("val"), node.meta.get("val")
        if not all(isinstance(t, torch.Tensor) for t in (d, v, out)) or d.shape != v.shape or d.device != v.device:
            continue
        fmt = _dense_format(out)
        if fmt is None or out.stride() != d.stride():
            continue
        with gm.graph.inserting_before(node):
            if d.dtype == v.dtype:
                new = gm.graph.call_function(aten.clone.default, (src,), {"memory_format": fmt})
            else:
                new = gm.graph.call_function(aten._to_copy.default, (src,), {"dtype": d.dtype, "memory_format": fmt})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed += 1
    return changed
