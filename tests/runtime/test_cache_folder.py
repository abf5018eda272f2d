"""An unusable cache folder (a file, a folder under a file, read-only): one warning naming it and
the OS error, kernels still generated and run, explain's cache line says why; ``ember cache``
counts and clears damaged program databases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ember
from ember.cli import main
from ember.runtime import cache


def _chain(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2.0).relu().sum(-1)


def _explain_with_cache(folder: Path, monkeypatch: pytest.MonkeyPatch, match: str) -> ember.report.explain.ExplainReport:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(folder))
    x = torch.randn(4, 8)
    with pytest.warns(RuntimeWarning, match=match) as warned, torch.no_grad():
        report = ember.explain(_chain, x)
    assert sum("cannot be used" in str(w.message) for w in warned) == 1
    return report


@pytest.mark.parametrize("layout", ["file", "under-a-file"])
def test_unusable_cache_folder_is_named_and_kernels_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               layout: str) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    folder = blocker if layout == "file" else blocker / "ember"
    report = _explain_with_cache(folder, monkeypatch, match=f"{folder}.*NotADirectoryError|{folder}.*FileExistsError")
    (graph,) = report.graphs
    assert graph.error is None and graph.target == "cpu"
    assert report.kernels == 1 and report.coverage()["generated"] > 0  # kernels went to a scratch folder
    assert graph.cache.startswith(f"off: cache folder {folder} unusable (") and "constants" not in graph.cache
    text = " ".join(str(report).split())
    assert f"Compile cache, {graph.title}: off: cache folder {folder} unusable" in text
    assert blocker.read_text() == "a file where the cache folder should be"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        report = _explain_with_cache(folder, monkeypatch, match=f"{folder}.*PermissionError")
        assert "PermissionError" in report.graphs[0].cache
    finally:
        folder.chmod(0o755)


def test_cache_info_counts_and_clear_removes_damaged_databases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "programs.sqlite").write_bytes(b"not a database")
    ember.compile(_chain, target="aten", cache_dir=str(tmp_path))(torch.randn(3, 5))  # moves it aside
    damaged = list(tmp_path.glob("programs.corrupt-*"))
    assert len(damaged) == 1
    info = cache.cache_info(tmp_path)
    assert info["damaged databases moved aside"] == 1 and info["damaged database bytes"] == len(b"not a database")
    assert info["compiled programs"] == 1 and info["usable"] == "yes"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    assert main(["cache", "clear"]) == 0
    assert "1 damaged program databases" in capsys.readouterr().out
    assert not list(tmp_path.glob("programs.corrupt-*")) and not (tmp_path / "programs.sqlite").exists()
    assert cache.cache_info(tmp_path)["damaged databases moved aside"] == 0


def test_cache_commands_on_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "NotADirectoryError" in cache.cache_info(blocker)["usable"]
    assert cache.clear_cache(blocker).startswith("nothing removed") and blocker.read_text() == "x"
