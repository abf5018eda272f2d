"""The whole-model check at the end of ``ember tune``: tuned choices that lose inside the model
(or change its result) are demoted to the rule; those that pay are kept; the verdict is noted so
the next tune does not time the model again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tune_models import ConvLinearNet, ScaleNet

import ember
import ember.tune.measure as measure
from ember import config
from ember.cli import main
from ember.tune.apply import forget_open
from ember.tune.db import Result, TuningDB
from ember.tune.device import device_key
from ember.tune.kernels import candidates, generate
from ember.tune.model_check import check_in_model, tuned_choices
from ember.tune.session import collect_groups, collect_work


@pytest.fixture
def tuned(tmp_path: Path):
    """A model, its input and a database in which its conv and fc layers have a non-rule winner."""
    torch.manual_seed(0)
    model, x = ConvLinearNet().eval(), torch.randn(2, 3, 6, 6)
    _, sites = collect_work(model, (x,), train=False, target="cpu")
    dev = device_key("cpu")
    db_path = tmp_path / "tuning.sqlite"
    rows = []
    for site in sites[:2]:
        rows += [Result(site.key, dev, {}, 2.0, "ok", label=site.label),
                 Result(site.key, dev, {"impl": "aten"}, 1.0, "ok", label=site.label)]
    TuningDB(db_path).record(rows)
    return model, x, db_path, {s.key for s in sites[:2]}


def _times(ms_of: dict[str, float]):
    """A stand-in for the interleaved timer: each variant's time from its tuned choices."""
    def fake(runs, device, budget_s=0.2, rounds=5, capture=True):
        # Whole models replay CUDA graphs of their own: never timed inside another capture.
        assert capture is False
        for run in runs:
            run()
        return [ms_of[name] for name in fake.names[:len(runs)]]
    fake.names = []
    return fake


def _check(model, x, db_path: Path, monkeypatch, ms_of: dict[str, float] | None = None):
    from ember.tune import model_check

    real_variants = model_check._variants

    def variants(choices):
        out = real_variants(choices)
        if ms_of is not None:
            timer.names = [v.name for v in out]
        return out

    monkeypatch.setattr(model_check, "_variants", variants)
    if ms_of is not None:
        timer = _times(ms_of)
        monkeypatch.setattr(measure, "time_interleaved_ms", timer)
    db = TuningDB(db_path)
    with config.patch(tuning_db=str(db_path)):
        return check_in_model(model, (x,), False, "cpu", db, device_key("cpu"), budget_s=600.0), db


def _used_choices(model, x, db_path: Path) -> dict:
    torch._dynamo.reset()
    with config.patch(tuning_db=str(db_path)), torch.no_grad():
        fn = ember.compile(model, target="cpu", cache=False)
        got = fn(x)
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    return tuned_choices(fn)


def test_choices_slower_in_the_model_are_demoted_to_the_rule(tuned, monkeypatch) -> None:
    model, x, db_path, keys = tuned
    assert set(_used_choices(model, x, db_path)) == keys
    slow = {"rules": 10.0, "all": 12.0, "library choices": 12.0, "better half": 11.0, "worse half": 10.5}
    check, db = _check(model, x, db_path, monkeypatch, slow)
    assert check.kept == "rules" and set(check.demoted) == keys
    # Both choices are library choices: that subset is "all" and is timed once.
    assert {v.name for v in check.variants} == {"rules", "all", "better half", "worse half"}
    for key in keys:
        rows = db.results(key, device_key("cpu"))
        assert any(r.status == "slower_in_model" and r.config == {"impl": "aten"} for r in rows)
        assert not any(r.failed for r in rows)  # demoted, not counted as wrong
    forget_open()
    assert _used_choices(model, x, db_path) == {}  # compile is back on the rule


def test_the_fastest_subset_is_kept_and_the_rest_demoted(tuned, monkeypatch) -> None:
    model, x, db_path, keys = tuned
    ms = {"rules": 10.0, "all": 9.5, "library choices": 9.5, "better half": 8.0, "worse half": 10.4}
    check, _ = _check(model, x, db_path, monkeypatch, ms)
    assert check.kept == "better half" and len(check.demoted) == 1
    forget_open()
    assert len(_used_choices(model, x, db_path)) == 1


def test_choices_that_pay_are_kept_and_the_verdict_is_noted(tuned, monkeypatch) -> None:
    model, x, db_path, keys = tuned
    fast = {"rules": 10.0, "all": 7.0, "library choices": 7.0, "better half": 8.0, "worse half": 9.0}
    check, _ = _check(model, x, db_path, monkeypatch, fast)
    assert check.kept == "all" and check.demoted == [] and not check.cached
    forget_open()
    again, _ = _check(model, x, db_path, monkeypatch, None)  # the real timer is never reached
    assert again.cached and again.kept == "all" and "judged earlier" in again.line()


def test_a_variant_with_a_different_result_is_never_kept(tuned, monkeypatch) -> None:
    model, x, db_path, keys = tuned
    real_compile = ember.compile

    def compile_off_by_a_bit(m, **kw):
        fn = real_compile(m, **kw)
        if not config.tuning_enabled():
            return fn

        def wrong(*args):
            return fn(*args) + 1e-2  # what a wrong tuned program would return
        wrong._ember_backend = fn._ember_backend
        return wrong

    monkeypatch.setattr(ember, "compile", compile_off_by_a_bit)
    fast = {"rules": 10.0, "all": 5.0, "library choices": 5.0, "better half": 5.0, "worse half": 5.0}
    check, _ = _check(model, x, db_path, monkeypatch, fast)
    assert check.kept == "rules" and set(check.demoted) == keys
    assert all("differs from the rules' program" in v.error for v in check.variants if v.name != "rules")


def test_subsets_are_left_out_when_the_budget_is_spent(tuned, monkeypatch) -> None:
    model, x, db_path, keys = tuned
    from ember.tune import model_check
    monkeypatch.setattr(measure, "time_interleaved_ms", lambda runs, *a, **k: [10.0, 9.0][:len(runs)])
    db = TuningDB(db_path)
    with config.patch(tuning_db=str(db_path)):
        check = model_check.check_in_model(model, (x,), False, "cpu", db, device_key("cpu"), budget_s=0.0)
    assert [v.name for v in check.variants] == ["rules", "all"]
    assert check.not_timed == ["better half", "worse half"] and "not timed, the budget" in check.line()
    assert check.kept == "all" and check.demoted == []


def test_a_second_tune_finds_every_choice_judged(tmp_path: Path, monkeypatch, capsys) -> None:
    # The first layer's library choice (ATen, its ReLU left to a kernel) and a configuration for a
    # kernel that only the rules' program has (the ReLU fused into oneDNN, the scale alone) are in
    # the database; the whole model is fastest on the rules. The first check demotes the library
    # choice, which brings that kernel in: the same ``ember tune`` judges it too, so a second tune
    # times nothing.
    from ember.tune import model_check

    torch.manual_seed(0)
    model, x = ScaleNet().eval(), torch.randn(8, 64)
    dev = device_key("cpu")
    db_path = tmp_path / "tuning.sqlite"
    _, sites = collect_work(model, (x,), train=False, target="cpu")
    rows = [Result(sites[0].key, dev, {}, 2.0, "ok", label=sites[0].label),
            Result(sites[0].key, dev, {"impl": "aten"}, 1.0, "ok", label=sites[0].label)]
    for group, target in collect_groups(model, (x,), train=False, target="cpu"):  # the rules' program
        config_ = next(c.config for c in candidates(group, target) if c.config)
        name = generate(group, target, {}).name
        rows += [Result(name, dev, {}, 2.0, "ok"), Result(name, dev, config_, 1.0, "ok")]
    TuningDB(db_path).record(rows)
    script = tmp_path / "model.py"
    script.write_text("import torch\nfrom tune_models import ScaleNet\ntorch.manual_seed(0)\n"
                      "model = ScaleNet().eval()\nexample_inputs = (torch.randn(8, 64),)\n")

    timed: list[int] = []
    real_check, real_timer = model_check.check_in_model, measure.time_interleaved_ms

    def rules_fastest(runs, device, budget_s=0.2, rounds=5, capture=True):
        for run in runs:
            run()
        timed.append(len(runs))
        return [1.0] + [2.0] * (len(runs) - 1)

    def check(*args, **kwargs):  # the whole-model timing only; the kernels' own is real
        monkeypatch.setattr(measure, "time_interleaved_ms", rules_fastest)
        try:
            return real_check(*args, **kwargs)
        finally:
            monkeypatch.setattr(measure, "time_interleaved_ms", real_timer)

    monkeypatch.setattr(model_check, "check_in_model", check)
    argv = ["tune", str(script), "--device", "cpu", "--budget", "60", "--db", str(db_path)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert len(timed) >= 2, first  # the program after the first demotions was judged as well
    assert "demoted as slower in the model" in first
    timed.clear()
    torch._dynamo.reset()
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert timed == [], second
    assert "no tuned choice differs from the rules here" in second or "judged earlier" in second
