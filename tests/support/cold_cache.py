"""ColdCache: the cache folder one cold process left, shared by the tests of a module that start from it.

Not a test module; test files import it by name (pyproject.toml puts tests/support on the path).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ColdCache:
    """A cold process's cache, made once and handed to each test as that process left it.

    A test of a warm start, a damaged entry or a replaced database first needs a cold process to
    fill the cache, and that process (a Python start, torch, one compile) is most of the test's
    time. Here it runs once per module (per xdist worker), made by the first test that asks: it
    then runs in a test's environment, as each test's own processes do. ``fresh()`` puts the
    untouched copy back at the same path before each test (Ember's CPU kernel modules are named
    after their cache folder, so a cache moved elsewhere would not load), so a test may damage it.
    """

    def __init__(self, base: Path, make: Callable[[Path], Any]) -> None:
        self.path = base / "cache"
        self._pristine = base / "pristine"
        self._make = make
        self._result: Any = None

    def fresh(self) -> tuple[Path, Any]:
        """The cache folder as the cold process left it, and what that process returned."""
        if not self._pristine.exists():
            shutil.rmtree(self.path, ignore_errors=True)  # what a failed attempt left
            self.path.mkdir(parents=True)
            self._result = self._make(self.path)
            shutil.copytree(self.path, self._pristine)
        else:
            shutil.rmtree(self.path)
            shutil.copytree(self._pristine, self.path)
        return self.path, self._result
