"""AOTAutograd's graph text (capture/aot_logs.py): not rendered while Ember compiles unless a log
shows it; a model still trains as in eager either way."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from core_helpers import assert_close
from torch._functorch._aot_autograd import graph_compile

import ember


def _train_step_rendering(monkeypatch: pytest.MonkeyPatch) -> int:
    """One compiled training step of a small model vs eager; how many graphs were rendered as text."""
    rendered = []
    real = torch.fx.GraphModule.print_readable

    def spy(self, *args, **kwargs):
        rendered.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    x = torch.randn(5, 8)
    ember.compile(model)(x).square().sum().backward()
    twin(x).square().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32)
    return len(rendered)


def test_graph_text_is_not_rendered_when_no_log_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    steps = (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs)
    assert _train_step_rendering(monkeypatch) == 0
    assert (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs) == steps  # restored


def test_graph_text_is_rendered_for_a_log_that_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    log = graph_compile.aot_graphs_log  # what TORCH_LOGS=aot_graphs turns on
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not the attribute: isEnabledFor caches its answer
    try:
        assert _train_step_rendering(monkeypatch) >= 2  # the forward and the backward
    finally:
        log.setLevel(level)
