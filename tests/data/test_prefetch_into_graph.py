"""prefetch(loader, into=model): batches copied into two slots that the CUDA graphs read in place.

On the CPU stand-in of CUDA graphs (support/cudagraph_fakes.py): the runner's replay reads the
captured addresses, so a graph that reads a slot in place sees exactly what the prefetcher
wrote there, and a write into a slot while a step uses it would change that step's result.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from cudagraph_fakes import FakeGraphs, cuda_graphs_on_cpu  # noqa: F401 - a fixture
from torch import nn

import ember
from ember.data import prefetch
from ember.runtime.cudagraphs.runner import CudaGraphRunner


def _mm_relu(args: list) -> tuple:
    x, w = args
    args.clear()
    return (torch.relu(x @ w),)


def _batches(n: int, rows: int = 3, last: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = [torch.randn(rows, 8, generator=g) for _ in range(n)]
    if last is not None:
        out.append(torch.randn(last, 8, generator=g))
    return out


def _slow_loader(items: list[torch.Tensor]):
    for x in items:
        time.sleep(0.001)
        yield x


class _Model:
    """What Dynamo does for the runners: one compiled program (runner) per input shape."""

    def __init__(self, backend: FakeGraphs) -> None:
        self.backend = backend
        self.w = torch.randn(8, 4)
        self.runners: dict[tuple, CudaGraphRunner] = {}

    def runner(self, rows: int) -> CudaGraphRunner:
        if rows not in self.runners:
            self.runners[rows] = CudaGraphRunner(_mm_relu, f"rows {rows}", backend=self.backend)
        return self.runners[rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = self.runner(x.shape[0])([x, self.w])
        return y


def _run(model: _Model, items: list[torch.Tensor], into: object) -> tuple[list[torch.Tensor], object]:
    """The loop: each step's result, the batch checked while the step still uses it."""
    fetcher = prefetch(_slow_loader(items), device="cpu", into=into)
    outs = []
    for i, x in enumerate(fetcher):
        y = model(x)
        outs.append(y.clone())
        del y
        time.sleep(0.003)  # the producer copies the next batch meanwhile: never into this one
        assert torch.equal(x, items[i]), f"batch {i} changed while the step used it"
    return outs, fetcher


def test_replays_read_the_slots_in_place_in_order_and_copy_nothing() -> None:
    items = _batches(10, last=2)
    plain = _Model(FakeGraphs())
    want = [torch.relu(x @ plain.w) for x in items]
    got, _ = _run(plain, items, into=None)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    assert plain.runner(3).g.dynamic_idx == [0]  # without into: the batch is copied into a buffer per replay

    model = _Model(FakeGraphs())
    model.w = plain.w
    runner = model.runner(3)
    outs, fetcher = _run(model, items, into=runner)
    assert all(torch.equal(a, b) for a, b in zip(outs, want)) and len(outs) == len(want)
    slots = fetcher.slots
    assert slots.written == 10 and slots.fresh == 1  # the partial last batch: a new tensor
    assert runner.calls == 0 and model.runner(2).calls == 1  # the partial batch ran as before
    for k in range(2):
        child = fetcher.router.children[(id(runner), k)]
        assert child.captures == 1 and child.replays == 4 and child.calls == 5
        assert child.g.dynamic_idx == [] and child.g.static_idx == [0, 1]  # read in place: no copy-in
        assert child.g.static_ptrs[0] == slots.sets[k][0].data_ptr()
        assert child.title.endswith(f"[prefetch slot {k}]")
    # Each slot was written once per batch it held, by the prefetcher only.
    assert [s[0]._version for s in slots.sets] == [5, 5]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train(model: nn.Module, batches, steps_out: list) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        steps_out.append(loss.detach().clone())


def _copied_in(backend: ember.EmberBackend) -> int:
    """Inputs the full-batch graphs (forward and backward) copy into a buffer before each replay."""
    return sum(len(graph.run.g.dynamic_idx) for record, graph in backend.programs
               if ("(frame 0/0)" in record.title or "(frame warm/0)" in record.title) and graph.run.g is not None)


@pytest.mark.usefixtures("cuda_graphs_on_cpu")
def test_training_through_ember_compile_equals_eager_and_reads_batches_in_place() -> None:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(34, 8, generator=g), torch.randint(0, 3, (34,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # 8 batches of 4, then one of 2

    eager = _Net()
    want: list[torch.Tensor] = []
    for _ in range(2):
        _train(eager, loader, want)

    model = _Net()
    compiled = ember.compile(model, target="aten")
    fetcher = prefetch(loader, device="cpu", into=compiled)
    got: list[torch.Tensor] = []
    _train(compiled, fetcher, got)
    _train(compiled, fetcher, got)  # a second pass: the same slots, no new capture
    assert len(got) == len(want) == 18
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {i}")
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    router, slots = fetcher.router, fetcher.slots
    # The forward and backward of the full-batch graph each have a child per slot, captured once
    # over both passes (the slots stay where they are: a moved one would be captured again).
    assert len(router.children) == 4 and all(c.replays >= 3 for c in router.children.values())
    for (rid, _), child in router.children.items():
        where = router.batch_args[rid]
        # A second capture only where an input other than the batch moved: the loss gradient the
        # backward reads is allocated outside the graphs each step; when it keeps its address for a
        # few steps it is read in place, and it moves when another thread's allocation (the
        # prefetcher's) takes that address first (4 of 58 runs, 2 cores with three busy processes beside).
        assert child.captures == 1 or (child.captures == 2 and child.demoted and not set(where) & child.demoted), (
            child.captures, child.last_reason, child.demoted, where)
        assert not set(where) & set(child.g.dynamic_idx), "a slot tensor copied into a buffer"
        assert set(where) <= set(child.g.static_idx)
    # The compiled model takes x; its backward reads x again (saved): both read the slot in place.
    assert [len(router.batch_args[rid]) for rid in {r for r, _ in router.children}] == [1, 1]
    copied = sum(len(c.g.dynamic_idx) for (_, k), c in router.children.items() if k == 0)
    # The first pass started before the model had graphs: its first batches were new tensors.
    assert slots.written + slots.fresh == 18 and slots.fresh >= 2 + 2  # two partial batches
    assert "prefetch slot" in " ".join(g.cudagraph for g in compiled._ember_backend.log.graphs)
    # Without into=, the same loop copies the batch into the forward's buffer before every replay.
    torch._dynamo.reset()
    plain = ember.compile(_Net(), target="aten")
    _train(plain, prefetch(loader, device="cpu"), [])
    assert _copied_in(plain._ember_backend) == copied + 2  # x into the forward's and the backward's buffer


def test_a_batch_kept_past_its_pass_is_left_to_its_holder() -> None:
    items = _batches(4)
    model = _Model(FakeGraphs())
    fetcher = prefetch(items, device="cpu", into=model.runner(3))
    for kept in fetcher:
        model(kept)
        break
    saved = kept.clone()
    got = [model(x).clone() for x in fetcher]  # a new pass while `kept` lies in a slot
    assert torch.equal(kept, saved) and fetcher.slots.renewed == 1
    assert all(torch.equal(a, torch.relu(x @ model.w)) for a, x in zip(got, items))
    got = [model(x).clone() for x in fetcher]  # a third pass: the new slots, read in place
    assert all(torch.equal(a, torch.relu(x @ model.w)) for a, x in zip(got, items))
    children = fetcher.router.children.values()
    assert len(children) == 2 and all(c.captures == 1 and c.calls == 4 and c.g.dynamic_idx == [] for c in children)


def test_a_batch_only_a_garbage_cycle_holds_keeps_its_slot() -> None:
    # A batch tensor that only an unreachable reference cycle still points to is not held: the
    # next pass collects it and writes the same slots, and the graphs reading them stay captured.
    items = _batches(4)
    model = _Model(FakeGraphs())
    fetcher = prefetch(items, device="cpu", into=model.runner(3))
    for x in fetcher:
        model(x)
    cycle: list = []
    cycle.append((cycle, x))  # noqa: B023 - the pass's last batch, kept by a cycle alone
    del cycle, x
    gc_was = gc.isenabled()
    gc.disable()  # the collector must not run on its own before the next pass starts
    try:
        got = [model(x).clone() for x in fetcher]
    finally:
        if gc_was:
            gc.enable()
    assert fetcher.slots.renewed == 0
    assert all(torch.equal(a, torch.relu(x @ model.w)) for a, x in zip(got, items))
    children = fetcher.router.children.values()
    assert len(children) == 2 and all(c.captures == 1 for c in children)


def test_into_rejects_what_it_cannot_route_and_warns_for_a_whole_step_program() -> None:
    with pytest.raises(TypeError, match="into"):
        prefetch([], device="cpu", into=object())
    model = nn.Linear(4, 2)
    step = ember.compile_step(lambda x: model(x).sum(), torch.optim.SGD(model.parameters(), lr=0.1),
                              compile=False)
    with pytest.warns(RuntimeWarning, match="whole-step program"):
        fetcher = prefetch([torch.randn(3, 4)], device="cpu", into=step)
    assert fetcher.router is None
    assert [step(x).shape for x in fetcher] == [torch.Size([])]
