"""Random numbers inside captured graphs, on CPU.

Ember's programs run through the CUDA-graph runner on its CPU stand-in (cudagraph_fakes.py: a
replay reruns the program on the captured tensors, the capture draws nothing), so dropout's
statistics, its masks across replays and the gradients through them are checked on the path a
GPU takes. The capture decision for transformers is checked on their AOTAutograd graphs moved to
fake CUDA tensors (test_cudagraph_rules.py), and memory-efficient attention's seeds on hand-made graphs.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from cudagraph_fakes import graphs_on_cpu
from test_cudagraph_rules import _aot_graphs, _attention_graph, _cuda
from torch import fx, nn

import ember
from ember.passes import attention_seeds
from ember.passes.attention_seeds import route_attention_seeds
from ember.runtime.cudagraphs.rules import cudagraph_blocker

aten = torch.ops.aten
P = 0.3


class _DropoutNet(nn.Module):
    """x -> dropout(x * w): the mask shows in the output (x and w are positive)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(n) + 0.5)
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.w)


def _statuses(compiled) -> list[str]:
    return [g.cudagraph for g in compiled._ember_backend.log.graphs]


@pytest.mark.parametrize("target", ["aten", "triton-interpret"])  # the interpreter: generated kernels around the draws
def test_dropout_in_replayed_graphs_draws_new_masks_with_eager_statistics(monkeypatch, target: str) -> None:
    n, steps = 4096, 6
    x = torch.rand(n) + 0.5
    runs = {}
    for graphs in (False, True):
        if graphs:
            graphs_on_cpu(monkeypatch)
        torch._dynamo.reset()
        model = _DropoutNet(n)
        model.w.data.copy_(torch.linspace(0.5, 1.5, n))
        compiled = ember.compile(model, target=target)
        torch.manual_seed(7)
        outs, grads = [], []
        for _ in range(steps):
            xi = x.clone().requires_grad_(True)
            out = compiled(xi)
            g = torch.randn(n)
            out.backward(g)
            outs.append(out.detach().clone())
            grads.append((g, xi.grad.clone()))
        runs[graphs] = (outs, grads, _statuses(compiled))
        if target != "aten":
            assert any(g.placement.get("generated") for g in compiled._ember_backend.log.graphs)
    outs, grads, statuses = runs[True]
    assert len(statuses) == 2 and all(s.startswith("captured") for s in statuses), statuses
    # Every replay draws what the same program draws uncaptured from the same generator state.
    for got, want in zip(outs, runs[False][0]):
        assert torch.equal(got, want)
    kept = [o != 0 for o in outs]
    sigma = (P * (1 - P) / n) ** 0.5
    for mask in kept:
        assert abs((~mask).float().mean().item() - P) < 5 * sigma
    assert all(not torch.equal(a, b) for i, a in enumerate(kept) for b in kept[i + 1:])
    w = torch.linspace(0.5, 1.5, n)
    for out, mask, (g, gx) in zip(outs, kept, grads):
        torch.testing.assert_close(out[mask], (x * w)[mask] / (1 - P))
        # The backward reuses the forward's mask: zero where it dropped, scaled by 1/(1-p) elsewhere.
        assert torch.all(gx[~mask] == 0)
        torch.testing.assert_close(gx[mask], (g * w)[mask] / (1 - P))
    # Eager's dropout over the same number of draws: the same fraction within the noise.
    eager = torch.cat([nn.functional.dropout(x, P) for _ in range(steps)])
    both = 5 * (2 * P * (1 - P) / (n * steps)) ** 0.5
    assert abs((eager == 0).float().mean().item() - (~torch.cat(kept)).float().mean().item()) < both


class _AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def test_attention_with_dropout_in_replayed_graphs_matches_uncaptured_runs(monkeypatch) -> None:
    x = torch.randn(2, 8, 16)
    runs = {}
    for graphs in (False, True):
        if graphs:
            graphs_on_cpu(monkeypatch)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _AttentionNet()
        compiled = ember.compile(model, target="aten")
        torch.manual_seed(3)
        outs = []
        for _ in range(4):
            out = compiled(x)
            out.square().sum().backward()
            outs.append((out.detach().clone(), model.qkv.weight.grad.clone()))
            model.zero_grad()
        runs[graphs] = outs, compiled._ember_backend.log
    (got, log), (want, _) = runs[True], runs[False]
    assert all(g.cudagraph.startswith("captured") for g in log.graphs)
    for (o, gw), (o2, gw2) in zip(got, want):
        torch.testing.assert_close(o, o2)
        torch.testing.assert_close(gw, gw2)
    assert not torch.equal(got[-1][0], got[-2][0])  # new dropout masks each replay
    backward = next(g for g in log.graphs if g.kind == "backward")
    ops = {op for counts in backward.placement.values() for op in counts}
    assert not {"aten.native_dropout", "aten.bernoulli", "aten.rand_like", "aten.rand"} & ops, ops


# -- memory-efficient attention's seeds (passes/attention_seeds.py) --------------------------------


def _efficient_backward_graph(dropout_p: float) -> fx.GraphModule:
    graph = fx.Graph()
    names = ["grad", "q", "k", "v", "bias", "out", "lse", "seed", "offset"]
    g, q, k, v, bias, out, lse, seed, offset = (graph.placeholder(n) for n in names)
    node = graph.call_function(aten._scaled_dot_product_efficient_attention_backward.default,
                               (g, q, k, v, bias, out, lse, seed, offset, dropout_p, [True, True, True, False]))
    graph.output(node)
    for p in (seed, offset):
        p.meta["val"] = _cuda(dtype=torch.int64)
    return fx.GraphModule({}, graph)


def test_memory_efficient_attention_with_dropout_is_captured_forward_and_backward() -> None:
    inputs = [_cuda(2, 2, 8, 16) for _ in range(3)]
    forward = _attention_graph(aten._scaled_dot_product_efficient_attention.default, 0.1)
    assert cudagraph_blocker(forward, inputs, "forward", "triton") is None
    back_inputs = [_cuda(2, 2, 8, 16) for _ in range(4)] + [_cuda(2, 2, 8), _cuda(2, 2, 16), _cuda(dtype=torch.int64),
                                                            _cuda(dtype=torch.int64)]
    backward = _efficient_backward_graph(0.1)
    assert cudagraph_blocker(backward, back_inputs, "backward", "triton") is None


def test_efficient_attention_backward_takes_its_seeds_through_ember_attention_seeds() -> None:
    gm = _efficient_backward_graph(0.1)
    assert route_attention_seeds(gm) == 1
    assert route_attention_seeds(gm) == 0  # already routed
    node = next(n for n in gm.graph.nodes if n.target == aten._scaled_dot_product_efficient_attention_backward.default)
    seed, offset = node.args[7], node.args[8]
    assert seed.target is operator.getitem and offset.target is operator.getitem
    pair = seed.args[0]
    assert pair.target == torch.ops.ember.attention_seeds.default and offset.args[0] is pair
    assert [a.name for a in pair.args] == ["seed", "offset"] and seed.meta["val"].device.type == "cuda"
    gm.graph.lint()
    assert route_attention_seeds(_efficient_backward_graph(0.0)) == 0  # no dropout, nothing to read


def test_attention_seeds_give_host_copies_uncaptured_and_refuse_host_seeds_under_capture(monkeypatch) -> None:
    seed, offset = torch.tensor(1234), torch.tensor(56)
    s, o = torch.ops.ember.attention_seeds(seed, offset)
    assert (s.item(), o.item()) == (1234, 56) and s.device.type == "cpu"
    assert s.data_ptr() != seed.data_ptr() and o.data_ptr() != offset.data_ptr()
    monkeypatch.setattr(attention_seeds, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="host tensor under CUDA-graph capture"):
        torch.ops.ember.attention_seeds(seed, offset)


def test_the_pass_runs_on_cuda_backward_graphs_only() -> None:
    from ember.passes import PassContext, passes_for

    def names(kind: str, target: str) -> list[str]:
        return [p.__name__ for p in passes_for(PassContext(kind, target, set()))]
    assert "route_attention_seeds" in names("backward", "triton")
    assert "route_attention_seeds" not in names("forward", "triton")
    assert "route_attention_seeds" not in names("backward", "triton-interpret")


# -- transformers: the capture decision and training on the runner ---------------------------------


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1,
                                  attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).train()


class _MaskedLMLoss(nn.Module):
    def __init__(self, bert: nn.Module, with_mask: bool) -> None:
        super().__init__()
        self.bert, self.with_mask = bert, with_mask

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(ids) if self.with_mask else None
        return self.bert(input_ids=ids, attention_mask=mask, labels=ids).loss


@pytest.mark.parametrize("with_mask", [False, True])
def test_bert_with_dropout_is_not_kept_out_of_cuda_graphs(with_mask: bool) -> None:
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 12))
    graphs = _aot_graphs(_MaskedLMLoss(_tiny_bert(), with_mask), ids, grad=True)
    assert [kind for kind, _, _ in graphs] == ["forward", "backward"]  # no graph break
    forward = graphs[0][1]
    assert any(n.target == aten.native_dropout.default for n in forward.graph.nodes)
    for kind, gm, inputs in graphs:
        assert cudagraph_blocker(gm, inputs, kind, "triton") is None, kind


def test_bert_trains_on_replayed_graphs_and_matches_eager_in_eval_mode(monkeypatch) -> None:
    graphs_on_cpu(monkeypatch)
    torch._dynamo.reset()
    bert = _tiny_bert()
    reference = copy.deepcopy(bert).eval()
    compiled = ember.compile(bert, target="aten")
    ids = torch.randint(0, 64, (2, 12))
    opt = torch.optim.SGD(bert.parameters(), lr=0.0)  # lr 0: the eval check below sees the same weights
    losses, outputs = [], []
    for _ in range(4):
        out = compiled(input_ids=ids, labels=ids)
        # Every step's output kept (as a loop that logs them later does): the forward's outputs
        # are still held at its next call, so it runs uncaptured and the backward captures again
        # while its saved token-type ids (an expanded (2, 12) tensor of stride (0, 1)) lie outside
        # the pool: they are copied into a pooled buffer of one row. Without this the same path
        # was taken only when garbage collection left an output held (once in a full-suite run).
        outputs.append(out)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    statuses = _statuses(compiled)
    assert statuses and all(s.startswith("captured") for s in statuses), statuses
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) > 1  # dropout: new masks each step
    bert.eval()
    with torch.no_grad():
        got = [compiled(input_ids=ids).logits.clone() for _ in range(3)]
        want = reference(input_ids=ids).logits
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)


def test_random_ops_stay_aten_ops_even_if_the_user_functionalizes_them(monkeypatch) -> None:
    # Functionalized, dropout would become philox_rand with host-tensor seeds as graph inputs
    # (capture/aot_settings.py): Ember's backend keeps the ATen op, whose kernel is graph-safe.
    from torch._functorch import config as functorch_config

    from ember.instruments import instrument

    seen = []

    def spy(stage, record, args):
        if stage == "passes":  # the captured graph, before Ember's passes
            gm = args[0].gm
            seen.append((record.kind, functorch_config.functionalize_rng_ops, {str(n.target) for n in gm.graph.nodes}))

    monkeypatch.setattr(functorch_config, "functionalize_rng_ops", True)
    torch._dynamo.reset()
    model = _DropoutNet(64)
    x = torch.rand(64, requires_grad=True)
    with instrument(before=spy):
        out = ember.compile(model, target="aten")(x)
        out.backward(torch.ones(64))
    (kind, flag, ops), = [s for s in seen if s[0] == "forward"]
    assert flag is False and "aten.native_dropout.default" in ops and not any("philox" in op for op in ops)
    kept = out.detach() != 0
    torch.testing.assert_close(x.grad, torch.where(kept, model.w.detach() / (1 - P), torch.zeros(64)))
    assert functorch_config.functionalize_rng_ops is True  # the user's setting, restored
