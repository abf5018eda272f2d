"""Compile a graph's CPU kernel modules in parallel: this process plus worker processes.

numba compiles one kernel at a time per process (it holds a global compiler lock), 0.1-0.3 s
each. A worker compiles a module by importing it, which leaves the machine code in numba's
cache next to the module file; this process then only loads it. Work is handed out one kernel
at a time (this process takes kernels from the front of the list, the workers from the back),
so a slow worker start or a long kernel never leaves anyone idle for long.

Workers are plain Python processes that read module paths on stdin and answer on stdout. They
import ``ember.runtime.cpu_support`` without running ``ember/__init__`` (which imports torch),
so one starts in about half a second; they live as long as this process (end of stdin ends
them). ``EMBER_COMPILE_WORKERS`` sets their number (default: CPU cores - 1, at most 8; 0 compiles
everything in this process). Workers only help when a core is free: while the load average
says the machine is busy (other processes keep the cores occupied; measured on a shared 2-core
machine: 5.3 s with a worker vs 4.7 s without at load 5; at load ~1, ResNet-18 training's 20
kernels 2.8 s with a worker vs 4.5 s without), this process compiles alone unless
``EMBER_COMPILE_WORKERS`` is set. Anything
that goes wrong in a worker only means this process compiles that kernel itself.
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ember.config import settings
from ember.runtime.precompile import worker_count

_WORKER_SCRIPT = r"""
import importlib.util, sys, types
root = sys.argv[1]
for name, path in (("ember", root), ("ember.runtime", root + "/runtime")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from ember.runtime.numba_import import import_numba_without_scipy_blas, load_launch_helpers
import_numba_without_scipy_blas()
import ember.runtime.cpu_support
print("ready", flush=True)
for line in sys.stdin:
    modname, path = line.rstrip("\n").split("\t")
    if modname == LAUNCH_HELPERS:
        try:
            load_launch_helpers()
            print("ok", flush=True)
        except BaseException as err:
            print("error " + repr(err).replace("\n", " ")[:500], flush=True)
        continue
    try:
        spec = importlib.util.spec_from_file_location(modname, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
        print("ok", flush=True)
    except BaseException as err:
        print("error " + repr(err).replace("\n", " ")[:500], flush=True)
"""

_EMBER_ROOT = Path(__file__).resolve().parents[1]
# The job that compiles (or loads) the launch helpers every kernel launch goes through,
# cpu_support.drive and drive_chunked, into numba's cache. A program whose kernels compile
# behind the ATen program may never launch one in that process (a short script, the bench's
# first call): the next process's warm first call then compiled drive itself, 1.36 s on a
# 2-core EPYC (tiny_transformer training; its kernels loaded in 0.02 s each).
LAUNCH_HELPERS = "ember-launch-helpers"
_WORKER_SCRIPT = _WORKER_SCRIPT.replace("LAUNCH_HELPERS", repr(LAUNCH_HELPERS))


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_SCRIPT, str(_EMBER_ROOT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.ready = False
        self.busy: str | None = None  # the module path being compiled
        self.since = 0.0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, modname: str, path: str) -> None:
        self.proc.stdin.write(f"{modname}\t{path}\n")
        self.proc.stdin.flush()
        self.busy = path
        self.since = time.monotonic()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


_WORKERS: list[_Worker] = []


def _idle_cores() -> int:
    """Cores the 1-minute load average leaves free (all of them when unknown). This process,
    busy compiling, accounts for up to 1.0 of the load itself."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(0, int(cores - max(0.0, load - 1.0)))


def _workers(count: int) -> list[_Worker]:
    live = [w for w in _WORKERS if w.alive()]
    _WORKERS[:] = live
    while len(_WORKERS) < count:
        try:
            _WORKERS.append(_Worker())
        except OSError:
            break
    return _WORKERS[:count]


def _shutdown() -> None:
    for w in _WORKERS:
        w.close()


atexit.register(_shutdown)


def compile_parallel(jobs: list[tuple[str, str]], compile_here: Callable[[str, str], None]) -> set[str]:
    """Compile ``jobs`` (module name, module path): this process calls ``compile_here`` on
    kernels from the front, workers import kernels from the back. Returns the paths the workers
    compiled (their machine code is in numba's disk cache now)."""
    # An explicit EMBER_COMPILE_WORKERS is obeyed; the default also looks at the load.
    explicit = settings().compile_workers is not None
    count = worker_count() if explicit else min(worker_count(), _idle_cores())
    timeout_s = settings().cpu_worker_timeout_s  # a kernel a worker has not finished by then is compiled here
    if count <= 0 or len(jobs) < 2:
        for modname, path in jobs:
            compile_here(modname, path)
        return set()
    todo = deque(jobs)
    done: set[str] = set()
    workers = _workers(min(count, len(jobs) - 1))

    def poll(timeout: float) -> None:
        """Read finished answers (and start lines) from the workers; hand out more work."""
        pipes = {w.proc.stdout.fileno(): w for w in workers if w.alive()}
        if not pipes:
            return
        readable, _, _ = select.select(list(pipes), [], [], timeout)
        for fd in readable:
            w = pipes[fd]
            line = w.proc.stdout.readline()
            if not line:  # the worker ended; the waiting loop takes its kernel back
                continue
            if line.startswith("ready"):
                w.ready = True
            elif w.busy is not None:
                if line.startswith("ok"):
                    done.add(w.busy)
                else:  # compile it here, where the error is reported properly
                    todo.appendleft(next(j for j in jobs if j[1] == w.busy))
                w.busy = None
        for w in workers:
            if w.ready and w.busy is None and w.alive() and todo:
                try:
                    w.send(*todo.pop())
                except OSError:
                    w.busy = None

    while True:
        poll(0.0)
        if todo:
            compile_here(*todo.popleft())
            continue
        busy = [w for w in workers if w.busy is not None]
        if not busy:
            return done
        poll(0.5)
        for w in busy:
            stuck = time.monotonic() - w.since > timeout_s
            if w.busy is not None and (not w.alive() or stuck):  # compile it here instead
                if stuck:
                    w.proc.kill()
                todo.append(next(j for j in jobs if j[1] == w.busy))
                w.busy = None


class BehindCompile:
    """CPU kernel modules compiling in worker processes while the caller goes on (see
    ``compile_behind``). ``done()`` says whether every module has an answer; ``failed`` holds the
    paths a worker could not compile (the caller then compiles them itself, where the error is
    reported properly)."""

    def __init__(self, jobs: list[tuple[str, str]]) -> None:
        self.jobs = jobs
        self.failed: dict[str, str] = {}
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def finish(self) -> None:
        self.seconds = time.perf_counter() - self.started
        self._done.set()


class _BehindThread:
    """One daemon thread feeding queued BehindCompile jobs to its own workers (not the pool
    compile_parallel uses: that one answers the main thread). The thread only writes paths to
    pipes and waits on them, so it takes the GIL only briefly."""

    def __init__(self) -> None:
        self.queue: deque[BehindCompile] = deque()
        self.wake = threading.Condition()
        self.workers: list[_Worker] = []
        self.thread = threading.Thread(target=self._loop, name="ember-cpu-compile-behind", daemon=True)
        self.thread.start()

    def submit(self, job: BehindCompile) -> None:
        with self.wake:
            self.queue.append(job)
            self.wake.notify()

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.queue:
                    self.wake.wait()
                job = self.queue[0]
            try:
                self._run(job)
            except Exception as err:  # noqa: BLE001 - the caller compiles what is left itself
                for _, path in job.jobs:
                    job.failed.setdefault(path, f"{type(err).__name__}: {err}")
            finally:
                with self.wake:
                    self.queue.popleft()
                job.finish()

    def _run(self, job: BehindCompile) -> None:
        self.workers = [w for w in self.workers if w.alive()]
        while len(self.workers) < max(1, min(worker_count(), len(job.jobs))):
            self.workers.append(_Worker())
        todo = deque([*job.jobs, (LAUNCH_HELPERS, LAUNCH_HELPERS)])  # last: the kernels come first
        timeout_s = settings().cpu_worker_timeout_s
        start = time.monotonic()
        while todo or any(w.busy for w in self.workers):
            if not any(w.ready for w in self.workers) and time.monotonic() - start > timeout_s:
                for w in self.workers:  # none came up: the caller compiles these itself
                    w.proc.kill()
                for _, path in todo:
                    job.failed[path] = "no compile worker became ready"
                return
            for w in self.workers:
                if w.ready and w.busy is None and w.alive() and todo:
                    w.send(*todo.popleft())
            pipes = {w.proc.stdout.fileno(): w for w in self.workers if w.alive()}
            if not pipes:
                for _, path in todo:
                    job.failed[path] = "no compile worker could start"
                for w in self.workers:
                    if w.busy:
                        job.failed[w.busy], w.busy = "the compile worker ended", None
                return
            readable, _, _ = select.select(list(pipes), [], [], 0.5)
            for fd in readable:
                w = pipes[fd]
                line = w.proc.stdout.readline()
                if line.startswith("ready"):
                    w.ready = True
                elif w.busy is not None and line:
                    if not line.startswith("ok"):
                        job.failed[w.busy] = line[6:].strip()
                    w.busy = None
            for w in self.workers:
                if w.busy is not None and (not w.alive() or time.monotonic() - w.since > timeout_s):
                    w.proc.kill()
                    job.failed[w.busy], w.busy = "the compile worker ended or took too long", None


_BEHIND: list[_BehindThread] = []
_BEHIND_LOCK = threading.Lock()


def compile_behind(jobs: list[tuple[str, str]]) -> BehindCompile | None:
    """Start compiling ``jobs`` (module name, module path) in worker processes and return at
    once; None when no worker may run (``EMBER_COMPILE_WORKERS=0``): then compile in place."""
    if not jobs or worker_count() <= 0:
        return None
    job = BehindCompile(jobs)
    with _BEHIND_LOCK:
        if not _BEHIND:
            _BEHIND.append(_BehindThread())
        _BEHIND[0].submit(job)
    return job


def wait_behind(timeout: float | None = None) -> bool:
    """Wait until every kernel module queued behind has an answer; whether they all have."""
    with _BEHIND_LOCK:
        if not _BEHIND:
            return True
        behind = _BEHIND[0]
    with behind.wake:
        pending = list(behind.queue)
    return all(job.wait(timeout) for job in pending)


def _shutdown_behind() -> None:
    # Kernels still compiling are finished first, so the next process finds them in numba's cache
    # (a warm start links them at once); the exit waits no longer than the first call would have.
    wait_behind(timeout=settings().cpu_worker_timeout_s)
    for behind in _BEHIND:
        for w in behind.workers:
            w.close()


atexit.register(_shutdown_behind)

__all__ = ["BehindCompile", "compile_behind", "compile_parallel", "wait_behind"]
