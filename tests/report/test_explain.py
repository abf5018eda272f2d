"""``ember.explain``: the report's numbers and text, training side effects, HTML in a real browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ember
from ember.report.explain import ExplainReport, explain, explain_with

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SECTIONS = ("Summary", "Compile time", "Ops by category", "Placement", "Fusion decisions", "Memory layout", "Fallback ops", "Coverage")


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(nn.functional.gelu(self.norm(self.lin(x))), dim=-1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def pointwise(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.sin() * y + 1).relu().sum(-1)


def with_break(x: torch.Tensor) -> torch.Tensor:
    y = x.cos() + 1
    torch._dynamo.graph_break()
    return (y * 2).exp()


class Branchy(nn.Module):
    """A branch on a tensor's value: Dynamo ends the graph there (a break torch 2.14 does not count
    in counters["graph_break"])."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # the break
            h = h * 2
        return self.b(h)


def _coverage_ok(report: ExplainReport) -> dict[str, float]:
    cov = report.coverage()
    assert set(cov) == {"generated", "fused-aten", "library", "fallback"}
    assert sum(cov.values()) == pytest.approx(100.0)
    for g in report.graphs:
        assert sum(report.coverage(g).values()) == pytest.approx(100.0)
    return cov


def test_function_default_options() -> None:
    report = ember.explain(pointwise, torch.randn(4, 8), torch.randn(4, 8))
    text = str(report)
    for heading in SECTIONS:
        assert heading in text
    assert not report.training and report.graph_breaks.total() == 0 and report.recompiles == []
    assert report.dynamo_graphs == 1 and [g.kind for g in report.graphs] == ["inference"]
    assert report.graphs[0].target == "cpu"  # auto on CPU: generated CPU kernels (numba)
    assert "Graphs: 1 captured by Dynamo" in text and "pointwise" in text and "reduction" in text
    assert _coverage_ok(report)["generated"] == pytest.approx(100.0)
    assert "100.0%" in text
    assert report.total_s > 0 and report.capture_s >= 0
    data = json.loads(json.dumps(report.as_dict()))
    assert data["aten_graphs"] == 1 and data["graphs"][0]["op_classes"]["pointwise"] >= 3


def test_module_inference_uses_library() -> None:
    model = Head()
    with torch.no_grad():
        report = explain(model, torch.randn(4, 16))
    text = str(report)
    assert not report.training
    # CPU inference: the linear layer is a oneDNN call, its weight frozen; GELU stays one ATen op.
    assert "mkldnn._linear_pointwise" in text and "library" in text
    cov = _coverage_ok(report)
    assert 0 < cov["library"] < 100
    placed = report.placement_counts()
    assert placed["library"]["mkldnn._linear_pointwise"] == 1
    assert dict(placed["fallback"]) == {"aten.gelu": 1} and "kept whole for CPU inference" in text


def test_training_conv_net_leaves_model_untouched() -> None:
    model = ConvNet().train()
    model.conv.weight.grad = torch.ones_like(model.conv.weight)  # a grad the user already has
    kept_grad = model.conv.weight.grad
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    report = explain(model, x)
    assert report.training and report.backward_s > 0
    assert sorted(g.kind for g in report.graphs) == ["backward", "forward"]
    assert all(g.error is None for g in report.graphs)
    # .grad fields, weights, BatchNorm running stats and the RNG are as they were.
    assert model.conv.weight.grad is kept_grad and torch.equal(kept_grad, torch.ones_like(kept_grad))
    assert model.conv.bias.grad is None and model.bn.weight.grad is None and model.bn.bias.grad is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    text = str(report)
    assert "aten.convolution" in text and "training" in text
    assert re.search(r"backward \d+ \(frame", text) and re.search(r"forward \d+ \(frame", text)
    _coverage_ok(report)


def test_triton_interpret_generates_kernels() -> None:
    report = explain_with(Head(), (torch.randn(4, 16),), target="triton-interpret")
    text = str(report)
    assert report.kernels > 0 and report.unique_kernels > 0
    assert f"Kernels generated: {report.kernels}" in text
    assert all(g.target == "triton-interpret" and g.kernel_sources for g in report.graphs)
    cov = _coverage_ok(report)
    assert cov["generated"] > 50 and cov["fused-aten"] == 0
    assert report.stage_totals()["codegen"] > 0


def test_graph_break_is_counted_with_reason() -> None:
    report = explain(with_break, torch.randn(4, 8))
    assert report.graph_breaks.total() == 1
    assert report.dynamo_graphs == 2 and len(report.graphs) == 2
    assert "graph_break" in next(iter(report.graph_breaks))
    text = str(report)
    assert "Graph breaks: 1" in text and "torch._dynamo.graph_break()" in text
    assert report.as_dict()["graph_breaks"]["count"] == 1


def test_data_dependent_branch_is_a_located_graph_break() -> None:
    import inspect

    source, first = inspect.getsourcelines(Branchy.forward)
    line = first + next(i for i, text in enumerate(source) if "if h.sum() > 0" in text)
    with torch.no_grad():
        report = explain(Branchy(), torch.randn(4, 8))
    assert report.dynamo_graphs >= 2 and report.graph_breaks.total() == 1, report.graph_breaks
    (reason,) = report.graph_breaks
    assert "tensor's value" in reason
    (place,) = report.break_locations[reason]
    assert f"test_explain.py:{line}: " in place, place
    assert place.endswith("if h.sum() > 0:  # the break")
    text = str(report)
    assert "Graph breaks: 1" in text and f"test_explain.py:{line}: if h.sum() > 0:" in text, text
    data = report.as_dict()["graph_breaks"]
    assert data["count"] == 1 and data["reasons"][0]["where"] == [place]


def test_recompile_counts_match_their_lists() -> None:
    compiled = ember.compile(Head(), target="aten", max_recompiles=4)
    with torch.no_grad():
        for b in (2, 3, 4):
            compiled(torch.randn(b, 16))
    report = ember.explain(compiled, torch.randn(5, 16))
    text = " ".join(str(report).split())  # rich wraps long lines
    # explain's own compile has no recompiles; the model's own history lists its two, after its count
    # (a Dynamo frame number, or "warm" where the warm start compiled them: on by default).
    assert "Recompiles in this run: 0 (explain compiles the model afresh, once)" in text, text
    assert re.search(r"; 2 recompile\(s\): frame (\d+|warm) compile \d+: ", text), text
    assert len(re.findall(r"frame (?:\d+|warm) compile \d+: ", text)) == 2, text


def test_compiled_object_reuses_its_options() -> None:
    compiled = ember.compile(Head(), target="triton-interpret")
    report = ember.explain(compiled, torch.randn(2, 16))
    assert report.target == "triton-interpret" and report.kernels > 0


def test_explaining_again_compiles_again_without_recompiles() -> None:
    # More explains of one function than Dynamo's default recompile limit (8).
    x = torch.randn(3, 5)
    for _ in range(9):
        report = explain(pointwise, x, x)
        assert len(report.graphs) == 1 and report.recompiles == [] and not report.problems()


def test_graph_ember_could_not_compile_is_listed() -> None:
    from ember.instruments import instrument

    def broken(stage: str, record: object, args: tuple) -> None:
        raise RuntimeError("injected failure")

    with pytest.warns(UserWarning, match="could not compile"), instrument(before=broken):
        report = explain(pointwise, torch.randn(4, 8), torch.randn(4, 8))
    text = str(report)
    assert "Problems" in text and "injected failure" in text and "could not compile" in text
    assert text.index("Problems") < text.index("Summary")
    assert report.problems() and report.as_dict()["problems"]


def _chromium(*flags: str, url: str, profile: Path) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           *flags, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)


def test_html_report(tmp_path: Path) -> None:
    report = explain_with(with_break, (torch.randn(4, 8),), target="triton-interpret")
    path = report.to_html(tmp_path / "explain.html")
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<details>" in html
    assert not re.search(r"<(script|link|img|iframe)\b", html)  # self-contained: no external assets
    kernel = next(name for g in report.graphs for name in g.kernel_sources)
    assert f"Kernel {kernel}" in html and "@triton.jit" in html
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); HTML not rendered")
    dom = _chromium("--dump-dom", url=path.as_uri(), profile=tmp_path / "profile").stdout
    for heading in (*SECTIONS, "Graphs"):
        assert f"<h2>{heading}</h2>" in dom
    assert kernel in dom and "Kernel plan" in dom and "Generated program" in dom
