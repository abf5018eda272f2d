"""A program that raises on its first call (an Ember bug: eager runs the graph) gives that call,
and every later one, to the graph as captured, says so, and never reruns a call that already
wrote one of its inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ember
from ember import config, pipeline


def _failing_link(monkeypatch: pytest.MonkeyPatch, before_raise=None) -> list[str]:
    """Every linked inference or forward program raises NameError on its first run (after
    ``before_raise(args)``); a backward's inputs are freed as it runs, so it has no fallback."""
    failed: list[str] = []
    link = pipeline._link

    def broken(job, *args, **kwargs):
        run = link(job, *args, **kwargs)
        if job.record.kind == "backward":
            return run
        calls = [0]

        def first_fails(inputs: list) -> object:
            calls[0] += 1
            if calls[0] == 1:
                if before_raise is not None:
                    before_raise(inputs)
                failed.append(job.record.title)
                raise NameError("name 'view_default' is not defined")
            return run(inputs)
        return first_fails
    monkeypatch.setattr(pipeline, "_link", broken)
    return failed


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3))


def test_inference_and_training_forward_fall_back_to_the_captured_graph(monkeypatch) -> None:
    failed = _failing_link(monkeypatch)
    torch.manual_seed(0)
    model = _net()
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, target="aten", cache=False)
    with config.patch(strict=False), pytest.warns(RuntimeWarning, match="failed on its first call"):
        for _ in range(2):  # the second call too: the fallback stays
            x = torch.randn(5, 6)
            out = compiled(x)
            want = ref(x)
            torch.testing.assert_close(out, want)
            out.square().sum().backward()
            want.square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)  # written once per call
    forward = [g for g in compiled._ember_backend.log.graphs if g.kind == "forward"]
    assert failed and forward and forward[0].error.startswith("failed on its first call")
    model.eval()
    ref.eval()
    with config.patch(strict=False), torch.no_grad(), pytest.warns(RuntimeWarning, match="failed on its first call"):
        x = torch.randn(5, 6)
        torch.testing.assert_close(compiled(x), ref(x))


def test_a_first_call_that_wrote_an_input_is_not_run_again(monkeypatch) -> None:
    def write_first_tensor(inputs: list) -> None:  # as a program that wrote an input, then failed
        torch.autograd.graph.increment_version(next(a for a in inputs if isinstance(a, torch.Tensor)))

    _failing_link(monkeypatch, write_first_tensor)
    model = _net().eval()
    compiled = ember.compile(model, target="aten", cache=False)
    with config.patch(strict=False), torch.no_grad(), pytest.raises(Exception, match="view_default"):
        compiled(torch.randn(5, 6))
