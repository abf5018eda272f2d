"""CUDA graphs, on CPU (``FakeGraphs``, cudagraph_fakes.py): an output that is a tensor the program
holds (a value folded from shapes alone, saved for the backward) is handed out as it is, not as
graph memory the caller keeps: it does not make every call capture again."""

from __future__ import annotations

import copy

import torch
from cudagraph_fakes import FakeGraphs
from torch import nn

import ember
from ember.instruments import instrument
from ember.runtime.cudagraphs.runner import CudaGraphRunner


class _CausalMix(nn.Module):
    """A causal mask built from the input's length only (folded at compile time, as T5's position
    buckets are), multiplied into the activations: the backward needs it, so the forward returns it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = (torch.arange(t)[:, None] >= torch.arange(t)[None, :]).to(x.dtype)
        return torch.tanh(mask @ self.proj(x))


def test_folded_constant_saved_for_backward_replays_without_recapture() -> None:
    torch.manual_seed(0)
    base = _CausalMix()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = ember.compile(model, target="aten", cache=False, frame_cache=False)
    runners: list[CudaGraphRunner] = []
    real_init = CudaGraphRunner.__init__

    def keep(self: CudaGraphRunner, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        runners.append(self)

    CudaGraphRunner.__init__ = keep  # type: ignore[method-assign]
    try:
        with instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None):
            for _ in range(5):
                x = torch.randn(3, 6, 8)
                compiled(x).square().sum().backward()
                ref(x).square().sum().backward()
                for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, pr.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
                    p.grad, pr.grad = None, None
    finally:
        CudaGraphRunner.__init__ = real_init  # type: ignore[method-assign]
    forward = next(r for r in runners if r.title.startswith("forward"))
    assert forward.captures == 1 and forward.replays == 4 and forward.uncaptured == 0, forward.status
    assert "constants" in dir(forward.run) and forward.run.constants, "the program lists the tensors it holds"
