"""``ember bench --data`` end to end on the CPU, tiny: JPEG files, decoding loader, both loops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ember.cli import main
from ember.data.jpeg_folder import JpegFolder, make_jpeg_folder


def test_jpeg_folder_decodes_what_was_written(tmp_path: Path) -> None:
    paths = make_jpeg_folder(tmp_path, 3, 48)
    ds = JpegFolder(paths, classes=2, size=32)
    image, label = ds[1]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and label == 1
    full, _ = JpegFolder(paths)[0]
    assert full.shape == (3, 48, 48) and full.float().std() > 5  # not a blank image


def test_bench_data_prints_both_loops_and_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data.json"
    rc = main(["bench", "--data", "--device", "cpu", "--batch", "2", "--iters", "1", "--warmup", "0",
               "--workers", "0", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "plain" in text and "prefetch" in text and "doctor, plain loop" in text
    assert "% of step time waiting for data" in text
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["loop"] for r in rows] == ["plain", "prefetch"] and all(r["steps"] == 1 for r in rows)
    assert all(r["verdict"] in ("input-bound", "compute-bound") for r in rows)
    assert doc["config"]["reports"]["plain"]["facts"]["num_workers"] == 0
