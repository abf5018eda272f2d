"""The peers of ``ember bench``: backends in their modes, the training-step hook, the timers, what
every row records, Ember against each peer, suites on the command line.

Fakes stand in for compilers where the test is about the harness; one slow test runs the
compiled-optimizer peer for real on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ember
from ember.bench import backends, harness, models, report
from ember.cli import main

PROVENANCE = {"timer", "peer_mode", "device_name", "torch", "triton", "python", "cuda", "gpu_driver", "git_commit",
              "date"}


def _run(backend_names: list[str], mode: str = "train", iters: int = 3, warmup: int = 1) -> list[dict[str, Any]]:
    return harness.run_benchmark(["tiny_transformer"], modes=[mode], backends=backend_names, device="cpu", batch=2,
                                 warmup=warmup, iters=iters, progress=False, small=True)


def test_default_backends_by_device() -> None:
    assert backends.default_backends(torch.device("cpu")) == ["eager", "inductor", "ember"]
    assert backends.default_backends(torch.device("cuda")) == ["eager", "inductor", "inductor-cudagraphs", "ember",
                                                              "ember-whole-step", "ember-whole-call"]
    assert backends.infer_only("ember-whole-call") and not backends.infer_only("ember")
    for opt_in in ("inductor-max-autotune", "inductor-cudagraphs-compiled-optimizer"):
        assert backends.BACKENDS[opt_in].opt_in
    assert backends.peer_mode("inductor-cudagraphs") == "torch.compile mode=reduce-overhead"
    assert backends.peer_mode("inductor-max-autotune") == "torch.compile mode=max-autotune"
    assert backends.train_step_factory("inductor-cudagraphs-compiled-optimizer") is not None
    assert backends.train_step_factory("inductor") is None


def test_a_backend_may_supply_the_whole_training_step(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {"steps": 0, "compiled": 0}

    def compile_model(model: torch.nn.Module) -> Any:
        seen["compiled"] += 1
        return model

    def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, autocast: Any) -> Any:
        seen.update(model=model, optimizer=optimizer, loss_fn=loss_fn)

        def step(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
            seen["steps"] += 1
            with autocast():
                loss = loss_fn(model(*inputs), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    monkeypatch.setitem(backends.BACKENDS, "whole-step",
                        backends.Backend(compile_model, "a fake whole-step compiler", train_step=train_step))
    rows = _run(["eager", "whole-step"], iters=3, warmup=2)
    assert [r["error"] for r in rows] == [None, None], rows[1].get("traceback")
    # first call + warm-up + timed steps (+ the CPU profiler's one step): all through the hook
    assert seen["steps"] == 1 + 2 + 3 + 1 and seen["compiled"] == 0
    assert seen["loss_fn"] is models.get_case("tiny_transformer").loss
    assert list(seen["optimizer"].param_groups[0]["params"]) == list(seen["model"].parameters())
    assert rows[1]["peer_mode"] == "a fake whole-step compiler"
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"])  # same weights, same batch

    rows = _run(["whole-step"], mode="infer")  # inference goes through the model factory
    assert rows[0]["error"] is None and seen["compiled"] == 1


def test_rows_record_the_timer_and_how_they_were_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_GIT_COMMIT", "abc1234")
    rows = _run(["eager"], iters=4)
    r = rows[0]
    assert r["error"] is None
    assert PROVENANCE <= set(r)
    assert r["timer"] == "sync_each_step" and r["peer_mode"] == "eager" and r["git_commit"] == "abc1234"
    assert r["torch"] == torch.__version__ and r["python"] == sys.version.split()[0]
    assert r["device_name"].startswith("CPU") and r["date"][:2] == "20"
    assert 0 < r["host_ms_median"] <= r["ms_max"] and r["ms_min"] <= r["ms_median"]
    assert r["pipelined_ms_median"] is None  # CUDA only: a CPU step is synchronous


def test_short_commit_falls_back_to_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_GIT_COMMIT", raising=False)
    monkeypatch.setattr(report, "_run", lambda cmd, cwd=None: None)  # no git, or not a checkout
    assert report.short_commit() == "unknown"


def test_sync_each_step_timer_separates_host_time() -> None:
    from ember.bench import timing

    calls: list[int] = []

    def step(x: int) -> None:
        calls.append(x)

    wall, host = timing.time_sync_each_step(step, [(1,), (2,)], 5, torch.device("cpu"))
    assert calls == [1, 2, 1, 2, 1] and len(wall) == len(host) == 5
    assert all(0 <= h <= w for h, w in zip(host, wall))
    assert timing.time_pipelined(step, [(1,)], 3, torch.device("cpu")) is None


def test_ember_rows_compare_with_every_peer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ember, "compile", lambda model, **kw: model, raising=False)
    monkeypatch.setitem(backends.BACKENDS, "slow-peer", backends.Backend(lambda m: m, "fake"))
    rows = _run(["eager", "slow-peer", "ember"], mode="infer")
    ember_row = rows[2]
    assert set(ember_row["vs_peers"]) == {"eager", "slow-peer"}
    for peer in rows[:2]:
        assert ember_row["vs_peers"][peer["backend"]] == pytest.approx(peer["ms_median"] / ember_row["ms_median"])
    assert "vs_peers" not in rows[0]
    png = report.plot(rows, tmp_path / "peers.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_suites_and_gpu_defaults(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, Any] = {}

    def fake_run(cases: list[str], **kwargs: Any) -> list[dict[str, Any]]:
        seen.update(kwargs, cases=cases)
        return [dict(model=c, mode="train", backend="eager", precision="bf16", batch=1, error=None) for c in cases]

    monkeypatch.setattr(harness, "run_benchmark", fake_run)
    monkeypatch.setattr(report, "env_info", lambda: {"device": "fake GPU", "torch": torch.__version__})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "--no-progress"]) == 0
    assert seen["backends"] == ["eager", "inductor", "inductor-cudagraphs", "ember", "ember-whole-step",
                                  "ember-whole-call"]
    assert main(["bench", "zoo", "--no-progress"]) == 0
    assert seen["cases"] == models.SUITES["zoo"] and len(seen["cases"]) >= 8
    assert main(["bench", "resnet50", "--suite", "zoo", "--no-progress"]) == 0
    assert seen["cases"] == ["resnet50", *models.SUITES["zoo"]]
    assert main(["bench", "--suite", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err

    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "suite zoo:" in out and "suite seed:" in out
    assert "backend inductor-max-autotune: torch.compile mode=max-autotune (opt-in)" in out


def test_zoo_is_not_seed_models() -> None:
    zoo = models.SUITES["zoo"]
    assert len(zoo) >= 8 and not set(zoo) & set(models.SEED_SUITE)
    for name in zoo:
        case = models.get_case(name)
        assert case.batch_train >= 1 and case.batch_infer >= 1


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="Inductor CPU needs a C++ compiler")
def test_compiled_optimizer_peer_trains_like_eager() -> None:
    # ~30 s on a 2-core CPU: Inductor compiles a small MLP's forward and backward and the SGD step
    # (twice: the momentum buffers appear after the first step).
    import contextlib
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    loss_fn = torch.nn.functional.cross_entropy
    batches = [((torch.randn(8, 16),), torch.randint(0, 4, (8,))) for _ in range(3)]
    from torch._dynamo.utils import counters

    losses, params, graphs = {}, {}, {}
    for name in ("eager", "inductor-cudagraphs-compiled-optimizer"):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        own = backends.train_step_factory(name)
        step = (own(model, opt, loss_fn, contextlib.nullcontext) if own else
                backends.default_train_step(backends.BACKENDS[name](model), opt, loss_fn, contextlib.nullcontext))
        losses[name] = [float(step(*b)) for b in batches]
        params[name] = [p.detach().clone() for p in model.parameters()]
        graphs[name] = counters["stats"]["unique_graphs"]
    # the model (forward and backward: one Dynamo graph) and the SGD step (twice: momentum appears)
    assert graphs == {"eager": 0, "inductor-cudagraphs-compiled-optimizer": 3}, graphs
    assert losses["inductor-cudagraphs-compiled-optimizer"] == pytest.approx(losses["eager"], rel=1e-5)
    for got, want in zip(params["inductor-cudagraphs-compiled-optimizer"], params["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_whole_step_rows_say_how_the_step_ran() -> None:
    # On the CPU the whole-step program compiles but captures no CUDA graph: the row says so.
    (row,) = _run(["ember-whole-step"], iters=2, warmup=1)
    assert row["error"] is None, row["error"]
    ws = row["whole_step"]
    assert ws["captured_calls"] == 0 and ws["calls"] >= row["iters"] + row["warmup"] + 1
    assert ws["status"].startswith("uncaptured") and any("cpu tensors" in why for why in ws["uncaptured"]), ws


def test_each_backend_gets_batches_no_earlier_backend_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    # A dynamic-shape graph compiled by AOTAutograd stamps the inputs it saves for backward
    # (``_dynamo_propagated_dynamic_indices``); Dynamo then traces those dims as dynamic in any
    # later compile. Batches shared between backends carried that into the next backend's row.
    seen: dict[str, list] = {"stamped": [], "values": []}

    def compile_dynamic(model: torch.nn.Module) -> Any:
        return torch.compile(model, backend="aot_eager", dynamic=True)

    def compile_observer(model: torch.nn.Module) -> Any:
        def forward(*inputs: torch.Tensor) -> Any:
            seen["stamped"].extend(hasattr(x, "_dynamo_propagated_dynamic_indices") for x in inputs)
            seen["values"].append([x.clone() for x in inputs])
            return model(*inputs)
        return forward

    monkeypatch.setitem(backends.BACKENDS, "dynamic", backends.Backend(compile_dynamic, "dynamic shapes"))
    monkeypatch.setitem(backends.BACKENDS, "observer", backends.Backend(compile_observer, "looks at its inputs"))
    rows = _run(["observer", "dynamic", "observer"], iters=1, warmup=0)
    assert [r["error"] for r in rows] == [None, None, None], [r.get("traceback") for r in rows]
    assert seen["stamped"] and not any(seen["stamped"])
    half = len(seen["values"]) // 2  # the two observer rows saw the same batches, value for value
    for before, after in zip(seen["values"][:half], seen["values"][half:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_training_rows_use_the_optimizer_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.optim.Optimizer] = []

    def own_step(model, optimizer, loss_fn, autocast):
        seen.append(optimizer)
        return backends.default_train_step(model, optimizer, loss_fn, autocast)

    monkeypatch.setitem(backends.BACKENDS, "recording", backends.Backend(lambda m: m, "eager", train_step=own_step))
    for name, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)):
        rows = harness.run_benchmark(["tiny_transformer"], backends=["recording"], device="cpu", batch=2, warmup=0,
                                     iters=1, progress=False, small=True, optimizer=name)
        assert rows[0]["error"] is None and rows[0]["optimizer"] == name
        assert type(seen[-1]) is cls
    infer = harness.run_benchmark(["tiny_transformer"], modes=["infer"], backends=["eager"], device="cpu", batch=1,
                                  warmup=0, iters=1, progress=False, small=True, optimizer="adamw")
    assert "optimizer" not in infer[0]
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adam, adamw"):
        harness.run_benchmark(["tiny_transformer"], backends=["eager"], device="cpu", optimizer="lamb")
    with pytest.raises(SystemExit):
        main(["bench", "tiny_transformer", "--optimizer", "lamb"])
    assert set(harness.OPTIMIZERS) == {"sgd", "adam", "adamw"}  # the CLI's choices
