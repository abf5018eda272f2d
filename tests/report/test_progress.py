"""The compile progress line (report/progress.py): shown when forced on, names the stages, off
when stderr is not a terminal, and never changes results."""

from __future__ import annotations

import torch

import ember
import ember.config
from ember.report import progress


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def test_forced_on_draws_a_line_naming_stages_and_keeps_results(capfd, monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setenv("EMBER_CACHE", "0")
    seen = []
    real_line = progress.CompileProgress.line
    monkeypatch.setattr(progress.CompileProgress, "line", lambda self: seen.append(real_line(self)) or seen[-1])
    model, x = _model(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
        out = ember.compile(model, target="aten", progress=True)(x)
    err = capfd.readouterr().err
    torch.testing.assert_close(out, expected)
    assert "ember compiling:" in err and "ember compiled 1 graph(s)" in err
    stages = {line.split(": ", 1)[1].split(" |")[0] for line in seen}
    assert {"capture", "passes", "program"} <= stages, stages
    assert any("graphs 1/1" in line for line in seen)


def test_off_when_stderr_is_not_a_terminal_and_when_switched_off(capfd, monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setenv("EMBER_CACHE", "0")
    assert not progress.enabled(None)  # pytest's captured stderr is not a terminal
    model, x = _model(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
        out = ember.compile(model, target="aten")(x)
        torch.testing.assert_close(out, expected)
        monkeypatch.setenv("EMBER_PROGRESS", "0")
        monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
        assert not progress.enabled(ember.config.Options.from_env().progress)
        torch.testing.assert_close(ember.compile(model, target="aten")(x + 1), model(x + 1))
    assert "ember compil" not in capfd.readouterr().err


def test_short_compiles_draw_nothing(capfd, monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 60.0)
    monkeypatch.setenv("EMBER_CACHE", "0")
    with torch.no_grad():
        ember.compile(_model(), target="aten", progress=True)(torch.randn(2, 8))
    assert "ember compil" not in capfd.readouterr().err


def test_environment_switch(monkeypatch):
    from ember.config import Options
    monkeypatch.delenv("EMBER_PROGRESS", raising=False)
    assert Options().progress is None and Options.from_env().progress is None
    monkeypatch.setenv("EMBER_PROGRESS", "1")
    assert Options.from_env().progress is True
    assert Options.from_env(progress=False).progress is False  # the option overrides the environment
    monkeypatch.setenv("EMBER_PROGRESS", "0")
    assert Options.from_env().progress is False
