"""The ``ember`` CLI and the benchmark harness behind it, with the quick CPU models.

The compiler core is replaced by fakes where a test needs ``ember.compile``/``explain``/
the cache, so these tests say nothing about the core and do not break while it changes.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import ember
from ember.bench import harness, models
from ember.cli import main

FAST = ["--small", "--batch", "2", "--iters", "3", "--warmup", "1", "--no-progress"]
ROW_KEYS = {
    "model", "mode", "backend", "precision", "batch", "device", "ms_median", "ms_min", "samples_per_s",
    "compile_s", "peak_mem_bytes", "peak_mem_source", "speedup_vs_eager", "error",
}


def _broken(model: torch.nn.Module) -> Any:
    raise RuntimeError("boom: this backend always fails")


@pytest.fixture(autouse=True)
def broken_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # setitem restores BACKENDS after each test.
    monkeypatch.setitem(harness.BACKENDS, "broken", _broken)


def test_bench_json_table_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "res.json", tmp_path / "plot" / "speedup.png"
    rc = main(["bench", "resnet18", "tiny_transformer", "--backend", "eager,broken", *FAST,
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert set(doc) >= {"env", "results", "config", "notes"}
    assert {"torch", "python", "device", "date", "git_commit", "cpu_count"} <= set(doc["env"])
    results = doc["results"]
    assert [(r["model"], r["backend"]) for r in results] == [
        ("resnet18", "eager"), ("resnet18", "broken"), ("tiny_transformer", "eager"), ("tiny_transformer", "broken"),
    ]
    for r in results:
        assert ROW_KEYS <= set(r)
        assert (r["mode"], r["batch"], r["device"], r["precision"]) == ("train", 2, "cpu", "fp32")
    for r in results[::2]:  # eager rows measured
        assert r["error"] is None
        assert 0 < r["ms_min"] <= r["ms_median"]
        assert r["samples_per_s"] == pytest.approx(2 / (r["ms_median"] / 1e3))
        assert r["compile_s"] > 0 and r["speedup_vs_eager"] == pytest.approx(1.0)
        assert r["iters"] == 3 and r["peak_mem_source"] == "cpu_profiler_step_peak" and r["peak_mem_bytes"] > 0
        assert isinstance(r["first_loss"], float)
    for r in results[1::2]:  # the failing backend is recorded, the run went on
        assert r["error"].startswith("RuntimeError: boom")
        assert "boom" in r["traceback"]
        assert r["ms_median"] is None and r["speedup_vs_eager"] is None

    out = capsys.readouterr().out
    assert "ms median" in out and "resnet18" in out and "tiny_transformer" in out and "broken" in out
    assert "RuntimeError: boom" in out
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_infer_with_fake_ember_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.nn.Module] = []

    def fake_compile(model: torch.nn.Module, **options: Any) -> Any:
        calls.append(model)
        return model

    monkeypatch.setattr(ember, "compile", fake_compile, raising=False)
    rows = harness.run_benchmark(["tiny_transformer"], modes=["infer"], backends=["eager", "ember"],
                                 device="cpu", batch=2, warmup=0, iters=2, progress=False, small=True)
    assert len(calls) == 1 and not calls[0].training
    assert [r["error"] for r in rows] == [None, None]
    assert rows[1]["max_abs_diff_vs_eager"] == 0.0  # same weights, same inputs
    assert rows[1]["speedup_vs_eager"] == pytest.approx(rows[0]["ms_median"] / rows[1]["ms_median"])


def test_ember_rows_split_the_first_call() -> None:
    rows = harness.run_benchmark(["tiny_transformer"], modes=["train"], backends=["ember"], device="cpu", batch=2,
                                 warmup=0, iters=1, progress=False, small=True)
    r = rows[0]
    assert r["error"] is None, r["error"]
    split = r["compile_split"]
    assert split["graphs"] == 2 and split["kernels"] > 0  # the forward and the backward
    assert set(split["ember_stages_s"]) >= {"passes", "schedule", "codegen", "program"}
    assert split["ember_s"] == pytest.approx(sum(split["ember_stages_s"].values()))
    assert 0 < split["ember_s"] < r["compile_s"] and split["first_run_s"] > 0
    rest = r["compile_s"] - split["ember_s"] - split["first_run_s"]
    assert split["capture_and_rest_s"] == pytest.approx(rest)
    collected = r["first_call_collections"]  # the compile's own collection at least (capture/aot_settings.py)
    assert sum(collected["count"]) >= 1 and 0 < collected["total_s"] < r["compile_s"]


def test_the_split_keeps_each_graphs_kernel_compile_note(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ember.report.records import CompileLog, GraphRecord

    log = CompileLog()
    log.graphs = [GraphRecord(title=f"{kind} 0", kind=kind, frame="0/0", target="triton") for kind in ("forward", "backward")]
    log.graphs[0].compile_note = "11 kernels on 15 worker processes: 1.30 s wall, 0.01 s before the first compile began"
    monkeypatch.setattr(harness, "ember_backend_of", lambda fn: SimpleNamespace(log=log))
    split = harness._compile_split(lambda: None, 2.0)
    assert split["compile_notes"] == {"forward 0": log.graphs[0].compile_note}  # the backward compiled nothing


def test_ember_backend_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(ember, "compile", raising=False)
    rows = harness.run_benchmark(["tiny_transformer"], backends=["ember"], device="cpu", batch=1,
                                 warmup=0, iters=1, progress=False, small=True)
    assert rows[0]["error"].startswith("BackendUnavailable: ember.compile is not available")


def test_build_failure_fails_only_that_case() -> None:
    def build(small: bool) -> torch.nn.Module:
        raise models.MissingDependencyError("model 'x' needs nothing: pip install ember[bench]")

    ok = models.get_case("tiny_transformer")
    bad = models.BenchCase("x", "always missing", build, ok.make_batch, ok.loss, 1, 1)
    rows = harness.run_benchmark([bad, ok], backends=["eager"], device="cpu", batch=1, warmup=0,
                                 iters=1, progress=False, small=True)
    assert rows[0]["error"].startswith("MissingDependencyError: model 'x'")
    assert rows[1]["error"] is None and rows[1]["ms_median"] > 0


def test_bench_defaults_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(cases: list[str], **kwargs: Any) -> list[dict[str, Any]]:
        seen.update(kwargs, cases=cases)
        return [dict(model=c, mode="train", backend="eager", precision="fp32", batch=8, error=None) for c in cases]

    monkeypatch.setattr(harness, "run_benchmark", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--no-progress"]) == 0
    assert seen["cases"] == ["resnet18", "tiny_transformer"]
    assert seen["modes"] == ["train"] and seen["precision"] == "fp32"
    assert seen["backends"] == ["eager", "inductor", "ember"]
    assert seen["iters"] >= 30 and seen["batch"] is None

    main(["bench", "resnet18", "--mode", "train", "--mode", "infer,train", "--batch", "1,4", "--iters", "5",
          "--backend", "eager", "--backend", "ember"])
    assert seen["modes"] == ["train", "infer"] and seen["batch"] == [1, 4] and seen["iters"] == 5
    assert seen["backends"] == ["eager", "ember"]


def test_bench_all_failing_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiny_transformer", "--backend", "broken", *FAST]) == 1
    assert main(["bench", "no_such_model", "--backend", "eager"]) == 2
    assert main(["bench", "resnet18", "--backend", "nope"]) == 2
    assert main(["bench", "resnet18", "--mode", "fly"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no_such_model'" in err and "unknown backend 'nope'" in err
    with pytest.raises(SystemExit):
        main(["bench", "--iters", "0"])


def test_bench_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in models.list_cases():
        assert name in out


def test_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and torch.__version__ in out and "python" in out
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["torch"] == torch.__version__ and env["cpu_count"] >= 1


def test_explain_with_fake(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []

    def fake_explain(model: torch.nn.Module, *args: Any, **kwargs: Any) -> str:
        seen.append((model.training, torch.is_grad_enabled(), [tuple(a.shape) for a in args]))
        return "FAKE EXPLAIN REPORT"

    monkeypatch.setattr(ember, "explain", fake_explain, raising=False)
    assert main(["explain", "tiny_transformer", "--small", "--batch", "2"]) == 0
    assert "FAKE EXPLAIN REPORT" in capsys.readouterr().out
    assert seen[0] == (False, False, [(2, 32), (2, 32)])
    assert main(["explain", "cyclegan", "--small", "--mode", "train"]) == 0
    assert seen[1] == (True, True, [(1, 3, 64, 64)])


def test_explain_missing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delattr(ember, "explain", raising=False)
    monkeypatch.setitem(sys.modules, "ember.explain", None)
    assert main(["explain", "tiny_transformer", "--small"]) == 1
    assert "ember.explain is not available" in capsys.readouterr().err


def test_cache_commands(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ember.runtime

    cleared: list[bool] = []
    fake = types.ModuleType("ember.runtime.cache")
    fake.cache_info = lambda: {"path": "/tmp/ember-cache", "entries": 3}  # type: ignore[attr-defined]
    fake.clear_cache = lambda: cleared.append(True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ember.runtime.cache", fake)
    monkeypatch.setattr(ember.runtime, "cache", fake, raising=False)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "/tmp/ember-cache" in out and "entries" in out
    assert main(["cache", "clear"]) == 0 and cleared == [True]

    monkeypatch.delattr(ember.runtime, "cache")
    monkeypatch.setitem(sys.modules, "ember.runtime.cache", None)  # import fails
    assert main(["cache", "info"]) == 1
    assert "cache is not available" in capsys.readouterr().err


def test_python_dash_m_ember(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    monkeypatch.setattr(sys, "argv", ["ember", "bench", "--list"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("ember", run_name="__main__")
    assert exc.value.code == 0
    assert "resnet50" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="Inductor CPU needs a C++ compiler")
def test_inductor_backend_runs(tmp_path: Path) -> None:
    # ~20-30 s on a 2-core CPU: Inductor's C++ codegen for a 2-layer BERT.
    rows = harness.run_benchmark(["tiny_transformer"], modes=["infer"], backends=["eager", "inductor"],
                                 device="cpu", batch=2, warmup=1, iters=3, progress=False, small=True)
    assert [r["error"] for r in rows] == [None, None], rows[1].get("traceback")
    assert rows[1]["max_abs_diff_vs_eager"] < 1e-3


def test_markdown_table_compares_with_inductor() -> None:
    from ember.bench import report

    rows = [{"model": "m", "mode": "train", "batch": 2, "backend": b, "ms_median": ms, "ms_min": ms,
             "samples_per_s": 2000 / ms, "compile_s": 1.0, "peak_mem_bytes": 1 << 20,
             "speedup_vs_eager": 10.0 / ms, "error": None} for b, ms in [("eager", 10.0), ("inductor", 5.0),
                                                                       ("ember", 4.0)]]
    rows.append({**rows[2], "backend": "broken", "ms_median": None, "speedup_vs_eager": None, "error": "boom"})
    lines = report.markdown_table(rows).splitlines()
    assert lines[0].startswith("| model |") and len(lines) == 2 + len(rows)
    assert lines[4].endswith("| 2.50x | 1.25x |")  # ember: 10/4 vs eager, 5/4 vs inductor
    assert "error: boom" in lines[5] and lines[5].endswith("| - | - |")


def test_timed_collections_count_each_generation_and_leave_no_callback() -> None:
    import gc

    from ember.bench.gc_time import describe, timed_collections

    callbacks = list(gc.callbacks)
    gc.disable()  # only the explicit collections below: none triggered by allocations meanwhile
    try:
        with timed_collections() as collected:
            gc.collect(0)
            gc.collect(2)
        with timed_collections() as none:
            pass
    finally:
        gc.enable()
    assert collected["count"] == [1, 0, 1] and collected["total_s"] == pytest.approx(sum(collected["seconds"]), abs=1e-5)
    assert gc.callbacks == callbacks
    assert none["count"] == [0, 0, 0] and none["total_s"] == 0
    assert describe(collected).startswith("collections: ") and "gen2 1" in describe(collected)


def test_launch_compiles_counts_what_the_listener_hears_and_restores_it() -> None:
    from triton import knobs

    from ember.bench import launch_compiles

    heard = []
    knobs.compilation.listener = lambda **kw: heard.append(kw["cache_hit"])
    try:
        with launch_compiles.counting() as counts:
            for hit in (True, False, False):
                knobs.compilation.listener(src=type("Src", (), {"name": "k"})(), metadata=None, metadata_group=None,
                                           times=None, cache_hit=hit)
        assert counts["hit"] == 1 and counts["miss"] == 2 and counts["missed"] == ["k", "k"]
        assert heard == [True, False, False]  # the listener that was there still hears every compile
        assert knobs.compilation.listener is not None and knobs.compilation.listener.__name__ == "<lambda>"
    finally:
        knobs.compilation.listener = None


@pytest.mark.parametrize("argv, option", [
    (["bench", "--device", "tpu"], "--device"),
    (["explain", "resnet18", "--device", "tpu"], "--device"),
    (["bench", "--batch", "abc"], "--batch"),
    (["bench", "--batch", "4,x"], "--batch"),
    (["explain", "resnet18", "--batch", "abc"], "--batch"),
    (["bench", "--iters", "many"], "--iters"),
])
def test_bad_values_are_one_line_errors(argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"argument {option}" in lines[0] and lines[0].startswith("ember "), captured.err
    assert "Traceback" not in captured.err and "invalid literal" not in captured.err and not captured.out


def test_cpu_bench_output_has_no_profiler_noise(tmp_path: Path) -> None:
    # The CPU memory column uses the torch profiler, whose tracing library printed
    # "USDT: ... profiler_start" and "ERROR: ... gpuGetDeviceCount failed" on a machine without a GPU.
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(ember.__file__).parents[1]), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-m", "ember", "bench", "tiny_transformer", "--backend", "eager",
                          "--small", "--batch", "2", "--iters", "2", "--warmup", "1", "--no-progress"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "tiny_transformer" in run.stdout and ("MiB" in run.stdout or "KiB" in run.stdout), output
    for noise in ("USDT", "profiler_start", "gpuGetDeviceCount", "ERROR"):
        assert noise not in output, output
