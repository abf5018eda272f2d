"""Fixtures of the generated-CPU-kernel tests (test_cpu_kernels.py, test_cpu_bf16.py).

Not a test module; the test files import the fixtures by name (pytest finds fixtures in a test
module's namespace). Each test module gets one kernel folder, so kernels compiled by one test are
reused by the next as they would be within one model; strict mode makes compile errors raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ember import config


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ember-cpu-cache")


@pytest.fixture(autouse=True)
def cpu_env(shared_cache: Path) -> Iterator[None]:
    torch._dynamo.reset()
    with config.patch(cache_dir=str(shared_cache), strict=True):
        yield


def compiled_graphs(compiled: Callable) -> list:
    """The graph records of an ``ember.compile`` result."""
    return compiled._ember_backend.log.graphs
