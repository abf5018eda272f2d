"""Which target a Dynamo frame compiles for: its inputs and the values its graph makes."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

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
