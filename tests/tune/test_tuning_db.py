"""The tuning database: best-of-checked, failures never returned, layering, concurrency, damage."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import warnings
from pathlib import Path

import pytest

from ember.tune.db import LayeredTuningDB, Result, TuningDB


def _ok(kernel: str, config: dict, ms: float, device: str = "dev") -> Result:
    return Result(kernel, device, config, ms, "ok")


def test_best_is_fastest_checked_and_failures_never_returned(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    db.record([_ok("k", {}, 2.0), _ok("k", {"XBLOCK": 256}, 1.0),
               Result("k", "dev", {"XBLOCK": 64}, None, "failed", "wrong result"),
               _ok("k", {"XBLOCK": 512}, 1.5), _ok("k", {"XBLOCK": 128}, 0.5, device="other")])
    choice = db.choices(["k", "absent"], "dev")
    assert list(choice) == ["k"]
    assert choice["k"].config == {"XBLOCK": 256} and choice["k"].ms == 1.0
    assert choice["k"].gain == pytest.approx(2.0)
    assert [r.config for r in db.top("k", "dev", 2)] == [{"XBLOCK": 256}, {"XBLOCK": 512}]
    results = db.results("k", "dev")
    assert results[-1].failed and results[-1].detail == "wrong result"
    # A failed candidate stays failed even when it is the only one.
    db.record([Result("bad", "dev", {"XBLOCK": 64}, None, "failed", "wrong")])
    assert "bad" not in db.choices(["bad"], "dev")


def test_layered_user_wins_and_shared_is_read_only(tmp_path: Path) -> None:
    shared = TuningDB(tmp_path / "shared.sqlite")
    shared.record([_ok("a", {"XBLOCK": 1}, 1.0), _ok("b", {"XBLOCK": 2}, 1.0)])
    shared.close()
    user = TuningDB(tmp_path / "user.sqlite")
    user.record([_ok("a", {"XBLOCK": 3}, 5.0)])
    user.close()
    layered = LayeredTuningDB(tmp_path / "user.sqlite", tmp_path / "shared.sqlite")
    got = layered.choices(["a", "b"], "dev")
    assert got["a"].config == {"XBLOCK": 3} and got["a"].source == "user"
    assert got["b"].config == {"XBLOCK": 2} and got["b"].source == "shared"
    with pytest.raises(PermissionError):
        TuningDB(tmp_path / "shared.sqlite", read_only=True).record([_ok("c", {}, 1.0)])
    assert not LayeredTuningDB(tmp_path / "none.sqlite", None).exists()


def _writer(path: str, worker: int, n: int) -> None:
    db = TuningDB(path)
    for i in range(n):
        db.record([_ok(f"k{worker}-{i}", {}, 1.0), _ok(f"k{worker}-{i}", {"XBLOCK": i}, 0.5)])
    db.close()


def test_concurrent_tuners_lose_no_record(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sqlite")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(TuningDB(path)) == 4 * 40 * 2


def test_damaged_file_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite"
    path.write_bytes(b"this is not an SQLite database" * 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db = TuningDB(path)
        db.record([_ok("k", {}, 1.0)])
    assert any("damaged" in str(w.message) for w in caught)
    assert len(list(tmp_path.glob("tuning.corrupt-*"))) == 1
    assert len(db) == 1
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.parametrize("suffix", [".json", ".sqlite"])
def test_export_import_round_trip(tmp_path: Path, suffix: str) -> None:
    src = TuningDB(tmp_path / "a.sqlite")
    src.record([_ok("k", {}, 2.0), _ok("k", {"XBLOCK": 8}, 1.0),
                Result("k", "dev", {"XBLOCK": 4}, None, "failed", "wrong")], fingerprint={"kind": "cpu"})
    assert src.export(tmp_path / f"out{suffix}") == 3
    dst = TuningDB(tmp_path / "b.sqlite")
    assert dst.import_from(tmp_path / f"out{suffix}") == 3
    assert dst.choices(["k"], "dev")["k"].config == {"XBLOCK": 8}
    assert dst.fingerprints() == {"dev": {"kind": "cpu"}}
    assert sum(r.failed for r in dst.all()) == 1


@pytest.mark.parametrize("suffix", [".json", ".sqlite"])
def test_whole_model_verdicts_travel_with_export_and_import(tmp_path: Path, suffix: str) -> None:
    db = TuningDB(tmp_path / "a.sqlite")
    db.record([Result("k1", "cpu-x", {}, 2.0, "ok"), Result("k1", "cpu-x", {"impl": "aten"}, 1.0, "ok")])
    db.demote([Result("k1", "cpu-x", {"impl": "aten"}, 1.0, "ok")], "whole model rules 1.0 ms, all 1.2 ms")
    verdict = {"kept": "rules", "demoted": ["k1"], "variants": {"rules": 1.0, "all": 1.2}, "at": 0.0}
    db.note("model_check:abc", verdict)
    db.note("schema-like", None)  # reading a missing note answers None and writes nothing
    out = tmp_path / f"export{suffix}"
    db.export(out)
    other = TuningDB(tmp_path / "b.sqlite")
    other.import_from(out)
    assert other.note("model_check:abc") == verdict and other.notes() == {"model_check:abc": verdict}
    rows = other.results("k1", "cpu-x")
    assert [r.status for r in rows] == ["ok", "slower_in_model"] and not any(r.failed for r in rows)
    assert other.choices(["k1"], "cpu-x")["k1"].config == {}  # the demoted choice is not the answer
