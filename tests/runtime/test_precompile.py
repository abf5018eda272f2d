"""The parallel kernel precompile's bookkeeping (runtime/precompile.py). Without a GPU every
warmup fails, which is the case worth checking: failures are counted and reported, never raised
(the launch compiles the kernel again), and a kernel is attempted once per process."""

from __future__ import annotations

import pytest

from ember import config
from ember.runtime import precompile as pc

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def {name}(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 2, mask=offs < N)
'''


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "_DONE", set())
    out = []
    for name in ("ember_k_a", "ember_k_b"):
        path = tmp_path / f"{name}.py"
        path.write_text(KERNEL.format(name=name))
        out.append(pc.job_for(path, name, ["torch.float32", "torch.float32"], {"N": 8, "BLOCK": 8}))
    return out


@config.patch(compile_workers=0)
def test_serial_precompile_reports_each_failure_once(jobs, monkeypatch):
    monkeypatch.setattr(pc, "compile_job", lambda job: (f"{job.name}: RuntimeError: no GPU", 100.0, 0.25))
    stats = pc.precompile(jobs + jobs[:1])  # a duplicate is compiled once
    assert stats.kernels == 2 and stats.workers == 0
    assert stats.errors == ["ember_k_a: RuntimeError: no GPU", "ember_k_b: RuntimeError: no GPU"]
    assert stats.compile_s == pytest.approx(0.5)
    assert "2 kernels on this process" in stats.describe() and "2 failed" in stats.describe()
    again = pc.precompile(jobs)
    assert again.kernels == 0 and again.describe() == "no new kernels"
    # the same kernel with other launch parameters is another compile
    other = pc.CompileJob(jobs[0].path, jobs[0].name, jobs[0].arg_dtypes, (("BLOCK", 16), ("N", 8)))
    assert pc.precompile([other]).kernels == 1
    # ... and with other argument dtypes (a kernel that ignores an argument's values is named
    # alike whatever its dtype, and Triton compiles each signature)
    bf16 = pc.CompileJob(jobs[0].path, jobs[0].name, ("bfloat16", "float32"), jobs[0].meta)
    assert pc.precompile([bf16, bf16]).kernels == 1


@config.patch(compile_workers=2)
def test_submit_returns_before_waiting_and_wait_reports_once(jobs, monkeypatch):
    started = []

    class Pool:  # a pool whose jobs finish only when their results are read
        def submit(self, fn, job):
            started.append(job.name)
            future = pc.cf.Future()
            future.set_result((None, 100.0, 0.5))
            return future

    monkeypatch.setattr(pc, "_pool", lambda workers: Pool())
    pending = pc.submit(jobs)
    assert started == ["ember_k_a", "ember_k_b"] and pending.stats.wall_s == 0.0  # not waited for yet
    stats = pending.wait()
    assert stats.kernels == 2 and stats.workers == 2 and stats.compile_s == pytest.approx(1.0)
    assert stats.errors == [] and pending.wait() is stats


def test_compile_job_returns_an_error_without_a_gpu(jobs, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU compiles the kernel")
    error, began, seconds = pc.compile_job(jobs[0])
    assert error is not None and error.startswith("ember_k_a: ")
    assert seconds >= 0 and began > 0


def test_stats_describe_parallel():
    stats = pc.PrecompileStats(kernels=10, workers=4, wall_s=2.0, compile_s=6.0, wait_s=1.5,
                               slowest="ember_k", slowest_s=1.25)
    text = stats.describe()
    assert "10 kernels on 4 worker processes" in text and "x3.0 parallel" in text
    assert "1.50 s before the first compile began" in text and "slowest ember_k 1.25 s" in text


def test_worker_count_from_env(monkeypatch):
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "3")
    assert pc.worker_count() == 3
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "-2")
    assert pc.worker_count() == 0



def test_workers_get_the_ptxas_whose_version_keys_the_parents_cache(tmp_path, monkeypatch):
    # Triton keys compiled kernels by its ptxas's version, read once per process: a worker must
    # run the ptxas that printed it, not whichever TRITON_PTXAS_PATH says now.
    tools = {}
    for name, text in (("new", "ptxas release 13.0"), ("old", "ptxas release 12.8")):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{text}'\n")
        path.chmod(0o755)
        tools[name] = str(path)
    version = "ptxas release 12.8\n"
    assert pc.matching_ptxas(version, [None, str(tmp_path / "missing"), tools["new"], tools["old"]]) == tools["old"]
    assert pc.matching_ptxas("ptxas release 11.0\n", [tools["new"], tools["old"]]) is None
    # Spawned workers see the match while submitting, and the parent's environment is left as it was.
    monkeypatch.setattr(pc, "_WORKER_ENV", {"TRITON_PTXAS_PATH": tools["old"]})
    monkeypatch.setenv("TRITON_PTXAS_PATH", tools["new"])
    with pc._as_worker_env():
        assert pc.os.environ["TRITON_PTXAS_PATH"] == tools["old"]
        assert pc.os.environ["EMBER_COMPILE_WORKER"] == "1"
    assert pc.os.environ["TRITON_PTXAS_PATH"] == tools["new"] and "EMBER_COMPILE_WORKER" not in pc.os.environ


@config.patch(compile_workers=2)
def test_jobs_carry_the_parents_triton_cache_folder_at_submission(jobs, monkeypatch):
    # Inductor can set TRITON_CACHE_DIR in this process after the workers were spawned: each job
    # names the folder the parent reads at submission, and the worker writes there.
    seen = []

    class Pool:
        def submit(self, fn, job):
            seen.append(job)
            future = pc.cf.Future()
            future.set_result((None, 100.0, 0.5))
            return future

    monkeypatch.setattr(pc, "_pool", lambda workers: Pool())
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    pc.submit(jobs).wait()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/inductor-triton")
    pc.submit(jobs).wait()  # the same kernels, now wanted in another folder: compiled again
    assert [j.cache_dir for j in seen] == ["", "", "/tmp/inductor-triton", "/tmp/inductor-triton"]
    monkeypatch.setenv("EMBER_COMPILE_WORKER", "1")
    monkeypatch.setattr(pc, "_lower_priority", lambda niceness: None)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    pc.compile_job(seen[-1])  # fails without a GPU, after pointing this process at the folder
    assert pc.os.environ["TRITON_CACHE_DIR"] == "/tmp/inductor-triton"


class _PendingPool:
    """A pool whose workers have not taken anything yet: every job's future stays pending."""

    def __init__(self) -> None:
        self.futures: list[pc.cf.Future] = []

    def submit(self, fn, job):
        self.futures.append(pc.cf.Future())
        return self.futures[-1]


@config.patch(compile_workers=2)
def test_jobs_no_worker_took_compile_here_while_no_worker_has_started(jobs, monkeypatch):
    pool = _PendingPool()
    monkeypatch.setattr(pc, "_pool", lambda workers: pool)
    monkeypatch.setattr(pc, "_STARTED", [pc.cf.Future()])  # a worker still importing torch
    compiled_here = []
    monkeypatch.setattr(pc, "compile_job", lambda job: compiled_here.append(job.name) or (None, 100.0, 0.25))
    pending = pc.submit(jobs)
    taken = pool.futures[0]
    assert taken.set_running_or_notify_cancel()  # a worker took the first job: it is not compiled here
    taken.set_result((None, 100.0, 0.5))
    stats = pending.wait()
    assert compiled_here == ["ember_k_b"] and stats.here == 1
    assert stats.kernels == 2 and stats.compile_s == pytest.approx(0.75) and stats.errors == []
    assert pool.futures[1].cancelled()  # the worker's copy of the job is never run
    assert "1 compiled in this process while the workers started" in stats.describe()


@config.patch(compile_workers=2)
def test_once_a_worker_has_started_the_jobs_stay_with_the_workers(jobs, monkeypatch):
    pool = _PendingPool()
    monkeypatch.setattr(pc, "_pool", lambda workers: pool)
    ready = pc.cf.Future()
    ready.set_result(1.0)
    monkeypatch.setattr(pc, "_STARTED", [pc.cf.Future(), ready])
    monkeypatch.setattr(pc, "compile_job", lambda job: pytest.fail("compiled in the parent"))
    pending = pc.submit(jobs)
    for future in pool.futures:
        future.set_result((None, 100.0, 0.5))
    stats = pending.wait()
    assert stats.here == 0 and stats.kernels == 2 and stats.compile_s == pytest.approx(1.0)
    assert "in this process" not in stats.describe()
