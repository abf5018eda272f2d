"""Compile workers start at ember.compile() where a CUDA compile will use them (runtime/early_start.py),
and spawned workers do not run the user's script again (runtime/precompile.py)."""

from __future__ import annotations

import sys

import torch

import ember
from ember.config import Options
from ember.runtime import early_start, precompile


def test_cpu_only_use_starts_no_workers(monkeypatch):
    started = []
    monkeypatch.setattr(precompile, "start_workers", lambda: started.append(1))
    model = torch.nn.Linear(4, 4)
    assert not early_start.wants_workers(model, Options())  # no CUDA device here
    ember.compile(model)(torch.randn(2, 4))
    assert started == []


def test_cuda_compiles_start_workers_at_compile_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    started = []
    monkeypatch.setattr(precompile, "start_workers", lambda: started.append(1))
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "2")
    fn = lambda x: x + 1  # noqa: E731 - no parameters: decided by the device alone
    assert early_start.start_workers_early(fn, Options())
    assert started == [1]
    # not for CPU targets, device="cpu", a model whose parameters are on the CPU, or 0 workers
    assert not early_start.wants_workers(fn, Options(target="cpu"))
    assert not early_start.wants_workers(fn, Options(device="cpu"))
    assert not early_start.wants_workers(torch.nn.Linear(2, 2), Options())
    monkeypatch.setenv("EMBER_COMPILE_WORKERS", "0")
    assert not early_start.start_workers_early(fn, Options())
    assert started == [1]


def test_workers_start_without_the_parents_main_module(monkeypatch):
    main = sys.modules["__main__"]
    with precompile._as_worker_env():
        hidden = sys.modules["__main__"]
        assert hidden is not main and getattr(hidden, "__file__", None) is None
        assert getattr(hidden, "__spec__", None) is None
    assert sys.modules["__main__"] is main


def test_no_workers_are_started_inside_a_worker(monkeypatch):
    monkeypatch.setenv("EMBER_COMPILE_WORKER", "1")
    monkeypatch.setattr(precompile, "_pool", lambda workers: (_ for _ in ()).throw(AssertionError("spawned")))
    precompile.start_workers()
