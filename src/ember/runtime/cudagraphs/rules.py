"""When a compiled program may run as a CUDA graph: ``cudagraph_blocker`` and its rules.

A pure function of the captured graph, its example inputs, its kind, the target and the on/off
switch, so that the decision can be tested without a GPU and printed by ``ember.explain``. A
program is refused when a replay could get it wrong: an op that waits for the device or has a
data-dependent shape, a random op outside the default generator's philox stream, an input whose
shape or strides change in place, or a CPU tensor computed inside. How a captured program is then
run is ``runtime/cudagraphs/runner.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx

from ember.config import Options, settings
from ember.graph_utils import get_attr
from ember.targets import BY_NAME

aten = torch.ops.aten

# Ops that wait for the device or produce data-dependent shapes on the host.
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.argwhere.default,
    aten.masked_select.default, aten.unique_consecutive.default, aten._unique.default,
    aten._unique2.default, aten.unique_dim.default, aten.bincount.default, aten.item.default,
    aten.equal.default, aten.is_nonzero.default,
}
# Indexing with a boolean mask calls nonzero() on the host.
_MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  aten._index_put_impl_.default}
# Random ops (packet names) whose CUDA kernels draw from the default generator's philox stream,
# which torch.cuda.CUDAGraph registers for capture and advances on every replay.
GRAPH_SAFE_RANDOM = {
    "native_dropout", "_fused_dropout", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "bernoulli", "bernoulli_", "uniform", "uniform_", "normal", "normal_",
    "exponential", "exponential_", "geometric", "geometric_", "cauchy", "cauchy_", "log_normal",
    "log_normal_", "random", "random_",
    # Attention with dropout: under capture the flash kernel takes seed and offset from the
    # generator's device memory and writes them into CUDA tensors that the backward reads
    # (uncaptured they are host tensors, which the runner never captures as inputs: see
    # ``_capture``). PyTorch's own CUDA-graph support (Inductor's cudagraph trees) relies on it.
    "_scaled_dot_product_flash_attention", "_flash_attention_forward",
    # Memory-efficient attention: host seeds uncaptured, device seeds captured, and its backward
    # reads them by its own capture status. An uncaptured backward after a replayed forward once
    # read device seeds on the host (segmentation fault on the H100, BERT with dropout:
    # benchmarks/results/h100/2026-11-23_suite_compile_profile/, run 5); Ember's CUDA backward graphs
    # now pass the seeds through ember::attention_seeds, which hands either form over
    # (passes/attention_seeds.py), and a capture never reads host seeds (runtime/cudagraph.py).
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_efficient_attention_forward",
    # cuDNN attention (what torch 2.11 picks for BERT on the H100): its forward, captured and
    # replayed 8 steps, gave eager's losses within 1.5e-3 with dropout 0.1 (eager's masks;
    # benchmarks/results/h100/2026-11-23_training_cuda_graphs_check/h100_train_cudagraph_run2.json). Its backward draws nothing new: it rebuilds the
    # forward's mask from the seed and offset tensors the forward wrote on the device.
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
}
CAPTURED_KINDS = ("inference", "forward", "backward")


def cudagraphs_enabled(option: bool | None = None) -> bool:
    """The ``cudagraphs`` option of a compile (None: as config.patch / EMBER_CUDAGRAPHS / the default give it)."""
    return Options.from_env().cudagraphs if option is None else option


def training_capture_enabled() -> bool:
    """Forward/backward capture is on unless EMBER_CUDAGRAPHS_TRAINING=0 (inference stays captured)."""
    return settings().cudagraphs_training


def cudagraph_blocker(gm: fx.GraphModule, example_inputs: Sequence[object], kind: str, target: str,
                      enabled: bool | None = None) -> str | None:
    """Why this graph must not be captured, or None when it can be."""
    if not cudagraphs_enabled(enabled):
        return "turned off (cudagraphs=False or EMBER_CUDAGRAPHS=0)"
    if not BY_NAME[target].runs_on_cuda:
        return f"target {target} does not run on a CUDA device"
    if kind not in CAPTURED_KINDS:
        return f"{kind} graphs are not captured (only {', '.join(CAPTURED_KINDS)})"
    if kind != "inference" and not training_capture_enabled():
        return "training graphs are not captured (EMBER_CUDAGRAPHS_TRAINING=0)"
    devices = set()
    for i, t in enumerate(example_inputs):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"input {i} is a Python {type(t).__name__}, not a tensor (a replay would reuse its first value)"
        if t.device.type != "cuda":
            return f"input {i} is on {t.device}"
        devices.add(str(t.device))
    if len(devices) > 1:
        return f"inputs are on several devices ({', '.join(sorted(devices))})"
    return _graph_blocker(gm)


def tensor_free(gm: fx.GraphModule, example_inputs: Sequence[object]) -> bool:
    """Whether a graph neither takes nor makes a tensor (a Dynamo frame around Python-only code,
    such as a model's config checks between graph breaks): it has no device work, so a CUDA graph
    around the whole step neither holds nor misses anything of it."""
    if any(isinstance(t, torch.Tensor) for t in example_inputs):
        return False
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (list, tuple)) else [val])):
            return False
    return True


def _graph_blocker(gm: fx.GraphModule) -> str | None:
    # root: value -> the graph input it may share memory with (views, getitems of views).
    root: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = node
        elif node.op == "get_attr":
            val = node.meta.get("val", get_attr(gm, str(node.target), None))
            # 0-dim CPU constants are read as scalars when a kernel launches: fixed, so fine.
            if isinstance(val, torch.Tensor) and val.device.type != "cuda" and val.dim() > 0:
                return f"constant {node.target} is a tensor on {val.device}"
        elif node.op == "call_function":
            why = _sync_reason(node) or _random_reason(node) or _mutation_reason(node, root)
            if why:
                return why
            if _may_alias_input(node):
                for a in node.all_input_nodes:
                    if a in root:
                        root[node] = root[a]
                        break
            val = node.meta.get("val")
            for v in val if isinstance(val, (list, tuple)) else [val]:
                if isinstance(v, torch.Tensor) and v.device.type != "cuda":
                    return f"{node.name} ({node.target}) produces a tensor on {v.device}"
    return None


def _sync_reason(node: fx.Node) -> str | None:
    target = node.target
    if target in SYNC_OPS:
        return f"{node.name} ({target}) synchronizes with the CPU"
    if target == aten.repeat_interleave.Tensor and node.kwargs.get("output_size") is None:
        return f"{node.name} ({target}) without output_size synchronizes with the CPU"
    if target in _MASK_INDEXING and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
        for idx in node.args[1]:
            val = idx.meta.get("val") if isinstance(idx, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8):
                return f"{node.name} ({target}) indexes with a boolean mask, which synchronizes with the CPU"
    return None


def _random_reason(node: fx.Node) -> str | None:
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return None
    schema = target._schema
    if _argument(node, schema, "dropout_p") == 0:
        return None  # attention without dropout draws nothing
    gen = _argument(node, schema, "generator")
    if gen is not None:
        return (f"random op {node.name} ({target}): draws from an explicit torch.Generator; only the "
                "default CUDA generator advances between replays")
    if target._overloadpacket.__name__ not in GRAPH_SAFE_RANDOM:
        return (f"random op {node.name} ({target}): not known to draw from the default CUDA generator's "
                "philox stream, so a replay could repeat its numbers")
    return None


def _argument(node: fx.Node, schema: torch.FunctionSchema, name: str) -> object:
    """The value ``node`` passes for argument ``name`` (its default when left out; None if no such argument)."""
    for i, sarg in enumerate(schema.arguments):
        if sarg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) and not sarg.kwarg_only else sarg.default_value
    return None


def _written_args(node: fx.Node) -> list[fx.Node]:
    """Graph values ``node`` writes to, from its schema's ``(a!)`` annotations."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out: list[fx.Node] = []
    for i, sarg in enumerate(schema.arguments):
        if sarg.alias_info is None or not sarg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(sarg.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _mutation_reason(node: fx.Node, root: dict[fx.Node, fx.Node]) -> str | None:
    # Writing an input's data is fine (in place if static, copied back if dynamic: see the
    # module docstring); changing its shape or strides is not repeated by a replay.
    target = node.target
    metadata = torch.Tag.inplace_view in getattr(target, "tags", ()) or target in (
        aten.resize_.default, aten.resize_as_.default) or getattr(target, "_overloadpacket", None) is aten.set_
    if not metadata:
        return None
    for v in _written_args(node):
        if v in root:
            return (f"input {root[v].name} has its shape or strides changed in place by {node.name} ({target}); "
                    "a replay would not repeat that")
    return None


def _may_alias_input(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


# ---------------------------------------------------------------------------------------------
# Inputs the program only reads
# ---------------------------------------------------------------------------------------------


def read_only_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the graph's inputs that no op writes, through any view of them.

    A replay copies a moving input into a buffer; for these the buffer may live in the graph's
    pool and be freed after its last read, like any other consumed input (runtime/cudagraphs/runner.py).
    A written input's buffer must outlive the replay, which copies it back to the caller's tensor.
    An op without a schema (a Python function, a higher-order op) counts as writing what it reads."""
    root: dict[fx.Node, fx.Node] = {}
    written: set[fx.Node] = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = node
        elif node.op == "call_function":
            if node.target is not operator.getitem and getattr(node.target, "_schema", None) is None:
                written.update(root[a] for a in node.all_input_nodes if a in root)
            written.update(root[v] for v in _written_args(node) if v in root)
            if _may_alias_input(node):
                for a in node.all_input_nodes:
                    if a in root:
                        root[node] = root[a]
                        break
    return frozenset(i for i, p in enumerate(placeholders) if p not in written)
