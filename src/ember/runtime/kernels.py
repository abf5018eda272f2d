"""Generated kernel modules on disk, content-addressed, loaded once per process.

Each kernel is written to ``<cache>/kernels/<name>.py`` (the name holds the content hash),
atomically, so concurrent processes never see a half-written file. A file whose content
does not match its hash is rewritten. Triton needs the source file to exist: it reads
kernels back with ``inspect``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ember.codegen.triton_kernel import KernelSource

_LOADED: dict[tuple[str, str, bool], Callable] = {}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def kernel_file(ks: KernelSource, kernel_dir: Path) -> Path:
    """The kernel's module file, written (or repaired) if needed."""
    path = kernel_dir / f"{ks.name}.py"
    text = ks.module_source()
    try:
        ok = path.read_text() == text
    except (OSError, UnicodeDecodeError):
        ok = False
    if not ok:
        _write_atomic(path, text)
    return path


def forget_loaded() -> None:
    """Drop the in-process kernel table, so the next load reads (and verifies) the files again."""
    _LOADED.clear()


def load_kernel(ks: KernelSource, kernel_dir: Path, interpret: bool) -> Callable:
    """The launchable Triton function for ``ks`` (interpreted on CPU when ``interpret``)."""
    key = (str(kernel_dir), ks.name, interpret)
    if key in _LOADED:
        return _LOADED[key]
    path = kernel_file(ks, kernel_dir)
    spec = importlib.util.spec_from_file_location(f"ember_kernels.{ks.name}", path)
    module = importlib.util.module_from_spec(spec)
    # Triton decides between compiled and interpreted functions when @triton.jit runs.
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    fn = getattr(module, ks.name)
    _LOADED[key] = fn
    return fn
