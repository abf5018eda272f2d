"""Every test gets its own Ember cache folder (kernels and compiled programs), never ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_ember_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    # Every test starts with an empty cache, so by default its first CPU calls would run fused groups
    # through ATen while numba compiles (runtime/aten_first.py) and the kernels would go untested:
    # tests compile them before the first call; tests/runtime/test_aten_first.py covers the default.
    monkeypatch.setenv("EMBER_CPU_ATEN_FIRST", "0")
