"""Writes into graph inputs kept in the graph (``input_mutations_in_graph``, capture/backend.py):
batch norm's running statistics and ``num_batches_tracked``, a buffer counter. AOTAutograd ends the
graph with ``copy_(input, value)``; Ember's program runs it, or has the kernel that computes the
value store it into the input (codegen/input_writes.py). Training with SGD matches eager step by
step (outputs, gradients, parameters, every buffer), and so does eval mode afterwards.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from cudagraph_fakes import FakeGraphs
from torch import nn

import ember
from ember import config
from ember.instruments import instrument

RTOL, ATOL = 1e-4, 1e-5


class Net(nn.Module):
    """Two conv + batch-norm blocks, a linear head and a buffer counted up in every forward."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum)
        self.fc = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        y = torch.relu(self.bn1(self.c1(x)))
        y = torch.relu(self.bn2(self.c2(y)))
        return self.fc(y.mean((2, 3)))


def _train_against_eager(model: nn.Module, steps: int = 5, **options: object) -> nn.Module:
    """``steps`` SGD steps of ``model`` under ember.compile and of an eager copy: outputs, every
    gradient, every parameter and buffer equal after each step; then one eval-mode call."""
    eager = copy.deepcopy(model)
    compiled = ember.compile(model, **options)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(4, 3, 8, 8)
        outs = []
        for fn, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            out = fn(x)
            out.square().mean().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=RTOL, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}")
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"grad {name}: {m}")
        opt_c.step()
        opt_e.step()
        for (name, b), (_, e) in zip(model.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, e, rtol=RTOL, atol=ATOL, msg=lambda m, step=step, name=name: f"step {step} {name}: {m}")
    assert int(model.count) == steps and int(model.bn1.num_batches_tracked) == steps
    assert not torch.allclose(model.bn2.running_var, torch.ones(8))  # the statistics did move
    model.eval()
    eager.eval()
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=RTOL, atol=ATOL)
    return compiled


def _captured(debug: Path, kind: str) -> str:
    (folder,) = [p for p in debug.iterdir() if p.name.startswith(kind)]
    return (folder / "00_captured.py").read_text()


@pytest.mark.parametrize("target", ["cpu", "triton-interpret"])
def test_batchnorm_training_keeps_statistics_in_the_graph(target: str, tmp_path: Path, monkeypatch) -> None:
    if target == "triton-interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    compiled = _train_against_eager(Net(), target=target, debug_dir=str(tmp_path))
    # Dynamo's frame: 2 x (running_mean, running_var, num_batches_tracked) + the counter, written
    # by the forward graph AOTAutograd handed to Ember, not by its wrapper afterwards.
    assert _captured(tmp_path, "forward").count("torch.ops.aten.copy_.default(primals_") == 7
    fw = next(r for r in compiled._ember_backend.log.graphs if r.kind == "forward")
    # Every write is a store of the kernel that computes the value: no copy_ is left to run.
    assert fw.program.count("[input write] stored into the graph input") == 7, fw.program
    assert "aten.copy_" not in fw.program
    inference = next(r for r in compiled._ember_backend.log.graphs if r.kind == "inference")
    assert "[input write]" in inference.program  # eval mode: only the counter moves


def test_switched_off_the_wrapper_writes_the_inputs(tmp_path: Path) -> None:
    torch.manual_seed(1)
    with config.patch(input_mutations_in_graph=False):
        _train_against_eager(Net(), steps=3, target="cpu", debug_dir=str(tmp_path))
    assert "copy_" not in _captured(tmp_path, "forward")


def test_copies_run_as_aten_without_kernel_stores() -> None:
    torch.manual_seed(2)
    with config.patch(input_writes_as_stores=False):
        compiled = _train_against_eager(Net(), steps=3, target="cpu")
    fw = next(r for r in compiled._ember_backend.log.graphs if r.kind == "forward")
    assert fw.program.count("aten.copy_.default(") == 7 and "[input write]" not in fw.program


def test_cumulative_moving_average() -> None:
    # momentum=None: the factor is 1 / num_batches_tracked, read on the host (a graph break).
    torch.manual_seed(3)
    _train_against_eager(Net(momentum=None), steps=4, target="cpu")


def test_a_counter_in_inference_mode() -> None:
    torch.manual_seed(4)
    model = Net().eval()
    compiled = ember.compile(model, target="cpu")
    eager = copy.deepcopy(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 8, 8)
            torch.testing.assert_close(compiled(x), eager(x), rtol=RTOL, atol=ATOL)
    assert int(model.count) == int(eager.count) == 3
    assert model.count._version >= 3  # the stores bump the version as copy_ would


def test_replayed_graphs_write_the_statistics_every_step() -> None:
    # Through the CUDA-graph runner on its CPU stand-in: the writes are found by version counters
    # on the recorded call, and each replay writes the buffers in place again.
    torch.manual_seed(5)
    with instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None):
        compiled = _train_against_eager(Net(), steps=5, target="cpu")
    fw = next(r for r in compiled._ember_backend.log.graphs if r.kind == "forward")
    assert fw.cudagraph.startswith("captured") and "7 input(s) mutated in place" in fw.cudagraph, fw.cudagraph
