"""numba's import and the cached CPU kernels of a warm start, loaded on a background thread.

Measured on a 2-core CPU (torch 2.14.1, numba 0.68.1, resnet18 inference 1x3x64x64): of a warm
first call's ~1.4 s, ~0.9 s was the CPU kernel loader on the main thread: importing numba (0.16 s),
numba's first use of its CPU target (``BaseContext.refresh`` imports numba's implementation
registries, among them ``numba.np.arraymath``, whose BLAS check imported ``scipy.linalg``: 0.4 s;
runtime/numba_import.py now keeps ``scipy.linalg`` out) and loading the kernel's cached machine
code. None of it needs the model or the call.

So with a warm start on the CPU target, ``ember.compile`` starts one background thread
(``LOADER.warm_numba``) that does this work, and while a warm-start file is linked each CPU kernel
is handed to the same thread (``LOADER.launcher``): the program gets a ``LazyLauncher`` that waits
for its kernel on the kernel's first launch. The main thread meanwhile reads and deserialises the
file and starts the program (resnet18's one CPU kernel is its final pooling, after every
convolution; ATen's convolutions release the GIL).

Nothing here can make a compile fail: a background job that raises is recorded (``problems``) and
the kernel is then loaded on the main thread, as without this module (which raises as before if
that fails too).

Off by default (``EMBER_CPU_BACKGROUND_LOAD=1`` turns it on). Measured on the 2-core CPU with
``ember bench --first-call`` (benchmarks/results/cpu/2026-11-25_warm_start): no gain. numba's import
and set-up are Python holding the GIL, the bench calls the model right after ``ember.compile``,
and the warm first run there is ~0.09 s (oneDNN's primitives are quick at this size): nothing
overlaps, the work just moves into the first run. It can only pay where the main thread waits
between ``ember.compile`` and the first call (a data loader's first batch). And a thread that is
importing while the process forks (data-loader workers) leaves module locks held in the child.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ember import config

# Set while a warm-start file is being linked: CPU kernels then load on the background thread.
_IN_BACKGROUND: ContextVar[bool] = ContextVar("ember_cpu_background", default=False)


def _fault() -> None:
    """Tests: make a background job fail (``config.patch(cpu_background_fault="...")``)."""
    text = config.settings().cpu_background_fault
    if text:
        raise RuntimeError(text)


def _warm_numba_now() -> None:
    """Import numba, run its CPU target's one-time set-up, and load the launch helpers' cached code."""
    _fault()
    from ember.runtime.numba_import import import_numba_without_scipy_blas, load_launch_helpers

    import_numba_without_scipy_blas()  # numba's import and registries, without scipy.linalg
    load_launch_helpers()


class LazyLauncher:
    """A CPU kernel's launcher whose loading runs on the background thread; the first launch waits."""

    def __init__(self, future: concurrent.futures.Future, load: Callable[[], Callable], loader: BackgroundLoader) -> None:
        self._future = future
        self._load = load
        self._loader = loader
        self._fn: Callable | None = None
        self._lock = threading.Lock()

    def resolve(self) -> Callable:
        """The real launcher: the background thread's, or (if that job failed) loaded here."""
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    try:
                        fn = self._future.result()
                    except Exception as err:  # noqa: BLE001 - load it on this thread instead
                        self._loader.note(f"background kernel load failed ({type(err).__name__}: {err}); "
                                          "loaded on the main thread")
                        fn = self._load()
                    self._fn = fn
        return self._fn

    @property
    def ready(self) -> Callable | None:
        """The real launcher once the first launch has resolved it (None before)."""
        return self._fn

    def __call__(self, *tensors: Any) -> None:
        fn = self._fn or self.resolve()
        fn(*tensors)

    def __getattr__(self, name: str) -> Any:  # units, threads: the real launcher's
        if name.startswith("_") or name == "ready":
            raise AttributeError(name)
        return getattr(self.resolve(), name)


class BackgroundLoader:
    """One background thread per process for numba's warm-up and CPU kernel loads (see the module
    docstring). Jobs run in the order given: the warm-up first, then the kernels."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._warm: concurrent.futures.Future | None = None
        self._lock = threading.RLock()
        self.problems: list[str] = []  # what failed in the background (then done on the main thread)

    def note(self, line: str) -> None:
        if line not in self.problems:
            self.problems.append(line)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-cpu-load")
            return self._pool.submit(fn)

    def warm_numba(self) -> concurrent.futures.Future:
        """Start numba's import and set-up on the background thread (once; later calls return the same job)."""
        with self._lock:
            if self._warm is None:
                # The Ember modules the jobs use are imported here first, so the two threads never
                # import the same Ember module at once (the kernel loads come from runtime/kernels.py,
                # imported by whoever hands them over).
                from ember.codegen import cpu_kernel  # noqa: F401
                self._warm = self._submit(_warm_numba_now)
                self._warm.add_done_callback(self._warm_done)
            return self._warm

    def _warm_done(self, future: concurrent.futures.Future) -> None:
        err = future.exception()
        if err is not None:
            self.note(f"numba's background warm-up failed ({type(err).__name__}: {err})")

    def launcher(self, load: Callable[[], Callable]) -> LazyLauncher:
        """The launcher of a CPU kernel's use, made by ``load`` on the background thread (or on the
        caller's, where that fails)."""

        def load_in_background() -> Callable:
            _fault()
            return load()

        self.warm_numba()
        return LazyLauncher(self._submit(load_in_background), load, self)


LOADER = BackgroundLoader()


def wanted(model: object, options: Any) -> bool:
    """Whether ``ember.compile(model, **options)`` should warm numba up now: a warm start whose
    kernels will be CPU (numba) kernels, and the setting on."""
    if not options.warm_start or not config.settings().cpu_background_load:
        return False
    if options.target not in ("auto", "cpu") or options.device == "cuda":
        return False
    if options.target == "auto":
        parameters = getattr(model, "parameters", None)
        try:
            devices = {p.device.type for p in parameters()} if callable(parameters) else set()
        except Exception:  # noqa: BLE001 - an unusual module: do not guess
            return False
        if devices != {"cpu"}:
            return False  # no parameters, or on a GPU: the target is not known yet
    return True


def start(model: object, options: Any) -> bool:
    """Start the background warm-up if ``wanted``; returns whether it did (never raises)."""
    try:
        if not wanted(model, options):
            return False
        LOADER.warm_numba()
        return True
    except Exception as err:  # noqa: BLE001 - a convenience: the main thread loads numba as before
        LOADER.note(f"background warm-up not started ({type(err).__name__}: {err})")
        return False


def active() -> bool:
    """Whether CPU kernels linked now load on the background thread."""
    return _IN_BACKGROUND.get()


@contextmanager
def kernels_in_background(enabled: bool = True) -> Iterator[None]:
    """CPU kernels linked inside the block load on the background thread (a warm start's link)."""
    token = _IN_BACKGROUND.set(enabled and config.settings().cpu_background_load)
    try:
        yield
    finally:
        _IN_BACKGROUND.reset(token)
