"""Pad matmul dimensions that are not a multiple of 16 bytes with zeros (GPU targets).

For every ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (the forms linear layers and batched products
take in the captured forward and backward graphs) the rule in ``matmul_padding_rule.py`` decides
which of M, K, N to round up. Then:

- an operand that needs a larger dim is copied into a zero-padded buffer by ``ember::pad_zeros``
  (ops/pad_zeros.py), which keeps the source's dimension order. An operand that is a transposing
  view (``permute``, ``t``, ``transpose``: a linear layer's weight, the gradient in a weight
  gradient) is padded at its source and the view applied again, so a transposed weight stays a
  transposed view for cuBLAS, and one tensor padded for two matmuls (the output gradient of a
  language-model head feeds both the input and the weight gradient) is copied once;
- K padding needs nothing else: the extra products are zeros. M or N padding gives a larger
  result, sliced back to the original size (a strided view: the generated kernels that read it are
  compiled for its strides); ``addmm``'s bias is padded along the result's padded dims;
- metadata is recomputed downstream of each slice (a ``view`` that the strided result no longer
  allows becomes ``reshape``), and graph outputs whose strides changed are copied back to the
  strides the caller (or the backward graph) expects.

A parameter is padded again at every call (a copy of the weight per matmul, counted in the
rule's cost and in ``explain``). What the pass did is in ``gm.meta["ember_matmul_padding"]``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx as fx

from ember.ops.pad_zeros import pad_zeros  # noqa: F401 - registers torch.ops.ember.pad_zeros
from ember.passes.cleanup import eliminate_dead_code, reaches_output
from ember.passes.graph_edit import add_node, fake_mode_of, node_val
from ember.passes.layout import dense_strides
from ember.passes.matmul_padding_rule import MatmulDims, PaddingDecision, decide, tf32_matmuls
from ember.passes.strided_results import refresh_downstream, restore_output_strides, same_layout

aten = torch.ops.aten
PADDING_META = "ember_matmul_padding"

# op -> (bias position or None, mat1 position, mat2 position); batched ops have a leading batch dim.
MATMULS = {aten.mm.default: (None, 0, 1), aten.addmm.default: (0, 1, 2),
           aten.bmm.default: (None, 0, 1), aten.baddbmm.default: (0, 1, 2)}
_BATCHED = {aten.bmm.default, aten.baddbmm.default}
_PERMUTES = {aten.permute.default, aten.t.default, aten.transpose.int}


def _nbytes(val: torch.Tensor) -> int:
    return val.numel() * val.element_size()


def _source_dims(view: fx.Node) -> list[int]:
    """For a permuting view: the source dim of each of its output dims."""
    rank = node_val(view).dim()
    if view.target == aten.permute.default:
        return [d % rank for d in view.args[1]]
    dims = list(range(rank))
    if view.target == aten.t.default:
        return dims[::-1] if rank == 2 else dims
    a, b = (d % rank for d in view.args[1:3])
    dims[a], dims[b] = dims[b], dims[a]
    return dims


def _where(node: fx.Node) -> str:
    """The layer a matmul belongs to (``lm_head``), or the node's name."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if stack:
        path = str(list(stack.values())[-1][0])
        if path.startswith("L[") and "]" in path:
            path = path[path.index("]") + 1:].lstrip(".")
        if path:
            return path
    return node.name


class _Padder:
    """One pass over one graph: the padded copies made so far (shared between matmuls)."""

    def __init__(self, gm: fx.GraphModule, mode: object) -> None:
        self.gm, self.mode = gm, mode
        self.pads: dict[tuple, fx.Node] = {}  # (source, padded shape) -> ember::pad_zeros node
        self.views: dict[tuple, fx.Node] = {}  # (pad node, view chain) -> the view again

    def _chain(self, x: fx.Node, want: dict[int, int]) -> tuple[fx.Node, list[fx.Node], dict[int, int]]:
        """``x``'s source through permuting views, the views, and ``want`` in the source's dims."""
        chain, src = [], x
        while src.op == "call_function" and src.target in _PERMUTES and isinstance(src.args[0], fx.Node):
            dims = _source_dims(src)
            want = {dims[d]: size for d, size in want.items()}
            chain.append(src)
            src = src.args[0]
        return src, chain, want

    def cost(self, x: fx.Node, want: dict[int, int]) -> int:
        """Bytes copied to pad ``x`` to ``want`` ({dim: size}): 0 if nothing grows or it is padded already."""
        val = node_val(x)
        want = {d: s for d, s in want.items() if s != val.shape[d]}
        if not want:
            return 0
        src, _, want = self._chain(x, want)
        shape = self._shape(src, want)
        if (src, shape) in self.pads:
            return 0
        sval = node_val(src)
        return _nbytes(sval) + sval.element_size() * _numel(shape)

    def _shape(self, src: fx.Node, want: dict[int, int]) -> tuple[int, ...]:
        return tuple(want.get(d, s) for d, s in enumerate(node_val(src).shape))

    def pad(self, x: fx.Node, want: dict[int, int], before: fx.Node) -> fx.Node:
        """``x`` with the dims in ``want`` enlarged by zeros (``x`` itself when nothing grows)."""
        val = node_val(x)
        want = {d: s for d, s in want.items() if s != val.shape[d]}
        if not want:
            return x
        src, chain, want = self._chain(x, want)
        shape = self._shape(src, want)
        graph = self.gm.graph
        with graph.inserting_before(before):
            padded = self.pads.get((src, shape))
            if padded is None:
                padded = add_node(graph, self.mode, torch.ops.ember.pad_zeros.default, (src, list(shape)))
                self.pads[(src, shape)] = padded
            key = (padded, tuple(chain))
            out = self.views.get(key)
            if out is None:
                out = padded
                for view in reversed(chain):
                    out = add_node(graph, self.mode, view.target, (out, *view.args[1:]), dict(view.kwargs))
                self.views[key] = out
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dims_of(node: fx.Node) -> MatmulDims | None:
    bias_at, a_at, b_at = MATMULS[node.target]
    a, b = node_val(node.args[a_at]), node_val(node.args[b_at])
    out = node_val(node)
    if not all(isinstance(t, torch.Tensor) for t in (a, b, out)) or a.dtype != b.dtype:
        return None
    if any(not isinstance(s, int) for t in (a, b) for s in (*t.shape, *t.stride())):
        return None  # symbolic shapes: Ember compiles those through ATen anyway
    if bias_at is not None and not isinstance(node_val(node.args[bias_at]), torch.Tensor):
        return None
    if node.target in _BATCHED:
        return MatmulDims(a.shape[0], a.shape[1], a.shape[2], b.shape[2], a.dtype)
    return MatmulDims(1, a.shape[0], a.shape[1], b.shape[1], a.dtype)


def pad_unaligned_matmuls(gm: fx.GraphModule, mode: str = "auto", min_flops_per_byte: float = 128.0,
                          min_gflop: float = 1.0) -> int:
    """The pass (module docstring). Returns how many matmuls it padded."""
    record: dict = {"padded": [], "declined": {}, "align": [], "copy_bytes": 0, "restored_outputs": 0}
    gm.meta[PADDING_META] = record
    graph = gm.graph
    fake = fake_mode_of(gm)
    if fake is None or mode == "off":
        return 0
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    original_outs = [node_val(o) for o in outs]
    captured = {n: node_val(n) for n in graph.nodes}  # each node's value before the pass
    padder = _Padder(gm, fake)
    tf32 = tf32_matmuls()
    declined: Counter = Counter()
    aligns: set[int] = set()
    replaced: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in MATMULS:
            continue
        dims = _dims_of(node)
        if dims is None:
            continue
        plan = _plan(node, dims)
        copy_cost = functools.partial(_copy_cost, padder, node, dims, plan)
        decision = decide(dims, copy_cost, mode, tf32, min_flops_per_byte, min_gflop)
        if not decision.pads:
            if not decision.declined.startswith("aligned"):
                declined[f"{_where(node)}: {_op_name(node)} {_describe(dims, decision)}: {decision.declined}"] += 1
            continue
        record["copy_bytes"] += copy_cost(decision.m, decision.k, decision.n)
        before = node_val(node)
        replacement = _rewrite(padder, node, dims, decision, plan)
        captured[replacement] = before
        replaced.add(replacement)
        aligns.add(decision.align)
        record["padded"].append(f"{_where(node)}: {_op_name(node)} {_describe(dims, decision)}")
    record["declined"] = dict(declined)
    record["align"] = sorted(aligns)
    if replaced:
        refresh_downstream(gm, fake, replaced, captured, "matmul padding")
        record["restored_outputs"] = restore_output_strides(gm, fake, output, original_outs)
        eliminate_dead_code(gm)  # the views of the unpadded arguments no matmul reads any more
    return len(record["padded"])


def _copy_cost(padder: _Padder, node: fx.Node, dims: MatmulDims, plan: Callable, m: int, k: int, n: int) -> int:
    """Bytes that padding ``node`` to (m, k, n) copies: its arguments into padded buffers, and its
    sliced result back to eager's strides where the caller sees it."""
    total = sum(padder.cost(x, want) for x, want in plan(m, k, n))
    out = node_val(node)
    if (m != dims.m or n != dims.n) and reaches_output(node):
        # The slice of the padded (contiguous) result: only rows cut off a single matrix keep its strides.
        sliced = dense_strides((*out.shape[:-2], m, n))
        if not same_layout(out, sliced):
            total += 2 * _nbytes(out)
    return total


def _op_name(node: fx.Node) -> str:
    return node.target._overloadpacket.__name__  # type: ignore[union-attr]


def _describe(dims: MatmulDims, d: PaddingDecision) -> str:
    parts = [f"{name} {old}->{new}" for name, old, new in (("M", dims.m, d.m), ("K", dims.k, d.k),
                                                           ("N", dims.n, d.n)) if old != new]
    if parts:
        return ", ".join(parts)
    return f"[{dims.m}x{dims.k}] @ [{dims.k}x{dims.n}]" + (f" x{dims.batch}" if dims.batch > 1 else "")


def _plan(node: fx.Node, dims: MatmulDims) -> Callable[[int, int, int], list[tuple[fx.Node, dict[int, int]]]]:
    """For padded sizes (m, k, n): each tensor argument to pad and its {dim: size}."""
    bias_at, a_at, b_at = MATMULS[node.target]
    lead = 1 if node.target in _BATCHED else 0

    def plan(m: int, k: int, n: int) -> list[tuple[fx.Node, dict[int, int]]]:
        out = [(node.args[a_at], {lead: m, lead + 1: k}), (node.args[b_at], {lead: k, lead + 1: n})]
        if bias_at is not None:
            bias = node.args[bias_at]
            shape = node_val(bias).shape
            result = (dims.m, dims.n)
            padded = (m, n)
            want = {}
            # The bias broadcasts from the right against the result's (M, N).
            for back in (1, 2):
                d = len(shape) - back
                if d >= 0 and shape[d] == result[-back] and shape[d] != 1:
                    want[d] = padded[-back]
            out.append((bias, want))
        return out

    return plan


def _rewrite(padder: _Padder, node: fx.Node, dims: MatmulDims, decision: PaddingDecision,
             plan: Callable) -> fx.Node:
    """Replace ``node`` by the matmul of padded arguments, sliced back; returns the replacement."""
    graph = padder.gm.graph
    args = list(node.args)
    positions = [i for i in MATMULS[node.target][1:]]
    bias_at = MATMULS[node.target][0]
    if bias_at is not None:
        positions.append(bias_at)
    for pos, (x, want) in zip(positions, plan(decision.m, decision.k, decision.n)):
        args[pos] = padder.pad(x, want, node)
    lead = 1 if node.target in _BATCHED else 0
    with graph.inserting_before(node):
        result = add_node(graph, padder.mode, node.target, tuple(args), dict(node.kwargs))
        result.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        for dim, size, padded in ((lead, dims.m, decision.m), (lead + 1, dims.n, decision.n)):
            if padded != size:
                result = add_node(graph, padder.mode, aten.slice.Tensor, (result, dim, 0, size))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return result


def padding_summary(gm: fx.GraphModule) -> dict:
    """What the pass did to ``gm`` (empty when it did not run): explain's matmul-padding lines."""
    return dict(gm.meta.get(PADDING_META, {}))


def padding_line(summary: dict) -> str:
    """``padded 3 matmul(s) to multiples of 8: lm_head: mm N 50257->50264; ...``"""
    padded = summary.get("padded", [])
    if not padded:
        return "no matmul padded"
    align = "/".join(str(a) for a in summary.get("align", []))
    copied = summary.get("copy_bytes", 0)
    return (f"padded {len(padded)} matmul(s) to multiples of {align}: {'; '.join(padded)} "
            f"({copied / 1e6:.1f} MB copied per call)")
