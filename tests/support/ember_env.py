"""The clean_ember fixture: a clean Dynamo and a hermetic Ember environment per test (imported by the conftest of each folder that wants it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import config

# Every variable Ember reads (config.py) and Triton's interpreter switch: none leaks in from the shell.
_ENV = (*config.env_names(), "TRITON_INTERPRET")


def _limit_name() -> str:
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


@pytest.fixture(autouse=True)
def clean_ember(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Reset Dynamo around each test; no EMBER_* variables leak in; internal errors raise."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EMBER_CPU_ATEN_FIRST", "0")  # kernels before the first call (tests/conftest.py says why)
    assert config.patched() == {}, "a config.patch leaked out of an earlier test"
    # Kernels and compiled programs go to a folder of this test, never the user's ~/.cache:
    # every test compiles from scratch unless it shares a cache on purpose.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    # ember.compile sets Dynamo's (process-global) recompile limit: restore it after each test.
    limit = getattr(torch._dynamo.config, _limit_name())
    torch._dynamo.reset()
    torch.manual_seed(1234)
    with config.patch(strict=True):
        yield
    torch._dynamo.reset()
    setattr(torch._dynamo.config, _limit_name(), limit)
