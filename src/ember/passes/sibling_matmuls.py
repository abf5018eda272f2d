"""Merge matmuls that read one activation with parameter-only weights into one (GPU inference).

An attention block projects its input three times (query, key, value) and a gated MLP twice
(gate, up): ``mm(x, t(w_q))``, ``mm(x, t(w_k))``, ... with the same ``x``. At batch 1 each of these
is a small GEMM whose time is mostly launch and tail, so one GEMM over the weights side by side
(``x @ cat(w_q, w_k, w_v)``) costs little more than one of them. The concatenated weight (and
bias) depends on parameters only: the freezing machinery computes it once per parameter version
(``passes/freeze.py``), so a call pays no copy. Each original product becomes a column slice of
the merged result; what reads it gets its metadata recomputed (``strided_results``).

Only inference graphs with frozen parameters (training updates the weights every step, where
the copy would be paid per step), only 2-D ``mm`` / ``addmm`` whose second operand (and bias) is
frozen, and only groups of the same op, dtype and inner dimension. The concatenated weight is
memory the frozen values keep; where a weight is a parameter itself (not a frozen cast that
already copies it, as autocast's is) that is a second copy of it, capped per graph by the
``merge_matmuls_max_copy_mb`` setting (a float32 language model's projections would double).
A weight defined after the
first product of its group is moved up: frozen nodes read parameters only, so any place before
their first reader is valid. What was merged is in ``gm.meta["ember_sibling_matmuls"]``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.passes.cleanup import eliminate_dead_code
from ember.passes.freeze import is_frozen
from ember.passes.graph_edit import add_node, fake_mode_of, node_val
from ember.passes.strided_results import refresh_downstream, restore_output_strides

aten = torch.ops.aten
MERGED_META = "ember_sibling_matmuls"


def _member(node: fx.Node) -> tuple | None:
    """The group key of a mergeable product (its input, op, dtype, K), or None."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default) or node.kwargs:
        return None
    bias, x, w = (None, *node.args) if node.target is aten.mm.default else node.args
    xv, wv, out = node_val(x), node_val(w), node_val(node)
    if not all(isinstance(t, torch.Tensor) for t in (xv, wv, out)) or wv.dim() != 2 or xv.dim() != 2:
        return None
    if any(not isinstance(s, int) for s in (*xv.shape, *wv.shape)) or not is_frozen(w):
        return None
    if bias is not None:
        bv = node_val(bias)
        if not (is_frozen(bias) and isinstance(bv, torch.Tensor) and bv.dim() == 1 and bv.shape[0] == wv.shape[1]
                and bv.dtype == out.dtype):
            return None
    return (x, node.target, wv.dtype, wv.shape[0], wv.device)


def _transposed(w: fx.Node) -> bool:
    """Whether ``w`` is the transpose of a 2-D tensor (``t``, ``permute(.., [1, 0])``, ``transpose(0, 1)``)."""
    if w.op != "call_function":
        return False
    if w.target is aten.t.default:
        return True
    if w.target is aten.permute.default:
        return list(w.args[1]) == [1, 0]
    return w.target is aten.transpose.int and {d % 2 for d in w.args[1:3]} == {0, 1}


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _hoist(node: fx.Node, before: fx.Node, order: dict[fx.Node, int]) -> None:
    """Move frozen ``node`` (and the frozen nodes it reads) up to just before ``before``."""
    if node.op != "call_function" or order[node] < order[before]:
        return
    for arg in node.all_input_nodes:
        _hoist(arg, before, order)
    before.prepend(node)
    order[node] = order[before] - 0.5  # before ``before``, after what was hoisted already


_VIEW_OPS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default, aten.slice.Tensor,
             aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim}


def _copied_bytes(value: fx.Node) -> int:
    """Bytes the concatenation copies beyond what the frozen values hold already: the value's
    size where it is a parameter seen through views (no frozen op made a copy of it)."""
    node = value
    while node.op == "call_function" and node.target in _VIEW_OPS:
        node = node.args[0]
    if node.op != "placeholder":
        return 0
    val = node_val(value)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def merge_sibling_matmuls(gm: fx.GraphModule, max_copy_mb: float = 256.0) -> int:
    """The pass (module docstring). Returns how many products it merged away."""
    graph = gm.graph
    record: list[str] = []
    gm.meta[MERGED_META] = record
    fake = fake_mode_of(gm)
    if fake is None:
        return 0
    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _member(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    original_outs = [node_val(o) for o in outs]
    captured = {n: node_val(n) for n in graph.nodes}
    slices: set[fx.Node] = set()
    merged = 0
    budget = max_copy_mb * 1e6
    for members in groups.values():
        if len(members) < 2:
            continue
        copied = sum(_copied_bytes(m.args[-1]) + (_copied_bytes(m.args[0]) if len(m.args) == 3 else 0)
                     for m in members)
        if copied > budget:
            record.append(f"not merged: {len(members)} products would copy {copied / 1e6:.1f} MB of parameters "
                          f"(merge_matmuls_max_copy_mb left: {budget / 1e6:.1f})")
            continue
        budget -= copied
        slices |= _merge(graph, fake, members, captured)
        merged += len(members) - 1
        widths = "+".join(str(node_val(m).shape[1]) for m in members)
        record.append(f"{len(members)} {members[0].target._overloadpacket.__name__}s of "
                      f"{list(node_val(members[0]).shape[:1])} rows, N {widths}")
    if slices:
        refresh_downstream(gm, fake, slices, captured, "merging sibling matmuls")
        restore_output_strides(gm, fake, output, original_outs)
        eliminate_dead_code(gm)  # the individual weights' transposes, now read by no product
    return merged


def _merge(graph: fx.Graph, fake: object, members: list[fx.Node], captured: dict) -> set[fx.Node]:
    first = members[0]
    order = _order(graph)
    has_bias = first.target is aten.addmm.default
    weights = [m.args[-1] for m in members]
    biases = [m.args[0] for m in members] if has_bias else []
    for v in (*weights, *biases):
        _hoist(v, first, order)
    with graph.inserting_before(first):
        if all(_transposed(w) for w in weights):
            # A linear layer's weight is t(W) of a row-major W: stack the Ws and transpose once,
            # so cuBLAS sees the same transposed layout as before.
            stacked = add_node(graph, fake, aten.cat.default, ([w.args[0] for w in weights], 0), frozen=True)
            weight = add_node(graph, fake, aten.t.default, (stacked,), frozen=True)
        else:
            weight = add_node(graph, fake, aten.cat.default, (weights, 1), frozen=True)
        args: tuple = (first.args[0], weight)
        if has_bias:
            bias = add_node(graph, fake, aten.cat.default, (biases,), frozen=True)
            args = (bias, first.args[1], weight)
        product = add_node(graph, fake, first.target, args)
        product.meta.update({k: v for k, v in first.meta.items() if k not in ("val", "ember_frozen")})
        slices = set()
        start = 0
        for m in members:
            width = node_val(m).shape[1]
            piece = add_node(graph, fake, aten.slice.Tensor, (product, 1, start, start + width))
            start += width
            captured[piece] = captured.get(m)
            m.replace_all_uses_with(piece)
            slices.add(piece)
    for m in members:
        graph.erase_node(m)
    return slices
