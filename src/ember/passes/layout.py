"""channels_last layout for convolutional graphs on the GPU targets.

cuDNN's NHWC convolution kernels are much faster than its NCHW ones in bf16, and every
activation around a convolution (batch norm, ReLU, residual adds) is pointwise or a
per-channel reduction that runs as fast on NHWC as on NCHW when the generated kernels walk
memory in order (codegen/triton_kernel.py). So:

1. Every 4-D ``convolution`` / ``convolution_backward`` gets its activation arguments in
   channels_last: one ``clone(memory_format=channels_last)`` per source tensor that is not
   already channels_last (the first layer's input, a tensor from an op that ignores layouts).
   Weights are not copied (see ``_CONV_ARGS``), but a weight that the graph computes anyway
   (autocast's cast of the fp32 parameter to bf16) is written in channels_last by that cast:
   cuDNN would otherwise convert it on every forward and backward call.
2. Fake-tensor metadata is recomputed (``refresh_metadata``): convolution outputs become
   channels_last and the layout flows through pointwise ops, reductions and views by PyTorch's
   own stride rules, so nothing between two convolutions converts.
3. Outputs the caller sees keep eager's layout: a conversion back is inserted for each one
   whose strides changed. In a training forward the *saved activations* (the outputs AOTAutograd
   hands to the backward, ``fw_metadata.tensors_saved_for_backwards_slice``) stay channels_last,
   and their strides are reported to AOTAutograd (``TracingContext.output_strides``, as Inductor
   does), which re-strides the backward graph's example inputs; the backward's pass copies those
   strides into its placeholders, so forward and backward agree and the backward program never
   copies a saved activation to fix its strides.

The passes run on the forward and the backward graph separately (AOTAutograd partitions the
joint graph first and calls Ember once per graph), forward first. Every conversion is recorded
in ``gm.meta["ember_layout"]`` for ``ember.explain``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.fx as fx

from ember import compat
from ember.config import settings
from ember.graph_utils import is_dense
from ember.ops import reflection_pad
from ember.passes.freeze import FROZEN
from ember.passes.graph_edit import add_node, fake_mode_of
from ember.schedule.range_select import RANGE_SELECT_OPS
from ember.schedule.rules import OpClass, classify

aten = torch.ops.aten
LAYOUT_META = "ember_layout"

# Activation arguments of each op that should be channels_last (positions in node.args). Weights
# are not copied: with a channels_last activation cuDNN (and oneDNN) run channels_last and take
# the weight in that layout internally, as eager does; an explicit copy of every weight cost a
# weight-sized buffer per layer (peak memory 2x eager for resnet18 at batch 2) and, at batch 1,
# more traffic than the activations.
_CONV_ARGS = {aten.convolution.default: (0,), aten.convolution_backward.default: (0, 1)}


_WEIGHT_ARG = {aten.convolution.default: 1, aten.convolution_backward.default: 2}


def _castable(weight: object) -> bool:
    """Whether ``weight`` is a cast that only convolutions read as their weight: its cast can
    write it in channels_last at no extra cost."""
    if not isinstance(weight, fx.Node) or weight.op != "call_function" or weight.target != aten._to_copy.default \
            or not _is_4d(weight):
        return False
    if weight.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    for user in weight.users:
        if user.op == "output":
            continue  # a saved activation: the backward reads it with these strides; others convert back
        if user.target not in _WEIGHT_ARG or user.args[_WEIGHT_ARG[user.target]] is not weight or \
                any(a is weight for i, a in enumerate(user.args) if i != _WEIGHT_ARG[user.target]):
            return False
    return True


def _cast_to_channels_last(weight: fx.Node, mode: object) -> bool:
    """Make ``weight``, a cast only convolutions read as their weight, produce channels_last."""
    if not _castable(weight):
        return False
    weight.kwargs = {**weight.kwargs, "memory_format": torch.channels_last}
    _rerun(weight, mode)
    return is_channels_last(weight.meta["val"])


# settings().layout_incremental: recompute a node's metadata only where an input's changed, and a
# pointwise node's without a fake-tensor dispatch where its strides are certain. Tests set False
# (every node re-run through the fake mode) to check that both give the same program.

# settings().layout_min_activation_to_weight: channels_last pays off where activations outweigh
# weights: a convolution given a channels_last activation and an NCHW weight converts the weight
# internally on every call, so a graph whose convolution weights are larger than their activations
# (batch 1, small images) stays NCHW. Compared in bytes summed over the graph's convolutions,
# counting only weights that would be converted per call (not autocast's casts, which write
# channels_last themselves: resnet50 at batch 1 in bf16 kept NCHW, and cuDNN then converted its
# activations to NHWC and back, 54 transposes per call on the H100); tests set 0 to force the layout.


def _bytes(node: object) -> int:
    val = _val(node)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_4d(node: object) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dim() == 4 and val.layout == torch.strided


def is_channels_last(val: torch.Tensor) -> bool:
    """Dense NHWC strides (size-1 dims may have any stride, as PyTorch allows)."""
    return val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last)


def _strides_of(val: object) -> tuple[int, ...] | None:
    return tuple(val.stride()) if isinstance(val, torch.Tensor) else None


def _same_layout(a: torch.Tensor, stride: Sequence[int]) -> bool:
    """Whether ``a`` has ``stride`` wherever it matters (size-1 dims may differ)."""
    return all(size == 1 or s == t for size, s, t in zip(a.shape, a.stride(), stride))


def saved_output_slice(kind: str) -> slice | None:
    """The forward outputs AOTAutograd saves for the backward (their layout is ours to choose);
    None when unknown (then every output keeps eager's layout)."""
    if kind != "forward":
        return None
    try:
        meta = compat.aot_forward_metadata()
        sl = getattr(meta, "tensors_saved_for_backwards_slice", None)
    except Exception:  # noqa: BLE001 - any AOTAutograd change: keep every output's layout
        return None
    return sl if isinstance(sl, slice) else None


def sync_placeholders(gm: fx.GraphModule, example_inputs: Sequence[object]) -> list[str]:
    """Give placeholders the strides of the example inputs where only strides differ (a backward
    graph whose saved activations the forward produced in channels_last). Returns their names."""
    mode = fake_mode_of(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if mode is None or len(placeholders) != len(example_inputs):
        return []
    changed = []
    for node, ex in zip(placeholders, example_inputs):
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(ex, torch.Tensor)):
            continue
        if val.shape != ex.shape or val.dtype != ex.dtype or _same_layout(val, ex.stride()):
            continue
        if any(not isinstance(s, int) for s in (*ex.shape, *ex.stride())):
            continue
        with mode:
            node.meta["val"] = torch.empty_strided(tuple(ex.shape), tuple(ex.stride()), dtype=ex.dtype,
                                                   device=val.device)
        changed.append(node.name)
    return changed


def _convert(gm: fx.GraphModule, mode: object, src: fx.Node, before: fx.Node,
             stride: tuple[int, ...] | None = None) -> fx.Node:
    """``src`` copied to channels_last (``stride`` None) or to exactly ``stride``."""
    val = src.meta["val"]
    with gm.graph.inserting_before(before):
        if stride is None:
            return add_node(gm.graph, mode, aten.clone.default, (src,), {"memory_format": torch.channels_last})
        for fmt in (torch.contiguous_format, torch.channels_last):
            if (fmt == torch.contiguous_format or val.dim() == 4) and all(
                    size == 1 or a == b for size, a, b in zip(val.shape, dense_strides(val.shape, fmt), stride)):
                return add_node(gm.graph, mode, aten.clone.default, (src,), {"memory_format": fmt})
        # Any other layout: a clone whose metadata names the strides; generated kernels allocate
        # exactly what the metadata says.
        with mode:
            want = torch.empty_strided(tuple(val.shape), tuple(stride), dtype=val.dtype, device=val.device)
        return add_node(gm.graph, mode, aten.clone.default, (src,), val=want)


def dense_strides(shape: Sequence[int], fmt: torch.memory_format = torch.contiguous_format) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` in ``fmt`` (contiguous or, for 4-D, channels_last)."""
    order = [1, 3, 2, 0] if fmt == torch.channels_last else list(range(len(shape) - 1, -1, -1))
    out = [0] * len(shape)
    step = 1
    for d in order:
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


def _where(node: fx.Node) -> str:
    return f"{node.name} ({tuple(node.meta['val'].shape)})"


def to_channels_last(gm: fx.GraphModule, kind: str = "inference",
                     example_inputs: Sequence[object] | None = None) -> int:
    """The pass (see the module docstring). Returns how many nodes it inserted or re-strided."""
    record: dict = {"conversions": [], "synced_inputs": [], "output_strides": [], "convolutions": 0}
    gm.meta[LAYOUT_META] = record
    mode = fake_mode_of(gm)
    if mode is None:
        return 0
    changed = 0
    captured = {n: n.meta.get("val") for n in gm.graph.nodes}  # what each node's metadata was
    if kind == "backward" and example_inputs is not None:
        record["synced_inputs"] = sync_placeholders(gm, example_inputs)
        changed += len(record["synced_inputs"])
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CONV_ARGS
             and all(_is_4d(n.args[i]) for i in _CONV_ARGS[n.target])]
    record["convolutions"] = len(convs)
    acts = sum(_bytes(n.args[0]) for n in convs)
    # Only weights cuDNN would convert on every call count: one that is channels_last already, or
    # a cast (autocast's bf16 copy of the parameter) that can write it so, costs nothing more.
    weights = sum(_bytes(w) for n in convs for w in (n.args[_WEIGHT_ARG[n.target]],)
                  if not (_is_4d(w) and is_channels_last(w.meta["val"])) and not _castable(w))
    tuning = settings()
    if convs and acts < tuning.layout_min_activation_to_weight * weights:
        record["skipped"] = f"convolution activations {acts} B < weights {weights} B: NCHW kept"
        convs = []
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    original = [_strides_of(_val(o)) for o in outs]
    if not convs and not record["synced_inputs"]:
        record["output_strides"] = original
        return 0
    # One sweep in graph order: each node's metadata is recomputed from its (already updated)
    # inputs, so a convolution sees whether its input is channels_last by now, and converts only
    # what is not (the graph's input, parameters, a tensor from an op that ignores layouts).
    converted: dict[fx.Node, fx.Node] = {}
    conv_set = set(convs)
    # A node's metadata is recomputed only when an input's changed (a new object: see _rerun) or
    # the pass rewrote its arguments: a fake-tensor dispatch per node was most of the pass (0.6 s
    # of vgg16's 1.0 s of Ember stages on the H100).
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        args_before = node.args
        if node in conv_set:
            w = node.args[_WEIGHT_ARG[node.target]]
            if isinstance(w, fx.Node) and not is_channels_last(w.meta["val"]) and _cast_to_channels_last(w, mode):
                record["conversions"].append(f"{_where(w)} -> channels_last (its cast writes it: weight of {node.name})")
                changed += 1
            args = list(node.args)
            for i in _CONV_ARGS[node.target]:
                src = args[i]
                if is_channels_last(src.meta["val"]):
                    continue
                if src not in converted:
                    converted[src] = _convert(gm, mode, src, node)
                    weight = (node.target == aten.convolution.default and i == 1) or i == 2
                    record["conversions"].append(f"{_where(src)} -> channels_last "
                                                 f"({'weight' if weight else 'activation'} of {node.name})")
                args[i] = converted[src]
            node.args = tuple(args)
        if node.target in _FOLLOWS_INPUT and (src := _convert_input_for_conv(gm, mode, node, converted)):
            record["conversions"].append(f"{_where(src)} -> channels_last (input of {node.name}, which a "
                                         "convolution reads)")
        if node.target in _MERGING_VIEWS and convs:
            changed += _restride_for_merge(node, mode)
        if not tuning.layout_incremental or node.args is not args_before or any(
                a.meta.get("val") is not captured.get(a) for a in node.all_input_nodes):
            changed += _rerun(node, mode)
        if node.target in _PAD_AS_3D and _pad_over_nhwc(gm, mode, node, record["conversions"]):
            record["conversions"].append(f"{_where(node)}: {node.target.__name__} runs as its 3-D form over the "
                                         "NHWC view (channels_last in and out, no copies)")
            changed += 1
    # Outputs the caller sees go back to eager's layout; saved activations keep ours.
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    saved = saved_output_slice(kind)
    saved_idx = set(range(len(outs))[saved]) if saved is not None else set()
    back: dict[tuple[fx.Node, tuple], fx.Node] = {}
    new_outs = list(outs)
    for i, (o, want) in enumerate(zip(outs, original)):
        val = _val(o)
        if i in saved_idx or want is None or not isinstance(val, torch.Tensor) or val.numel() <= 1:
            continue
        if o.op != "call_function" or _same_layout(val, want):
            continue
        key = (o, want)
        if key not in back:
            back[key] = _convert(gm, mode, o, output, stride=want)
            record["conversions"].append(f"{_where(o)} -> eager layout {want} (graph output {i})")
        new_outs[i] = back[key]
    if back:
        output.args = (type(output.args[0])(new_outs) if isinstance(output.args[0], (list, tuple))
                       else new_outs[0],)
        changed += len(back)
    record["output_strides"] = [_strides_of(_val(o)) for o in new_outs]
    return changed + len(converted)


# Ember's ops whose output takes its first input's memory format.
_FOLLOWS_INPUT = {reflection_pad.FORWARD_OP}


def _convert_input_for_conv(gm: fx.GraphModule, mode: object, node: fx.Node,
                            converted: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """A layout-following op on an NCHW tensor that feeds a convolution (the first layer's padding
    of the graph's input): convert its smaller input instead of its output. The input it converted."""
    src = node.args[0]
    if not _is_4d(src) or is_channels_last(_val(src)):
        return None
    if not any(u.target in _CONV_ARGS and u.args[0] is node for u in node.users):
        return None
    if src not in converted:
        converted[src] = _convert(gm, mode, src, node)
    node.args = (converted[src], *node.args[1:])
    return src


# 2-D reflection / replication padding and their backward ops -> the 3-D op over the NHWC view.
_PAD_AS_3D = {
    aten.reflection_pad2d.default: aten.reflection_pad3d.default,
    aten.replication_pad2d.default: aten.replication_pad3d.default,
    aten.reflection_pad2d_backward.default: aten.reflection_pad3d_backward.default,
    aten.replication_pad2d_backward.default: aten.replication_pad3d_backward.default,
}
_PAD_BACKWARD = {aten.reflection_pad2d_backward.default, aten.replication_pad2d_backward.default}


def _pad_over_nhwc(gm: fx.GraphModule, mode: object, node: fx.Node, converted_input: list[str]) -> bool:
    """Run a 2-D padding op (or its backward) on channels_last tensors as the 3-D op over their NHWC
    view: x (N, C, H, W) channels_last is x.permute(0, 2, 3, 1), a contiguous (N, H, W, C); as
    (N, 1, H, W, C) its H and W are the 3-D op's depth and height, C its unpadded width. ATen's 2-D
    kernels make their input contiguous and write NCHW, so each padded layer of a channels_last
    graph copied its input, then its output back for the next convolution, and the backward the
    same (45 copies, 1.1 ms of a style_transfer training step on the H100). The padding order is
    (left, right, top, bottom[, front, back]) from the last dim: (0, 0, left, right, top, bottom)."""
    backward = node.target in _PAD_BACKWARD
    tensors = list(node.args[:2] if backward else node.args[:1])
    pad = node.args[2] if backward else node.args[1]
    if not (isinstance(pad, (list, tuple)) and len(pad) == 4 and all(isinstance(p, int) for p in pad)):
        return False
    if not all(_is_4d(t) for t in tensors) or len(node.users) == 0:
        return False
    if not all(is_channels_last(_val(t)) for t in tensors):
        # A forward padding that feeds a convolution (the first layer's, on the NCHW input): convert
        # its input instead of its larger output, and the saved padded input is channels_last too.
        if backward or not any(u.target in _CONV_ARGS and u.args[0] is node for u in node.users):
            return False
        tensors = [_convert(gm, mode, tensors[0], node)]
        converted_input.append(f"{_where(node.args[0])} -> channels_last (input of {node.name}, which a "
                               "convolution reads)")
    with gm.graph.inserting_before(node):
        views = [add_node(gm.graph, mode, aten.unsqueeze.default,
                          (add_node(gm.graph, mode, aten.permute.default, (t, [0, 2, 3, 1])), 1)) for t in tensors]
        pad3d = add_node(gm.graph, mode, _PAD_AS_3D[node.target], (*views, [0, 0, *pad]))
        nhwc = add_node(gm.graph, mode, aten.squeeze.dims, (pad3d, [1]))
        out = add_node(gm.graph, mode, aten.permute.default, (nhwc, [0, 3, 1, 2]))
    if tuple(_val(out).shape) != tuple(_val(node).shape) or not is_channels_last(_val(out)):
        raise AssertionError(f"{node.name}: the 3-D padding over the NHWC view gave {_val(out).shape} "
                             f"{_val(out).stride()} for {_val(node).shape}")
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return True


_VIEWS = {aten.view.default, aten._unsafe_view.default}
_MERGING_VIEWS = _VIEWS | {aten.reshape.default}


def _merge_groups(src_shape: Sequence[int], out_shape: Sequence[int]) -> list[list[int]] | None:
    """For a reshape that only merges runs of adjacent dims: the source dims of each output dim."""
    groups, d = [], 0
    for size in out_shape:
        if d >= len(src_shape):
            return None
        run, prod = [d], src_shape[d]
        d += 1
        while prod < size and d < len(src_shape):
            run.append(d)
            prod *= src_shape[d]
            d += 1
        if prod != size:
            return None
        groups.append(run)
    return groups if d == len(src_shape) else None


def _restride_for_merge(node: fx.Node, mode: object) -> int:
    """A reshape merging dims of a freshly computed tensor into a 4-D activation (generated
    pooling's backward: (n, c, h/2, 2, w/2, 2) -> (n, c, h, w)): give the producer the strides
    of a channels_last 4-D tensor split into those dims, so the reshape is a view. PyTorch's
    stride rules gave the producer a layout the merge cannot view, and the reshape copied the
    gradient of every pooling layer (1.7 ms of a vgg16 step). The producer must be a pointwise
    op read by nothing else: its generated kernel allocates exactly the strides its metadata has."""
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op != "call_function" or len(src.users) != 1:
        return 0
    val, out = _val(src), _val(node)
    if not (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)) or out.dim() != 4 or val.dim() <= 4:
        return 0
    if classify(src).cls != OpClass.POINTWISE or src.target in RANGE_SELECT_OPS:
        return 0
    groups = _merge_groups(tuple(val.shape), tuple(out.shape))
    if groups is None or _viewable(val, tuple(out.shape)):
        return 0  # a merge the producer's layout already views (a window partition's .contiguous()):
        # re-striding it would turn the views after it into copies
    stride = [0] * val.dim()
    for out_stride, run in zip(dense_strides(tuple(out.shape), torch.channels_last), groups):
        step = out_stride
        for d in reversed(run):
            stride[d] = step
            step *= max(val.shape[d], 1)
    if _same_layout(val, stride):
        return 0
    with mode:
        src.meta["val"] = torch.empty_strided(tuple(val.shape), tuple(stride), dtype=val.dtype, device=val.device)
    if node.target != aten.reshape.default:
        node.target = aten.reshape.default
    return 1


def _viewable(val: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether a tensor laid out as ``val`` can be viewed as ``shape`` without a copy."""
    try:
        torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype, device="meta").view(shape)
    except (RuntimeError, ValueError):  # ValueError: the meta kernel's "Cannot view a tensor ..."
        return False
    return True


def _rerun(node: fx.Node, mode: object) -> int:
    """Recompute ``node``'s metadata from its inputs' (as graph_edit.refresh_metadata does for a
    whole graph); 1 if its strides changed. Metadata whose strides did not change keeps its
    object, which tells the nodes downstream that they need no re-run."""
    if node.meta.get(FROZEN):
        return 0
    old = node.meta.get("val")
    if settings().layout_incremental and isinstance(old, torch.Tensor) and (node.target in _SIMPLE_VIEWS or
                                                          (classify(node).cls == OpClass.POINTWISE
                                                           and node.target not in RANGE_SELECT_OPS)):
        fast = _view_val(node, old, mode) if node.target in _SIMPLE_VIEWS else _pointwise_val(node, old, mode)
        if fast is not None:
            if _strides_of(fast) == _strides_of(old):
                return 0
            node.meta["val"] = fast
            return 1
    try:
        with mode:
            new = node.target(*fx.node.map_arg(node.args, _val), **fx.node.map_arg(node.kwargs, _val))
    except Exception:  # noqa: BLE001 - ops without fake kernels keep what capture recorded
        if node.target not in _VIEWS:
            return 0
        # A view of a channels_last tensor (flatten) may not be expressible as a view: reshape
        # copies exactly when it must.
        node.target = aten.reshape.default
        with mode:
            new = node.target(*fx.node.map_arg(node.args, _val), **fx.node.map_arg(node.kwargs, _val))
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor) or old.shape != new.shape or old.dtype != new.dtype:
            return 0  # never trust a re-run that disagrees on more than layout
        if old.stride() == new.stride():
            return 0
        node.meta["val"] = new
        return 1
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new) and all(
            _strides_of(a) == _strides_of(b) for a, b in zip(old, new)):
        return 0  # a multi-output op (batch norm) whose outputs kept their strides
    node.meta["val"] = new
    return 0


_SIMPLE_VIEWS = {aten.unsqueeze.default, aten.select.int, aten.alias.default, aten.permute.default}


def _view_val(node: fx.Node, old: torch.Tensor, mode: object) -> torch.Tensor | None:
    """The metadata of a simple view from its base's, by ATen's own stride rules, as one
    ``as_strided`` of the base (so it still aliases it): a fake dispatch of these views on the
    6-D window tensors of generated pooling took 1.5 to 2.2 ms each on the H100 machine."""
    base = _val(node.args[0])
    if not isinstance(base, torch.Tensor) or any(isinstance(a, fx.Node) for a in node.args[1:]):
        return None
    shape, stride, offset = list(base.shape), list(base.stride()), base.storage_offset()
    target = node.target
    if target == aten.unsqueeze.default:
        dim = node.args[1] % (base.dim() + 1)
        shape.insert(dim, 1)
        stride.insert(dim, shape[dim + 1] * stride[dim] if dim < base.dim() else 1)
    elif target == aten.select.int:
        dim = node.args[1] % base.dim()
        index = node.args[2] % shape[dim] if shape[dim] else 0
        offset += index * stride[dim]
        del shape[dim], stride[dim]
    elif target == aten.permute.default:
        dims = [d % base.dim() for d in node.args[1]]
        shape, stride = [shape[d] for d in dims], [stride[d] for d in dims]
    if tuple(shape) != tuple(old.shape):
        return None
    if tuple(stride) == old.stride() and offset == old.storage_offset():
        return old
    with mode:
        return aten.as_strided.default(base, shape, stride, offset)


def _pointwise_val(node: fx.Node, old: torch.Tensor, mode: object) -> torch.Tensor | None:
    """The metadata of a pointwise node without a fake-tensor dispatch (about 8 us against 60 for
    the dispatch on this machine), where it is certain: every input that can order the output's
    dims (one with two or more non-broadcast dims) has the output's shape and one set of strides
    and is dense, so TensorIterator gives the output exactly those strides. None otherwise."""
    if "memory_format" in node.kwargs or any(size == 1 for size in old.shape):
        return None  # a layout asked for; size-1 dims, whose strides TensorIterator picks itself
    tensors = [v for v in (_val(a) for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]
    deciding = [t for t in tensors if sum(1 for size in t.shape if size != 1) >= 2]
    if not deciding or any(tuple(t.shape) != tuple(old.shape) for t in deciding):
        return None
    stride = deciding[0].stride()
    if any(t.stride() != stride for t in deciding) or not is_dense(deciding[0]):
        return None
    if any(t.device != old.device for t in tensors if t.dim() > 0):
        return None
    if stride == old.stride():
        return old
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        meta = torch.empty_strided(tuple(old.shape), tuple(stride), dtype=old.dtype, device="meta")
        return FakeTensor(mode, meta, old.device)
    except Exception:  # noqa: BLE001 - a torch without this constructor: dispatch instead
        return None


def layout_summary(gm: fx.GraphModule) -> dict:
    """What the pass did to ``gm`` (empty when it did not run): explain's layout section."""
    return dict(gm.meta.get(LAYOUT_META, {}))


def report_output_strides(kind: str, summary: dict) -> None:
    """Tell AOTAutograd the strides of a forward graph's outputs, so the backward graph is
    compiled for the saved activations' real layout (see the module docstring)."""
    strides = summary.get("output_strides") if summary else None
    if kind != "forward" or not strides:
        return
    with contextlib.suppress(Exception):  # reporting is an optimisation; never fail on it
        tc = compat.tracing_context()
        if tc is not None and isinstance(tc.output_strides, list):
            tc.output_strides.extend(list(s) if s is not None else None for s in strides)
