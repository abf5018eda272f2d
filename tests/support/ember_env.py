"""The clean_ember fixture: a clean Dynamo and a hermetic Ember environment per test (imported by the conftest of each folder that wants it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_ENV = ("EMBER_TARGET", "EMBER_DEBUG_DIR", "EMBER_CACHE_DIR", "EMBER_CHECK", "EMBER_CACHE", "EMBER_CUDAGRAPHS",
        "EMBER_CUDAGRAPHS_TRAINING",
        "DEBUG", "TRITON_INTERPRET")


def _limit_name() -> str:
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


@pytest.fixture(autouse=True)
def clean_ember(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Reset Dynamo around each test; no EMBER_* variables leak in; internal errors raise."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EMBER_STRICT", "1")
    # Kernels and compiled programs go to a folder of this test, never the user's ~/.cache:
    # every test compiles from scratch unless it shares a cache on purpose.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    # ember.compile sets Dynamo's (process-global) recompile limit: restore it after each test.
    limit = getattr(torch._dynamo.config, _limit_name())
    torch._dynamo.reset()
    torch.manual_seed(1234)
    yield
    torch._dynamo.reset()
    setattr(torch._dynamo.config, _limit_name(), limit)
