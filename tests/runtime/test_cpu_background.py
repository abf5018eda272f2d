"""numba's warm-up and a warm start's CPU kernels on a background thread (runtime/cpu_background.py):
a failing background job never breaks a compile, and the program still matches eager."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import ember
from ember import config
from ember.runtime import cpu_background
from ember.runtime.cpu_background import BackgroundLoader
from ember.runtime.kernels import forget_loaded


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))) * 2.0)


def _run(model: nn.Module, cache: Path, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    compiled = ember.compile(model, warm_start=True, cache_dir=str(cache), target="cpu")
    with torch.no_grad():
        out = compiled(x)
    return out, compiled._ember_backend.log.warm_start


def test_failing_background_kernel_load_is_redone_on_the_main_thread(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    cold, log = _run(model, tmp_path, x)
    assert any(line.startswith("saved") for line in log), log
    forget_loaded()  # as in a new process: the kernel is loaded again
    with config.patch(cpu_background_load=True, cpu_background_fault="injected background failure"):
        warm, log = _run(model, tmp_path, torch.clone(x))  # loads the file this process saved
    assert any(line.startswith("loaded") for line in log), log
    # The kernel's background job failed (so the background path was taken) and was redone here.
    assert any("background kernel load failed (RuntimeError: injected background failure)" in line
               for line in log), log
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(warm, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)
    # Later launches use the loaded kernel directly.
    assert torch.equal(_run(model, tmp_path, x)[0], warm)


def test_failing_warm_up_is_recorded_not_raised() -> None:
    loader = BackgroundLoader()
    with config.patch(cpu_background_fault="no numba here"):
        job = loader.warm_numba()
        err = job.exception(timeout=60)
    assert isinstance(err, RuntimeError) and "no numba here" in str(err)
    assert loader.warm_numba() is job  # started once per process
    assert any("numba's background warm-up failed (RuntimeError: no numba here)" in p for p in loader.problems)


def test_started_only_for_a_cpu_warm_start() -> None:
    model = Net()
    assert not cpu_background.wanted(model, config.Options.from_env(warm_start=True, target="cpu"))  # off by default

    def options(**kw: object) -> config.Options:
        return config.Options.from_env(**{"warm_start": True, **kw})

    with config.patch(cpu_background_load=True):
        assert cpu_background.wanted(model, options(target="cpu"))
        assert cpu_background.wanted(model, options(target="auto"))
        assert not cpu_background.wanted(model, options(target="cpu", warm_start=False))
        assert not cpu_background.wanted(model, options(target="triton"))
        assert not cpu_background.wanted(model, options(target="auto", device="cuda"))
        assert not cpu_background.wanted(nn.Identity(), options(target="auto"))  # no parameters: not known
