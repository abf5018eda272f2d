"""Which target a Dynamo frame compiles for: its inputs and the values its graph makes."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ember.config import Options
from ember.pipeline import compile_graph
from ember.report.records import GraphRecord
from ember.targets import CPU, TRITON, frame_values, resolve_target


def _mask_builder_graph(device: str) -> fx.GraphModule:
    """A frame like transformers' mask builders: no tensor input, a tensor made on ``device``."""
    graph = fx.Graph()
    n = graph.placeholder("n")
    made = graph.call_function(torch.arange, (n,), {"device": device})
    graph.output(made)
    with FakeTensorMode():
        made.meta["example_value"] = torch.arange(8, device=device)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_frame_without_cuda_inputs_that_makes_cuda_tensors_takes_the_gpu_target():
    gm = _mask_builder_graph("cuda")
    assert resolve_target("auto", [8]) is not TRITON  # its inputs alone say nothing of CUDA
    assert resolve_target("auto", frame_values(gm, [8])) is TRITON


def test_a_frame_on_the_cpu_keeps_the_cpu_target():
    gm = _mask_builder_graph("cpu")
    assert resolve_target("auto", frame_values(gm, [8, torch.randn(3)])).name == resolve_target("auto", []).name
    assert resolve_target("auto", frame_values(gm, [8])) in (CPU, resolve_target("auto", []))
    assert frame_values(None, [1, 2]) == [1, 2]


def _compiled_record(gm: fx.GraphModule, inputs: list) -> GraphRecord:
    record = GraphRecord("inference 0", "inference", "0/0", "")
    # As a whole-step program compiles its graphs: per-graph capture off.
    compile_graph(gm, inputs, Options.from_env(cudagraphs=False), record)
    return record


def test_a_graph_without_tensors_does_not_keep_a_whole_step_program_uncaptured():
    """A Dynamo frame around Python-only code (bart's config checks between graph breaks) gives a
    graph with no tensor: it gets the CPU target for want of any, runs no device work, and must
    not stop the step around it from being captured; a graph computing on the CPU still does."""
    empty = fx.Graph()
    empty.output(())
    record = _compiled_record(fx.GraphModule(torch.nn.Module(), empty), [])
    assert record.target != "triton" and record.whole_step_blocker is None

    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    graph.output((y,))
    x.meta["val"], y.meta["val"] = torch.randn(4), torch.randn(4)
    record = _compiled_record(fx.GraphModule(torch.nn.Module(), graph), [torch.randn(4)])
    assert record.whole_step_blocker and "does not run on a CUDA device" in record.whole_step_blocker
