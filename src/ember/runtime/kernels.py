"""Generated kernel modules on disk, content-addressed, loaded once per process.

Each kernel is written to ``<cache>/kernels/<name>.py`` (the name holds the content hash),
atomically, so concurrent processes never see a half-written file. A file whose content
does not match its hash is rewritten. Triton needs the source file to exist: it reads
kernels back with ``inspect``.

CPU kernels (names ``ember_cpu_*``, codegen/cpu_kernel.py) are numba modules shared by every
use with the same structure: the module source of one use is the shared module plus a trailing
line with this use's sizes, strides and constants. The shared part is written as
``<kernel>.py`` and imported once per process (numba compiles it, or loads the machine code it
cached in ``__pycache__`` next to the file); each use becomes a small launcher around it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from ember.codegen.kernel_source import KernelSource, split_module
from ember.config import settings
from ember.runtime import kernel_module, triton_key

_LOADED: dict[tuple[str, str, bool], Callable] = {}
_CPU_MODULES: dict[tuple[str, str], ModuleType] = {}
# CPU kernel modules may load on a background thread (runtime/cpu_background.py): one at a time.
_CPU_IMPORT_LOCK = threading.RLock()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def kernel_file(ks: KernelSource, kernel_dir: Path) -> Path:
    """The kernel's module file, written (or repaired) if needed."""
    return _module_file(kernel_dir / f"{ks.name}.py", ks.module_source())


def _module_file(path: Path, text: str) -> Path:
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
    _CPU_MODULES.clear()


@contextlib.contextmanager
def jit_mode(interpret: bool) -> Iterator[None]:
    """``@triton.jit`` inside the block makes interpreted functions (CPU tensors) or compiled ones:
    Triton decides when the decorator runs, from TRITON_INTERPRET."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def load_kernel(ks: KernelSource, kernel_dir: Path, interpret: bool) -> Callable:
    """The launchable Triton function for ``ks`` (interpreted on CPU when ``interpret``)."""
    key = (str(kernel_dir), ks.name, interpret)
    if key in _LOADED:
        fn = _LOADED[key]
        if ks.name.startswith("ember_cpu_"):  # a background-loaded launcher: the real one once it is ready
            fn = getattr(fn, "ready", None) or fn
        return fn
    if ks.name.startswith("ember_cpu_"):
        from ember.runtime import cpu_background
        text = ks.module_source()
        if cpu_background.active():  # a warm start's link: numba loads it meanwhile
            _LOADED[key] = cpu_background.LOADER.launcher(lambda: _cpu_launcher(text, kernel_dir))
        else:
            _LOADED[key] = _cpu_launcher(text, kernel_dir)
        return _LOADED[key]
    text = ks.module_source()
    path = _module_file(kernel_dir / f"{ks.name}.py", text)
    if interpret:
        _LOADED[key] = _import_jit(ks.name, path, text, interpret)
        return _LOADED[key]
    from ember.runtime import cubin_launch
    if cubin_launch.enabled():
        # Launched from its stored binary; the module is imported only for a launch without one.
        folder, name = cubin_launch.record_place(path, ks.name, kernel_dir)
        _LOADED[key] = cubin_launch.CubinKernel(name, text, folder, lambda: _import_jit(ks.name, path, text, False))
    else:
        _LOADED[key] = _import_jit(ks.name, path, text, False)
    return _LOADED[key]


def _import_jit(name: str, path: Path, text: str, interpret: bool) -> Callable:
    """The ``@triton.jit`` function ``name`` of the kernel module in ``path`` (whose text is ``text``)."""
    if not interpret:
        triton_key.install()
    keep = settings().kernel_load_cache
    with jit_mode(interpret):
        module = kernel_module.import_file(f"ember_kernels.{name}", path, keep)
    fn = getattr(module, name)
    if keep and not interpret:
        kernel_module.preset_cache_key(fn, path, text)
    return fn


_MODULES: dict[tuple[str, bool], ModuleType] = {}


def load_module(path: Path, interpret: bool) -> ModuleType:
    """A module of hand-written ``@triton.jit`` kernels, imported once per mode: its kernels and the
    helpers they call are interpreted (CPU tensors) or compiled alike."""
    key = (str(path), interpret)
    if key not in _MODULES:
        def load() -> ModuleType:
            if not interpret:
                triton_key.install()
            with jit_mode(interpret):
                return kernel_module.import_file(f"ember_kernels.{path.stem}_{int(interpret)}", path,
                                                 settings().kernel_load_cache)
        from ember.runtime import cubin_launch
        if not interpret and cubin_launch.enabled():
            # Its kernels launch recorded binaries; the module is imported for a launch without one.
            _MODULES[key] = cubin_launch.KernelModule(path, cubin_launch.default_folder(), load)  # type: ignore[assignment]
        else:
            _MODULES[key] = load()
    return _MODULES[key]


def _cpu_module_name(kernel_dir: Path, name: str) -> str:
    # numba's cache rebuilds a function's environment by importing its module by name, so the
    # module must be in sys.modules under a name that is the same in every process (and unique
    # to the folder) before it runs.
    return f"ember_cpu_{hashlib.sha256(str(kernel_dir).encode()).hexdigest()[:8]}_{name}"


def _import_cpu_module(kernel_dir: Path, name: str, path: Path) -> ModuleType:
    key = (str(kernel_dir), name)
    with _CPU_IMPORT_LOCK:
        if key not in _CPU_MODULES:
            from ember.runtime.numba_import import load_launch_helpers, numba_for_cached_code

            modname = _cpu_module_name(kernel_dir, name)
            spec = importlib.util.spec_from_file_location(modname, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[modname] = module
            # Cached machine code loads without numba's target set-up; a kernel numba compiles
            # gets the set-up first, without scipy.linalg (runtime/numba_import.py says why).
            with numba_for_cached_code():
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(modname, None)
                    raise
                if not _CPU_MODULES:  # the launch helpers every kernel goes through, loaded the same way
                    load_launch_helpers()
            _CPU_MODULES[key] = module
        return _CPU_MODULES[key]


def cpu_kernel_module(text: str, kernel_dir: Path) -> ModuleType:
    """Import (compiling, or loading numba's cached machine code) the shared module of a CPU
    kernel's module source; once per process and folder."""
    shared, instance = split_module(text)
    name = instance["kernel"]
    if (str(kernel_dir), name) in _CPU_MODULES:
        return _CPU_MODULES[(str(kernel_dir), name)]
    return _import_cpu_module(kernel_dir, name, _module_file(kernel_dir / f"{name}.py", shared))


def _cpu_launcher(text: str, kernel_dir: Path) -> Callable:
    from ember.runtime.cpu_support import launcher

    module = cpu_kernel_module(text, kernel_dir)
    _, instance = split_module(text)
    return launcher(getattr(module, instance["kernel"]).address, instance)


def _numba_cached(path: Path) -> bool:
    """Whether numba's cache next to ``path`` has an index for its kernel (then loading is fast)."""
    return any((path.parent / "__pycache__").glob(f"{path.stem}.{path.stem}-*.nbi"))


def _cpu_modules_to_load(kernels: list[KernelSource], kernel_dir: Path) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """The distinct shared modules among ``kernels`` (CPU kernels only) this process has not
    imported yet, written to disk: module path -> (kernel name, digest); and the kernels whose
    file could not be written: digest -> error text."""
    failed: dict[str, str] = {}
    todo: dict[str, tuple[str, str]] = {}
    for ks in kernels:
        if ks.backend != "cpu" or ks.digest in failed:
            continue
        shared, instance = split_module(ks.module_source())
        name = instance["kernel"]
        if (str(kernel_dir), name) in _CPU_MODULES:
            continue
        try:
            path = _module_file(kernel_dir / f"{name}.py", shared)
        except OSError as err:
            failed[ks.digest] = f"{type(err).__name__}: {err}"
            continue
        todo[str(path)] = (name, ks.digest)
    return todo, failed


def uncached_cpu_modules(kernels: list[KernelSource], kernel_dir: Path) -> list[tuple[str, str]]:
    """(module name, path) of the CPU kernel modules among ``kernels`` that numba would have to
    compile: neither imported by this process nor in numba's cache on disk."""
    todo, _ = _cpu_modules_to_load(kernels, kernel_dir)
    return [(_cpu_module_name(kernel_dir, name), path) for path, (name, _) in todo.items()
            if not _numba_cached(Path(path))]


def compile_cpu_kernels(kernels: list[KernelSource], kernel_dir: Path) -> dict[str, str]:
    """Import every distinct shared module among ``kernels`` (CPU kernels only), compiling the
    ones numba has not cached yet in parallel (runtime/cpu_compile.py). Returns the kernels that
    failed to compile: digest -> error text (their groups then run through ATen)."""
    from ember.runtime.cpu_compile import compile_parallel

    todo, failed = _cpu_modules_to_load(kernels, kernel_dir)

    def here(modname: str, path: str) -> None:
        name, digest = todo[path]
        try:
            _import_cpu_module(kernel_dir, name, Path(path))
        except Exception as err:  # noqa: BLE001 - the caller runs these groups through ATen
            failed[digest] = f"{type(err).__name__}: {str(err)[:300]}"

    cold = [(_cpu_module_name(kernel_dir, todo[p][0]), p) for p in todo if not _numba_cached(Path(p))]
    compile_parallel(cold, here)
    for path, (name, _) in todo.items():  # cached ones, and those the workers compiled
        if (str(kernel_dir), name) not in _CPU_MODULES:
            here(_cpu_module_name(kernel_dir, name), path)
    return failed
