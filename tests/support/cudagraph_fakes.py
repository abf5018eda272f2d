"""A CPU stand-in for CUDA graphs, shared by the CUDA-graph tests (test_cudagraph_runner.py, test_graph_pool.py).

``FakeGraphs`` has the memory semantics that matter: capture runs nothing, a replay reads the
captured input tensors and writes its results into the captured output tensors, so a replay
overwrites whatever a caller still holds from an earlier one unless the runner prevents it. With
it: runners on it, a forward/backward pair of programs sharing one pool, and a training step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ember import instruments
from ember.instruments import instrument
from ember.runtime.cudagraphs import runner as cudagraph
from ember.runtime.cudagraphs.runner import CudaBackend, CudaGraphRunner


class _FakeGraph:
    """Like a CUDA graph it holds addresses, not the caller's tensors (only the runner's buffers
    stay alive, held by the runner). Its outputs' memory is its own (a pool): it keeps aliases."""

    def __init__(self, run, inputs: list, outputs: object) -> None:
        self.run = run
        # An output on an input's memory (a forward returning its input as a saved activation) is
        # not kept: that memory is the caller's, and a real graph holds no reference to it.
        given = {x.untyped_storage()._cdata for x in inputs if isinstance(x, torch.Tensor)}
        self.outputs = [None if isinstance(x, torch.Tensor) and x.untyped_storage()._cdata in given
                        else x.detach() if isinstance(x, torch.Tensor) else x for x in _leaves(outputs)]
        self.inputs = [weakref.ref(x) if isinstance(x, torch.Tensor) else (lambda x=x: x) for x in inputs]
        self.ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in inputs]
        # A consumed input whose memory is still alive (another graph's pool) is read from it.
        self.memory = [(StorageWeakRef(x.untyped_storage()), x.storage_offset(), x.shape, x.stride(), x.dtype)
                       if isinstance(x, torch.Tensor) else None for x in inputs]

    def read(self, args: list) -> list:
        """The tensors at the captured addresses: the caller's where they are there, else buffers."""
        out = []
        for i, (ref, ptr) in enumerate(zip(self.inputs, self.ptrs)):
            if isinstance(args[i], torch.Tensor) and args[i].data_ptr() == ptr:
                out.append(args[i])
            else:
                x = ref()
                if x is None and ptr is not None and not self.memory[i][0].expired():
                    weak, offset, shape, stride, dtype = self.memory[i]
                    storage = torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
                    x = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
                assert x is not None or ptr is None, f"the graph reads freed memory (input {i})"
                out.append(x)
        return out


def _write(old: torch.Tensor, fresh: torch.Tensor) -> None:
    """A replay writing ``fresh`` into the captured output ``old``; an expanded output (stride 0,
    one element seen many times, BERT's token-type ids) is written once per element."""
    for d, stride in enumerate(old.stride()):
        if stride == 0 and old.shape[d] > 1:
            old, fresh = old.narrow(d, 0, 1), fresh.narrow(d, 0, 1)
    old.copy_(fresh)


def _leaves(out: object) -> list:
    """The output's leaves (a model's output object too: a Hugging Face ModelOutput is a pytree)."""
    return torch.utils._pytree.tree_leaves(out)


class FakeGraphs(CudaBackend):
    """CUDA-graph memory semantics on CPU. Capture runs the program once to learn its outputs,
    then restores every input's contents and the RNG (a real capture executes nothing). A replay
    runs the program on the captured input tensors (fixed addresses) and copies its results
    into the captured outputs (fixed addresses), without touching version counters."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captured = 0
        self.recovered = False
        self.pools: list[object] = []
        self.graphs: list[_FakeGraph] = []

    def new_pool(self, device: torch.device, shared: bool) -> object:
        return object()

    def on_device(self, t: torch.Tensor) -> bool:
        return True  # CPU tensors play device memory here

    def view(self, ptr: int, nbytes: int, device: torch.device, keeper: object) -> torch.UntypedStorage:
        # A storage on the same memory that does not own it, like the CUDA one.
        buf = (ctypes.c_char * nbytes).from_address(ptr)
        buf.keeper = keeper
        return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()

    def capture(self, run, inputs: list, device: torch.device, pool: object = None,
                prepare=None) -> tuple[object, object]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        self.pools.append(pool)
        given = list(inputs)
        if prepare is not None:
            prepare(inputs)
        # What ``prepare`` allocated lies in the pool, which the graph keeps: its memory stays
        # valid for the runner's copies after the program freed the tensors.
        made = [x for x, y in zip(inputs, given) if x is not y]
        for x, y in zip(inputs, given):
            if x is not y:  # this capture runs the program: it must read the call's values
                # An expanded buffer (a broadcast mask, BERT's token-type ids) has one memory
                # location per broadcast row: written once, as the runner's copy_in does.
                _write(x.data, y)
        saved = [x.clone() if isinstance(x, torch.Tensor) else None for x in inputs]
        rng = torch.get_rng_state()
        outputs = run(list(inputs))
        for x, s in zip(inputs, saved):
            if s is not None:
                _write(x.data, s)  # .data: restoring contents is not a mutation
        torch.set_rng_state(rng)
        graph = _FakeGraph(run, list(inputs), outputs)
        graph.pool_memory = made
        self.graphs.append(graph)
        return graph, outputs

    def replay(self, graph: object, args: list) -> None:
        assert isinstance(graph, _FakeGraph)
        inputs = graph.read(args)
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        versions = [x._version for x in tensors]
        new = graph.run(list(inputs))
        torch._C._autograd._unsafe_set_version_counter(tensors, versions)
        for old, fresh in zip(graph.outputs, _leaves(new)):
            if isinstance(old, torch.Tensor) and old.untyped_storage()._cdata != fresh.untyped_storage()._cdata:
                _write(old.data, fresh)

    def recover(self, device: torch.device) -> None:
        self.recovered = True

    def refs_to(self, storage_cdata: int) -> int:
        # Unlike a CUDA graph, the stand-in keeps its graphs' outputs (detached) to write into.
        return sum(1 for g in self.graphs for x in g.outputs
                   if isinstance(x, torch.Tensor) and x.untyped_storage()._cdata == storage_cdata)


def fake_runner(program: Callable[[list], object], backend: FakeGraphs | None = None) -> CudaGraphRunner:
    """A CudaGraphRunner of ``program`` on the CPU stand-in."""
    return CudaGraphRunner(program, "test", backend=backend or FakeGraphs())


def tanh_forward(args: list) -> tuple:
    """A forward program (it consumes its arguments, as Ember's do): [x, w] -> (loss, h = x @ w)."""
    x, w = args
    args.clear()
    h = x @ w
    return torch.tanh(h).sum(), h  # the loss and a saved activation


def tanh_backward(args: list) -> tuple:
    """tanh_forward's backward: [h, w, grad] -> (a gradient from the saved activation h,)."""
    h, w, grad = args
    args.clear()
    return (grad * (1 - torch.tanh(h) ** 2)).sum(0) + w.sum(),


def graphs_on_cpu_rule(gm: object, inputs: object, kind: str, target: str, enabled: bool = True) -> str | None:
    """The capture rule on CPU: every graph is captured unless CUDA graphs are turned off."""
    return None if enabled else "turned off"


@pytest.fixture
def cuda_graphs_on_cpu() -> Iterator[None]:
    """Ember's programs go through CudaGraphRunner on the CPU stand-in when cudagraphs=True."""
    with instrument(cudagraph_device=FakeGraphs(), capture_rule=graphs_on_cpu_rule):
        yield


def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same from the middle of a test, until it ends: the stand-in and the capture rule set as
    the active instruments (ember.instruments, the pipeline's seam for this)."""
    hooks = dataclasses.replace(instruments.active(), cudagraph_device=FakeGraphs(), capture_rule=graphs_on_cpu_rule)
    monkeypatch.setattr(instruments, "_ACTIVE", hooks)


# The runner decides from addresses: an input that stays put is read in place, one that moves
# is copied or makes its graph capture again. CPU malloc reuses addresses at random, so these
# tests fix them: every batch is new memory (kept alive, never reused) and the cotangent is one
# tensor. Fresh tensors made inside the tests made them flaky (about 1 run in 3).
_BATCHES: list[torch.Tensor] = []
COTANGENT = torch.ones(3, 4)


def new_batch() -> torch.Tensor:
    """A [3, 8] input in memory that no later tensor reuses (see above)."""
    x = torch.randn(3, 8)
    _BATCHES.append(x)
    return x


def runner_pair(backend: FakeGraphs | None = None) -> tuple[CudaGraphRunner, CudaGraphRunner, cudagraph.GraphPool]:
    """Runners of tanh_forward and tanh_backward sharing one GraphPool, as a model's training graphs."""
    backend = backend or FakeGraphs()
    pool = cudagraph.GraphPool()
    fw, bw = fake_runner(tanh_forward, backend), fake_runner(tanh_backward, backend)
    fw.pool = bw.pool = pool
    return fw, bw, pool


def train_step(fw: CudaGraphRunner, bw: CudaGraphRunner, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward of a runner_pair on a new batch, checked; returns (loss, gradient)."""
    x = new_batch()
    out = fw([x, w])
    loss, h = out[0].clone(), out[1]  # the loss read, as a training loop does before the backward
    del out
    (g,) = bw([h, w, COTANGENT])
    want_h = x @ w
    torch.testing.assert_close(loss, torch.tanh(want_h).sum())
    torch.testing.assert_close(g, (1 - torch.tanh(want_h) ** 2).sum(0) + w.sum())
    return loss, g
