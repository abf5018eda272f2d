"""A frame Dynamo cannot trace (an error during its trace, not a graph break: here an op whose
fake kernel is wrong, as a library's broken meta kernel would be) runs eagerly under Ember, as
the rest of the model compiles: correct outputs and gradients, one warning, the frame in the
compile log; strict mode raises as torch.compile does."""

from __future__ import annotations

import pytest
import torch

import ember
from ember import config


@torch.library.custom_op("ember_test::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], 3)  # wrong: the trace's shapes stop matching, the real op is fine


doubled.register_autograd(lambda ctx, grad: grad * 2)


class Untraceable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (doubled(self.lin(x)) + x).tanh()


@pytest.mark.parametrize("warm_start", [True, False])
def test_a_frame_dynamo_cannot_trace_runs_eagerly(warm_start: bool) -> None:
    torch.manual_seed(0)
    model, x = Untraceable(), torch.randn(2, 4)
    want = model(x)
    want.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with config.patch(strict=False, warm_start=warm_start), pytest.warns(RuntimeWarning, match="could not trace"):
        compiled = ember.compile(model)
        got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    (note,) = compiled._ember_backend.log.gave_up
    assert "Dynamo could not trace it (TorchRuntimeError" in note and "forward" in note
    with config.patch(strict=False):
        torch.testing.assert_close(compiled(x * 2), model(x * 2))  # later calls: eager again, no new note
    assert len(compiled._ember_backend.log.gave_up) == 1


def test_strict_mode_raises_as_torch_compile_does() -> None:
    compiled = ember.compile(Untraceable(), warm_start=False)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError):
        compiled(torch.randn(2, 4))
