"""Compile a graph's Triton kernels in parallel, before its first launch.

Triton compiles a kernel on its first launch, one at a time, in the calling process: for a
ResNet-50 training step that is hundreds of serial compiles. Instead, as soon as a graph's
kernels are written, a pool of worker processes compiles each unique kernel through
``JITFunction.warmup`` with the argument dtypes (no tensors are needed). The binaries land in
Triton's on-disk cache, so the first real launch in this process only loads them.

A kernel whose real arguments specialise differently (a pointer not 16-byte aligned, say)
simply compiles again at launch: precompiling can make the first call faster, never wrong.
Workers are spawned (not forked: the parent may hold a CUDA context) once per process; a worker
needs seconds to import torch and Triton, so ``start_workers`` lets the backend begin that while
Dynamo and AOTAutograd are still capturing. ``EMBER_COMPILE_WORKERS=0`` compiles serially in
this process instead. Each call returns a ``PrecompileStats`` that ``ember.explain`` reports.

``submit`` does not wait: the pipeline hands the pending compile to the compiled program, whose
first call waits for it. Meanwhile the parent goes on with the next graph (the backward, which
the backend has AOTAutograd compile right after the forward on GPU targets): its passes and code
generation run while the workers compile the forward's kernels, instead of after them.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import importlib.util
import logging
import multiprocessing
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ember.config import settings

log = logging.getLogger(__name__)

_POOL: cf.ProcessPoolExecutor | None = None
_STARTED: list[cf.Future] = []  # the workers' start-up jobs
# (kernel name, argument dtypes, launch meta) compiled or attempted by this process. One kernel
# name can launch with other block sizes (a split reduction's combining kernel does, across layers
# of a model) and with other argument dtypes (the same combining kernel reads only its float32
# workspace, so its source, and with it its name, does not depend on the dtypes of the other
# tensors it is handed): Triton specialises on both, so each is its own compile.
_DONE: set[tuple[str, tuple, tuple, str]] = set()
_LOG: list[tuple[CompileJob, float]] = []  # every job this process compiled ahead, with its seconds


# An integer (not pointer) argument in a job's arg_dtypes. The warm-up passes SCALAR_ARG for it:
# neither 1 nor a multiple of 16, so it takes Triton's unspecialised int32 variant, the one a
# parameter marked do_not_specialize always gets.
SCALAR_INT32 = "scalar_int32"
SCALAR_ARG = 17
# An integer argument passed as this value ("int:64"): Triton specialises a kernel on its integer
# arguments (equal to 1, divisible by 16), so a job that knows the launch's values builds its binary.
INT_VALUE = "int:"


def int_arg(value: int) -> str:
    return f"{INT_VALUE}{int(value)}"


@dataclass(frozen=True)
class CompileJob:
    """One kernel to compile: its module file, function name, argument dtypes and launch meta."""

    path: str
    name: str
    arg_dtypes: tuple[str, ...]  # torch dtype names, e.g. "float32"
    meta: tuple[tuple[str, int], ...]
    # The parent's TRITON_CACHE_DIR when it submitted the job ("": Triton's default folder).
    cache_dir: str = ""
    # The parent's worker_niceness setting at submission (a config.patch does not reach the workers).
    niceness: int = 10
    # Where the binary is recorded for the parent's static launches (runtime/cubin_launch.py): the
    # parent's device tag ("": not recorded) and its default kernel folder.
    cubin_tag: str = ""
    cubin_folder: str = ""


@dataclass
class PrecompileStats:
    """Where one graph's kernel_compile stage went."""

    kernels: int = 0  # unique kernels compiled by this call (others were compiled before)
    workers: int = 0  # 0: compiled in this process
    wall_s: float = 0.0
    compile_s: float = 0.0  # sum of the kernels' own compile times
    wait_s: float = 0.0  # from submitting to the first kernel's compile starting (worker start-up)
    slowest: str = ""
    slowest_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    here: int = 0  # kernels this process compiled itself while no worker had started yet

    def describe(self) -> str:
        if not self.kernels:
            return "no new kernels"
        where = f"{self.workers} worker processes" if self.workers else "this process"
        text = (f"{self.kernels} kernels on {where}: {self.wall_s:.2f} s wall, {self.compile_s:.2f} s of compiling "
                f"(x{self.compile_s / max(self.wall_s, 1e-9):.1f} parallel)")
        if self.workers:
            text += f", {self.wait_s:.2f} s before the first compile began"
        if self.here:
            text += f", {self.here} compiled in this process while the workers started"
        if self.slowest:
            text += f"; slowest {self.slowest} {self.slowest_s:.2f} s"
        if self.errors:
            text += f"; {len(self.errors)} failed (they compile at launch)"
        return text


def worker_count() -> int:
    explicit = settings().compile_workers
    if explicit is not None:
        return max(0, explicit)
    # The parent waits while they compile: every core but one (Triton's compile is single-threaded).
    return max(1, min(32, (os.cpu_count() or 2) - 1))


def _lower_priority(niceness: int) -> None:
    """Workers (and the ptxas processes they start) yield the CPU to the parent: while they
    compile the forward's kernels the parent captures and compiles the backward, and with a
    worker per core but one, the parent's passes ran 5x slower on the H100 machine than alone."""
    try:
        current = os.nice(0)
        if current < niceness:
            os.nice(niceness - current)
    except (AttributeError, OSError):
        pass


def _start_worker(niceness: int) -> float:
    """Runs in each worker once: the imports a compile needs and one small compile (a worker's
    first compile pays the compiler's set-up). Returns when it finished.

    Where the parent passed its Triton target (``worker_triton.TARGET_ENV``), the worker compiles
    for it without torch and without touching the GPU; if the warm-up compile fails that way it
    goes back to Triton's own driver, which imports torch and initialises CUDA."""
    _lower_priority(niceness)
    os.environ["TRITON_INTERPRET"] = "0"
    from ember.runtime import worker_triton
    from ember.runtime.compile_warmup import compile_warmup_kernel

    if worker_triton.install_target_driver(os.environ.get(worker_triton.TARGET_ENV, "")):
        try:
            with worker_triton.torch_import_refused():
                compile_warmup_kernel()
            return time.time()
        except Exception:  # noqa: BLE001 - Triton's own driver below
            log.debug("compile without torch failed; using Triton's driver", exc_info=True)
            worker_triton.uninstall_target_driver()
    import torch  # noqa: F401
    from triton.runtime import driver

    driver.active.get_current_target()
    try:
        compile_warmup_kernel()
    except Exception:  # noqa: BLE001 - only a head start: the real compiles report their own errors
        log.debug("compile warm-up kernel failed", exc_info=True)
    return time.time()


def _build_launcher(kernel: object) -> None:
    """Build the compiled kernel's launcher here, as its first launch in the parent would: where
    Triton compiles a C launcher per signature, it lands in the on-disk cache. Best effort."""
    from triton.runtime import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the first launch in the parent builds it instead
        log.debug("launcher build failed for %s", getattr(kernel, "name", kernel), exc_info=True)


def _use_cache_dir(cache_dir: str) -> None:
    """Write binaries where the parent will look for them. The folder can change in the parent
    after the workers were spawned: Inductor sets TRITON_CACHE_DIR when it first loads a kernel
    of its own (not always on its first compile), and every kernel the workers had built in the
    folder they started with then compiled again at launch (79 of 79 of style_transfer's on the
    H100 when cyclegan's Inductor run came first in the process: 18-20 s of its first call)."""
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    else:
        os.environ.pop("TRITON_CACHE_DIR", None)


def compile_job(job: CompileJob) -> tuple[str | None, float, float]:
    """Compile one kernel in this process: (error text or None, start time, seconds). Runs in the
    workers (without torch where they compile for the parent's target) and in the parent."""
    began = time.time()
    if os.environ.get("EMBER_COMPILE_WORKER") == "1":
        _lower_priority(job.niceness)
    os.environ["TRITON_INTERPRET"] = "0"
    if os.environ.get("EMBER_COMPILE_WORKER") == "1":  # the parent's own compiles use its folder as it is
        _use_cache_dir(job.cache_dir)
    try:
        from ember.runtime import triton_key
        triton_key.install()  # after the cache folder is set: the stored key lives there
        compiled = warm_up(job)
        if job.cubin_tag:
            _record_binary(job, compiled)
        else:
            _build_launcher(compiled)
    except Exception as err:  # the launch in the parent compiles it again and reports properly
        return f"{job.name}: {type(err).__name__}: {err}", began, time.time() - began
    return None, began, time.time() - began


def warm_up(job: CompileJob) -> object:
    """Triton's compiled kernel of ``job``, built in this process by ``JITFunction.warmup`` (the
    kernel's module imported from its file; stand-ins for its tensors, no torch needed): for
    whatever target Triton's active driver names (runtime/target_compile.py's for a GPU not here)."""
    from ember.runtime.worker_triton import pointer_arg
    spec = importlib.util.spec_from_file_location(f"ember_precompile.{job.name}", job.path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, job.name)
    args = [SCALAR_ARG if d == SCALAR_INT32 else int(d[len(INT_VALUE):]) if d.startswith(INT_VALUE)
            else pointer_arg(d) for d in job.arg_dtypes]
    return fn.warmup(*args, grid=(1,), **dict(job.meta))


def _record_binary(job: CompileJob, compiled: object) -> None:
    """Record the binary for the parent's launch with 16-byte aligned tensors (what the warm-up
    assumed), so its first launch goes straight to it; best effort. A job with an unspecialised
    integer does not know the launch's value, so the parent records that one at its first launch."""
    from ember.runtime import cubin_records
    if SCALAR_INT32 in job.arg_dtypes:
        _build_launcher(compiled)
        return
    args = tuple(int(d[len(INT_VALUE):]) if d.startswith(INT_VALUE) else (d, True) for d in job.arg_dtypes)
    try:
        if cubin_records.record_compiled(Path(job.path), job.name, Path(job.cubin_folder), job.cubin_tag,
                                         cubin_records.key_text((job.meta, args)), compiled, len(args)):
            return
    except Exception:  # noqa: BLE001 - the parent's first launch records it instead
        log.debug("no record for %s", job.name, exc_info=True)
    _build_launcher(compiled)  # the parent launches this one through Triton


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
    return _POOL


def matching_ptxas(version: str, candidates: Sequence[str | None]) -> str | None:
    """The first executable among ``candidates`` whose ``--version`` prints ``version``."""
    for path in candidates:
        if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if out == version:
            return path
    return None


_WORKER_ENV: dict[str, str] = {}


def _worker_triton_env() -> dict[str, str]:
    """What the workers' Triton takes from the parent: the GPU target they compile for
    (``worker_triton.TARGET_ENV``: they then need neither torch nor CUDA) and TRITON_PTXAS_PATH,
    the ptxas whose version keys this process's Triton cache.

    Triton keys a compiled kernel by the version of its ptxas, read once per process. Inductor
    points TRITON_PTXAS_PATH at PyTorch's own ptxas when it compiles, possibly after this
    process's Triton has read the version of its bundled one: workers spawned then use the
    other ptxas, and every kernel they compiled missed the cache at launch and compiled again
    (all 82 of vgg16's on the H100, 10 s of its first step when Inductor had compiled before)."""
    if _WORKER_ENV:
        return _WORKER_ENV
    from ember.runtime import worker_triton
    path, target = None, ""
    try:
        import torch
        import triton
        from triton.backends.nvidia import compiler as nvidia
        from triton.runtime import driver

        current = driver.active.get_current_target()
        target = worker_triton.target_text(current)
        try:
            version = nvidia.get_ptxas_version(current.arch)
        except TypeError:  # a Triton whose get_ptxas_version takes no architecture
            version = nvidia.get_ptxas_version()
        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        ours = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
        path = matching_ptxas(version, [os.environ.get("TRITON_PTXAS_PATH"), bundled, ours])
    except Exception:  # noqa: BLE001 - no CUDA Triton here: the workers decide for themselves
        log.debug("no Triton target or ptxas for the workers", exc_info=True)
    _WORKER_ENV["TRITON_PTXAS_PATH"] = path or ""
    _WORKER_ENV[worker_triton.TARGET_ENV] = target
    return _WORKER_ENV


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned process first runs the parent's ``__main__`` script again (as ``__mp_main__``) so
    that pickled functions of the script resolve: the user's script, with its imports (torch,
    torchvision, transformers: seconds per worker on a busy host) and, without an
    ``if __name__ == "__main__"`` guard, its whole body. The workers only run functions of this
    module, so they are started while ``__main__`` is a bare module (multiprocessing reads the
    main module's spec and file when it starts a process, in ``spawn.get_preparation_data``)."""
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


@contextlib.contextmanager
def _as_worker_env() -> Iterator[None]:
    """Processes spawned inside see EMBER_COMPILE_WORKER=1: ``import ember`` there skips
    registering the Dynamo backend (and so importing Dynamo), seconds per worker; the parent's
    Triton target and ptxas (``_worker_triton_env``); and not the parent's script
    (``_main_module_hidden``)."""
    extra = {"EMBER_COMPILE_WORKER": "1", **{k: v for k, v in _worker_triton_env().items() if v}}
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        with _main_module_hidden():
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_workers() -> None:
    """Begin spawning the compile workers now (idempotent; a no-op with 0 workers, and inside a
    worker)."""
    if os.environ.get("EMBER_COMPILE_WORKER") == "1":
        return
    workers = worker_count()
    if workers and not _STARTED:
        pool = _pool(workers)
        with _as_worker_env():  # the pool spawns a process per submit while none is idle
            niceness = settings().worker_niceness
            _STARTED.extend(pool.submit(_start_worker, niceness) for _ in range(workers))


class PendingCompile:
    """Jobs handed to the workers; ``wait()`` blocks until they are done and returns their stats
    (the first call only; later calls return the same stats)."""

    def __init__(self, todo: list[CompileJob], workers: int) -> None:
        self.todo = todo
        self.stats = PrecompileStats(kernels=len(todo), workers=workers)
        self.submitted = time.time()
        self.futures: list[cf.Future] = []
        self.results: list[tuple[str | None, float, float]] | None = None
        self.done = not todo
        if not todo:
            return
        if workers == 0:
            self.results = [compile_job(j) for j in todo]
            return
        try:
            with _as_worker_env():
                self.futures = [_pool(workers).submit(compile_job, j) for j in todo]
        except Exception as err:  # noqa: BLE001 - a broken pool (killed worker): launches compile on demand
            self._broken(err)

    def _compile_here_while_workers_start(self) -> dict[int, tuple[str | None, float, float]]:
        """Jobs no worker has taken yet, compiled in this process for as long as no worker has
        finished starting. A worker imports torch and Triton first (seconds on a GPU host), and a
        graph captured faster than that hands its kernels over before any worker can take them,
        while this process has nothing to do but wait. A job is taken only by cancelling its
        still-pending future, so no kernel is compiled twice; once a worker is ready, the rest is
        theirs."""
        here: dict[int, tuple[str | None, float, float]] = {}
        for i, (job, future) in enumerate(zip(self.todo, self.futures)):
            if any(started.done() for started in _STARTED):
                break
            if future.cancel():
                here[i] = compile_job(job)
        self.stats.here = len(here)
        return here

    def _broken(self, err: Exception) -> None:
        self.stats.errors.append(f"parallel compile failed: {type(err).__name__}: {err}")
        self.futures, self.results = [], []

    def wait(self) -> PrecompileStats:
        if self.done:
            return self.stats
        self.done = True
        if self.results is None:
            try:
                here = self._compile_here_while_workers_start()
                self.results = [here[i] if i in here else f.result() for i, f in enumerate(self.futures)]
            except Exception as err:  # noqa: BLE001 - as above
                self._broken(err)
        stats, results = self.stats, self.results or []
        stats.wall_s = time.time() - self.submitted
        if not results:
            return stats
        stats.errors = [e for e, _, _ in results if e]
        _LOG.extend((j, s) for j, (_, _, s) in zip(self.todo, results))
        stats.compile_s = sum(s for _, _, s in results)
        if stats.workers:
            stats.wait_s = max(0.0, min(b for _, b, _ in results) - self.submitted)
        slowest = max(range(len(self.todo)), key=lambda i: results[i][2])
        stats.slowest, stats.slowest_s = self.todo[slowest].name, results[slowest][2]
        return stats


def _key(job: CompileJob) -> tuple[str, tuple, tuple, str]:
    return job.name, job.arg_dtypes, job.meta, job.cache_dir


def submit(jobs: Sequence[CompileJob]) -> PendingCompile:
    """Start compiling the jobs not compiled before in this process; returns without waiting
    (with no workers, or one job, it compiles them here first)."""
    here = os.environ.get("TRITON_CACHE_DIR", "")
    niceness = settings().worker_niceness
    tag, folder = _cubin_place()
    jobs = [dataclasses.replace(j, cache_dir=here, niceness=niceness, cubin_tag=tag, cubin_folder=folder)
            for j in jobs]
    todo = [j for j in {_key(j): j for j in jobs}.values() if _key(j) not in _DONE]
    _DONE.update(_key(j) for j in todo)
    workers = worker_count()
    return PendingCompile(todo, 0 if len(todo) == 1 else workers)


def _cubin_place() -> tuple[str, str]:
    """The device tag and default kernel folder the workers record binaries under ("" when the
    static launches are off or impossible here)."""
    from ember.runtime import cubin_launch
    if not cubin_launch.enabled():
        return "", ""
    import torch
    try:
        return cubin_launch.device_tag(torch.cuda.current_device()), str(cubin_launch.default_folder())
    except Exception:  # noqa: BLE001 - no tag: the parent records at its first launches
        log.debug("no device tag for cubin records", exc_info=True)
        return "", ""


def precompile(jobs: Sequence[CompileJob]) -> PrecompileStats:
    """Compile the jobs not compiled before in this process, and wait for them."""
    return submit(jobs).wait()


def compile_log() -> list[tuple[CompileJob, float]]:
    """(job, compile seconds) of every kernel this process compiled ahead of its first launch."""
    return list(_LOG)


def job_for(path: Path, name: str, arg_dtypes: Sequence[object], meta: dict[str, int]) -> CompileJob:
    """A job for kernel ``name`` of ``path``: per argument a torch dtype (a pointer), SCALAR_INT32
    (an unspecialised int) or ``int_arg(value)``."""
    return CompileJob(str(path), name, tuple(str(d).removeprefix("torch.") for d in arg_dtypes),
                      tuple(sorted(meta.items())))
