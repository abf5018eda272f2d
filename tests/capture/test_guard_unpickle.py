"""The tensors of Dynamo's saved guards load as fakes of one mode (compat.guard_tensors_unpickled_in_one_fake_mode):
the same metadata as torch's own unpickling, one FakeTensorMode for all of them. That the loaded
guards still reject a changed shape, dtype or flag: tests/capture/test_warm_start.py."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from ember import compat

guards = pytest.importorskip("torch._dynamo.guards")


def _saved(tensors: list[torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    held = [*tensors, *(t.grad for t in tensors if t.grad is not None)]  # what the guards read
    guards.GuardsStatePickler({id(t): t for t in held}, {}, {}, buf).dump(tensors)
    return buf.getvalue()


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, type(t).__name__,
            None if t.grad is None else (t.grad.shape, t.grad.dtype))


def test_guard_tensors_load_with_the_same_metadata_under_one_mode() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last))
    weight.grad = torch.randn(8, 3, 3, 3)
    tensors = [weight, torch.randn(5, 7).t(), torch.randint(0, 9, (4,)), torch.randn(2, 3, dtype=torch.bfloat16)]
    data = _saved(tensors)
    plain = pickle.loads(data)
    with compat.guard_tensors_unpickled_in_one_fake_mode():
        shared = pickle.loads(data)
    assert [_meta(t) for t in shared] == [_meta(t) for t in plain]
    assert len({id(t.fake_mode) for t in shared}) == 1
    assert len({id(t.fake_mode) for t in plain}) == len(plain)  # torch's own: one mode per tensor
    assert guards.GuardsStatePickler.__dict__["_unpickle_tensor"].__func__.__name__ == "_unpickle_tensor"


def test_frame_names_are_the_same_text_when_shortened_once(monkeypatch) -> None:
    import traceback

    import torch.utils._traceback as tb

    frames = [traceback.FrameSummary(torch.__file__, 10, "f", line="x = 1"),
              traceback.FrameSummary(__file__, 20, "g", line="y = 2")]
    plain = [tb.format_frame(f, line=True) for f in frames]
    calls = []
    original = tb.shorten_filename
    monkeypatch.setattr(tb, "shorten_filename", lambda fn, base=None: calls.append(fn) or original(fn, base=base))
    with compat.frame_names_shortened_once():
        once = [tb.format_frame(f, line=True) for f in frames * 3]
    assert once == plain * 3
    assert calls == [torch.__file__, __file__]  # each file named once
    assert [tb.format_frame(f, line=True) for f in frames] == plain  # torch's own again afterwards
    assert len(calls) == 4
