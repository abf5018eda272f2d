"""RNN modules in inference calls are traced into the model's graph (Dynamo's ``allow_rnn``, on
during Ember's calls with gradients off): one graph, the recurrence as per-step matmuls and
generated gate kernels, equal to eager. Training keeps Dynamo's graph break (cuDNN's or ATen's
RNN runs eagerly between graphs), and ``trace_rnn=False`` keeps it in inference too. The user's
own Dynamo setting is left as it was.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import assert_close, assert_compiled_cleanly, log_of

import ember

nn = torch.nn


class RecurrentNet(nn.Module):
    """A projection, a stacked recurrence, a head: the shape of a language or sequence model."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 8)
        self.rnn = cell(8, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.recurrence(self.proj(x).tanh())).softmax(-1)

    def recurrence(self, h: torch.Tensor) -> torch.Tensor:
        # A method of its own, as the zoo's language model has it: where Dynamo breaks the graph
        # at the RNN, it compiles the code before and after it.
        hidden, _state = self.rnn(h)
        return hidden


def _net(cell: type[nn.RNNBase]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = RecurrentNet(cell)
    eager = RecurrentNet(cell)
    eager.load_state_dict(model.state_dict())
    return model, eager


def _check_training(compiled: nn.Module, model: nn.Module, eager: nn.Module, x: torch.Tensor) -> None:
    """Output, input gradient and every parameter gradient equal to eager's."""
    results = []
    for fn, params in ((compiled, model), (eager, eager)):
        params.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        results.append([out.detach(), leaf.grad] + [p.grad for p in params.parameters()])
    for i, (got, want) in enumerate(zip(*results)):
        assert got is not None and want is not None, f"gradient {i} missing"
        assert_close(got, want, f"value {i}")


def _fallback_ops(compiled: object) -> set[str]:
    return {reason.split(":")[0] for g in log_of(compiled).graphs for reason in g.fallback_reasons}


@pytest.mark.parametrize("target", ["cpu", "triton-interpret"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_inference_traces_the_recurrence_into_one_graph(target: str, cell: type[nn.RNNBase]) -> None:
    model, eager = _net(cell)
    model.eval(), eager.eval()
    compiled = ember.compile(model, target=target)
    for seed in (1, 2):
        x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert len(log.frames) == 1 and len(log.graphs) == 1, log.frames  # no graph break at the RNN
    assert log.graphs[0].kernels > 0 and log.graphs[0].target == target  # the gates in generated kernels
    assert not any("lstm" in op or "gru" in op for op in _fallback_ops(compiled))
    assert torch._dynamo.config.allow_rnn is False  # Dynamo's own default, back after the call


def test_training_keeps_the_graph_break_and_matches_eager() -> None:
    model, eager = _net(nn.LSTM)
    compiled = ember.compile(model, target="cpu")
    x = torch.randn(2, 6, 5)
    _check_training(compiled, model, eager, x)
    log = log_of(compiled)
    assert len(log.frames) >= 2  # the LSTM ran between graphs, as Dynamo's default has it
    assert_compiled_cleanly(log)


def test_training_then_inference_on_one_model() -> None:
    model, eager = _net(nn.LSTM)
    compiled = ember.compile(model, target="cpu")
    x = torch.randn(3, 4, 5)
    _check_training(compiled, model, eager, x)
    frames_training = len(log_of(compiled).frames)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    # Gradients off: a recompile of the model's frame, the recurrence traced this time.
    assert len(log_of(compiled).frames) == frames_training + 1


def test_trace_rnn_off_keeps_the_break_in_inference() -> None:
    model, eager = _net(nn.LSTM)
    compiled = ember.compile(model.eval(), target="cpu", trace_rnn=False)
    x = torch.randn(2, 6, 5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager.eval()(x), rtol=1e-4, atol=1e-5)
    assert len(log_of(compiled).frames) >= 2


def test_the_users_allow_rnn_is_kept_in_training() -> None:
    model, eager = _net(nn.GRU)
    compiled = ember.compile(model, target="cpu")
    x = torch.randn(2, 6, 5)
    with torch._dynamo.config.patch(allow_rnn=True):
        _check_training(compiled, model, eager, x)
        assert torch._dynamo.config.allow_rnn is True
    assert len(log_of(compiled).frames) == 1  # the user asked Dynamo to trace RNNs: one graph


class PackedNet(nn.Module):
    """Variable-length sequences through a bidirectional LSTM (pack / pad around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 8, 2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _state = self.rnn(packed)
        padded, _lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return padded.sum(-1)


class VariantNet(nn.Module):
    def __init__(self, rnn: nn.Module, with_state: bool = False) -> None:
        super().__init__()
        self.rnn, self.with_state = rnn, with_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.with_state:  # an initial state made in the graph
            h = torch.full((self.rnn.num_layers, x.shape[1], self.rnn.hidden_size), 0.1)
            out, (hn, _cn) = self.rnn(x, (h, h.clone()))
            return out * 2 + hn.sum()
        out, _state = self.rnn(x)
        return out.tanh()


@pytest.mark.parametrize("case", ["packed", "projections", "bidirectional_gru", "relu_rnn", "initial_state"])
def test_rnn_variants_in_inference_match_eager(case: str) -> None:
    torch.manual_seed(0)
    model = {"packed": lambda: PackedNet(),
             "projections": lambda: VariantNet(nn.LSTM(6, 8, 2, proj_size=4)),
             "bidirectional_gru": lambda: VariantNet(nn.GRU(6, 8, 3, bidirectional=True, dropout=0.3)),
             "relu_rnn": lambda: VariantNet(nn.RNN(6, 8, 2, nonlinearity="relu", bias=False)),
             "initial_state": lambda: VariantNet(nn.LSTM(6, 8, 1), with_state=True)}[case]().eval()
    compiled = ember.compile(model, target="cpu")
    gen = torch.Generator().manual_seed(5)
    if case == "packed":
        args = (torch.randn(3, 5, 6, generator=gen), torch.tensor([5, 2, 4]))
    else:
        args = (torch.randn(5, 3, 6, generator=gen),)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["cpu", "triton-interpret"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_long_recurrence_runs_as_one_rnn_call(target: str, cell: type[nn.RNNBase]) -> None:
    # 6 steps x 2 layers x 2 directions = 24 step-layers, above the limit set here: one ATen RNN
    # call (ops/rnn.py) instead of the unrolled steps; oneDNN off, so short ones would unroll.
    torch.manual_seed(0)
    model = VariantNet(cell(6, 8, 2, bidirectional=True)).eval()
    x = torch.randn(6, 3, 6, generator=torch.Generator().manual_seed(2))
    with ember.config.patch(rnn_unroll_max_steps=16), torch.backends.mkldnn.flags(enabled=False), torch.no_grad():
        compiled = ember.compile(model, target=target)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        x2 = torch.randn(6, 3, 6, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(compiled(x2), model(x2), rtol=1e-4, atol=1e-5)
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert sum(n for why, n in log.rewrites.items() if "ops/rnn.py" in why) == 1
    assert "ember.rnn" in log.graphs[0].program


def test_a_long_recurrence_under_autocast_runs_in_autocasts_dtype() -> None:
    torch.manual_seed(0)
    model = VariantNet(nn.LSTM(6, 8, 1)).eval()
    x = torch.randn(12, 2, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            want = model(x)
        except RuntimeError as err:  # oneDNN's bf16 LSTM needs AVX-512 (an AVX2-only CPU fails in eager)
            pytest.skip(f"eager's bf16 LSTM fails on this CPU: {str(err).splitlines()[0][:120]}")
    with ember.config.patch(rnn_unroll_max_steps=4), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = ember.compile(model, target="cpu")
        got = compiled(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert "ember.rnn" in log_of(compiled).graphs[0].program
