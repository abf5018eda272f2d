"""Ember's on-disk cache: ``ember cache info|clear``.

The cache holds the generated kernel modules (``<cache>/kernels/<name>.py``, named by content
hash, written atomically and verified on every load, see ``runtime.kernels``) and the compiled
programs (``<cache>/programs.sqlite``, see ``runtime.artifacts``).
The folder is ``EMBER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ember``, else ``~/.cache/ember``.
Triton keeps its compiled binaries in its own cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``); ``info`` reports it too but ``clear`` leaves it alone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ember.config import Options
from ember.runtime import kernels
from ember.runtime.artifacts import ProgramStore
from ember.runtime.cache_folder import folder_problem
from ember.runtime.triton_key import triton_cache_dir


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder in use (``path`` overrides the environment)."""
    return Path(path) if path else Options.from_env().cache_root()


def _usage(folder: Path, pattern: str = "*") -> tuple[int, int]:
    files = [p for p in folder.rglob(pattern) if p.is_file()] if folder.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def cache_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Where the cache is and what it holds."""
    root = cache_dir(path)
    n_kernels, kernel_bytes = _usage(root / "kernels", "ember_*.py")
    triton_dir = triton_cache_dir()
    n_triton, triton_bytes = _usage(triton_dir)
    store = ProgramStore(root)
    db_bytes = store.path.stat().st_size if store.path.exists() else 0
    damaged = _damaged_databases(root)
    return {"path": str(root), "usable": (folder_problem(str(root)) or "yes") if root.exists() else "yes (not created yet)",
            "compiled programs": store.count(), "cached frames": store.count("frames"),
            "program database bytes": db_bytes,
            "damaged databases moved aside": len(damaged),
            "damaged database bytes": sum(p.stat().st_size for p in damaged),
            "kernel modules": n_kernels, "kernel module bytes": kernel_bytes,
            "triton cache": str(triton_dir), "triton cache files": n_triton, "triton cache bytes": triton_bytes}


def _damaged_databases(root: Path) -> list[Path]:
    """Program databases found damaged and moved aside (``programs.corrupt-<pid>-<time>``,
    runtime/artifacts.py)."""
    return [p for p in root.glob("programs.corrupt-*") if p.is_file()] if root.is_dir() else []


def clear_cache(path: str | os.PathLike[str] | None = None) -> str:
    """Delete Ember's compiled programs, kernel modules and damaged databases; returns what was removed."""
    root = cache_dir(path)
    if root.exists() and not root.is_dir():
        return f"nothing removed: {root} is a file, not a cache folder"
    n, size = _usage(root / "kernels")
    store = ProgramStore(root)
    programs, frames = store.count(), store.count("frames")
    store.clear()
    damaged = _damaged_databases(root)
    for p in damaged:
        p.unlink(missing_ok=True)
    shutil.rmtree(root / "kernels", ignore_errors=True)
    kernels.forget_loaded()
    return (f"removed {programs} compiled programs, {frames} cached frames, {len(damaged)} damaged program databases and {n} kernel "
            f"files ({size} bytes) from {root}")
