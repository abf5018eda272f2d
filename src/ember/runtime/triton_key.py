"""Triton's own cache key, kept between processes.

Every process that launches a Triton kernel computes ``triton.runtime.cache.triton_key()`` once,
at its first launch: a SHA-256 of Triton's compiler, backend and language sources and of the
whole ``libtriton`` shared library (0.43 s of bert's 1.6 s warm first call on an H100 host, 0.8 s
on this 2-core CPU), and every compile worker does it again. The key only changes when those files
change, so it is stored in Triton's cache folder with a stamp of what it was computed from (Triton's
version and the size and modification time of every file the key reads) and taken from there
when the stamp still matches; any difference computes it afresh. ``EMBER_TRITON_KEY_CACHE=0`` turns
this off.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_FILE = "ember_triton_key.json"
_installed = False


def _triton_dir() -> Path:
    import triton
    return Path(triton.__file__).resolve().parent


def triton_cache_dir() -> Path:
    """Triton's cache folder: ``TRITON_CACHE_DIR``, else its default under the home folder."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def stamp() -> str:
    """Triton's version and the size and mtime of every file ``triton_key`` reads: its cache
    module, the compiler, backends and language packages, and the ``_C`` libraries."""
    import triton
    root = _triton_dir()
    digest = hashlib.sha256(f"{triton.__version__} {root}".encode())
    folders = [root / "compiler", root / "backends", root / "language", root / "_C"]
    files = [root / "runtime" / "cache.py"]
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            files += [Path(dirpath) / name for name in sorted(filenames)]
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        digest.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def install() -> None:
    """Make ``triton.runtime.cache.triton_key`` answer from the stored key when its stamp matches
    (once per process; a no-op where the key was already computed here)."""
    global _installed
    if _installed:
        return
    _installed = True
    from ember.config import settings
    if not settings().triton_key_cache:
        return
    try:
        import triton.runtime.cache as triton_cache
    except ImportError:
        return
    original = triton_cache.triton_key
    info = getattr(original, "cache_info", None)
    if info is not None and info().currsize:
        return  # computed in this process already: nothing to save
    path = triton_cache_dir() / _FILE
    now = stamp()
    try:
        stored = json.loads(path.read_text())
        key = stored["key"] if stored.get("stamp") == now and isinstance(stored.get("key"), str) else None
    except (OSError, ValueError, TypeError, KeyError):
        key = None
    if key is None:
        key = original()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"stamp": now, "key": key}))
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            pass
    value = key

    def triton_key() -> str:
        return value

    triton_cache.triton_key = triton_key  # get_cache_key looks the name up at each call
