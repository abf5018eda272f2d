"""When Ember replays a program as a CUDA graph, and why not: the decision rule, on CPU.

CI has no GPU, so the inputs are fake CUDA tensors (FakeTensorMode) and graphs are traced
from small functions of ATen ops; capture itself runs in benchmarks on the device.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses import FakeTensorMode

import ember
from ember.runtime.cudagraph import cudagraph_blocker

aten = torch.ops.aten


def _cuda(*shape: int) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


def _graph(fn) -> fx.GraphModule:
    return fx.symbolic_trace(fn)


def _clean(x, w):
    return aten.relu.default(aten.mm.default(x, w))


def test_clean_inference_graph_is_captured() -> None:
    assert cudagraph_blocker(_graph(_clean), [_cuda(4, 8), _cuda(8, 2)], "inference", "triton") is None


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"enabled": False}, "turned off"),
    ({"target": "triton-interpret"}, "does not run on a CUDA device"),
    ({"target": "aten"}, "does not run on a CUDA device"),
    ({"kind": "backward"}, "backward graphs are not captured yet"),
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
    why = cudagraph_blocker(_graph(_clean), [_cuda(4, 8), torch.randn(8, 2)], "inference", "triton")
    assert why == "input 1 is on cpu"


def test_host_synchronisation_blocks_capture() -> None:
    def fn(x):
        return aten._local_scalar_dense.default(aten.sum.default(x))

    why = cudagraph_blocker(_graph(fn), [_cuda(4)], "inference", "triton")
    assert why is not None and "synchronizes with the CPU" in why and "_local_scalar_dense" in why


def test_mutated_input_blocks_capture() -> None:
    def fn(x, y):
        aten.add_.Tensor(x, y)
        return aten.mul.Tensor(x, 2)

    why = cudagraph_blocker(_graph(fn), [_cuda(4), _cuda(4)], "inference", "triton")
    assert why is not None and "input x is mutated in place" in why


def test_explain_reports_why_cpu_programs_are_not_captured() -> None:
    report = ember.explain(ember.compile(torch.nn.Linear(4, 3), target="triton-interpret"), torch.randn(2, 4))
    assert "CUDA graph" in str(report) and "does not run on a CUDA device" in str(report)
