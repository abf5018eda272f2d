"""``ember.explain``'s host time per step and what ran outside the graphs (report/host_time.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from cudagraph_fakes import graphs_on_cpu  # the CPU stand-in for CUDA graphs

import ember
from ember.report.explain import explain_with
from ember.report.host_time import measure_steps

HEADING = "Host time per step, and what ran outside the graphs"


class _BrokenNet(nn.Module):
    """Two Dynamo graphs: a print between the layers is a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 16), nn.Linear(16, 4), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.a(x)))
        print("", end="")  # graph break: Dynamo does not trace print
        return self.b(y)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 16), nn.Linear(16, 4), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def test_graph_break_and_uncaptured_graphs_are_reported_with_host_time() -> None:
    torch._dynamo.reset()
    report = explain_with(_BrokenNet(), (torch.randn(8, 16),), steps=3, target="aten")
    text = str(report)
    assert HEADING in text
    section = text[text.index(HEADING):text.index("Compile time")]
    assert "3 step(s) timed after 2 warm-up step(s)" in section
    assert "1 graph break(s): eager code runs between the 2 Dynamo graphs" in section and "print" in section
    assert section.count("not captured: target aten does not run on a CUDA device") == 4  # 2 forward, 2 backward
    host = report.as_dict()["host_time"]
    assert host["timed_steps"] == 3 and host["step_host_ms"] > 0
    assert len(host["graphs"]) == 4
    for g in host["graphs"]:
        # Each graph runs once a step, uncaptured: all of its time is the program's.
        assert g["calls"] == 3 and g["replays"] == 0 and g["uncaptured"] == 3
        assert g["program_ms"] == pytest.approx(g["in_graph_ms"]) and g["runner_ms"] == 0
    # The breakdown adds up to the mean host time of a step.
    assert host["in_programs_ms"] + host["outside_programs_ms"] == pytest.approx(host["step_host_ms"], rel=1e-6) \
        or host["outside_programs_ms"] == 0
    assert host["in_programs_ms"] == pytest.approx(sum(g["in_graph_ms"] for g in host["graphs"]))


def test_replayed_graphs_report_nothing_outside_the_graphs(monkeypatch) -> None:
    graphs_on_cpu(monkeypatch)
    torch._dynamo.reset()
    report = explain_with(_Net(), (torch.randn(8, 16),), steps=3, target="aten")
    host = report.as_dict()["host_time"]
    assert [g["title"].split()[0] for g in host["graphs"]] == ["forward", "backward"]
    for g in host["graphs"]:
        assert g["cudagraph"].startswith("captured"), g["cudagraph"]
        # At most one capture during the timed steps, for a reason the runner names: on the CPU
        # stand-in malloc may hand a fresh tensor (the loss's cotangent) the address of the one
        # before, so the first capture read it in place and it later moves; or garbage the
        # collector had not yet freed held a replay's outputs at a capture, and the pool was
        # renewed (when it runs depends on what the process allocated before). Every call
        # still replays.
        assert g["calls"] == 3 and g["replays"] == 3 and g["uncaptured"] == 0, g
        status = g["cudagraph"]
        assert g["captures"] == 0 or (g["captures"] == 1 and ("moved" in status or "renewed" in status)), status
        # A capture runs the program once (recording it): its host time is program time.
        assert g["replay_ms"] > 0 and (g["program_ms"] == 0 or g["captures"] == 1), g
    # The one such capture is listed under "outside the graphs" too; nothing else may be.
    assert all("0 of 3 call(s) ran uncaptured and 1 captured again" in line and ("moved" in line or "renewed" in line)
               for line in host["outside_graphs"]), host["outside_graphs"]
    text = str(report)
    if not host["outside_graphs"]:
        assert "nothing: every call of every graph replayed a CUDA graph" in text
    assert "graph break" not in text[text.index(HEADING):text.index("Compile time")]


def test_html_has_the_host_time_section(tmp_path: Path) -> None:
    torch._dynamo.reset()
    report = explain_with(_BrokenNet(), (torch.randn(4, 16),), steps=1, target="aten")
    html = report.to_html(tmp_path / "explain.html").read_text()
    assert HEADING in html and "replay ms/step" in html and "graph break(s)" in html


def test_no_steps_or_a_model_that_writes_its_inputs_is_not_timed() -> None:
    class WritesInput(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return x * 2

    torch._dynamo.reset()
    report = explain_with(_Net(), (torch.randn(4, 16),), steps=0, target="aten")
    assert report.host is None and "Not measured (steps=0)." in str(report)
    x = torch.zeros(3)
    report = explain_with(WritesInput(), (x,), steps=3, target="aten")
    assert torch.equal(x, torch.ones(3))  # one call, as eager: the timed steps did not run
    assert report.host is None and "the model writes its inputs" in str(report)


def test_the_timers_are_removed_afterwards(monkeypatch) -> None:
    graphs_on_cpu(monkeypatch)
    torch._dynamo.reset()
    compiled = ember.compile(_Net(), target="aten")
    x = torch.randn(4, 16)

    def step() -> None:
        compiled(x).sum().backward()
    step()
    backend = compiled._ember_backend
    before = [(g.run, g.run.run, g.run.backend.__dict__.get("replay")) for _, g in backend.programs]
    host = measure_steps(step, lambda: list(backend.programs), steps=2)
    assert [g.calls for g in host.graphs] == [2, 2]
    after = [(g.run, g.run.run, g.run.backend.__dict__.get("replay")) for _, g in backend.programs]
    assert after == before


def test_explain_steps_come_from_the_environment(monkeypatch) -> None:
    from ember import config
    monkeypatch.setenv("EMBER_EXPLAIN_STEPS", "0")
    assert config.explain_steps() == 0
    torch._dynamo.reset()
    assert explain_with(_Net(), (torch.randn(4, 16),), target="aten").host is None
