"""Each test here runs with a clean Dynamo and a hermetic Ember environment (support/ember_env.py)."""

from collections.abc import Iterator

import pytest
from ember_env import clean_ember  # noqa: F401 - an autouse fixture

from ember import config


@pytest.fixture
def split_reductions() -> Iterator[None]:
    """Split every looped reduction in the interpreter (as the GPU splits those with few programs)."""
    with config.patch(interpret_split_target_programs=64):
        yield
