"""Tuning generated kernels: wrong candidates rejected, compile uses the database, explain says so,
a second tune is answered by the database, the CLI."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import ember
from ember.cli import main
from ember.tune.db import Result, TuningDB
from ember.tune.device import device_key
from ember.tune.measure import candidate_output_hook
from ember.tune.session import collect_groups, tune_groups


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.Softmax(-1))




def test_wrong_candidate_is_rejected_and_recorded_failed(tmp_path: Path) -> None:
    groups = collect_groups(_model(), (torch.randn(64, 32),), train=False, target="cpu")
    assert groups
    db = TuningDB(tmp_path / "t.sqlite")
    corrupted: list[str] = []

    def corrupt_single_thread(ks, outputs) -> None:
        # The single-threaded candidate is the one the model likes best on this 2-core machine.
        if '"threads":1' in ks.source.replace(" ", ""):
            corrupted.append(ks.name)
            outputs[0].view(-1)[3] += 1.0

    with candidate_output_hook(corrupt_single_thread):
        report = tune_groups(groups, db, tmp_path / "kernels", budget_s=60, progress=False)
    assert corrupted, "the injected wrong candidate never ran"
    (kernel,) = report.kernels
    assert kernel.failed >= 1 and kernel.best_config.get("threads") != 1
    rows = db.results(kernel.kernel, device_key("cpu"))
    failed = [r for r in rows if r.failed]
    assert any(r.config.get("threads") == 1 and "differ" in r.detail for r in failed)
    best = db.choices([kernel.kernel], device_key("cpu"))[kernel.kernel]
    assert best.config.get("threads") != 1


def test_compile_uses_tuned_config_and_explain_shows_gain(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    model, x = _model(), torch.randn(64, 32)
    groups = collect_groups(model, (x,), train=False, target="cpu")
    from ember.tune.kernels import generate
    default = generate(groups[0][0], groups[0][1], {})
    assert not (tmp_path / "cache" / "tuning.sqlite").exists()  # untuned compile never creates it
    TuningDB(tmp_path / "cache" / "tuning.sqlite").record([
        Result(default.name, device_key("cpu"), {}, 2.0, "ok"),
        Result(default.name, device_key("cpu"), {"threads": 1}, 1.0, "ok"),
        Result(default.name, device_key("cpu"), {"threads": 2}, 0.1, "failed", "wrong result")])
    with torch.no_grad():
        report = ember.explain(model, x)
    text = str(report)
    assert "Tuning" in text and "threads=1" in text and "2.00x" in text
    tuned = [t for g in report.graphs for t in g.tuned.values()]
    assert tuned and tuned[0]["config"] == {"threads": 1}
    with torch.no_grad():
        torch.testing.assert_close(ember.compile(model, target="cpu")(x), model(x), rtol=1e-5, atol=1e-5)


def test_second_tune_is_answered_by_the_database(tmp_path: Path) -> None:
    groups = collect_groups(_model(), (torch.randn(64, 32),), train=False, target="cpu")
    db = TuningDB(tmp_path / "t.sqlite")
    first = tune_groups(groups, db, tmp_path / "kernels", budget_s=60, progress=False)
    assert first.measured and not any(k.cached for k in first.kernels)
    t0 = time.perf_counter()
    second = tune_groups(groups, db, tmp_path / "kernels", budget_s=60, progress=False)
    assert time.perf_counter() - t0 < 2.0
    assert all(k.cached for k in second.kernels) and not second.measured
    assert [k.best_config for k in second.kernels] == [k.best_config for k in first.kernels]


def test_triton_interpret_candidates_are_checked(tmp_path: Path) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(a * b + 1.0).sum(-1)

    groups = collect_groups(fn, (torch.randn(16, 96), torch.randn(16, 96)), train=False, target="triton-interpret")
    db = TuningDB(tmp_path / "t.sqlite")
    report = tune_groups(groups, db, tmp_path / "kernels", budget_s=60, top=2, progress=False)
    (kernel,) = report.kernels
    assert kernel.tried >= 1 and kernel.failed == 0 and kernel.best_ms is not None


def test_cli_tune_export_import(tmp_path: Path, capsys) -> None:
    script = tmp_path / "model.py"
    script.write_text("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64))\n"
                      "example_inputs = (torch.randn(32, 16),)\n")
    db = tmp_path / "t.sqlite"
    assert main(["tune", str(script), "--device", "cpu", "--budget", "30", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "default ms" in out and "tried/failed" in out
    assert len(TuningDB(db)) >= 2
    assert main(["tune", "--db", str(db), "--export", str(tmp_path / "out.json")]) == 0
    assert main(["tune", "--db", str(tmp_path / "other.sqlite"), "--import", str(tmp_path / "out.json")]) == 0
    assert len(TuningDB(tmp_path / "other.sqlite")) == len(TuningDB(db))


def test_looped_and_split_reduction_candidates_pass_the_check(tmp_path: Path) -> None:
    # 5000 reduced elements: a looped reduction in the interpreter; candidates change RBLOCK and split it.
    groups = collect_groups(lambda x: (x * x).sum(-1), (torch.randn(4, 5000),), train=False,
                            target="triton-interpret")
    report = tune_groups(groups, TuningDB(tmp_path / "t.sqlite"), tmp_path / "kernels", budget_s=60, top=3,
                         progress=False)
    (kernel,) = report.kernels
    assert kernel.tried == 3 and kernel.failed == 0, kernel.failures


def test_float32_check_allows_reordered_long_sums_but_not_wrong_values() -> None:
    from ember.tune.measure import mismatch

    # A long reduction summed in another order: results near zero move by about eps * sqrt(n) * the
    # size of the terms, measured against the output's largest value.
    x = torch.randn(4, 401_408, dtype=torch.float64)
    ref = x.sum(1).float()
    reordered = x.float().view(4, 784, 512).sum(2).sum(1)
    assert mismatch([ref], [reordered]) == ""
    ref = torch.tensor([1000.0, 1e-3])
    assert mismatch([ref], [torch.tensor([1000.0, 1.5e-3])]) == ""
    assert "differ" in mismatch([ref], [torch.tensor([1000.0, 1.0])])
    assert "differ" in mismatch([torch.tensor([1.0, 0.5])], [torch.tensor([1.0, 0.52])])


def test_candidates_go_to_the_compile_workers_before_they_are_measured(tmp_path: Path, monkeypatch) -> None:
    # On the GPU Triton compiles a kernel on its first launch, in the tuner's process, one at a
    # time; the tuner hands the next kernels' candidates to the compile workers first.
    import dataclasses

    from ember.runtime import precompile
    from ember.targets import TRITON_INTERPRET
    from ember.tune import kernels, session

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                                torch.nn.LayerNorm(8))
    groups = collect_groups(model, (torch.randn(8, 16),), train=False, target="triton-interpret")
    compiling = dataclasses.replace(TRITON_INTERPRET, name="triton-compiled-ahead", interpret=False)
    assert compiling.precompiles()
    submitted: list[str] = []
    measured: list[tuple[str, bool]] = []
    monkeypatch.setattr(precompile, "submit", lambda jobs: submitted.extend(j.name for j in jobs))
    real_tune = kernels.tune_group

    def tune_group(group, target, *args, prepared=None, **kwargs):
        names = [prepared.default.name, *(ks.name for _, ks in prepared.chosen)] if prepared else []
        measured.append((kernels.generate(group, target, {}).name, bool(names) and set(names) <= set(submitted)))
        return real_tune(group, TRITON_INTERPRET, *args, prepared=prepared, **kwargs)

    monkeypatch.setattr(session, "tune_group", tune_group)
    report = tune_groups([(g, compiling) for g, _ in groups], TuningDB(tmp_path / "t.sqlite"), tmp_path / "kernels",
                         budget_s=120, top=2, progress=False)
    assert len(measured) >= 2 and all(ahead for _, ahead in measured), measured
    assert all(not k.error for k in report.kernels) and sum(k.tried for k in report.kernels) >= 2
    # the jobs name every kernel file, written where the launches will load them from
    assert all((tmp_path / "kernels" / f"{name}.py").exists() for name in submitted)
