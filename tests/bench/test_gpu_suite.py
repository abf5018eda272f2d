"""``benchmarks/scripts/gpu_suite.py``: the folder of a run packed into one archive (the device
returns only a few files a call)."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "scripts" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_archive_packs_every_json_and_log_and_removes_them(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    out.mkdir()
    rows = {f"main_job{i}.json": {"results": [{"ms_median": 1.0 + i}]} for i in range(12)}
    for name, row in rows.items():
        (out / name).write_text(json.dumps(row))
        (out / name.replace(".json", ".log")).write_text("log")
    (out / "notes.txt").write_text("kept")
    target = _gpu_suite().archive(out)
    assert target == tmp_path / "suite.tgz"
    with tarfile.open(target) as tar:
        names = sorted(tar.getnames())
        assert len(names) == 24
        assert json.load(tar.extractfile("suite/main_job3.json")) == rows["main_job3.json"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
