"""CUDA graphs, on CPU: the replay runner (the capture rule: test_cudagraph_rules.py).

CI has no GPU. ``CudaGraphRunner`` is checked with ``FakeGraphs`` (cudagraph_fakes.py), a CPU
stand-in with the memory semantics of CUDA graphs that matter here. Capture itself runs in
benchmarks/scripts/gpu_cudagraph_check.py on the device.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from core_helpers import bn_dropout_net
from cudagraph_fakes import (
    COTANGENT,
    FakeGraphs,
    fake_runner,
    new_batch,
    runner_pair,
    tanh_backward,
    tanh_forward,
    train_step,
)
from torch import nn

import ember
from ember.instruments import instrument
from ember.runtime.cudagraphs import memory as graph_memory
from ember.runtime.cudagraphs import runner as cudagraph
from ember.runtime.cudagraphs.runner import MAX_CAPTURES, PROMOTE_AFTER, CudaGraphRunner

aten = torch.ops.aten


# -- the runner, on the CPU stand-in for CUDA graphs --------------------------------------------


def _mm_relu(args: list) -> tuple:
    x, w = args
    args.clear()
    return (torch.relu(x @ w),)


def test_replays_match_uncaptured_calls() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_mm_relu)
    for _ in range(6):
        x = torch.randn(3, 8)
        (got,) = runner([x, w])  # still held during the next call: copied after one uncaptured call
        torch.testing.assert_close(got, torch.relu(x @ w))
    assert runner.captures == 1 and runner.replays == 4 and runner.uncaptured == 1
    assert runner.status.startswith("captured") and "1 inputs read in place, 1 copied in" in runner.status
    assert "outputs: 0 handed out from the graph's memory, 1 copied" in runner.status


def test_a_read_only_input_is_copied_into_a_buffer_in_the_graphs_pool() -> None:
    # Its buffer is allocated inside the capture (from the pool) and the runner keeps only a
    # view of that memory: the program frees the buffer after its last read, as it would free
    # a consumed input. Each replay copies the new batch there first.
    backend = FakeGraphs()
    w = torch.randn(8, 4)
    runner = CudaGraphRunner(_mm_relu, "test", backend=backend, read_only=frozenset({0, 1}))
    for _ in range(6):
        x = torch.randn(3, 8)
        (got,) = runner([x, w])
        torch.testing.assert_close(got, torch.relu(x @ w))
        del got
    g = runner.g
    assert runner.captures == 1 and runner.replays == 5 and g.dynamic_idx == [0]
    (pooled,) = backend_graph_memory(g)  # allocated by the capture, in the pool
    assert g.buffers[0].data_ptr() == pooled.data_ptr()
    assert g.buffers[0].untyped_storage()._cdata != pooled.untyped_storage()._cdata  # a view, not the owner


def backend_graph_memory(g: object) -> list:
    return g.graph.pool_memory  # type: ignore[attr-defined]


def test_a_pooled_buffer_where_an_input_lies_is_moved_out_of_the_pool() -> None:
    # In a shared pool another graph may hand out outputs where this graph's pooled buffer lay
    # during its capture (two forwards, then one backward through both): copying the next input
    # in would overwrite an input before it is read. The runner captures again with that buffer
    # outside the pool. The stand-in never reuses memory, so the clash is staged: an output span
    # of the pool is registered at the buffer and the input is a tensor on that memory.
    backend = FakeGraphs()
    bw = CudaGraphRunner(tanh_backward, "backward", backend=backend, read_only=frozenset({0, 1, 2}))
    bw.pool = cudagraph.GraphPool()
    w = torch.randn(8, 4)

    def want(h: torch.Tensor) -> torch.Tensor:
        return (COTANGENT * (1 - torch.tanh(h) ** 2)).sum(0) + w.sum()

    for _ in range(2):  # uncaptured, then captured with h's buffer in the pool
        h = torch.randn(3, 4)
        torch.testing.assert_close(bw([h, w, COTANGENT])[0], want(h))
    g = bw.g
    assert g.dynamic_idx == [0] and list(g.pooled) == [0]
    ptr, nbytes = g.pooled[0]
    g.state.spans[ptr] = nbytes
    h = torch.empty(0).set_(backend.view(ptr, nbytes, torch.device("cpu"), g.state), 0, (3, 4), (4, 1))
    h.copy_(torch.randn(3, 4))
    expected = want(h.clone())
    torch.testing.assert_close(bw([h, w, COTANGENT])[0], expected)
    assert bw.unpooled == {0} and "now copied outside it" in bw.last_reason, bw.last_reason
    assert bw.g is not g and bw.g.pooled == {} and bw.captures == 2
    h = torch.randn(3, 4)
    torch.testing.assert_close(bw([h, w, COTANGENT])[0], want(h))


def test_a_written_input_keeps_a_buffer_of_its_own_even_when_marked_read_only_elsewhere() -> None:
    # Only what rules.read_only_inputs names goes into the pool: the written statistic
    # keeps a held buffer, copied back after each replay.
    runner = CudaGraphRunner(lambda args: _bn_stats([args[1], args[0]]), "test", backend=FakeGraphs(),
                             read_only=frozenset({1}))
    _moving_statistic_calls(runner)
    assert runner.replays == 4 and len(backend_graph_memory(runner.g)) == 1


def test_outputs_held_by_the_caller_are_never_overwritten() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_mm_relu)
    kept = []
    for _ in range(3 * MAX_CAPTURES):
        x = torch.randn(3, 8)
        kept.append((runner([x, w])[0], torch.relu(x @ w)))
    for got, want in kept:
        torch.testing.assert_close(got, want)
    assert runner.replays > 0 and runner.uncaptured >= 1
    assert "copied" in runner.status and "still held" in runner.status


def test_held_groups_reads_the_same_counts_as_each_groups_check() -> None:
    # The runner's one-pass check (cached handles, mapped counts) against is_held group by group:
    # outputs handed out from the pool and dropped, then one held, then dropped again.
    from ember.runtime.cudagraphs.memory import held_groups, is_held

    def both(g: object) -> tuple[list[int], list[int]]:
        return held_groups(g), [k for k, grp in enumerate(g.groups) if is_held(grp)]

    w = torch.randn(8, 4)
    fw = fake_runner(tanh_forward)
    for _ in range(4):
        fw([new_batch(), w])  # dropped at once: handed out from the pool every time
    g = fw.g
    assert fw.replays >= 2 and g.groups[0].view is not None and g.counts is not None
    assert both(g) == ([], [])
    out = fw([new_batch(), w])
    assert fw.g is g and both(g)[0] == both(g)[1] != []  # the held outputs show
    del out
    assert both(g) == ([], [])


def test_outputs_dropped_before_the_next_call_come_from_the_graph_memory() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_mm_relu)
    for _ in range(5):
        runner([torch.randn(3, 8), w])  # result dropped at once
    assert runner.captures == 1 and runner.uncaptured == 0
    assert "outputs: 1 handed out from the graph's memory, 0 copied" in runner.status


def test_saved_activations_survive_a_second_forward_before_the_backward() -> None:
    w = torch.randn(8, 4)
    fw, bw = fake_runner(tanh_forward), fake_runner(tanh_backward)
    for _ in range(6):
        xs = [torch.randn(3, 8) for _ in range(2)]
        outs = [fw([x, w]) for x in xs]  # two forwards, then both backwards
        grads = [bw([h, w, torch.ones(3, 4)])[0] for _, h in outs]
        for x, (loss, h), g in zip(xs, outs, grads):
            want_h = x @ w
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(loss, torch.tanh(want_h).sum())
            torch.testing.assert_close(g, (1 - torch.tanh(want_h) ** 2).sum(0) + w.sum())
    assert fw.replays > 0 and bw.replays > 0


def test_parameters_are_read_in_place_and_a_moved_one_is_copied_from_then_on() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_mm_relu)
    x = torch.randn(3, 8)
    runner([x, w])
    runner([x, w])
    w.mul_(2)  # optimizer step: same address, new values
    torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
    w = torch.randn(8, 4)  # a new parameter tensor
    torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
    assert runner.captures == 2 and "moved" in runner.status and 1 in runner.demoted


def _bn_stats(args: list) -> tuple:
    x, mean = args
    args.clear()
    aten.copy_.default(mean, mean * 0.9 + x.mean(0) * 0.1)
    return (x - mean,)


def test_a_mutated_static_input_is_written_once_per_call() -> None:
    mean = torch.zeros(4)
    want = torch.zeros(4)
    runner = fake_runner(_bn_stats)
    x = torch.randn(5, 4)
    for _ in range(5):
        before = mean._version
        (got,) = runner([x, mean])
        want = want * 0.9 + x.mean(0) * 0.1
        torch.testing.assert_close(mean, want)
        torch.testing.assert_close(got, x - want)
        assert mean._version > before  # as eager: autograd's in-place checks still see it
        del got
    assert runner.replays == 4 and "1 input(s) mutated in place" in runner.status


def _moving_statistic_calls(runner: CudaGraphRunner) -> None:
    """Five calls of ``_bn_stats`` as (mean, x) with both moving: the mean is written in place."""
    for _ in range(5):
        x, m = torch.randn(5, 4), torch.randn(4)
        want_m = m * 0.9 + x.mean(0) * 0.1
        (got,) = runner([m, x])
        torch.testing.assert_close(m, want_m)
        torch.testing.assert_close(got, x - want_m)
        del got


def test_a_mutated_copied_input_is_written_back() -> None:
    mean = torch.zeros(4)
    runner = fake_runner(lambda args: _bn_stats([args[1], args[0]]))  # (mean, x): the statistic moves
    _moving_statistic_calls(runner)
    assert runner.replays == 4 and "1 mutated copied input(s) written back" in runner.status
    del mean


def _views(args: list) -> tuple:
    x, w = args
    args.clear()
    y = x @ w
    return x, x.t(), y, y[1:], None


def test_outputs_that_alias_inputs_or_each_other_alias_as_uncaptured() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_views)
    kept = []
    for _ in range(4):
        x = torch.randn(3, 8)
        out = runner([x, w])
        assert out[0] is x and out[1].data_ptr() == x.data_ptr() and out[4] is None
        assert out[3].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
        kept.append((x, out))
    for x, out in kept:  # held across calls: copies, with the alias between them kept
        torch.testing.assert_close(out[2], x @ w)
        out[2][1, 0] = 42.0
        assert out[3][0, 0] == 42.0


def _dropout(args: list) -> tuple:
    (x,) = args
    args.clear()
    return aten.native_dropout.default(x, 0.5, True)


def test_random_ops_draw_new_numbers_each_replay_as_uncaptured_calls_do() -> None:
    x = torch.randn(64)
    torch.manual_seed(0)
    want = [_dropout([x])[1] for _ in range(5)]
    torch.manual_seed(0)
    runner = fake_runner(_dropout)
    got = [runner([x])[1] for _ in range(5)]  # all kept: one uncaptured call, then copies
    assert runner.replays == 3 and runner.uncaptured == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not torch.equal(got[-1], got[-2])


def test_an_input_that_keeps_its_address_is_read_in_place_after_a_while() -> None:
    w = torch.randn(8, 4)
    runner = fake_runner(_mm_relu)
    runner([torch.randn(3, 8), w])
    x = torch.randn(3, 8)  # from the second call on the same tensor
    for _ in range(PROMOTE_AFTER + 3):
        x.normal_()
        torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
    assert runner.captures == 2 and "2 inputs read in place, 0 copied in" in runner.status
    assert "kept its address" in runner.status


def test_after_the_last_capture_everything_is_copied() -> None:
    runner = fake_runner(_mm_relu)
    for _ in range(MAX_CAPTURES + 3):
        x, w = torch.randn(3, 8), torch.randn(8, 4)
        keep = torch.randn(8, 4)  # noqa: F841 - keeps the freed w's memory from being reused
        torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
        del keep
    assert runner.captures <= MAX_CAPTURES


def test_final_capture_is_stable() -> None:
    runner = fake_runner(_mm_relu)
    runner.captures = MAX_CAPTURES - 1  # the next capture is the last
    w = torch.randn(8, 4)
    for _ in range(5):
        x = torch.randn(3, 8)
        torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
    assert runner.captures == MAX_CAPTURES and "final: everything copied" in runner.status
    assert "0 inputs read in place, 2 copied in" in runner.status and "0 handed out" in runner.status


def test_a_failed_capture_runs_uncaptured_and_says_why() -> None:
    w = torch.randn(8, 4)
    backend = FakeGraphs(fail=True)
    runner = fake_runner(_mm_relu, backend)
    for _ in range(3):
        x = torch.randn(3, 8)
        torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w))
    assert backend.recovered  # the CUDA backend resets the generator's capture state there
    assert runner.status.startswith("not captured: capture failed") and "stream is capturing" in runner.status


# -- Ember training through the runner ----------------------------------------------------------


def _train(model: nn.Module, fn, batches: list, accumulate: int, together: bool = False) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for chunk in batches:
        if together:  # two forwards, then one backward through both
            loss = sum(nn.functional.cross_entropy(fn(x), y) for x, y in chunk)
            loss.backward()
            losses.append(loss.item())
        else:
            for x, y in chunk:
                loss = nn.functional.cross_entropy(fn(x), y) / accumulate
                loss.backward()
                losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize(("accumulate", "together"), [(1, False), (2, False), (2, True)])
def test_ember_training_with_graphs_matches_training_without(monkeypatch, accumulate: int, together: bool) -> None:
    torch.manual_seed(0)
    base = bn_dropout_net()
    batches = [[(torch.randn(2, 3, 8, 8), torch.randint(0, 2, (2,))) for _ in range(accumulate)] for _ in range(4)]
    runs = {}
    for graphs in (False, True):
        # with graphs, every graph goes through the runner, on the CPU stand-in
        hooks = (instrument(cudagraph_device=FakeGraphs(), capture_rule=lambda *a, **k: None) if graphs
                 else contextlib.nullcontext())
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled = ember.compile(model, target="aten")
        torch.manual_seed(1)
        with hooks:
            losses = _train(model, compiled, batches, accumulate, together)
        statuses = [g.cudagraph for g in compiled._ember_backend.log.graphs]
        runs[graphs] = (losses, [p.detach().clone() for p in model.state_dict().values()], statuses)
    (l0, p0, _), (l1, p1, statuses) = runs[False], runs[True]
    assert statuses and all(s.startswith("captured") for s in statuses), statuses
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0))
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b)



# -- one memory pool for a model's training graphs --------------------------------------------


def test_forward_and_backward_share_one_pool_and_the_backward_reads_activations_in_place() -> None:
    backend = FakeGraphs()
    fw, bw, pool = runner_pair(backend)
    w = torch.randn(8, 4)
    for _ in range(5):
        train_step(fw, bw, w)  # nothing kept across steps
    assert fw.captures == bw.captures == 1 and fw.uncaptured == bw.uncaptured == 0
    assert backend.pools[0] is backend.pools[1] is pool.state.handle
    assert 0 in bw.g.sources and 0 in bw.g.static_idx  # the activation h: read where fw wrote it
    assert "memory pool shared" in bw.status and "1 other graph" in bw.status


def test_ember_training_graphs_get_the_models_pool(cuda_graphs_on_cpu, monkeypatch) -> None:
    torch._dynamo.reset()
    model = bn_dropout_net()
    compiled = ember.compile(model, target="aten")
    for _ in range(3):
        nn.functional.cross_entropy(compiled(torch.randn(2, 3, 8, 8)), torch.randint(0, 2, (2,))).backward()
    statuses = [g.cudagraph for g in compiled._ember_backend.log.graphs]
    assert len(statuses) == 2 and all("memory pool shared" in s for s in statuses), statuses
    assert compiled._ember_backend.graph_pool.state is not None


def test_an_inference_graph_gets_a_pool_of_its_own(cuda_graphs_on_cpu, monkeypatch) -> None:
    # Sized on its first call and released like the training pool (runtime/cudagraphs/pool.py), but
    # apart from it: inference and training graphs of one model never share memory.
    torch._dynamo.reset()
    model = bn_dropout_net().eval()
    compiled = ember.compile(model, target="aten")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        outs = [compiled(x).clone() for _ in range(3)]
        want = model(x)
    assert all(torch.allclose(o, want, atol=1e-5) for o in outs)
    (graph,) = compiled._ember_backend.log.graphs
    assert graph.kind == "inference" and "a memory pool of its own" in graph.cudagraph, graph.cudagraph
    assert "captured" in graph.cudagraph and compiled._ember_backend.graph_pool.state is None


class _ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # the caller sees it, as in eager
        return self.lin(x) + y


@pytest.mark.parametrize("in_graph", [False, True])
def test_inference_inputs_moving_between_calls_are_copied_into_the_graphs_pool(cuda_graphs_on_cpu, monkeypatch,
                                                                               in_graph: bool) -> None:
    # Without input_mutations_in_graph both are only read by the program (AOTAutograd applies the
    # module's write to x after it, from an output), so both buffers lie in the graph's pool and die
    # after their last read: each replay copies the new batch there and the caller still sees
    # eager's values. With it, the program writes x (copy_ into it): x's buffer must outlive the
    # replay, which copies it back to the caller's tensor; only y's lies in the pool.
    monkeypatch.setenv("EMBER_INPUT_MUTATIONS_IN_GRAPH", "1" if in_graph else "0")
    backend = FakeGraphs()
    made: list[int] = []
    capture = backend.capture

    def counting(*args, **kwargs):
        graph, outputs = capture(*args, **kwargs)
        made.append(len(graph.pool_memory))
        return graph, outputs

    backend.capture = counting
    torch._dynamo.reset()
    model = _ScalesItsInput().eval()
    compiled = ember.compile(model, target="aten")
    with torch.no_grad(), instrument(cudagraph_device=backend):
        for _ in range(5):
            x, y = torch.randn(3, 8), torch.randn(3, 4)
            x_eager = x.clone()
            want = model(x_eager, y)
            got = compiled(x, y)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(x, x_eager)
            del got
    (graph,) = compiled._ember_backend.log.graphs
    assert "captured" in graph.cudagraph and "2 copied in" in graph.cudagraph, graph.cudagraph
    assert made == ([1] if in_graph else [2]), made  # one capture; the read-only buffers allocated by it, in the pool
    assert ("1 mutated copied input(s) written back" in graph.cudagraph) == in_graph, graph.cudagraph


def test_a_held_output_of_another_graph_where_a_replay_writes_makes_that_call_uncaptured() -> None:
    fw, bw, _ = runner_pair()
    w = torch.randn(8, 4)
    train_step(fw, bw, w)
    train_step(fw, bw, w)  # both captured
    fw.g.protected = []  # as on the GPU when the backward's gradients reuse forward memory
    kept = train_step(fw, bw, w)[1]  # a replay's gradient, still held during the next forward
    want = kept.clone()
    before = fw.uncaptured
    train_step(fw, bw, w)
    assert fw.uncaptured == before + 1 and "another graph" in fw.last_reason
    assert all(grp.copy for grp in bw.g.groups)  # handed out as copies from now on
    torch.testing.assert_close(kept, want)
    del kept
    train_step(fw, bw, w)
    kept = train_step(fw, bw, w)[1]  # now a copy: holds no pool memory
    train_step(fw, bw, w)  # replayed again
    assert fw.uncaptured == before + 1 and fw.captures == 1
    del kept


def test_a_capture_never_lands_on_memory_of_a_held_replay_output() -> None:
    fw, bw, pool = runner_pair()
    w = torch.randn(8, 4)
    fw([new_batch(), w])
    fw([new_batch(), w])  # captured
    kept, h = fw([new_batch(), w])  # a replay's loss, held by the caller
    state = pool.state
    assert graph_memory.unclean(state, {})
    assert bw([h, w, COTANGENT]) is not None  # first call: uncaptured anyway
    loss, h = fw([new_batch(), w])
    bw([h, w, COTANGENT])  # the held loss is in the pool: renewed, this call uncaptured
    assert pool.state is None and pool.renewals == 1 and bw.g is None and "renewed" in bw.status
    del kept, loss, h
    train_step(fw, bw, w)  # the forward captures into the new pool, then the backward
    assert fw.g.state is bw.g.state is pool.state and "renewed" in fw.last_reason
    train_step(fw, bw, w)


def test_a_backward_whose_inputs_are_replay_outputs_gets_a_private_pool() -> None:
    # A forward captured in a call whose backward never ran, replayed before the first backward
    # capture: only this call's arguments hold the replay's outputs.
    fw, bw, pool = runner_pair()
    w = torch.randn(8, 4)
    h = fw([new_batch(), w])[1]
    bw([h, w, COTANGENT])
    del h
    fw([new_batch(), w])  # captured, outputs dropped (the probe)
    train_step(fw, bw, w)  # fw replays; bw captured into a pool of its own
    assert not bw.g.state.shared and "a memory pool of its own" in bw.status and pool.renewals == 0
    for _ in range(3):
        train_step(fw, bw, w)
    assert bw.replays >= 3


class _HostSeeds(FakeGraphs):
    """int64 tensors play host tensors (attention's philox seed from an uncaptured forward)."""

    def on_device(self, t: torch.Tensor) -> bool:
        return t.dtype != torch.int64


def _seeded(args: list) -> tuple:
    x, seed = args
    args.clear()
    return (x * float(seed.item()),)


def test_a_host_input_that_changes_between_calls_is_never_captured() -> None:
    runner = fake_runner(_seeded, _HostSeeds())
    for i in range(4):
        x = torch.randn(4)
        torch.testing.assert_close(runner([x, torch.tensor(i + 1)])[0], x * (i + 1))
    assert runner.captures == 0 and "capture deferred: input 1 is a host tensor" in runner.status
