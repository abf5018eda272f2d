"""The ``cudnn_benchmark`` option: cuDNN's benchmark mode is on while an Ember program with
convolutions runs (GPU targets), and the user's setting holds outside it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

import ember

nn = torch.nn


class _FlagAtConvolutions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        real = not any(is_fake(a) for a in args if isinstance(a, torch.Tensor))  # not a trace's fake tensors
        if real and func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            self.seen.append(torch.backends.cudnn.benchmark)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_benchmark_mode_only_while_the_program_runs(on: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    eager.load_state_dict(model.state_dict())
    compiled = ember.compile(model, target="triton-interpret", cudnn_benchmark=on)
    assert torch.backends.cudnn.benchmark is False
    compiled(torch.randn(2, 3, 10, 10, requires_grad=True)).sum().backward()  # compiled outside the mode
    model.zero_grad()
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    mode = _FlagAtConvolutions()
    with mode:
        got = compiled(x)
        got.square().sum().backward()
    want = eager(xe)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-4)
    assert len(mode.seen) >= 3, mode.seen  # two forward convolutions, their backward
    assert mode.seen == [on] * len(mode.seen), mode.seen
    assert torch.backends.cudnn.benchmark is False  # the process's setting is put back
