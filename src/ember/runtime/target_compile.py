"""Compile Triton kernels for a GPU that is not here: every kernel through the real compiler
(Triton's passes, LLVM, ptxas) for a named target, an H100 (``cuda:90:32``) by default.

Triton's interpreter runs the kernels' arithmetic on a CPU (the tests do), but it never meets
what only the compiler sees: an op or layout the GPU backend rejects, a constexpr combination
that does not lower, a tile whose pipeline buffers need more shared memory than the device has
(Triton finds that only when it loads the binary on the GPU, as ``OutOfResources``). This module
compiles compile jobs (runtime/precompile.py's ``CompileJob``) for the target in child processes
with Triton's target-only driver (runtime/worker_triton.py), so a machine without a GPU, CI
included, can tell whether the kernels a GPU run would launch compile and fit.

    python -m ember.runtime.target_compile [--target cuda:90:32] < jobs.json   # results as JSON

The children need Triton, not torch: EMBER_TARGET_COMPILE_PYTHON may name the Python of another
environment, one with the Triton version of the GPU machine, to check the kernels against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ember.runtime.precompile import CompileJob, warm_up

H100 = "cuda:90:32"
# Shared memory one block may use (bytes, the opt-in maximum Triton checks at load) per compute
# capability: CUDA's table of the per-block limits.
SHARED_LIMIT = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
                100: 232448, 120: 101376}


@dataclass(frozen=True)
class TargetCompile:
    """One job's compile for the target: seconds, the shared memory the binary asks for and the
    limit of the target, or the compiler's error."""

    job: CompileJob
    seconds: float
    shared: int | None = None
    shared_limit: int | None = None
    error: str | None = None
    triton: str = ""  # the version of the Triton that compiled it

    @property
    def fits(self) -> bool:
        return self.shared is None or self.shared_limit is None or self.shared <= self.shared_limit

    @property
    def ok(self) -> bool:
        return self.error is None and self.fits

    def problem(self) -> str:
        """What is wrong ("" when nothing), for a report line."""
        if self.error is not None:
            return self.error
        if not self.fits:
            return f"needs {self.shared} bytes of shared memory, the target allows {self.shared_limit}"
        return ""

    def describe(self) -> str:
        meta = ", ".join(f"{k}={v}" for k, v in self.job.meta)
        return f"{self.job.name} ({meta}) [{', '.join(self.job.arg_dtypes)}]"


def compile_for_target(jobs: Sequence[CompileJob], target: str = H100, processes: int | None = None,
                       timeout_s: float = 1800.0, python: str | None = None) -> list[TargetCompile]:
    """Compile every distinct job for ``target`` (``backend:arch:warp_size``), in ``processes``
    child processes (default: the CPUs this process may use), each with an empty Triton cache so
    that every kernel really compiles. ``python``: the interpreter of the children (default
    EMBER_TARGET_COMPILE_PYTHON's, else this one's): one whose environment holds another Triton (the GPU machine's
    version, say; torch is not needed there) checks the kernels against that Triton. Results in
    the order of ``jobs``."""
    distinct = list(dict.fromkeys(jobs))
    if not distinct:
        return []
    processes = max(1, min(processes or len(os.sched_getaffinity(0)), len(distinct)))
    shares = [distinct[i::processes] for i in range(processes)]
    by_job: dict[CompileJob, TargetCompile] = {}
    with tempfile.TemporaryDirectory(prefix="ember_target_compile_") as folder:
        from ember.config import settings
        python = python or settings().target_compile_python or sys.executable
        children = [(share, _start(share, target, os.path.join(folder, f"cache{i}"), python))
                    for i, share in enumerate(shares)]
        for share, (child, text) in children:
            out, err = child.communicate(text, timeout=timeout_s)
            if child.returncode == 0:
                by_job.update((job, TargetCompile(job, **row)) for job, row in zip(share, json.loads(out)))
                continue
            # A compiler that crashed its process (not an exception): each job again on its own,
            # so the crash is charged to the kernel that caused it.
            for job in share:
                lone, lone_text = _start([job], target, os.path.join(folder, "lone"), python)
                out, err = lone.communicate(lone_text, timeout=timeout_s)
                by_job[job] = (TargetCompile(job, **json.loads(out)[0]) if lone.returncode == 0 else
                               TargetCompile(job, 0.0, error=f"the compile process died ({lone.returncode}): "
                                                             f"{err.strip()[-1000:]}"))
    return [by_job[j] for j in jobs]


def _start(share: Sequence[CompileJob], target: str, cache_dir: str, python: str) -> tuple[subprocess.Popen, str]:
    source = str(Path(__file__).resolve().parents[2])  # the folder holding the ember package
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
    child = subprocess.Popen([python, "-m", "ember.runtime.target_compile", "--target", target],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return child, json.dumps([dataclasses.asdict(j) for j in share])


def _compile_one(job: CompileJob, arch: int) -> dict:
    import triton

    began = time.perf_counter()
    version = triton.__version__
    try:
        shared = int(warm_up(job).metadata.shared)
    except Exception as err:  # noqa: BLE001 - the compiler's error is the result
        return {"seconds": time.perf_counter() - began, "error": f"{type(err).__name__}: {str(err)[:1500]}",
                "triton": version}
    return {"seconds": time.perf_counter() - began, "shared": shared, "shared_limit": SHARED_LIMIT.get(arch),
            "triton": version}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Compile Triton compile jobs (JSON on stdin) for a GPU target.")
    ap.add_argument("--target", default=H100, help="backend:arch:warp_size (default: %(default)s)")
    args = ap.parse_args(argv)
    from ember.runtime import worker_triton
    if not worker_triton.install_target_driver(args.target):
        raise SystemExit(f"not a Triton target: {args.target!r} (expected backend:arch:warp_size, e.g. {H100})")
    arch = int(args.target.split(":")[1])
    jobs = [CompileJob(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                          for k, v in row.items()}) for row in json.load(sys.stdin)]
    json.dump([_compile_one(job, arch) for job in jobs], sys.stdout)


if __name__ == "__main__":
    main()
