"""The on-disk kernel cache: info/clear, and damaged entries detected and rebuilt."""

from __future__ import annotations

from pathlib import Path

import torch

import ember
from ember import config
from ember.cli import main
from ember.runtime import cache, kernels


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 2 + 1, dim=-1).sum(dim=0)


def _run(tmp: Path, x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    kernels.forget_loaded()
    # The second run is a program-cache hit: it loads the kernel files, which are verified
    # against the stored sources and rewritten when damaged.
    return ember.compile(_fn, target="triton-interpret", cache_dir=str(tmp))(x)


def test_cache_info_clear_and_damaged_entries(tmp_path: Path, capsys) -> None:
    x = torch.randn(6, 33)
    want = _fn(x)
    torch.testing.assert_close(_run(tmp_path, x), want)
    files = sorted((tmp_path / "kernels").glob("ember_*.py"))
    info = cache.cache_info(tmp_path)
    assert files and info["kernel modules"] == len(files) and info["kernel module bytes"] > 0
    assert info["compiled programs"] == 1 and info["program database bytes"] > 0

    # A truncated entry and one overwritten with garbage: detected by content, rewritten.
    good = {f: f.read_text() for f in files}
    files[0].write_text(good[files[0]][: len(good[files[0]]) // 2])
    if len(files) > 1:
        files[1].write_bytes(b"\xff\xfe not python")
    torch.testing.assert_close(_run(tmp_path, x.clone()), want)
    assert all(f.read_text() == text for f, text in good.items())

    with config.patch(cache_dir=str(tmp_path)):  # the folder the CLI works on
        assert main(["cache", "info"]) == 0
        assert str(tmp_path) in capsys.readouterr().out
        assert main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert not list(tmp_path.rglob("ember_*.py")) and cache.cache_info(tmp_path)["compiled programs"] == 0
    torch.testing.assert_close(_run(tmp_path, x), want)  # rebuilt after clear
