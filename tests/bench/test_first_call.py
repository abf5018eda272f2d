"""``ember bench --first-call``: cold and warm first calls, each in a new process (bench/first_call.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ember.bench import first_call
from ember.cli import main


def test_cache_folders_and_child_command(tmp_path: Path) -> None:
    env = first_call.cache_env(tmp_path)
    assert {env[v] for v in first_call.CACHES} == {str(tmp_path / s) for s in ("ember", "triton", "inductor")}
    cmd = first_call.child_command("resnet18", "infer", "ember", "cpu", "fp32", 1, True, tmp_path / "r.json")
    assert cmd[-1] == "1" and "--small" in cmd and cmd[cmd.index("--warmup") + 1] == "0"


def test_cold_then_warm_rows_from_new_processes(tmp_path: Path) -> None:
    out = tmp_path / "first.json"
    code = main(["bench", "resnet18", "--mode", "infer", "--backend", "ember", "--device", "cpu", "--small",
                 "--batch", "1", "--first-call", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["cache"] for r in rows] == ["cold", "warm"]
    for row in rows:
        assert row["backend"] == "ember" and not row.get("error")
        assert 0 < row["first_call_s"] < row["process_s"]
    stages = [r["compile_split"]["ember_stages_s"] for r in rows]
    assert stages[0]["passes"] > 0  # cold: compiled
    # warm: the cold process's program, from the warm-start file (no trace at all), the frame cache
    # (no AOTAutograd trace either) or the program cache
    warm = rows[1]["compile_split"]
    assert stages[1]["passes"] == 0
    assert (any("loaded" in line for line in warm["frame_cache"] + warm.get("warm_start", []))
            or stages[1]["cache_load"] > 0), warm
