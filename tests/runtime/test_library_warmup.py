"""Library set-up replayed off the first run (runtime/library_warmup.py): a plan's library calls
as text, replayed on scratch tensors without drawing random numbers, in a helper thread beside a
warm start's load and beside a compile, joined before the first run."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember import config
from ember.report.records import GraphRecord
from ember.runtime import library_warmup as lw

aten = torch.ops.aten


def _extern_steps(fn, *inputs) -> list:
    """Each call_function node of ``fn``'s ATen graph as an ``extern`` step (as the plan makes them)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return [types.SimpleNamespace(kind="extern", nodes=[n]) for n in gm.graph.nodes if n.op == "call_function"]


def _graph(x, w, a, b):
    y = aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    z = aten.mm.default(a, b)
    return y, z, aten.mm.default(a, b)  # the same call twice: recorded once


def _inputs():
    return torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(5, 6), torch.randn(6, 7)


def test_calls_are_recorded_once_each_for_the_recorded_device_types_only():
    steps = _extern_steps(_graph, *_inputs())
    assert lw.library_calls(steps) == []  # CPU calls: not recorded by default (RECORDED_DEVICE_TYPES)
    calls = lw.library_calls(steps, ("cpu",))
    ops = [json.loads(c)["op"] for c in calls]
    assert ops == [["aten", "convolution", "default"], ["aten", "mm", "default"]]
    conv = json.loads(calls[0])
    assert conv["args"][0] == {"tensor": [[2, 3, 8, 8], [192, 64, 8, 1], 0, "float32", "cpu"]}
    assert conv["args"][3:] == [[1, 1], [1, 1], [1, 1], False, [0, 0], 1]


def test_replay_runs_each_call_and_counts_failures():
    calls = lw.library_calls(_extern_steps(_graph, *_inputs()), ("cpu",))
    done = lw.replay(calls)
    assert (done.calls, done.failed) == (2, 0)
    bad = json.loads(calls[1])
    bad["args"][1]["tensor"][0] = [9, 7]  # (5, 6) @ (9, 7): a shape error, skipped and counted
    done = lw.replay([json.dumps(bad), calls[0]])
    assert (done.calls, done.failed) == (2, 1)
    assert "mm" in done.first_error or "shape" in done.first_error.lower()
    assert "1 failed" in done.describe()


def test_replay_sets_dropout_to_zero():
    """A replayed call must not draw random numbers: its dropout probability becomes 0 (the CPU
    flash-attention kernel refuses any other, so the call fails unless it was zeroed)."""
    q = torch.randn(1, 2, 8, 4)
    steps = _extern_steps(lambda q: aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.25), q)
    calls = lw.library_calls(steps[:1], ("cpu",))
    assert json.loads(calls[0])["args"][3] == 0.25
    with pytest.raises(RuntimeError, match="dropout"):
        aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.25)
    state = torch.get_rng_state()
    done = lw.replay(calls)
    assert (done.calls, done.failed) == (1, 0), done.first_error
    assert torch.equal(torch.get_rng_state(), state)


def test_replay_makes_strided_scratch_tensors():
    """A transposed input with a storage offset is made with its own strides and offset."""
    base = torch.randn(3, 40)
    a = base[:, 2:].t()  # (38, 3), strides (1, 40), offset 2
    steps = _extern_steps(lambda a, b: aten.mm.default(a, b), a, torch.randn(3, 5))
    (call,) = lw.library_calls(steps, ("cpu",))
    assert json.loads(call)["args"][0]["tensor"][:3] == [[38, 3], [1, 40], 2]
    made = lw._decode(json.loads(call)["args"][0])
    assert (made.shape, made.stride(), made.storage_offset()) == ((38, 3), (1, 40), 2)
    assert not made.any()  # zeros: no NaN, any index in range


def test_background_replay_restores_the_switch_interval():
    calls = lw.library_calls(_extern_steps(_graph, *_inputs()), ("cpu",))
    before = sys.getswitchinterval()
    helper = lw.BackgroundReplay(calls)
    assert sys.getswitchinterval() <= lw.SWITCH_INTERVAL_S
    done = helper.join()
    assert sys.getswitchinterval() == before
    assert done is not None and (done.calls, done.failed) == (2, 0)
    assert helper.join() is done  # a second join is harmless


def test_collecting_gathers_each_call_once():
    lw.collect(["outside"])  # no block: nowhere to go, no error
    with lw.collecting() as calls:
        lw.collect(["a", "b"])
        lw.collect(["b", "c"])
    assert calls == ["a", "b", "c"]


def test_replays_queue_in_one_helper_and_join_all_waits_for_every_one():
    calls = lw.library_calls(_extern_steps(_graph, *_inputs()), ("cpu",))
    before = sys.getswitchinterval()
    jobs = [lw.BackgroundReplay(calls) for _ in range(3)]
    lw.join_all()
    assert all(job.finished() for job in jobs)
    assert [(job.result.calls, job.result.failed) for job in jobs] == [(2, 0)] * 3
    assert sys.getswitchinterval() == before  # restored once the last one finished
    lw.join_all()  # nothing queued: returns at once


def test_no_replay_starts_without_calls_or_with_the_setting_off():
    calls = lw.library_calls(_extern_steps(_graph, *_inputs()), ("cpu",))
    assert lw.start_replay([]) is None
    with config.patch(library_warmup=False):
        assert lw.start_replay(calls) is None
    job = lw.start_replay(calls)
    assert job is not None and job.join().calls == 2


class _Pending:
    def __init__(self) -> None:
        self.waited = False

    def wait(self):
        self.waited = True
        return types.SimpleNamespace(describe=lambda: "3 kernels", errors=[])


def test_first_run_waits_for_the_kernels_then_every_replay():
    from ember.pipeline import _await_kernels

    calls = lw.library_calls(_extern_steps(_graph, *_inputs()), ("cpu",))
    record = GraphRecord("forward", "forward", "0/0", "triton")
    pending, own, other = _Pending(), lw.BackgroundReplay(calls), lw.BackgroundReplay(calls)
    _await_kernels(record, pending, own)  # type: ignore[arg-type]
    assert pending.waited and own.finished() and other.finished()
    assert record.compile_note.startswith("3 kernels; beside the compile: 2 library call(s) set up in "), \
        record.compile_note
    record = GraphRecord("forward", "forward", "0/0", "triton")
    _await_kernels(record, None, lw.BackgroundReplay(calls))  # no kernels to wait for
    assert record.compile_note.startswith("beside the compile: 2 library call(s)"), record.compile_note


@pytest.mark.parametrize("cached", ["no", "frame cache", "program cache"])
def test_a_compile_replays_its_calls_beside_it_and_before_the_first_run(tmp_path, monkeypatch, cached):
    """A compiled graph's library calls start replaying once its plan is known, a frame-cache
    graph's once it is linked; its first run waits for them (CPU calls recorded here, as CUDA's are by default)."""
    import ember

    monkeypatch.setattr(lw, "RECORDED_DEVICE_TYPES", ("cpu", "cuda"))
    started = []
    real = lw.BackgroundReplay

    class Recorded(real):
        def __init__(self, calls):
            started.append(self)
            super().__init__(calls)
    monkeypatch.setattr(lw, "BackgroundReplay", Recorded)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), config.patch(frame_cache=cached != "program cache"):
        for _ in range(1 if cached == "no" else 2):
            torch._dynamo.reset()
            started.clear()
            compiled = ember.compile(model, cache_dir=str(tmp_path), warm_start=False)
            torch.testing.assert_close(compiled(x), model(x))
    assert started and all(job.finished() for job in started)
    (graph,) = compiled._ember_backend.log.graphs
    assert graph.cache == {"no": "stored", "frame cache": "frame cache", "program cache": "hit"}[cached]
    assert "beside the compile: 2 library call(s) set up in " in graph.compile_note, graph.compile_note


@pytest.mark.parametrize("enabled", [True, False])
def test_warm_start_replays_the_saved_calls_beside_its_load(tmp_path, monkeypatch, enabled):
    """The first process saves its programs' library calls with the frame; the next load replays
    them in a helper thread (CPU calls recorded here, as CUDA's are by default) and the result is
    eager's."""
    import ember

    monkeypatch.setattr(lw, "RECORDED_DEVICE_TYPES", ("cpu", "cuda"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8)
    logs = []
    with torch.no_grad(), config.patch(library_warmup=enabled):
        for _ in range(2):
            compiled = ember.compile(model, warm_start=True, cache_dir=str(tmp_path))
            torch.testing.assert_close(compiled(x), model(x))
            logs.append(compiled._ember_backend.log.warm_start)
    assert any(line.startswith("saved ") for line in logs[0])
    assert any(line.startswith("loaded ") for line in logs[1])
    beside = [line for line in logs[1] if line.startswith("beside the load")]
    if enabled:
        assert len(beside) == 1 and beside[0].startswith("beside the load: 2 library call(s) set up in "), logs[1]
    else:
        assert beside == []


def test_depthwise_convolutions_beyond_one_per_op_are_left_to_the_first_run():
    """cuDNN's per-shape depthwise builds are kept per thread: the replay makes one per op (to load
    the code they share) and leaves the others; grouped convolutions with several input channels
    per group and ordinary ones are all replayed."""
    def graph(*xs):
        outs = []
        for i, x in enumerate(xs):
            channels = x.shape[1]
            groups = channels if i < 3 else 2  # three depthwise shapes, then a grouped one
            w = torch.randn(channels, channels // groups, 3, 3)
            outs.append(aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups))
        w = torch.randn(5, 4, 1, 1)
        outs.append(aten.convolution.default(xs[0], w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
        return outs
    xs = [torch.randn(1, 4, 6 + i, 6) for i in range(4)]
    calls = lw.library_calls(_extern_steps(graph, *xs), ("cpu",))
    assert len(calls) == 5
    kept, backward, left = lw.replayed_calls(calls)
    assert left == 2 and kept == [calls[0], calls[3], calls[4]] and backward == []
    done = lw.replay(calls)
    assert (done.calls, done.failed, done.left) == (3, 0, 2)
    assert "2 depthwise convolution(s) left to the first run" in done.describe()


def test_gradient_calls_are_all_replayed_inside_a_backward():
    """Autograd runs a CUDA backward on its own thread per device, and torch keeps cuDNN's plans per
    thread: every gradient call (depthwise ones included) is replayed inside a backward pass, where
    that thread makes it; forward calls are made by the replaying thread, outside any backward."""
    x = torch.randn(1, 4, 6, 6)
    w = torch.randn(4, 1, 3, 3)
    g = torch.randn(1, 4, 6, 6)

    def graph(g, x, w):
        y = aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4)
        return y, aten.convolution_backward.default(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4,
                                                    [True, True, False])
    calls = lw.library_calls(_extern_steps(graph, g, x, w), ("cpu",))
    other = lw.library_calls(_extern_steps(graph, g[:, :, :5], x[:, :, :5], w), ("cpu",))
    kept, backward, left = lw.replayed_calls(calls + other)
    assert [json.loads(c)["op"][1] for c in kept] == ["convolution"] and left == 1
    assert [json.loads(c)["op"][1] for c in backward] == ["convolution_backward"] * 2

    seen = []
    real = lw._call_once

    def noting(call):
        seen.append((call["op"][1], torch._C._current_graph_task_id() != -1))
        real(call)

    lw._call_once = noting
    try:
        done = lw.replay(calls + other)
    finally:
        lw._call_once = real
    assert seen == [("convolution", False), ("convolution_backward", True), ("convolution_backward", True)]
    assert (done.calls, done.failed, done.left, done.in_backward) == (3, 0, 1, 2)
    assert "2 of them inside a backward" in done.describe()


def test_a_failing_gradient_call_is_counted_and_the_rest_still_run():
    x, w, g = torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3), torch.randn(1, 4, 6, 6)

    def graph(g, x, w):
        return aten.convolution_backward.default(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4,
                                                 [True, True, False])
    call = json.loads(lw.library_calls(_extern_steps(graph, g, x, w), ("cpu",))[0])
    bad = json.loads(json.dumps(call))
    bad["args"][1]["tensor"][0] = [1, 3, 6, 6]  # input channels that do not match the weight
    done = lw.replay([json.dumps(bad), json.dumps(call)])
    assert (done.calls, done.failed, done.in_backward) == (2, 1, 2)


def _depthwise_and_plain(x, w_dw, w):
    y = aten.convolution.default(x, w_dw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4)
    return y, aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _depthwise_inputs():
    return torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3), torch.randn(5, 4, 3, 3)


def test_the_running_thread_makes_its_own_thread_local_forward_calls():
    """cuDNN's depthwise and attention set-up stays with the thread that made it: the thread that
    will run the program makes those calls itself (only those), where it would otherwise wait."""
    import threading

    calls = lw.library_calls(_extern_steps(_depthwise_and_plain, *_depthwise_inputs()), ("cpu",))
    attention = json.dumps({"op": ["aten", "_scaled_dot_product_cudnn_attention", "default"], "args": [],
                            "kwargs": {}})
    gradient = json.dumps({"op": ["aten", "convolution_backward", "default"], "args": [], "kwargs": {}})
    assert lw.thread_local_calls([*calls, attention, gradient]) == [calls[0], attention]
    seen = []
    real = lw._call_once

    def noting(call):
        seen.append((call["op"][1], threading.get_ident()))
        real(call)

    lw._call_once = noting
    try:
        done = lw.replay_here(calls)
        with config.patch(library_warmup=False):
            off = lw.replay_here(calls)
    finally:
        lw._call_once = real
    assert seen == [("convolution", threading.get_ident())]
    assert (done.calls, done.failed) == (1, 0) and off.calls == 0


def test_the_first_run_makes_its_thread_local_calls_before_waiting_for_kernels(monkeypatch):
    from ember import pipeline

    calls = lw.library_calls(_extern_steps(_depthwise_and_plain, *_depthwise_inputs()), ("cpu",))
    order = []
    real = lw.replay_here
    monkeypatch.setattr(pipeline, "replay_here", lambda c: order.append("here") or real(c))

    class Pending(_Pending):
        def wait(self):
            order.append("kernels")
            return super().wait()

    record = GraphRecord("forward", "forward", "0/0", "triton")
    pipeline._await_kernels(record, Pending(), lw.BackgroundReplay(calls))  # type: ignore[arg-type]
    assert order == ["here", "kernels"]
    assert "on the running thread before its first run: 1 library call(s) set up in " in record.compile_note, \
        record.compile_note


def test_a_warm_start_makes_its_thread_local_calls_on_the_loading_thread(tmp_path, monkeypatch):
    import ember

    monkeypatch.setattr(lw, "RECORDED_DEVICE_TYPES", ("cpu", "cuda"))
    # On the CPU the convolution is oneDNN's, standing here for cuDNN's depthwise one.
    monkeypatch.setattr(lw, "_THREAD_LOCAL_FORWARD", frozenset({"_convolution_pointwise"}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5)).eval()
    x = torch.randn(2, 4, 8, 8)
    logs = []
    with torch.no_grad():
        for _ in range(2):
            compiled = ember.compile(model, warm_start=True, cache_dir=str(tmp_path))
            torch.testing.assert_close(compiled(x), model(x))
            logs.append(compiled._ember_backend.log.warm_start)
    assert any(line.startswith("loaded ") for line in logs[1]), logs[1]
    here = [line for line in logs[1] if line.startswith("on this thread after the load")]
    assert len(here) == 1 and here[0].startswith("on this thread after the load: 1 library call(s)"), logs[1]
