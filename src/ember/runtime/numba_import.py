"""numba's import and CPU target set-up without importing ``scipy.linalg``, and cached machine
code loaded without that set-up.

Called before a generated CPU kernel module is imported (runtime/kernels.py), by the background
warm-up (runtime/cpu_background.py) and in the compile workers (runtime/cpu_compile.py, which run
without ``ember/__init__``: this module imports nothing of Ember's and not torch). Not from
runtime/cpu_support.py: its hash is in every kernel's name, so editing it would rename (and
recompile) every cached kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import sys
import threading
from collections.abc import Iterator

_REFUSED = "scipy.linalg"
_LOCK = threading.Lock()
# Set on a thread inside `numba_for_cached_code`: numba's cache loads skip the target's set-up.
_CACHED_CODE = threading.local()
_NUMBA_LOAD_OVERLOAD = None  # numba's own Cache.load_overload, once ours is installed


class _RefuseScipyLinalg(importlib.abc.MetaPathFinder):
    """Raises ImportError for ``scipy.linalg`` and its submodules, on the installing thread only."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - the finder protocol
        if threading.get_ident() == self.thread and (fullname == _REFUSED or fullname.startswith(_REFUSED + ".")):
            raise ImportError(f"{fullname} is not imported while numba sets up (ember/runtime/numba_import.py)")
        return None


def import_numba_without_scipy_blas() -> None:
    """Import numba and run its CPU target's one-time set-up with ``scipy.linalg`` unavailable.

    Why: the set-up (``BaseContext.refresh``) imports ``numba.np.arraymath``, whose module-level
    ``_HAVE_BLAS = _check_blas()`` imports ``scipy.linalg.cython_blas``, i.e. all of
    ``scipy.linalg`` (0.2-0.3 s of a 0.8 s warm first call on a 2-core CPU, more under load). It
    only decides whether ``np.correlate``/``np.convolve`` take their float inner product from
    ``np.dot`` (BLAS) or a plain loop; Ember's kernels use neither. Refusing just
    ``scipy.linalg.cython_blas`` does not help: ``scipy.linalg``'s ``__init__`` imports it
    itself, so the whole package would load and then fail. The package is refused instead.

    ``np.dot``, ``np.vdot``, ``@`` and ``np.linalg.*`` are unaffected: numba/np/linalg.py calls
    ``ensure_blas()``/``ensure_lapack()`` (which import ``scipy.linalg.cython_blas``/``_lapack``)
    in each intrinsic's codegen, i.e. when such a function is compiled, after this has returned.

    Does nothing beyond a plain ``import numba`` when ``numba.np.arraymath`` is already imported
    (the check has run) or ``scipy.linalg`` is (the check is then cheap). The finder refuses only
    imports made by this thread, and is removed in a ``finally``. Should the set-up fail with the
    finder in place (say a numba extension that needs ``scipy.linalg``), it runs again without it,
    raising as numba's own first use would if that fails too.
    """
    with _LOCK:
        _set_up_refusing_scipy_linalg()


def _set_up_refusing_scipy_linalg() -> None:
    if "numba.np.arraymath" in sys.modules or _REFUSED in sys.modules:
        import numba  # noqa: F401
        return
    finder = _RefuseScipyLinalg()
    sys.meta_path.insert(0, finder)
    try:
        _set_up_numba()
        return
    except Exception:  # noqa: BLE001 - the plain set-up below, as without this function
        pass
    finally:
        sys.meta_path.remove(finder)
    _set_up_numba()


def _set_up_numba() -> None:
    import numba  # noqa: F401
    from numba.core.registry import cpu_target

    cpu_target.target_context.refresh()  # imports numba.np.arraymath (its BLAS check)


@contextlib.contextmanager
def numba_for_cached_code() -> Iterator[None]:
    """Import numba; inside the block (this thread only), a function that numba finds in its
    cache loads without the CPU target's one-time set-up.

    Why: numba's ``Cache.load_overload`` runs ``target_context.refresh()`` before every load,
    and the first one imports and installs every typing and lowering registry numba has (the
    ``numba.np``, ``numba.cpython``, ``numba.typed`` ... implementations: ~0.1 s of a 0.35 s warm
    first call on a 2-core CPU, the GIL held). Loading machine code uses none of them: the cached
    library is linked, its wrapper's address taken, parfors' ``reload_init`` run. Its one need
    is numba's runtime (NRT) symbols, which the set-up is also where numba initialises:
    ``rtsys.initialize`` is called instead (without it a cached ``parallel=True`` function
    crashes at its first call). A function not in the cache is compiled by numba next; the full
    set-up (``scipy.linalg`` refused, as above) runs first and numba's compiler refreshes as
    usual. Outside the block, and where numba's cache class lacks the methods this relies on,
    loads are numba's own."""
    import numba  # noqa: F401

    if not _install_cached_load():
        yield
        return
    before = getattr(_CACHED_CODE, "on", False)
    _CACHED_CODE.on = True
    try:
        yield
    finally:
        _CACHED_CODE.on = before


def _install_cached_load() -> bool:
    global _NUMBA_LOAD_OVERLOAD
    from numba.core import caching

    with _LOCK:
        if _NUMBA_LOAD_OVERLOAD is not None:
            return True
        if not all(hasattr(caching.Cache, name) for name in
                   ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")):
            return False
        _NUMBA_LOAD_OVERLOAD = caching.Cache.load_overload
        caching.Cache.load_overload = _load_overload
        return True


def _load_overload(self, sig, target_context):  # noqa: ANN001, ANN202 - numba's Cache.load_overload
    if not getattr(_CACHED_CODE, "on", False):
        return _NUMBA_LOAD_OVERLOAD(self, sig, target_context)
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)  # NRT's symbols: all a cached function needs of the set-up
    with self._guard_against_spurious_io_errors():
        found = self._load_overload(sig, target_context)
    if found is None:  # numba compiles it next: the set-up first, scipy.linalg refused
        _set_up_refusing_scipy_linalg()
    return found


def load_launch_helpers() -> None:
    """Compile, or load from numba's cache, the functions every CPU kernel launch goes through
    (``cpu_support.drive`` and ``drive_chunked``) for the argument types launches use: Python
    ints and a C-contiguous int64 vector. ``units=0`` returns at once. Used when a process imports
    its first CPU kernel module (runtime/kernels.py, before any launch), by the background warm-up
    (runtime/cpu_background.py) and by the compile workers' last job (runtime/cpu_compile.py,
    where ``ember`` is a stub package: hence the import by name)."""
    import numpy as np

    # The first call of a parallel numba function starts numba's OpenMP thread pool, which sets
    # the process's OpenMP thread count (torch's too) to numba's: a user's
    # ``torch.set_num_threads`` would be undone, and inside Dynamo's trace (a compile loading its
    # kernels) Dynamo stops on the changed global state. Put torch's count back.
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        support = importlib.import_module("ember.runtime.cpu_support")
        argv = np.zeros(1, dtype=np.int64)
        support.drive(0, 0, 1, argv)
        support.drive_chunked(0, 0, 1, 1, argv)
    finally:
        if torch is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
