"""CPU inference: convolutions and linear layers as oneDNN calls with fused epilogues.

Measured on the 2-core AMD EPYC (AVX-512) development machine, fp32, torch 2.14.1:
- ``mkldnn._linear_pointwise`` runs BERT's 128x3072x768 GEMM in 1.40 ms where ``addmm``
  (MKL) takes 3.03 ms, with the same fp32 accuracy (max error vs float64 1e-6 relative).
- a channels_last ``max_pool2d`` takes 0.13 ms where NCHW takes 2.30 ms (1x64x112x112);
  oneDNN convolutions return channels_last, so everything after the first one is.
- a convolution with its weight reordered once (``_reorder_convolution_weight``, frozen) and
  ReLU / hardswish / add+ReLU fused as oneDNN post-ops replaces conv + normalisation + one or
  two elementwise passes over the activation.

Rules (each a plain check on the node): one dtype for input, weight, bias and output: float32, or bfloat16 where
oneDNN has native bf16 kernels (AVX512-BF16 / AMX); frozen weight (and bias), 2-D convolution not
transposed; linear = ``addmm(bias, X, t(W))`` or ``mm(X, t(W))`` with 2-D X. A post-op is fused
when the op's only user is one of ``_UNARY`` (through one view for linear) or, for
convolutions, an ``add`` of a same-shape tensor optionally followed by ReLU.

The rule (oneDNN for both) is the default. A chooser (``choose``, from the tuning database:
tune/apply.py) may pick another implementation per site (passes/library_sites.py): ATen's op as
captured, or for float32 linear layers MKL's packed GEMM (``mkl._mkl_linear``); the epilogue then
stays in the graph as its own kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ember.passes.freeze import is_frozen
from ember.passes.graph_edit import add_node, fake_mode_of, refresh_metadata
from ember.passes.library_sites import Choose, LibrarySite, tensor_sig

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn

# ATen op -> oneDNN post-op name (the subset mkldnn._convolution_pointwise accepts).
_UNARY = {aten.relu.default: "relu", aten.hardswish.default: "hardswish", aten.sigmoid.default: "sigmoid",
          aten.tanh.default: "tanh", aten.silu.default: "swish", aten.hardsigmoid.default: "hardsigmoid"}
_LINEAR_UNARY = {aten.relu.default: "relu", aten.gelu.default: "gelu"}

LIBRARY_OPS = {mkldnn._convolution_pointwise.default, mkldnn._convolution_pointwise.binary,
               mkldnn._linear_pointwise.default}


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_convolution_pointwise")


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _library_dtypes() -> set[torch.dtype]:
    # oneDNN's bf16 kernels need AVX512-BF16 / AMX; elsewhere it emulates them slowly.
    bf16 = hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()
    return {torch.float32, torch.bfloat16} if bf16 else {torch.float32}


def _same_dtype(*nodes: object) -> bool:
    """All of ``nodes`` hold tensors of one dtype that oneDNN runs natively on this CPU."""
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    dtypes = {v.dtype for v in vals}
    return len(dtypes) == 1 and dtypes <= _library_dtypes()


def _val_sig(node: object):
    return tensor_sig(node.meta["val"]) if isinstance(node, fx.Node) else None


def _unary_name(node: fx.Node) -> str:
    if node.target == aten.gelu.default:
        return "gelu:" + node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return _UNARY.get(node.target, _LINEAR_UNARY.get(node.target, str(node.target)))


def _conv_site(conv: fx.Node, chain: list[fx.Node], unary: str, other: fx.Node | None) -> LibrarySite:
    x, weight, bias, stride, padding, dilation, _, _, groups = conv.args
    epilogue = ("add" + ("+relu" if unary == "relu" else "")) if other is not None else \
        (_unary_name(chain[-1]) if unary != "none" else "none")
    return LibrarySite("conv", _val_sig(x), _val_sig(weight), _val_sig(bias),
                       (tuple(stride), tuple(padding), tuple(dilation), groups), epilogue, _val_sig(other),
                       x_is_graph_input=x.op == "placeholder", impls=("onednn", "aten"))


def _conv(graph: fx.Graph, mode: object, conv: fx.Node, choose: Choose | None = None) -> bool:
    x, weight, bias, stride, padding, dilation, transposed, _, groups = conv.args
    wval = weight.meta.get("val")
    if (transposed or not is_frozen(weight) or (bias is not None and not is_frozen(bias))
            or not _same_dtype(conv, x, weight, *([bias] if bias is not None else []))
            or wval is None or wval.dim() != 4):
        return False
    out = conv.meta["val"]
    chain, unary, other = [conv], "none", None
    user = _only_user(conv)
    if user is not None and user.target in _UNARY and len(user.args) == 1:
        chain, unary = [conv, user], _UNARY[user.target]
    elif (user is not None and user.target == aten.add.Tensor and len(user.args) == 2 and not user.kwargs
          and user.meta["val"].shape == out.shape and user.meta["val"].dtype == out.dtype):
        a, b = user.args
        cand = b if a is conv else a
        if isinstance(cand, fx.Node) and cand is not conv and cand.meta["val"].shape == out.shape:
            chain, other = [conv, user], cand
            after = _only_user(user)
            if after is not None and after.target == aten.relu.default:
                chain, unary = [conv, user, after], "relu"
    choice = choose(_conv_site(conv, chain, unary, other)) if choose is not None else None
    if choice is not None and choice.impl == "aten":
        return False  # the tuned choice: ATen's convolution, the epilogue a kernel of its own
    with graph.inserting_before(chain[-1]):
        packed = add_node(graph, mode, mkldnn._reorder_convolution_weight.default,
                          (weight, list(padding), list(stride), list(dilation), groups, list(x.meta["val"].shape)),
                          frozen=True, val=wval)
        if other is None:
            new = add_node(graph, mode, mkldnn._convolution_pointwise.default,
                           (x, packed, bias, list(padding), list(stride), list(dilation), groups, unary, [], ""))
        else:
            # The binary overload has no fake kernel; its result is laid out like the unary one's.
            with mode:
                val = mkldnn._convolution_pointwise.default(
                    x.meta["val"], wval, None if bias is None else bias.meta["val"], list(padding), list(stride),
                    list(dilation), groups, "none", [], "")
            new = add_node(graph, mode, mkldnn._convolution_pointwise.binary,
                           (x, other, packed, bias, list(padding), list(stride), list(dilation), groups,
                            "add", 1.0, None if unary == "none" else unary, [], ""), val=val)
    _replace_chain(graph, chain, new)
    return True


def _linear_impls(x: fx.Node) -> tuple[str, ...]:
    mkl = torch.backends.mkl.is_available() and x.meta["val"].dtype == torch.float32
    return ("onednn", "mkl", "aten") if mkl else ("onednn", "aten")


def _linear(graph: fx.Graph, mode: object, node: fx.Node, choose: Choose | None = None) -> bool:
    if node.target == aten.addmm.default:
        if len(node.args) != 3 or node.kwargs:
            return False
        bias, x, wt = node.args
        if not (is_frozen(bias) and bias.meta["val"].dim() == 1):
            return False
    else:
        x, wt = node.args
        bias = None
    if not (isinstance(wt, fx.Node) and wt.target in (aten.t.default, aten.permute.default)):
        return False
    if wt.target == aten.permute.default and list(wt.args[1]) != [1, 0]:
        return False
    weight = wt.args[0]
    if not (is_frozen(weight) and _same_dtype(weight, x, node, *([bias] if bias is not None else []))
            and x.meta["val"].dim() == 2):
        return False
    chain, view, unary, algo = [node], None, "none", ""
    user = _only_user(node)
    if user is not None and user.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        after = _only_user(user)
        if after is not None and after.target in _LINEAR_UNARY:
            chain, view, unary = [node, user, after], user, _LINEAR_UNARY[after.target]
    elif user is not None and user.target in _LINEAR_UNARY:
        chain, unary = [node, user], _LINEAR_UNARY[user.target]
    last = chain[-1]
    if unary == "gelu":
        algo = last.kwargs.get("approximate", last.args[1] if len(last.args) > 1 else "none")
    if choose is not None:
        site = LibrarySite("linear", _val_sig(x), _val_sig(weight), _val_sig(bias), (),
                           f"gelu:{algo}" if unary == "gelu" else unary, impls=_linear_impls(x))
        choice = choose(site)
        impl = choice.impl if choice is not None else None
        if impl == "aten":
            return False  # the tuned choice: addmm / mm as captured, the epilogue a kernel of its own
        if impl == "mkl" and "mkl" in site.impls:
            _mkl_linear(graph, mode, node, x, weight, bias)
            return True
    with graph.inserting_before(last):
        new = add_node(graph, mode, mkldnn._linear_pointwise.default,
                       (x, weight, bias, unary, [], algo))
        if view is not None:
            new = add_node(graph, mode, view.target, (new, view.args[1]))
    _replace_chain(graph, chain, new)
    return True


def _mkl_linear(graph: fx.Graph, mode: object, node: fx.Node, x: fx.Node, weight: fx.Node,
                bias: fx.Node | None) -> None:
    """``node`` (addmm / mm of a frozen weight) -> MKL's GEMM with the weight packed once; its users
    (a view, an epilogue) are left as they are."""
    batch = x.meta["val"].shape[0]
    with graph.inserting_before(node):
        # The packed weight's shape is MKL's business; only mkl._mkl_linear reads it.
        packed = add_node(graph, mode, torch.ops.mkl._mkl_reorder_linear_weight.default, (weight, batch),
                          frozen=True, val=weight.meta["val"])
        new = add_node(graph, mode, torch.ops.mkl._mkl_linear.default, (x, packed, weight, bias, batch))
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _replace_chain(graph: fx.Graph, chain: list[fx.Node], new: fx.Node) -> None:
    """``chain`` (first op .. its last fused user, each the only user of the one before) -> ``new``."""
    chain[-1].replace_all_uses_with(new)
    for n in reversed(chain):
        graph.erase_node(n)


def lower_cpu_library_calls(gm: fx.GraphModule, choose: Choose | None = None) -> int:
    """Rewrite float32 (and, where the CPU has native bf16, bfloat16) convolutions and linear
    layers with frozen weights into oneDNN calls (or what ``choose`` picks per site)."""
    mode = fake_mode_of(gm)
    if mode is None or not available():
        return 0
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    before = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in _flat(output.args[0])]
    lowered = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.convolution.default:
            lowered += _conv(graph, mode, node, choose)
        elif node.target in (aten.addmm.default, aten.mm.default):
            lowered += _linear(graph, mode, node, choose)
    if lowered:
        refresh_metadata(gm, mode)
        _keep_output_layouts(graph, mode, output, before)
    return lowered


def _flat(value: object) -> list:
    return [x for v in value for x in _flat(v)] if isinstance(value, (list, tuple)) else [value]


def _keep_output_layouts(graph: fx.Graph, mode: object, output: fx.Node, before: list) -> None:
    """The program returns what eager returns: outputs that became channels_last are copied back."""
    for node, old in zip(_flat(output.args[0]), before):
        new = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.stride() == new.stride():
            continue
        if not old.is_contiguous():
            continue
        with graph.inserting_before(output):
            copy = add_node(graph, mode, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        output.replace_input_with(node, copy)
