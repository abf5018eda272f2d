"""benchmarks/scripts/gpu_cudagraph_check.py, on CPU: its training rows pass through the CUDA-graph
runner on the CPU stand-in (cudagraph_fakes.py), and fail when the runner's held-output guard is
switched off; its comparison, plan and output path."""

from __future__ import annotations

import functools

import pytest
import torch

import ember
from ember.runtime.cudagraphs import runner as cudagraph


@functools.cache
def _check_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "scripts" / "gpu_cudagraph_check.py"
    spec = importlib.util.spec_from_file_location("gpu_cudagraph_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["plain", "accumulate", "together"])
def test_gpu_check_training_rows_pass_on_cpu(cuda_graphs_on_cpu, monkeypatch, mode: str) -> None:
    check = _check_module()
    row = check.check_training("convnet", "fp32", mode, device="cpu", steps=3, graphs_off=mode == "plain",
                               compile_fn=functools.partial(ember.compile, target="aten"))
    assert row["ok"], row["problems"]
    assert row["replays"] > 0 and len(row["statuses"]) == 2
    assert len(row["losses"]["graphs"]) == 3 * (2 if mode == "accumulate" else 1)
    assert "convnet" in check.table([row]) and "NO" not in check.table([row])


def test_gpu_check_layer_per_graph_rows_pass_on_cpu(cuda_graphs_on_cpu, monkeypatch) -> None:
    # One frame's graphs run six times a step, each call on a graph of its own (call_sites.py).
    check = _check_module()
    row = check.check_training("layer_breaks", "fp32", "together", device="cpu", steps=3, graphs_off=False,
                               compile_fn=functools.partial(ember.compile, target="aten"))
    assert row["ok"], row["problems"]
    assert row["replays"] > 0 and any("times per call of the model" in s for s in row["statuses"]), \
        row["statuses"]


def test_gpu_check_fails_when_a_replay_overwrites_held_outputs(cuda_graphs_on_cpu, monkeypatch) -> None:
    check = _check_module()
    monkeypatch.setattr(cudagraph, "held_groups", lambda g: [])  # the runner's guard, switched off
    row = check.check_training("convnet", "fp32", "together", device="cpu", steps=3, graphs_off=False,
                               compile_fn=functools.partial(ember.compile, target="aten"))
    assert not row["ok"] and any("vs eager" in p for p in row["problems"]), row["problems"]


def test_gpu_check_compare_names_the_worst_tensor() -> None:
    check = _check_module()
    initial = {"w": torch.zeros(3), "running_mean": torch.zeros(3)}
    ref = check.Run(losses=[1.0, 0.5], state={"w": torch.ones(3), "running_mean": torch.ones(3)})
    same = check.Run(losses=[1.0, 0.5], state={"w": torch.ones(3), "running_mean": torch.ones(3)})
    errors = check.compare(same, ref, initial, {"w"})
    assert check.problems_of(errors, check.TOL["fp32"]["eager"], "eager") == []
    off = check.Run(losses=[1.0, 0.5], state={"w": torch.tensor([1.0, 1.0, 1.1]), "running_mean": torch.ones(3)})
    problems = check.problems_of(check.compare(off, ref, initial, {"w"}), check.TOL["fp32"]["eager"], "eager")
    assert len(problems) == 1 and problems[0].startswith("param_abs vs eager") and "(w)" in problems[0]
    graphs = check.problems_of(check.compare(off, ref, initial, {"w"}), check.TOL["fp32"]["graphs"], "no graphs")
    assert sorted(p.split()[0] for p in graphs) == ["param_abs", "update"]
    short = check.Run(losses=[1.0], state=ref.state)
    assert any(p.startswith("loss") for p in check.problems_of(check.compare(short, ref, initial, {"w"}),
                                                               check.TOL["fp32"]["eager"], "eager"))
    nan = check.Run(losses=[float("nan"), 0.5], state=ref.state)
    assert any(p.startswith("loss") for p in check.problems_of(check.compare(nan, ref, initial, {"w"}),
                                                               check.TOL["fp32"]["eager"], "eager"))


def test_gpu_check_plan_and_output(monkeypatch, tmp_path) -> None:
    check = _check_module()
    rows = check.plan(None, ["convnet"], ["bert"])
    assert ("convnet", "fp32", "accumulate") in rows and ("convnet", "fp32", "together") in rows
    assert ("convnet", "bf16", "plain") in rows and rows[-2:] == [("bert", "bf16", "infer"), ("recovery", "fp32", "failure")]
    assert all(mode != "infer" for _, _, mode in check.plan("train", ["convnet"], ["bert"]))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert check.output_path(None) == str(tmp_path / "cudagraph_check.json")
    assert check.output_path("x.json") == "x.json"
