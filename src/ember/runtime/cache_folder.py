"""Whether Ember's cache folder can be used, and where kernels go when it cannot.

A cache folder that is a file, lies under a file, or cannot be written (read-only mount,
permissions) would otherwise surface as every save failing quietly and CPU kernels falling
back to ATen. Instead: one warning naming the folder and the OS error, generated kernels
written to a temporary folder of this process (so they still run), no compiled-program
cache, and ``ember.explain``'s cache line says why.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ember.config import Options


@functools.cache
def folder_problem(folder: str) -> str | None:
    """Why ``folder`` cannot hold Ember's cache (the OS error), or None when it can.

    Checked by creating it and writing a file in it: permission bits alone do not tell
    (root ignores them; a read-only mount does not show in them)."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return "NotADirectoryError: it is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ember-write-test-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


@functools.cache
def _scratch_folder() -> str:
    folder = tempfile.mkdtemp(prefix="ember-cache-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


@functools.cache
def _warn_once(folder: str, problem: str, scratch: str) -> None:
    warnings.warn(f"ember: the cache folder {folder} cannot be used ({problem}); compiled programs are not "
                  f"stored and generated kernels go to {scratch} for this process. Set EMBER_CACHE_DIR "
                  f"(or cache_dir=) to a writable folder.", RuntimeWarning, stacklevel=3)


def usable_options(options: Options) -> tuple[Options, str | None]:
    """``options`` itself when its cache folder works; else a copy whose cache folder is a
    temporary one of this process, and the reason (the OS error) the configured one failed."""
    folder = os.fspath(options.cache_root())
    problem = folder_problem(folder)
    if problem is None:
        return options, None
    scratch = _scratch_folder()
    _warn_once(folder, problem, scratch)
    import dataclasses
    return dataclasses.replace(options, cache_dir=scratch), f"cache folder {folder} unusable ({problem})"
