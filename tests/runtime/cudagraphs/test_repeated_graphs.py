"""CUDA graphs, on CPU: a graph run more than once per step (one compiled frame per layer), and
inputs that are broadcast (expanded) views. The runner is checked with ``FakeGraphs``
(cudagraph_fakes.py), as in test_cudagraph_runner.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cudagraph_fakes import FakeGraphs, fake_runner, new_batch
from torch import nn

import ember
from ember.instruments import instrument
from ember.runtime.cudagraphs import runner as cudagraph_runner
from ember.runtime.cudagraphs.runner import CudaGraphRunner


class _AttentionLayer(nn.Module):
    """A layer whose graph returns views (q, k, v) of one projection's output, as attention does."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, 2, d // 2).transpose(1, 2)

        a = nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.norm(x + torch.tanh(self.o(a.transpose(1, 2).reshape(b, t, d))))


class _LayerPerGraph(nn.Module):
    """Every layer a graph of its own, all layers one compiled frame: the frame's graph runs once
    per layer and step (BART's layers on the GPU), its earlier calls' activations still held."""

    def __init__(self, layers: int = 6, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_AttentionLayer(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()
        return x


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("sites", [True, False])
def test_a_graph_called_once_per_layer_never_overwrites_saved_activations(monkeypatch, steps: int,
                                                                          sites: bool) -> None:
    # Without call sites (torch.compile(backend="ember") counts no model calls) one graph serves
    # every layer: its second call within a step is captured while the first's outputs are held.
    if not sites:
        monkeypatch.setattr(cudagraph_runner, "MAX_SITES", 1)
    torch.manual_seed(0)
    base = _LayerPerGraph()
    x = torch.randn(2, 5, 16)
    ref = copy.deepcopy(base)
    (ref(x) ** 2).sum().backward()
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    compiled = ember.compile(model, target="aten")
    with instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None):
        for _ in range(steps):
            model.zero_grad()
            (compiled(x) ** 2).sum().backward()
    statuses = [g.cudagraph for g in compiled._ember_backend.log.graphs]
    if steps > 1 or not sites:  # with sites, one step is every site's first (uncaptured) call
        assert any(s.startswith("captured") for s in statuses), statuses
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _runners(compiled) -> list[CudaGraphRunner]:
    return [graph.run for _, graph in compiled._ember_backend.programs if isinstance(graph.run, CudaGraphRunner)]


def test_each_call_of_a_layer_graph_in_a_step_replays_a_graph_of_its_own() -> None:
    # One frame serves layers 2-6 (its forward and backward run five times a step, with each
    # layer's parameters). Each call of a step gets a graph of its own that reads that layer's
    # parameters in place: in the last steps every call replays, none captures or runs
    # uncaptured, and training matches eager step for step. (The CPU stand-in's memory is the
    # process heap, where a freed output's address can come back as another tensor's, which may
    # cost a recapture in the first steps; the steady state is what is asserted.)
    torch.manual_seed(0)
    base = _LayerPerGraph(layers=6)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    batches = [torch.randn(2, 5, 16) for _ in range(7)]
    torch._dynamo.reset()
    compiled = ember.compile(model, target="aten")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    last = 2
    before: dict[int, tuple[int, int, int]] = {}
    with instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None):
        for step, x in enumerate(batches):
            if step == len(batches) - last:
                everyone = _runners(compiled) + [site for r in _runners(compiled) for site in r.sites]
                before = {id(one): (one.captures, one.replays, one.uncaptured) for one in everyone}
            for fn, opt in ((ref, opts[0]), (compiled, opts[1])):
                loss = (fn(x) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, pr, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    runners = _runners(compiled)
    repeated = [r for r in runners if r.sites]
    assert len(repeated) == 2, [r.status for r in runners]  # the layer frame's forward and backward
    for r in repeated:
        assert len(r.sites) == 4 and "runs 5 times per call of the model" in r.status, r.status
    for one in runners + [site for r in repeated for site in r.sites]:
        captures, replays, uncaptured = before[id(one)]
        assert (one.captures, one.replays - replays, one.uncaptured) == (captures, last, uncaptured), \
            (one.title, one.status)
    for r in [r for r in repeated if r.title.startswith("forward")]:
        # each call's layer parameters (ten of the graph's eleven inputs) are read in place
        assert all(len(site.g.static_idx) >= 10 for site in r.sites), [site.status for site in r.sites]


def test_each_call_of_a_layer_graph_in_inference_gets_a_graph_of_its_own() -> None:
    torch.manual_seed(0)
    model = _LayerPerGraph(layers=4).eval()
    torch._dynamo.reset()
    compiled = ember.compile(model, target="aten")
    with torch.no_grad(), instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None):
        for _ in range(4):
            x = torch.randn(2, 5, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    repeated = [r for r in _runners(compiled) if r.sites]
    assert len(repeated) == 1 and len(repeated[0].sites) == 3, [r.status for r in _runners(compiled)]
    for site in repeated[0].sites:  # one pool for the four: captured in order, as training graphs
        assert site.captures == 1 and site.replays == 3 and site.pool is repeated[0].pool, site.status


def _masked_sum(args: list) -> tuple:
    x, mask = args
    args.clear()
    return ((x * mask).sum(1),)


def test_an_expanded_input_that_moves_is_copied_one_element_per_broadcast_dim() -> None:
    runner = fake_runner(_masked_sum)
    rows = []
    for _ in range(6):  # a new expanded mask (one row repeated) every call, as a broadcast attention mask
        row = torch.randn(1, 8)
        rows.append(row)  # keeps every call's memory distinct (the runner decides from addresses)
        mask = row.expand(3, 8)
        x = new_batch()
        (got,) = runner([x, mask])
        torch.testing.assert_close(got, (x * mask).sum(1))
        del got
    assert runner.captures == 1 and runner.replays >= 4, runner.status
    # Then a mask that is not expanded: the graph's buffer holds one row, so it captures again.
    mask = torch.randn(3, 8)
    x = new_batch()
    (got,) = runner([x, mask])
    torch.testing.assert_close(got, (x * mask).sum(1))
    assert "no longer expanded" in runner.status or runner.captures == 2, runner.status


def _tanh_layer_and_input_grad(args: list) -> tuple:
    """y = tanh(x * mask) @ w and, for the upstream gradient g, dy/dx: a forward and its backward
    in one program that only reads its inputs (so their copy buffers may live in the graph's pool)."""
    x, mask, w, g = args
    args.clear()
    h = torch.tanh(x * mask)
    return h @ w, (g @ w.T) * (1 - h * h) * mask


def test_a_moving_expanded_input_read_only_is_copied_into_a_pooled_buffer_and_matches_eager() -> None:
    # The buffer of an input the program only reads is allocated inside the capture, in the
    # graph's pool, with the input's strides: for an expanded input (a broadcast mask, BERT's
    # saved token-type ids in its backward) one memory location per broadcast row. The CPU
    # stand-in fills it with the call's values before running the program; a plain copy_ into
    # it raised "more than one element of the written-to tensor refers to a single memory
    # location" and the graph ran uncaptured from then on.
    runner = CudaGraphRunner(_tanh_layer_and_input_grad, "test", backend=FakeGraphs(),
                             read_only=frozenset(range(4)))
    w = torch.randn(8, 5)
    rows = []
    for _ in range(5):
        row = torch.randn(1, 8)
        rows.append(row)  # every call's mask in new memory: the input moves, so it is copied in
        mask, x, g = row.expand(3, 8), new_batch(), torch.randn(3, 5)
        assert mask.stride() == (0, 1)
        y, gx = runner([x, mask, w, g])
        xr = x.clone().requires_grad_(True)
        want = torch.tanh(xr * mask) @ w
        want.backward(g)
        torch.testing.assert_close(y, want.detach())
        torch.testing.assert_close(gx, xr.grad)
        del y, gx
    assert runner.disabled is None, runner.status
    assert runner.captures == 1 and runner.replays >= 4, runner.status
    assert runner.g is not None and 1 in runner.g.pooled and 1 in runner.g.dynamic_idx  # the path under test
