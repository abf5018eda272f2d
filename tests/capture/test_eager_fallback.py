"""A model Dynamo cannot trace runs eagerly (capture/eager_fallback.py): the same results as eager,
said once, and a bad input still raises eager's error without switching compilation off."""

from __future__ import annotations

import warnings

import pytest
import torch
from core_helpers import assert_close, log_of

import ember
from ember import config


class CompileOnlyMask(torch.nn.Module):
    """Builds a tensor only while compiled (as Hugging Face models do when they detect a compile)
    whose shape the rest of the forward cannot take: Dynamo's trace fails, eager runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).relu()
        mask = torch.ones(1, 5) if torch.compiler.is_compiling() else torch.zeros(1, 6)
        return y + mask


def _calls_warning(compiled, *args) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = compiled(*args)
    return out, [str(w.message) for w in seen if "Dynamo could not trace" in str(w.message)]


@pytest.mark.parametrize("warm_start", [False, True], ids=["no-warm-start", "warm-start"])
def test_an_untraceable_model_runs_eagerly_and_says_so_once(warm_start: bool) -> None:
    torch.manual_seed(0)
    model = CompileOnlyMask()
    with config.patch(strict=False, warm_start=warm_start):
        compiled = ember.compile(model, target="aten")
        x = torch.randn(3, 8, requires_grad=True)
        out, said = _calls_warning(compiled, x)
        assert len(said) == 1 and "broadcast" in said[0], said  # the model's own error, named
        assert_close(out, model(x), "first call")
        # Gradients flow through the eager run as through eager.
        (g,) = torch.autograd.grad(out.square().sum(), x)
        (want,) = torch.autograd.grad(model(x).square().sum(), x)
        assert_close(g, want, "input gradient")
        x2 = torch.randn(5, 8)
        out2, said2 = _calls_warning(compiled, x2)
        assert not said2  # once
        assert_close(out2, model(x2), "second call")
    log = log_of(compiled)
    assert not log.graphs  # nothing compiled, nothing traced again
    assert len(log.gave_up) == 1 and "could not trace" in log.gave_up[0]


def test_a_function_dynamo_cannot_trace_runs_eagerly() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        extra = torch.ones(2, 3) if torch.compiler.is_compiling() else torch.zeros(4)
        return x.sin() + extra

    compiled = ember.compile(fn, target="aten", warm_start=False)
    x = torch.randn(3, 4)
    out, said = _calls_warning(compiled, x)
    assert said and out.shape == (3, 4)
    assert_close(out, fn(x), "function")


def test_a_bad_input_raises_eagers_error_and_compiles_the_next_call() -> None:
    fine = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh())
    compiled = ember.compile(fine, target="aten", warm_start=False)
    bad = torch.randn(3, 7)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # eager's own message
        compiled(bad)
    x = torch.randn(3, 8)
    assert_close(compiled(x), fine(x), "good call after a bad one")
    assert log_of(compiled).graphs and not log_of(compiled).gave_up


def test_a_trace_failing_after_compiled_code_ran_is_not_run_twice() -> None:
    # The graph before the break ran (it could have written buffers): running the whole call again
    # eagerly could apply a write twice, so Dynamo's error reaches the caller as torch.compile's does.
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2.0
        torch._dynamo.graph_break()
        extra = torch.ones(2, 3) if torch.compiler.is_compiling() else torch.zeros(4)
        return y + extra

    compiled = ember.compile(fn, target="aten", warm_start=False)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        compiled(torch.randn(3, 4))
    assert not log_of(compiled).gave_up


def test_a_real_model_dynamo_cannot_trace() -> None:
    # Hugging Face's Nystromformer builds a [batch, 1, tokens, tokens] mask when it detects a
    # compile, which its [batch, heads, landmarks, tokens] scores cannot take (torch.compile raises).
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.NystromformerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64,
                                           max_position_embeddings=64, num_landmarks=4,
                                           segment_means_seq_len=16, conv_kernel_size=3)
    model = transformers.NystromformerForMaskedLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 16))
    compiled = ember.compile(model)
    out, said = _calls_warning(compiled, ids)
    assert said
    assert_close(out.logits, model(ids).logits, "logits")
    report = ember.explain(compiled, ids)
    assert any("could not trace" in p for p in report.problems())
