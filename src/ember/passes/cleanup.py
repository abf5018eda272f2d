"""Cleanup passes: dead-code elimination, common-subexpression elimination, constant folding,
functional copies as clones, clones that keep their source's layout."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ember.graph_utils import FOLDED_PREFIX, is_dense
from ember.schedule.op_support import POINTWISE_OPS
from ember.schedule.rules import CONSTANT_OPS, RANDOM_OPS, VIEW_OPS

aten = torch.ops.aten

# Folding a fill into a tensor constant trades a free inline constant for memory; only
# fold results this small, unless computing them takes a kernel of its own (below).
FOLD_MAX_NUMEL = 64
# Largest value folded where the kernels could not compute it inline (swin_t's attention mask at
# 224x224: 64 windows x 49 x 49 = 153,664 elements). Computed once at compile time, kept by the
# program (codegen/program.py stores folded values with the program, not as module attributes).
SHAPE_CONSTANT_MAX_NUMEL = 1 << 20
# Values with no tensor input that fold: fills (CONSTANT_OPS) and aranges.
SHAPE_SOURCES = CONSTANT_OPS | {aten.arange.default, aten.arange.start, aten.arange.start_step}
# Ops a kernel computes inline from constants: a chain of only these stays unfolded when large.
_INLINE_OPS = CONSTANT_OPS | POINTWISE_OPS | {
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
    aten.expand.default, aten.alias.default, aten.t.default, aten.transpose.int,
}


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


def _constant_source(node: fx.Node) -> bool:
    """A fill or an arange: a value given by its arguments alone (no tensor input)."""
    return (node.op == "call_function" and node.target in SHAPE_SOURCES and not node.all_input_nodes
            and isinstance(node.meta.get("val"), torch.Tensor))


def fold_constants(gm: fx.GraphModule) -> int:
    """Evaluate nodes whose tensor inputs are all constants (get_attr, fills, aranges).

    A folded value becomes a module attribute where something not folded reads it. Small
    results (``FOLD_MAX_NUMEL``) always fold; results up to ``SHAPE_CONSTANT_MAX_NUMEL`` fold
    where their computation has a step a kernel cannot compute inline (a slice_scatter, a
    reshape of a computed value: swin's shifted-window attention mask, built from the input's
    shape alone on every call). Fills alone, and views and pointwise ops of them, stay inline
    constants. Random ops are never folded (neither are ``empty`` and the like: no value)."""
    value: dict[fx.Node, torch.Tensor] = {}
    structural: dict[fx.Node, bool] = {}  # the value's computation has a step no kernel inlines
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = getattr(gm, node.target, None)
            if isinstance(attr, torch.Tensor):
                value[node] = attr
                structural[node] = False  # a module constant: ops on it fold when small, as before
            continue
        if not _is_pure(node) or node.target is operator.getitem:
            continue
        inputs = node.all_input_nodes
        if inputs and not all(i in value for i in inputs):
            continue
        if not inputs and not _constant_source(node):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > SHAPE_CONSTANT_MAX_NUMEL:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: value[n])
        with torch.no_grad():
            result = node.target(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            continue
        value[node] = result
        structural[node] = (node.target not in _INLINE_OPS or any(structural[i] for i in inputs)
                            or not inputs and node.target not in CONSTANT_OPS)
    folded = 0
    outputs = _outputs(gm)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" or node not in value or not node.all_input_nodes:
            continue
        if node not in outputs and all(u in value for u in node.users):
            continue  # only folded nodes read it
        result = value[node]
        if result.numel() > FOLD_MAX_NUMEL and not structural[node]:
            continue
        name = f"{FOLDED_PREFIX}{folded}_{node.name}"
        gm.register_buffer(name, result)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
        folded += 1
    return folded


def _outputs(gm: fx.GraphModule) -> set[fx.Node]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return set(output.all_input_nodes)


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


def _view_base(node: fx.Node) -> fx.Node:
    """The node a chain of views starts from (``node`` itself when it is no view)."""
    while node.op == "call_function" and node.target in VIEW_OPS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def reaches_output(node: fx.Node) -> bool:
    """Whether ``node`` or a view of it is a graph output (what the caller or the backward sees)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user.op == "call_function" and user.target in VIEW_OPS and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def remove_layout_preserving_clones(gm: fx.GraphModule) -> int:
    """A ``clone`` whose result has its source's exact layout, of a value the graph computed
    (no input, no view of one) and which nobody sees outside the graph, is its source: the graph
    is functional, so nothing writes either between the copy and its reads. Model code calls
    ``.contiguous()`` / ``.clone()`` on tensors that already are (Swin's window reverse copies
    each attention output once more), and each such clone was a kernel that moved the whole
    tensor. Run after the layout pass, whose strides decide which clones keep their layout."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.clone.default or not isinstance(node.args[0], fx.Node):
            continue
        src = node.args[0]
        base = _view_base(src)
        if base.op != "call_function" or base.target in RANDOM_OPS:
            continue
        out, val = node.meta.get("val"), src.meta.get("val")
        if not (isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)) or out.dtype != val.dtype \
                or out.shape != val.shape or out.device != val.device or out.stride() != val.stride():
            continue
        if not (is_dense(val) and is_dense(out)) or val.storage_offset() or reaches_output(node):
            continue
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        changed += 1
    return changed
