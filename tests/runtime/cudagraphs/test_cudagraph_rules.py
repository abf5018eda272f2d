"""The CUDA-graph capture rule (runtime/cudagraphs/rules.py), on CPU.

CI has no GPU: ``cudagraph_blocker`` is checked on graphs with fake CUDA tensors, hand-written
ones and real AOTAutograd training graphs moved to fake CUDA. The runner that replays captured
programs is tested in test_cudagraph_runner.py.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import bn_dropout_net
from torch import fx, nn
from torch._subclasses import FakeTensorMode

import ember
from ember import config
from ember.runtime.cudagraphs.rules import cudagraph_blocker, read_only_inputs

aten = torch.ops.aten
_FAKE = FakeTensorMode(allow_non_fake_inputs=True)


def test_training_capture_is_on_by_default_and_can_be_turned_off() -> None:
    from ember.runtime.cudagraphs.runner import training_capture_enabled
    assert training_capture_enabled()
    for kind in ("forward", "backward"):
        assert cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], kind, "triton") is None
    with config.patch(cudagraphs_training=False):
        assert not training_capture_enabled()
        why = cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], "backward", "triton")
        assert why is not None and "EMBER_CUDAGRAPHS_TRAINING=0" in why
        assert cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], "inference", "triton") is None


def _cuda(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with _FAKE:
        return torch.empty(shape, device="cuda", dtype=dtype)


def _cuda_like(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    with _FAKE:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def _graph(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def _clean(x, w):
    return aten.relu.default(aten.mm.default(x, w))


def _why(fn, *inputs: torch.Tensor, kind: str = "inference") -> str | None:
    return cudagraph_blocker(_graph(fn), list(inputs), kind, "triton")


# -- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["inference", "forward", "backward"])
def test_clean_graphs_of_every_kind_are_captured(kind: str) -> None:
    assert _why(_clean, _cuda(4, 8), _cuda(8, 2), kind=kind) is None


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"enabled": False}, "turned off"),
    ({"target": "triton-interpret"}, "does not run on a CUDA device"),
    ({"target": "aten"}, "does not run on a CUDA device"),
    ({"kind": "joint"}, "joint graphs are not captured"),
])
def test_switches_and_targets(kwargs, reason) -> None:
    args = {"kind": "inference", "target": "triton", **kwargs}
    enabled = args.pop("enabled", True)
    why = cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], args["kind"], args["target"], enabled)
    assert why is not None and reason in why


def test_environment_switch(monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CUDAGRAPHS", "0")
    why = cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], "inference", "triton")
    assert why is not None and "EMBER_CUDAGRAPHS" in why


def test_cpu_input_blocks_capture() -> None:
    assert _why(_clean, _cuda(4, 8), torch.randn(8, 2)) == "input 1 is on cpu"


def test_python_number_input_blocks_capture() -> None:
    why = cudagraph_blocker(_graph(lambda x, n: aten.mul.Tensor(x, n)), [_cuda(4), 3], "forward", "triton")
    assert why is not None and "input 1 is a Python int" in why


def test_host_synchronisation_blocks_capture() -> None:
    def fn(x):
        return aten._local_scalar_dense.default(aten.sum.default(x))

    why = _why(fn, _cuda(4), kind="forward")
    assert why is not None and "synchronizes with the CPU" in why and "_local_scalar_dense" in why


def test_boolean_mask_indexing_blocks_capture() -> None:
    def fn(x, mask):
        return aten.index.Tensor(x, [mask])

    gm = _graph(fn)
    mask = next(n for n in gm.graph.nodes if n.name == "mask")
    mask.meta["val"] = _cuda(4, dtype=torch.bool)
    why = cudagraph_blocker(gm, [_cuda(4), _cuda(4, dtype=torch.bool)], "backward", "triton")
    assert why is not None and "boolean mask" in why


def test_data_mutation_of_an_input_is_captured() -> None:
    # Static inputs are written in place by the replay; copied ones are written back after it.
    def fn(x, y):
        aten.add_.Tensor(x, y)
        return aten.mul.Tensor(x, 2)

    assert _why(fn, _cuda(4), _cuda(4)) is None


def _scaled(x: torch.Tensor) -> torch.Tensor:  # a Python function: no schema says what it writes
    return x * 2


fx.wrap("_scaled")


def test_read_only_inputs_are_those_no_op_writes_through_any_view() -> None:
    def fn(x, y, z, w, v):
        aten.add_.Tensor(aten.view.default(y, [2, 2]), 1)  # y written through a view
        aten.copy_.default(w, x)  # w written, x only read
        return aten.mul.Tensor(x, z), _scaled(v)

    # x and z are only read; y and w are written; v reaches a function whose writes are unknown.
    assert read_only_inputs(_graph(fn)) == frozenset({0, 2})


def test_metadata_mutation_of_an_input_blocks_capture() -> None:
    def fn(x):
        v = aten.view.default(x, [2, 2])
        aten.transpose_.default(v, 0, 1)
        return aten.mul.Tensor(v, 2)

    why = _why(fn, _cuda(4))
    assert why is not None and "input x has its shape or strides changed in place" in why and "transpose_" in why


def test_graph_safe_random_op_is_captured() -> None:
    def fn(x):
        return aten.native_dropout.default(x, 0.5, True)

    assert _why(fn, _cuda(8), kind="forward") is None


@pytest.mark.parametrize(("target", "args", "kwargs"), [
    (aten.multinomial.default, ("x", 2), {}),
    (aten.randperm.default, (8,), {"device": torch.device("cuda")}),
])
def test_random_op_outside_the_philox_stream_blocks_capture(target, args, kwargs) -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(target, tuple(x if a == "x" else a for a in args), kwargs))
    why = cudagraph_blocker(fx.GraphModule({}, graph), [_cuda(8)], "forward", "triton")
    name = target._overloadpacket.__name__
    assert why is not None and why.startswith("random op") and name in why and "repeat its numbers" in why


def _attention_graph(op: object, dropout_p: float) -> fx.GraphModule:
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    args = (q, k, v, None, True, dropout_p) if "efficient" in str(op) or "cudnn" in str(op) else (q, k, v, dropout_p)
    graph.output(graph.call_function(op, args))
    return fx.GraphModule({}, graph)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("op", [aten._scaled_dot_product_flash_attention.default,
                                aten._scaled_dot_product_cudnn_attention.default])
def test_attention_with_or_without_dropout_is_captured(op, dropout_p: float) -> None:
    # With dropout its CUDA kernels draw from the generator's philox stream, graph-safe: seed and
    # offset reach the backward in CUDA tensors when captured.
    inputs = [_cuda(2, 2, 8, 16) for _ in range(3)]
    assert cudagraph_blocker(_attention_graph(op, dropout_p), inputs, "forward", "triton") is None


def test_cudnn_attention_backward_with_dropout_is_captured() -> None:
    # It rebuilds the forward's mask from the seed and offset the forward wrote on the device.
    graph = fx.Graph()
    names = ["grad", "q", "k", "v", "out", "lse", "seed", "offset"]
    g, q, k, v, out, lse, seed, offset = (graph.placeholder(n) for n in names)
    graph.output(graph.call_function(aten._scaled_dot_product_cudnn_attention_backward.default,
                                     (g, q, k, v, out, lse, seed, offset, None, None, None, 8, 8, 0.1, False)))
    inputs = [_cuda(2, 2, 8, 16) for _ in range(6)] + [_cuda(1), _cuda(1)]
    assert cudagraph_blocker(fx.GraphModule({}, graph), inputs, "backward", "triton") is None


def test_memory_efficient_attention_with_or_without_dropout_is_captured() -> None:
    # Its backward reads the seeds by its own capture status; Ember's backward graphs hand them
    # over through ember::attention_seeds (passes/attention_seeds.py, test_graph_rng.py).
    inputs = [_cuda(2, 2, 8, 16) for _ in range(3)]
    op = aten._scaled_dot_product_efficient_attention.default
    for p in (0.0, 0.1):
        assert cudagraph_blocker(_attention_graph(op, p), inputs, "forward", "triton") is None


def test_dropout_p_of_an_unknown_attention_op_decides() -> None:
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    graph.output(graph.call_function(aten._scaled_dot_product_fused_attention_overrideable.default, (q, k, v),
                                     {"dropout_p": 0.5}))
    inputs = [_cuda(2, 2, 8, 16) for _ in range(3)]
    why = cudagraph_blocker(fx.GraphModule({}, graph), inputs, "forward", "triton")
    assert why is not None and why.startswith("random op") and "overrideable" in why
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    graph.output(graph.call_function(aten._scaled_dot_product_fused_attention_overrideable.default, (q, k, v)))
    assert cudagraph_blocker(fx.GraphModule({}, graph), inputs, "forward", "triton") is None


def test_random_op_with_its_own_generator_blocks_capture() -> None:
    gen = torch.Generator()

    def fn(x):
        return aten.bernoulli.default(x, generator=gen)

    why = _why(fn, _cuda(8), kind="forward")
    assert why is not None and why.startswith("random op") and "explicit torch.Generator" in why


def test_cpu_intermediate_blocks_capture() -> None:
    def fn(x):
        return aten._to_copy.default(x, device=torch.device("cpu"))

    gm = _graph(fn)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["val"] = torch.empty(4)
    why = cudagraph_blocker(gm, [_cuda(4)], "backward", "triton")
    assert why is not None and "produces a tensor on cpu" in why


def _aot_graphs(model: nn.Module, x: torch.Tensor, grad: bool) -> list[tuple[str, fx.GraphModule, list]]:
    """Ember's AOTAutograd graphs of ``model(x)`` (traced on CPU), moved to fake CUDA tensors."""
    from torch._dynamo.backends.common import aot_autograd

    from ember.capture.backend import _decompositions
    from ember.capture.partition import partition_joint_graph

    graphs: list[tuple[str, fx.GraphModule, list]] = []

    def grab(kind: str):
        def compiler(gm: fx.GraphModule, inputs: list):
            graphs.append((kind, gm, list(inputs)))
            from functorch.compile import make_boxed_func
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=grab("forward"), bw_compiler=grab("backward"),
                           inference_compiler=grab("inference"), decompositions=_decompositions(),
                           partition_fn=partition_joint_graph)
    compiled = torch.compile(model, backend=backend)
    with torch.set_grad_enabled(grad):
        out = compiled(x)
    if grad:
        out.sum().backward()
    moved = []
    for kind, gm, inputs in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            vals = val if isinstance(val, (list, tuple)) else [val]
            if any(isinstance(v, torch.Tensor) for v in vals):
                cuda = [_cuda_like(v) for v in vals]
                node.meta["val"] = type(val)(cuda) if isinstance(val, (list, tuple)) else cuda[0]
        moved.append((kind, gm, [_cuda_like(t) for t in inputs]))
    return moved


def test_training_forward_and_backward_graphs_are_captured() -> None:
    graphs = _aot_graphs(bn_dropout_net(), torch.randn(2, 3, 8, 8), grad=True)
    assert [kind for kind, _, _ in graphs] == ["forward", "backward"]
    forward = graphs[0][1]
    assert any(n.target == aten.native_dropout.default for n in forward.graph.nodes)
    for kind, gm, inputs in graphs:
        assert cudagraph_blocker(gm, inputs, kind, "triton") is None, kind


def test_inference_graph_updating_batch_norm_statistics_is_captured() -> None:
    # Batch norm in train mode under no_grad: the new running statistics are graph outputs
    # (AOTAutograd copies them into the buffers), and dropout draws random numbers.
    [(kind, gm, inputs)] = _aot_graphs(bn_dropout_net(), torch.randn(2, 3, 8, 8), grad=False)
    assert kind == "inference"
    assert any(n.target == aten.native_dropout.default for n in gm.graph.nodes)
    assert cudagraph_blocker(gm, inputs, kind, "triton") is None


def test_explain_reports_why_cpu_programs_are_not_captured() -> None:
    report = ember.explain(ember.compile(torch.nn.Linear(4, 3), target="triton-interpret"), torch.randn(2, 4))
    assert "CUDA graph" in str(report) and "does not run on a CUDA device" in str(report)


def test_dropout_inside_an_activation_checkpoint_is_not_captured() -> None:
    # run_and_save_rng_state returns the generator's state as a host tensor (the forward) and the
    # recompute takes it back (the backward): a replay would hand out the state of the capture.
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _cuda(4, 8)
    saved = g.call_function(run_and_save_rng_state, (aten.native_dropout.default, x, 0.5, True))
    with _FAKE:
        saved.meta["val"] = (torch.empty(16, dtype=torch.uint8),
                             (torch.empty(4, 8, device="cuda"), torch.empty(4, 8, device="cuda", dtype=torch.bool)))
    g.output(saved)
    forward = fx.GraphModule(torch.nn.Module(), g)
    assert "on cpu" in cudagraph_blocker(forward, [_cuda(4, 8)], "forward", "triton")

    g = fx.Graph()
    state, y = g.placeholder("state"), g.placeholder("y")
    redo = g.call_function(run_with_rng_state, (state, aten.native_dropout.default, y, 0.5, True))
    g.output(redo)
    backward = fx.GraphModule(torch.nn.Module(), g)
    with _FAKE:
        host_state = torch.empty(16, dtype=torch.uint8)
    assert "input 0 is on cpu" in cudagraph_blocker(backward, [host_state, _cuda(4, 8)], "backward", "triton")
