"""Tuned library choices on the GPU code path: per site, the library call or Ember's kernel.

Matmuls: every ``mm``, ``addmm`` (a bias with one value per column), ``bmm`` and
``ember::small_bmm`` left by the passes before this one, with bf16/fp16 operands of static sizes,
is a ``LibrarySite`` ("matmul"). Its first implementation is what the rules produced (``cublas``,
or ``small_bmm`` where that rule took the product); the others are ``cublas`` and ``tiled``
(``ember::tiled_matmul`` with a tile configuration). An ``addmm`` whose only reader is a ReLU has
it as the site's epilogue, and also ``cublaslt``: ``aten._addmm_activation``, which asks cuBLASLt
for the ReLU in its epilogue (ATen applies it after the product where cuBLASLt cannot); the rule
leaves the ReLU to a generated kernel. (cuBLASLt's GELU epilogue is the tanh approximation; the
GPU code path has decomposed every GELU into its formula for fusion before this pass, so none is
offered.)

Depthwise convolutions: every ``aten.convolution`` / ``convolution_backward`` that Ember's
depthwise kernels take (passes/depthwise.py's rule) and cuDNN runs, is a site ("conv" /
"conv_backward") whose implementations are ``cudnn`` (the rule) and ``ember``. Where
``EMBER_DEPTHWISE=1`` already gave them to Ember's kernels, they are not sites.

Attention in inference graphs: every ``_scaled_dot_product_*_attention`` call whose output alone
is read (no log-sum-exp saved for a backward), without dropout, is a site ("attention") whose
implementations are the backend the dispatcher picked at capture (the rule) and the others with
a fake kernel for its inputs: ``flash`` (no mask), ``efficient``, ``cudnn`` and ``math`` (ATen's
composite) on the GPU, ``math`` beside ``flash_cpu`` on CPU tensors; on the GPU code path also
``ember`` (``ember::attention``, ops/attention.py, one candidate per tile configuration) where it
takes the call. Where the chosen backend lays its output out otherwise (``math``'s is contiguous,
the others' heads-inner), the ops after it are planned again for its strides (passes/strided_results.py), a copy only where a view cannot
follow; the whole-model check of ``ember tune`` times that cost with the rest.

The CPU target's inference graphs get the attention choice alone (their matmuls and convolutions
are the CPU library pass's sites; no generated kernel). Each site is offered to the tuning
database's chooser; a tuned answer replaces the node, no answer keeps the rule's. Runs last
among the GPU passes, so the calls it sees are those the program would run (padded, merged, laid out channels_last, or Ember's small products).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ember.ops import attention, tiled_matmul
from ember.passes import depthwise
from ember.passes.graph_edit import add_node, fake_mode_of, fake_result, node_val, same_value
from ember.passes.library_sites import Choose, LibraryChoice, LibrarySite, tensor_sig
from ember.passes.strided_results import refresh_downstream, restore_output_strides, same_layout

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
    activation = activation_after(node)
    if activation is not None:
        impls += ("cublaslt",)
    return LibrarySite("matmul", tensor_sig(a), tensor_sig(b), tensor_sig(bias) if bias is not None else None, (),
                       activation[0] if activation is not None else "none", impls=impls, device_type=device_type)


def activation_after(node: fx.Node) -> tuple[str, fx.Node] | None:
    """("relu", node) where an ``addmm``'s only reader is a ReLU of it (cuBLASLt can apply it in its
    epilogue); None otherwise. In training the ReLU's backward reads the ReLU's output, not the
    product, so the product has no other reader there either."""
    if node.target is not aten.addmm.default or len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op == "call_function" and user.target is aten.relu.default and user.args == (node,) and not user.kwargs:
        return "relu", user
    return None


_GRADS = ("input", "weight", "bias")


def conv_site(node: fx.Node, device_type: str) -> LibrarySite | None:
    """The site of a depthwise convolution or its backward that cuDNN runs and Ember's kernels
    take, or None."""
    if node.target is aten.convolution.default:
        x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
        op, grad, grads = "conv", None, "none"
    elif node.target is aten.convolution_backward.default:
        grad, x, weight, _, stride, padding, dilation, transposed, output_padding, groups, mask = node.args
        bias = None
        users = list(node.users)
        if not users or any(u.target is not operator.getitem or not mask[u.args[1]] for u in users):
            return None
        op, grads = "conv_backward", "grads:" + ",".join(_GRADS[i] for i in sorted({u.args[1] for u in users}))
    else:
        return None
    if not depthwise.takes(node_val(x), node_val(weight), stride, padding, dilation, transposed, output_padding,
                           groups):
        return None
    vals = [node_val(t) for t in (weight, bias, grad) if t is not None]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    sig = {name: tensor_sig(node_val(t)) if t is not None else None for name, t in
           (("bias", bias), ("grad", grad))}
    params = (tuple(stride), tuple(padding), tuple(dilation), groups)
    return LibrarySite(op, tensor_sig(node_val(x)), tensor_sig(node_val(weight)), sig["bias"], params, grads,
                       other=sig["grad"], impls=("cudnn", "ember"), device_type=device_type)


def _replace_product(gm: fx.GraphModule, mode: object, node: fx.Node, choice: LibraryChoice) -> bool:
    a, b, bias = _operands(node)  # type: ignore[misc]
    if choice.impl == "cublaslt":
        return _fuse_activation(gm, mode, node, a, b, bias)
    with gm.graph.inserting_before(node):
        if choice.impl == "tiled":
            new = add_node(gm.graph, mode, torch.ops.ember.tiled_matmul.default,
                           (a, b, bias, tiled_matmul.tiles_of(choice.config)))
        else:  # cuBLAS where the small-product rule took it
            new = add_node(gm.graph, mode, aten.bmm.default, (a, b))
    if not same_value(new.meta["val"], node_val(node)):
        gm.graph.erase_node(new)  # planned for other strides: keep the rule's product
        return False
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return True


def _fuse_activation(gm: fx.GraphModule, mode: object, node: fx.Node, a: object, b: object, bias: object) -> bool:
    """The addmm and the activation that alone reads it, as one ``_addmm_activation``."""
    found = activation_after(node)
    if found is None:
        return False
    _, activation = found
    with gm.graph.inserting_before(activation):
        new = add_node(gm.graph, mode, aten._addmm_activation.default, (bias, a, b))
    if not same_value(new.meta["val"], node_val(activation)):
        gm.graph.erase_node(new)
        return False
    new.meta["stack_trace"] = activation.meta.get("stack_trace")
    activation.replace_all_uses_with(new)
    gm.graph.erase_node(activation)
    gm.graph.erase_node(node)
    return True


_ATTENTION = {aten._scaled_dot_product_flash_attention.default: "flash",
              aten._scaled_dot_product_efficient_attention.default: "efficient",
              aten._scaled_dot_product_cudnn_attention.default: "cudnn",
              aten._scaled_dot_product_flash_attention_for_cpu.default: "flash_cpu"}


def attention_call(impl: str, q: object, k: object, v: object, mask: object, causal: bool, scale: object,
                   config: dict | None = None) -> tuple[object, tuple, dict]:
    """(op, args, kwargs) of attention without dropout as ``impl`` computes it (output: item 0;
    ``config``: the tiles of Ember's kernel, ``ember``)."""
    if impl == "ember":
        return torch.ops.ember.attention.default, (q, k, v, mask, causal, scale, attention.tiles_of(config or {})), {}
    if impl == "flash":
        return aten._scaled_dot_product_flash_attention.default, (q, k, v, 0.0, causal, False), {"scale": scale}
    if impl == "efficient":
        return aten._scaled_dot_product_efficient_attention.default, (q, k, v, mask, False, 0.0, causal), \
            {"scale": scale}
    if impl == "cudnn":
        return aten._scaled_dot_product_cudnn_attention.default, (q, k, v, mask, False, 0.0, causal, False), \
            {"scale": scale}
    if impl == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, causal), \
            {"attn_mask": mask, "scale": scale}
    return aten._scaled_dot_product_attention_math.default, (q, k, v, mask, 0.0, causal), {"scale": scale}


def _attention_operands(node: fx.Node) -> tuple | None:
    """(q, k, v, mask, causal, scale) of an attention call without dropout, or None."""
    args, kwargs = node.args, node.kwargs

    def arg(index: int, name: str, default: object) -> object:
        return args[index] if len(args) > index else kwargs.get(name, default)
    if _ATTENTION[node.target] in ("flash", "flash_cpu"):
        mask, dropout, causal = kwargs.get("attn_mask"), arg(3, "dropout_p", 0.0), arg(4, "is_causal", False)
    else:
        mask, dropout, causal = arg(3, "attn_bias", None), arg(5, "dropout_p", 0.0), arg(6, "is_causal", False)
    return None if dropout else (*args[:3], mask, bool(causal), kwargs.get("scale"))


def attention_site(node: fx.Node, mode: object, device_type: str, generated: bool = True) -> LibrarySite | None:
    """The site of an attention call whose output alone is read, or None. ``generated``: Ember's
    kernel among the candidates (the GPU code path) where it takes the call."""
    users = list(node.users)
    if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return None
    operands = _attention_operands(node)
    if operands is None:
        return None
    q, k, v, mask, causal, scale = operands
    vals = [node_val(t) for t in (q, k, v)]
    mask_val = node_val(mask) if mask is not None else None
    old = node_val(users[0])
    tensors = [*vals, old] + ([mask_val] if mask is not None else [])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors[:4]) or \
            not all(isinstance(t, torch.Tensor) and all(type(s) is int for s in (*t.shape, *t.stride()))
                    for t in tensors):
        return None
    rule = _ATTENTION[node.target]
    others = ("flash", "efficient", "cudnn", "math") if device_type == "cuda" else ("flash_cpu", "math")
    if generated and attention.takes(*vals, mask_val):
        others += ("ember",)
    impls = [rule]
    for impl in others:  # (one whose output has other strides: the ops after it are planned again)
        if impl == rule or (impl == "flash" and mask is not None):
            continue
        try:
            val = fake_result(mode, *attention_call(impl, q, k, v, mask, causal, scale))[0]
        except Exception:  # noqa: BLE001 - a backend without a fake kernel for these inputs is no candidate
            continue
        if val.shape == old.shape and val.dtype == old.dtype:
            impls.append(impl)
    if len(impls) == 1:
        return None
    return LibrarySite("attention", tensor_sig(vals[0]), tensor_sig(vals[1]),
                       tensor_sig(mask_val) if mask is not None else None, (causal, scale), "none",
                       other=tensor_sig(vals[2]), impls=tuple(impls), device_type=device_type)


def _replace_attention(gm: fx.GraphModule, mode: object, node: fx.Node, choice: LibraryChoice,
                       restrided: set[fx.Node]) -> bool:
    """Replace the call; an output in other strides than the rule's joins ``restrided``."""
    q, k, v, mask, causal, scale = _attention_operands(node)  # type: ignore[misc]
    target, args, kwargs = attention_call(choice.impl, q, k, v, mask, causal, scale, choice.config)
    before = node_val(next(iter(node.users)))
    with gm.graph.inserting_before(node):
        new = add_node(gm.graph, mode, target, args, kwargs)
        out = add_node(gm.graph, mode, operator.getitem, (new, 0), val=new.meta["val"][0])
    new.meta["stack_trace"] = out.meta["stack_trace"] = node.meta.get("stack_trace")
    for user in list(node.users):
        user.replace_all_uses_with(out)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not same_layout(out.meta["val"], before.stride()):
        restrided.add(out)
    return True


def choose_gpu_library_implementations(gm: fx.GraphModule, choose: Choose, device_type: str,
                                       attention_only: bool = False) -> int:
    """Replace every matmul, depthwise convolution and attention call whose site has a tuned
    implementation; returns how many. ``attention_only``: the attention calls alone (CPU
    inference, where matmuls and convolutions are the CPU library pass's choices)."""
    mode = None
    changed = 0
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    original_outs = [node_val(o) for o in outs]
    captured = {n: node_val(n) for n in gm.graph.nodes}  # each node's value before the pass
    restrided: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or (attention_only and node.target not in _ATTENTION):
            continue
        if node.target in (*_PRODUCTS, torch.ops.ember.small_bmm.default):
            site = matmul_site(node, device_type)
        elif node.target in (aten.convolution.default, aten.convolution_backward.default):
            site = conv_site(node, device_type)
        elif node.target in _ATTENTION:
            if mode is None:
                mode = fake_mode_of(gm)
            site = attention_site(node, mode, device_type, generated=not attention_only)
        else:
            continue
        choice = choose(site) if site is not None else None
        if choice is None or choice.impl == site.impls[0] or choice.impl not in site.impls:
            continue
        if mode is None:
            mode = fake_mode_of(gm)
        if site.op == "matmul":
            applied = _replace_product(gm, mode, node, choice)
        elif site.op == "attention":
            applied = _replace_attention(gm, mode, node, choice, restrided)
        elif site.op == "conv":
            applied = depthwise.forward_to_ember(gm, mode, node)
        else:
            applied = depthwise.backward_to_ember(gm, mode, node)
        changed += bool(applied)
        if not applied and choice.declined is not None:
            choice.declined()
    if restrided:  # the ops after an output in new strides: planned again, graph outputs copied back
        refresh_downstream(gm, mode, restrided, captured, "attention choice")
        restore_output_strides(gm, mode, output, original_outs)
    return changed
