"""Triton's cache key kept between processes (runtime/triton_key.py): taken from the stored file
only while the stamp of Triton's files matches; a changed stamp or a damaged file computes it
afresh (and stores it again); the switch turns it off."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import triton.runtime.cache as triton_cache

from ember import config
from ember.runtime import triton_key

REAL = triton_cache.triton_key.__wrapped__  # Triton's own computation, under its lru_cache


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private Triton cache folder and a Triton key not yet computed in this process; Triton's
    function and the install flag are restored after the test."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_cache, "triton_key", functools.lru_cache()(REAL))
    monkeypatch.setattr(triton_key, "_installed", False)
    return tmp_path / "ember_triton_key.json"


def _new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_cache, "triton_key", functools.lru_cache()(REAL))
    monkeypatch.setattr(triton_key, "_installed", False)


def test_the_key_is_stored_then_read_back(stored: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    triton_key.install()
    want = REAL()
    assert triton_cache.triton_key() == want
    assert json.loads(stored.read_text()) == {"stamp": triton_key.stamp(), "key": want}
    # The next process answers from the file (a marker value shows it was read, not computed).
    stored.write_text(json.dumps({"stamp": triton_key.stamp(), "key": "stored-key"}))
    _new_process(monkeypatch)
    triton_key.install()
    assert triton_cache.triton_key() == "stored-key"


@pytest.mark.parametrize("damage", ["other_stamp", "not_json", "no_key"])
def test_a_changed_stamp_or_damaged_file_computes_it_afresh(stored: Path, damage: str) -> None:
    stored.write_text({"other_stamp": json.dumps({"stamp": "from other files", "key": "stale"}),
                       "not_json": "{broken", "no_key": json.dumps({"stamp": triton_key.stamp()})}[damage])
    triton_key.install()
    want = REAL()
    assert triton_cache.triton_key() == want
    assert json.loads(stored.read_text()) == {"stamp": triton_key.stamp(), "key": want}


def test_the_switch_leaves_triton_alone(stored: Path) -> None:
    before = triton_cache.triton_key
    with config.patch(triton_key_cache=False):
        triton_key.install()
    assert triton_cache.triton_key is before and not stored.exists()
