"""Importing a generated Triton kernel module, and the two costs a warm process need not pay again.

A process that loads a saved program imports each kernel's module and launches it once; before
its first launch Triton computes the kernel's cache key (a walk over the function's syntax tree
and every function it calls) to find the compiled binary in its cache. On an H100 host those
steps were most of a warm first call after the warm-start file (resnet50 training: 174 kernels,
~1 s of a 3.0 s first call under cProfile), and both give the same answer for the same file:

- **The module's code object** is kept beside the file (``__pycache__/<name>.ember-<tag>.code``,
  with the SHA-256 of the source it came from and of the interpreter's version), also where
  ``PYTHONDONTWRITEBYTECODE`` stops Python from writing its own ``.pyc`` (container images often
  set it). A file whose hash differs, or that cannot be read or unmarshalled, is compiled again
  and rewritten. A stored program's code object is kept the same way (``compile_kept``).
- **Triton's cache key of the kernel function** is stored in ``<name>.py.triton-key`` with a
  check made of Triton's own key (its sources and library, ``runtime/triton_key.py``) and the
  module text; when both match, the key is set on the loaded function before its first launch,
  so Triton looks its binary up without the walk. Anything else (another Triton, an edited file,
  a damaged record) lets Triton compute it as usual and records the new one.
``kernel_load_cache`` (``EMBER_KERNEL_LOAD_CACHE=0``) turns both off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import sys
import threading
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

_CODE_MAGIC = b"EMBERCODE1"


def replace_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file: readers see the old file or the new one;
    a folder that cannot be written leaves it as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a concurrent reader sees the old file or the new one
    except OSError:
        tmp.unlink(missing_ok=True)


def _code_path(path: Path) -> Path:
    return path.parent / "__pycache__" / f"{path.stem}.ember-{sys.implementation.cache_tag}.code"


def compile_kept(source: bytes, filename: str, cached: Path) -> CodeType:
    """``compile(source, filename, "exec")``, its code object kept in ``cached`` with the SHA-256 of
    the source and the interpreter's version; a file that does not match, or cannot be read or
    unmarshalled, is compiled again and rewritten. A kept code object compiled under another file
    name (a program's title numbers its graph within a process) gets ``filename``, so tracebacks
    name this one. Kernel modules and programs use it."""
    # The interpreter's version too: a code object marshalled by another Python is not one to run.
    digest = hashlib.sha256(source + b"\0" + sys.version.encode()).digest()
    try:
        blob = cached.read_bytes()
        if blob.startswith(_CODE_MAGIC) and blob[len(_CODE_MAGIC):len(_CODE_MAGIC) + 32] == digest:
            code = marshal.loads(blob[len(_CODE_MAGIC) + 32:])
            return code if code.co_filename == filename else _renamed(code, filename)
    except (OSError, ValueError, EOFError, TypeError):
        pass  # missing or damaged: compile below
    code = compile(source, filename, "exec", dont_inherit=True)
    replace_atomic(cached, _CODE_MAGIC + digest + marshal.dumps(code))
    return code


def _renamed(code: CodeType, filename: str) -> CodeType:
    """``code`` and every code object nested in it with ``co_filename`` set to ``filename``."""
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


class _KernelLoader(importlib.machinery.SourceFileLoader):
    """Python's source loader with the code object kept by source hash, not by the bytecode flag."""

    def get_code(self, fullname: str) -> Any:
        path = Path(self.get_filename(fullname))
        return compile_kept(self.get_data(str(path)), str(path), _code_path(path))


def import_file(name: str, path: Path, keep_code: bool | None = None) -> ModuleType:
    """The module in ``path`` executed as ``name`` (not put in ``sys.modules``); ``keep_code``: its
    code object kept beside it (default: the ``kernel_load_cache`` setting; a caller that has read
    it passes it)."""
    if keep_code is None:
        from ember.config import settings
        keep_code = settings().kernel_load_cache
    if keep_code:
        spec = importlib.util.spec_from_file_location(name, path, loader=_KernelLoader(name, str(path)))
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key_check(text: str) -> str | None:
    try:
        import triton.runtime.cache as triton_cache
        return hashlib.sha256(f"{triton_cache.triton_key()}\n{text}".encode()).hexdigest()
    except Exception:  # noqa: BLE001 - no Triton key here: keep Triton's own path
        return None


def preset_cache_key(fn: Any, path: Path, text: str) -> None:
    """Give the compiled (not interpreted) Triton function ``fn`` loaded from ``path`` (whose text is
    ``text``) the cache key stored for this text and this Triton; without one, compute it now (as its
    first launch would) and store it. Called only where ``kernel_load_cache`` is on."""
    if getattr(fn, "hash", 0) is not None or not isinstance(
            getattr(type(fn), "cache_key", None), property):
        return  # interpreted, already keyed, or a Triton whose functions keep no ``hash``
    check = _key_check(text)
    if check is None:
        return
    record = path.with_name(path.name + ".triton-key")
    try:
        stored = json.loads(record.read_text())
        if stored.get("check") == check and isinstance(stored.get("key"), str):
            fn.hash = stored["key"]
            return
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or damaged: compute below
    try:
        key = fn.cache_key
    except Exception:  # noqa: BLE001 - let the first launch raise what Triton raises
        return
    replace_atomic(record, json.dumps({"check": check, "key": key}).encode())
