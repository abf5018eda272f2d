"""Compile a graph's Triton kernels in parallel, before its first launch.

Triton compiles a kernel on its first launch, one at a time, in the calling process: for a
ResNet-50 training step that is hundreds of serial compiles. Instead, as soon as a graph's
kernels are written, a pool of worker processes compiles each unique kernel through
``JITFunction.warmup`` with the argument dtypes (no tensors are needed). The binaries land in
Triton's on-disk cache, so the first real launch in this process only loads them.

A kernel whose real arguments specialise differently (a pointer not 16-byte aligned, say)
simply compiles again at launch: precompiling can make the first call faster, never wrong.
Workers are spawned (not forked: the parent may hold a CUDA context) once per process.
``EMBER_COMPILE_WORKERS=0`` compiles serially in this process instead.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import importlib.util
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_POOL: cf.ProcessPoolExecutor | None = None
_DONE: set[str] = set()  # kernel names compiled (or attempted) by this process's pool


@dataclass(frozen=True)
class CompileJob:
    """One kernel to compile: its module file, function name, argument dtypes and launch meta."""

    path: str
    name: str
    arg_dtypes: tuple[str, ...]  # torch dtype names, e.g. "float32"
    meta: tuple[tuple[str, int], ...]


def worker_count() -> int:
    env = os.environ.get("EMBER_COMPILE_WORKERS")
    if env is not None:
        return max(0, int(env))
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def compile_job(job: CompileJob) -> str | None:
    """Compile one kernel in this process; returns an error text or None. Runs in the workers."""
    import torch

    os.environ["TRITON_INTERPRET"] = "0"
    try:
        spec = importlib.util.spec_from_file_location(f"ember_precompile.{job.name}", job.path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, job.name)
        dtypes = [getattr(torch, d) for d in job.arg_dtypes]
        fn.warmup(*dtypes, grid=(1,), **dict(job.meta))
    except Exception as err:  # the launch in the parent compiles it again and reports properly
        return f"{job.name}: {type(err).__name__}: {err}"
    return None


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
    return _POOL


def precompile(jobs: Sequence[CompileJob]) -> list[str]:
    """Compile the jobs not compiled before in this process; returns the error texts."""
    todo = [j for j in {j.name: j for j in jobs}.values() if j.name not in _DONE]
    if not todo:
        return []
    _DONE.update(j.name for j in todo)
    workers = worker_count()
    if workers == 0 or len(todo) == 1:
        return [e for e in map(compile_job, todo) if e]
    try:
        results = list(_pool(workers).map(compile_job, todo))
    except Exception as err:  # a broken pool (killed worker): launches compile on demand
        return [f"parallel compile failed: {type(err).__name__}: {err}"]
    return [e for e in results if e]


def job_for(path: Path, name: str, arg_dtypes: Sequence[object], meta: dict[str, int]) -> CompileJob:
    return CompileJob(str(path), name, tuple(str(d).removeprefix("torch.") for d in arg_dtypes),
                      tuple(sorted(meta.items())))
