"""Bad options and wrong-device inputs: a clear error naming the problem, raised as Ember's own."""

from __future__ import annotations

import pytest
import torch

import ember
from ember.config import Options


@pytest.mark.parametrize("value", [-3, 2.5, True, "8"])
def test_max_recompiles_must_be_a_non_negative_integer(value: object) -> None:
    with pytest.raises(ValueError, match=r"max_recompiles must be an integer >= 0.*got"):
        ember.compile(torch.sin, max_recompiles=value)
    with pytest.raises(ValueError, match="max_recompiles"):
        Options(max_recompiles=value)  # type: ignore[arg-type]
    assert Options(max_recompiles=0).max_recompiles == 0


def test_device_error_names_the_input_and_backend() -> None:
    compiled = ember.compile(lambda x: x.sin() + 1, device="cuda", target="aten")
    with pytest.raises(ValueError) as info:
        compiled(torch.randn(3))
    text = str(info.value)
    assert text.startswith("ember.compile(device='cuda'): graph input 0 ([3]) is on cpu"), text
    assert "backend=" not in text and "BackendCompilerFailed" not in type(info.value).__name__


def test_other_backend_errors_name_ember(monkeypatch: pytest.MonkeyPatch) -> None:
    import ember.capture.backend as backend

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(backend, "aot_autograd", broken)
    with pytest.raises(Exception, match="backend='ember'"):
        ember.compile(lambda x: x.cos() * 2, target="aten")(torch.randn(3))
