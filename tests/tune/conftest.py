"""Shared by the tuning tests: open database handles are closed around each test."""

from __future__ import annotations

import pytest

from ember.tune.apply import forget_open


@pytest.fixture(autouse=True)
def _fresh_db_handles():
    forget_open()
    yield
    forget_open()
