"""How Ember's backend sets AOTAutograd up: its graph text (capture/aot_settings.py) is not rendered
unless a log shows it, and on GPU targets the backward compiles right after the forward
(capture/aot_settings.py), so its compile overlaps the forward's kernel compile. A model still trains
as in eager either way."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from core_helpers import assert_close
from torch._functorch._aot_autograd import graph_compile

import ember


def _train_step_rendering(monkeypatch: pytest.MonkeyPatch) -> int:
    """One compiled training step of a small model vs eager; how many graphs were rendered as text."""
    rendered = []
    real = torch.fx.GraphModule.print_readable

    def spy(self, *args, **kwargs):
        rendered.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    x = torch.randn(5, 8)
    ember.compile(model)(x).square().sum().backward()
    twin(x).square().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32)
    return len(rendered)


def test_graph_text_is_not_rendered_when_no_log_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    steps = (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs)
    assert _train_step_rendering(monkeypatch) == 0
    assert (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs) == steps  # restored


def test_graph_text_is_rendered_for_a_log_that_shows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    log = graph_compile.aot_graphs_log  # what TORCH_LOGS=aot_graphs turns on
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not the attribute: isEnabledFor caches its answer
    try:
        assert _train_step_rendering(monkeypatch) >= 2  # the forward and the backward
    finally:
        log.setLevel(level)


def test_on_gpu_targets_the_backward_compiles_with_the_forward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    compiled = ember.compile(model, target="triton-interpret")
    x = torch.randn(5, 8)
    out = compiled(x)
    log = compiled._ember_backend.log
    assert [g.kind for g in log.graphs] == ["forward", "backward"]  # before any backward ran
    out.square().sum().backward()
    twin(x).square().sum().backward()
    assert len(log.graphs) == 2
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32)
    assert not torch._functorch.config.force_non_lazy_backward_lowering  # only while Ember compiles


def test_cpu_targets_compile_the_backward_on_first_use() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    # (The frame cache, on by default, compiles both at once: AOTAutograd's entry it stores holds both.)
    # Dynamo's path: the warm start compiles the backward with the forward (it saves both)
    compiled = ember.compile(model, target="cpu", frame_cache=False, warm_start=False)
    loss = compiled(torch.randn(5, 8)).sum()
    assert [g.kind for g in compiled._ember_backend.log.graphs] == ["forward"]
    loss.backward()
    assert [g.kind for g in compiled._ember_backend.log.graphs] == ["forward", "backward"]


def test_garbage_collection_pauses_only_while_ember_compiles() -> None:
    import gc

    from ember.instruments import instrument

    seen = []

    def spy(stage: str, record: object, args: tuple) -> None:
        if stage == "passes":
            seen.append(gc.isenabled())

    assert gc.isenabled()
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    x = torch.randn(3, 8)
    with instrument(before=spy):
        assert_close(ember.compile(model, warm_start=False)(x), model(x), torch.float32)  # one lazy graph
    assert seen == [False] and gc.isenabled()


class _Cycle:
    """An object in a reference cycle: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_paused_block_collects_its_own_garbage_at_its_end_and_unfreezes() -> None:
    import gc
    import weakref

    from ember.bench.gc_time import timed_collections
    from ember.capture.aot_settings import gc_paused

    gc.collect()
    old = _Cycle()
    old_ref = weakref.ref(old)
    with timed_collections() as collected, gc_paused():
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # the old objects frozen meanwhile
        inside = [_Cycle() for _ in range(3000)]  # enough allocations to trigger collections
        refs = [weakref.ref(c) for c in inside]
        del inside, old
        assert all(r() is not None for r in refs)
    assert collected["count"] == [0, 0, 1]  # none inside; one at the end
    assert all(r() is None for r in refs)  # the block's own cyclic garbage is gone
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert old_ref() is not None  # frozen through the block: left for a later collection
    gc.collect()
    assert old_ref() is None


def test_paused_block_keeps_a_callers_own_arrangement() -> None:
    import gc

    from ember.capture.aot_settings import gc_paused

    gc.disable()  # a caller with the collector off: nothing collected, nothing frozen
    try:
        with gc_paused():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    keep = _Cycle()
    gc.freeze()  # a process that froze objects itself: they stay frozen
    try:
        frozen = gc.get_freeze_count()
        with pytest.raises(RuntimeError):
            with gc_paused():
                assert not gc.isenabled()
                raise RuntimeError("a failed compile")
        # Still frozen: `keep` is not among the collected generations' objects. (The count itself
        # may drop a little: frozen objects other threads release are freed by reference counting.)
        assert gc.isenabled() and gc.get_freeze_count() > frozen // 2
        assert not any(obj is keep for obj in gc.get_objects())
    finally:
        gc.unfreeze()
    del keep


def test_paused_block_restores_the_collector_when_it_raises() -> None:
    import gc

    from ember.capture.aot_settings import gc_paused

    with pytest.raises(ValueError):
        with gc_paused():
            raise ValueError("a failed compile")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_warm_start_compile_pauses_the_collector_through_dynamos_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    # The warm start's compile (Dynamo's trace, AOTAutograd, Ember, the guards and the save) is one
    # paused block with the older objects frozen; the collector is back on after it.
    import gc

    from ember.capture import warm_artifact as wa

    seen = []
    real = wa.API.aot_compile_fullgraph

    def spy(*args: object, **kwargs: object) -> object:
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(wa.API, "aot_compile_fullgraph", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh())
    x = torch.randn(3, 8)
    compiled = ember.compile(model, warm_start=True)
    with torch.no_grad():
        assert_close(compiled(x), model(x), torch.float32)
    assert any(line.startswith("saved") for line in compiled._ember_backend.log.warm_start)
    assert seen == [(False, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_objects_frozen_before_ember_was_imported_do_not_turn_the_freeze_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPython 3.12 starts with 375 static tuples frozen: the block freezes and collects there too.
    import gc

    from ember.capture import aot_settings

    gc.freeze()  # stands for the interpreter's own frozen objects
    try:
        monkeypatch.setattr(aot_settings, "_FROZEN_AT_IMPORT", gc.get_freeze_count())
        from ember.bench.gc_time import timed_collections

        with timed_collections() as collected, aot_settings.gc_paused():
            assert not gc.isenabled()
        assert collected["count"] == [0, 0, 1]  # the block's one collection
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
