"""Recompiles: up to ``max_recompiles`` static specialisations per frame, then one dynamic-shape
graph that serves every later size; results always match eager, and the log and ``ember.explain``
say what changed at each recompile and when the switch to a dynamic-shape graph happened.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from core_helpers import assert_close, assert_compiled_cleanly, check_against_eager, log_of

import ember


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)
        self.ln = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(x)).softmax(-1) * 3.0 + x[..., :6].tanh()


class BrokenNet(SmallNet):
    """Two Dynamo frames: a graph break in the middle."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(self.fc(x)).relu()
        torch._dynamo.graph_break()
        return (y * 2.0).softmax(-1) + x[..., :6].sin()


class BranchNet(SmallNet):
    """A branch on a tensor's value: the code after it runs in resume frames of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            y = y * 2.0
        return self.ln(y).softmax(-1) + x[..., :6].sin()


def _frames(log) -> list[str]:
    return [cid for cid, _ in log.frames]


def test_static_specialisations_then_one_dynamic_graph() -> None:
    model = SmallNet()
    compiled = ember.compile(model, target="aten", max_recompiles=3, warm_start=False)  # Dynamo's path
    batches = (2, 3, 4, 5, 6, 7, 9)  # seven sizes, three static specialisations
    for b in batches:
        check_against_eager(compiled, model, [torch.randn(b, 8)], params=list(model.parameters()))
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert _frames(log) == ["0/0", "0/1", "0/2", "0/3"], log.frames
    assert log.dynamic == ["0/3"]
    # The forward and backward of the dynamic frame run the captured graphs; the others are Ember's.
    dynamic = [g for g in log.graphs if g.dynamic]
    assert sorted(g.kind for g in dynamic) == ["backward", "forward"] and {g.frame for g in dynamic} == {"0/3"}
    assert all(g.target == "aten (dynamic shapes)" and g.placement["fallback"] for g in dynamic)
    assert all(any("s" in s for s in g.input_signature) for g in dynamic), [g.input_signature for g in dynamic]
    assert all(g.target == "aten" for g in log.graphs if not g.dynamic)
    assert len(log.recompiles) == 3
    for line, (old, new) in zip(log.recompiles, [(2, 3), (3, 4), (4, 5)]):
        assert f"[{old}, 8]" in line and f"[{new}, 8]" in line, line
    assert "dynamic-shape graph" not in "".join(log.recompiles[:2])
    assert "dynamic-shape graph torch.float32[s" in log.recompiles[2] and "after 3 static" in log.recompiles[2]

    # Sizes seen before keep their static graphs; new sizes take the dynamic one: no compile.
    for b in (2, 4, 11, 1000):
        check_against_eager(compiled, model, [torch.randn(b, 8)], params=list(model.parameters()))
    assert len(log.frames) == 4 and log.dynamic == ["0/3"]


def test_dynamic_graph_in_inference() -> None:
    model = SmallNet().eval()
    compiled = ember.compile(model, target="aten", max_recompiles=1, warm_start=False)  # Dynamo's path
    with torch.no_grad():
        for b in (3, 5, 7, 2):
            x = torch.randn(b, 8)
            assert_close(compiled(x), model(x), f"batch {b}")
    log = log_of(compiled)
    assert _frames(log) == ["0/0", "0/1"] and log.dynamic == ["0/1"]
    assert [g.kind for g in log.graphs if g.dynamic] == ["inference"]


def test_every_frame_of_a_graph_break_gets_bounded() -> None:
    model = BrokenNet()
    compiled = ember.compile(model, target="aten", max_recompiles=2)
    for b in (2, 3, 4, 5, 6):
        check_against_eager(compiled, model, [torch.randn(b, 8)], params=list(model.parameters()))
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    frames: dict[str, list[str]] = {}
    for cid, _ in log.frames:
        frames.setdefault(cid.partition("/")[0], []).append(cid)
    assert len(frames) == 2, log.frames
    for cids in frames.values():
        # Two static specialisations, then one dynamic-shape graph for the remaining sizes.
        assert len(cids) == 3 and cids[-1] in log.dynamic and not set(cids[:2]) & set(log.dynamic), log.frames


def test_explain_lists_every_recompile_and_the_switch() -> None:
    compiled = ember.compile(SmallNet(), target="aten", max_recompiles=2, warm_start=False)  # Dynamo's path
    with torch.no_grad():
        for b in (2, 3, 4, 5):
            compiled(torch.randn(b, 8))
    report = ember.explain(compiled, torch.randn(3, 8))
    text = str(report)
    log = log_of(compiled)
    assert len(log.recompiles) == 2 and log.dynamic == ["0/2"]
    assert "3 Dynamo graph(s), 2 with static shapes, 1 with dynamic shapes" in text, text
    for line in log.recompiles:
        assert " ".join(line.split()) in " ".join(text.split()), line  # rich may wrap long lines
    history = report.as_dict()["model_history"]
    assert history == {"compiles": ["0/0", "0/1", "0/2"], "recompiles": log.recompiles, "dynamic_shape_graphs": ["0/2"],
                       "frames_run_eagerly": []}


def test_eighteen_batch_sizes_after_a_graph_break_share_one_dynamic_graph_per_frame() -> None:
    model = BranchNet().eval()
    compiled = ember.compile(model, target="aten")  # default budget: 8 static specialisations per frame
    sizes = list(range(1, 19))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Dynamo giving up on a frame would warn
        with torch.no_grad():
            for b in sizes + sizes[::-1]:  # the second pass compiles nothing new
                x = torch.randn(b, 8)
                assert_close(compiled(x), model(x), f"batch {b}")
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert not log.gave_up
    per_frame: dict[str, list[str]] = {}
    for cid, _ in log.frames:
        per_frame.setdefault(cid.partition("/")[0], []).append(cid)
    assert len(per_frame) >= 2, log.frames  # the frame before the branch and at least one after it
    for cids in per_frame.values():
        dynamic = [c for c in cids if c in log.dynamic]
        assert len(dynamic) <= 1 and len(cids) <= 9, (cids, log.recompiles)
    first_pass = len(log.frames)
    with torch.no_grad():
        for b in (25, 40, 3):
            compiled(torch.randn(b, 8))
    assert len(log.frames) == first_pass, log.recompiles[first_pass - len(per_frame):]


MODE = {"name": "a"}


def by_mode(x: torch.Tensor) -> torch.Tensor:
    # Dynamo guards on the string's value: each new one compiles again, no dynamic shape helps.
    return (x * 2.0).softmax(-1) if MODE["name"].startswith("a") else x.exp()


def test_dynamo_giving_up_is_warned_once_and_explained() -> None:
    compiled = ember.compile(by_mode, target="aten", max_recompiles=1)
    x = torch.randn(3, 7)
    with pytest.warns(RuntimeWarning, match="runs it eagerly") as warned:
        for name in ("a", "ab", "abc", "b", "bc", "abcd", "bcd", "abcde", "c"):
            MODE["name"] = name
            assert_close(compiled(x), by_mode(x), f"mode {name}")  # past the limit: eager, still correct
    assert sum("eagerly" in str(w.message) for w in warned) == 1
    log = log_of(compiled)
    assert len(log.gave_up) == 1 and "by_mode" in log.gave_up[0], log.gave_up
    report = ember.explain(compiled, x)
    text = " ".join(str(report).split())
    assert "Dynamo gave up compiling a frame of the compiled model; it runs eagerly" in text and "by_mode" in text
    assert report.as_dict()["model_history"]["frames_run_eagerly"] == log.gave_up


def test_warm_start_programs_count_as_the_static_specialisations(tmp_path) -> None:
    # With the warm start on, its saved programs are the static specialisations (frames "warm/N",
    # each recompile logged with what changed); then Dynamo compiles one dynamic-shape graph.
    model = SmallNet()
    compiled = ember.compile(model, target="aten", max_recompiles=3, warm_start=True, cache_dir=str(tmp_path))
    for b in (2, 3, 4, 5, 6, 7, 9):
        check_against_eager(compiled, model, [torch.randn(b, 8)], params=list(model.parameters()))
    log = log_of(compiled)
    frames = _frames(log)
    assert frames[:3] == ["warm/0", "warm/1", "warm/2"] and len(frames) == 4, log.frames
    assert log.dynamic == frames[3:], (log.dynamic, log.frames)
    assert log.recompiles[:2] == ["frame warm compile 1: input 2: torch.float32[2, 8]@cpu -> torch.float32[3, 8]@cpu",
                                  "frame warm compile 2: input 2: torch.float32[3, 8]@cpu -> torch.float32[4, 8]@cpu"]
