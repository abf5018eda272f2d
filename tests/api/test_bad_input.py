"""Inputs a compiled function was not compiled for: new shapes, new dtypes, wrong devices, wrong
ranks, and more shapes than the recompile limit allows.

A new input signature fails Dynamo's guards and compiles again (a static specialisation, until
``max_recompiles`` are used up; then one dynamic-shape graph), and the log says why. Wrong inputs
must raise what eager raises, never return a result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from core_helpers import assert_close, assert_compiled_cleanly, check_against_eager, forward_backward, log_of

import ember
from ember.capture.backend import DYNAMIC_RECOMPILES


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 6)
        self.ln = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(x)).softmax(-1) * 3.0 + x[..., :6].tanh()


def softmax_chain(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2.0).softmax(-1) + x.exp() * 0.5


# -- (a) a new shape recompiles, stays correct, and the log says why ----------------------------

@pytest.mark.parametrize("kind", ["function", "module"])
def test_new_shape_recompiles_and_stays_correct(kind: str) -> None:
    if kind == "module":
        model = SmallNet()
        eager, params = model, list(model.parameters())
    else:
        eager, params = softmax_chain, []
    # Dynamo's recompile path (the warm start's compile ids are warm/N: tests/capture/test_recompiles.py)
    compiled = ember.compile(eager, target="aten", warm_start=False)

    check_against_eager(compiled, eager, [torch.randn(3, 8)], params=params)
    check_against_eager(compiled, eager, [torch.randn(5, 8)], params=params)
    # A third call with the first shape hits the first compile's cache entry: still correct.
    check_against_eager(compiled, eager, [torch.randn(3, 8)], params=params)

    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert [cid for cid, _ in log.frames] == ["0/0", "0/1"], log.frames
    assert len(log.recompiles) == 1, log.recompiles
    reason = log.recompiles[0]
    assert "[3, 8]" in reason and "[5, 8]" in reason, reason
    # Training graphs: a forward and a backward for each of the two compiles.
    assert sorted((g.frame, g.kind) for g in log.graphs) == [
        ("0/0", "backward"), ("0/0", "forward"), ("0/1", "backward"), ("0/1", "forward")]
    new_shape_graph = next(g for g in log.graphs if g.frame == "0/1" and g.kind == "forward")
    assert "torch.float32[5, 8]@cpu" in new_shape_graph.input_signature


def test_new_rank_recompiles_and_stays_correct() -> None:
    compiled = ember.compile(softmax_chain, target="aten")
    check_against_eager(compiled, softmax_chain, [torch.randn(4, 8)])
    check_against_eager(compiled, softmax_chain, [torch.randn(2, 3, 8)])
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert len(log.recompiles) == 1 and "[2, 3, 8]" in log.recompiles[0], log.recompiles


# -- (b) a new dtype --------------------------------------------------------------------------

def test_new_dtype_recompiles_and_stays_correct() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.softmax(-1) * w).sum(-1) + x.mean(-1).sigmoid()

    compiled = ember.compile(fn, target="aten")
    check_against_eager(compiled, fn, [torch.randn(4, 8), torch.randn(8)])
    x64, w64 = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    # Compares float64 results (dtype included) at float64 tolerances.
    check_against_eager(compiled, fn, [x64, w64])

    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert len(log.recompiles) == 1, log.recompiles
    assert "float32" in log.recompiles[0] and "float64" in log.recompiles[0], log.recompiles
    assert any("torch.float64[4, 8]@cpu" in g.input_signature for g in log.graphs)


def test_float64_precision_is_kept() -> None:
    # A float64 result computed in float32 anywhere would be off by ~1e-7 relative: far above 1e-12.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 1.0000001).softmax(-1) - x.exp() / x.exp().sum(-1, keepdim=True)

    compiled = ember.compile(fn, target="aten")
    compiled(torch.randn(3, 5))
    x = torch.randn(3, 5, dtype=torch.float64) * 10
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-12, atol=1e-14)


# -- other input changes: layout, requires_grad --------------------------------------------------

def test_non_contiguous_input_after_contiguous_is_correct() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).softmax(-1) + y.cos()

    compiled = ember.compile(fn, target="aten")
    check_against_eager(compiled, fn, [torch.randn(4, 6), torch.randn(4, 6)])
    transposed = torch.randn(6, 4).t()
    assert not transposed.is_contiguous()
    y = torch.randn(4, 6)
    assert_close(compiled(transposed, y), fn(transposed, y), "transposed input")
    check_against_eager(compiled, fn, [transposed, y])  # clone() keeps the transposed strides
    sliced = torch.randn(4, 12)[:, ::2]
    assert_close(compiled(sliced, y), fn(sliced, y), "strided input")
    assert_compiled_cleanly(log_of(compiled))


def test_requires_grad_change_recompiles_and_stays_correct() -> None:
    compiled = ember.compile(softmax_chain, target="aten")
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert_close(compiled(x), softmax_chain(x), "no-grad call")
    check_against_eager(compiled, softmax_chain, [torch.randn(4, 8)])
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    assert {g.kind for g in log.graphs} == {"inference", "forward", "backward"}


# -- (c) an input on the wrong device ------------------------------------------------------------

def _eager_error(fn, *args) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: B017 - whatever eager raises is the reference
        fn(*args)
    return info.value


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "after-cpu-call"])
def test_meta_input_to_cpu_module_raises_like_eager(warm: bool) -> None:
    model = SmallNet()
    bad = torch.randn(3, 8, device="meta")
    eager_err = _eager_error(model, bad)
    assert "meta" in str(eager_err)

    compiled = ember.compile(model, target="aten")
    if warm:
        check_against_eager(compiled, model, [torch.randn(3, 8)], params=list(model.parameters()))
    with pytest.raises(type(eager_err)) as info:
        compiled(bad)
    assert "meta" in str(info.value)
    # Still correct on good input afterwards.
    check_against_eager(compiled, model, [torch.randn(3, 8)], params=list(model.parameters()))


def test_meta_input_mixed_with_cpu_input_raises_like_eager() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).relu() * 2.0

    cpu, meta = torch.randn(4, 5), torch.randn(4, 5, device="meta")
    eager_err = _eager_error(fn, cpu, meta)
    compiled = ember.compile(fn, target="aten")
    y = torch.randn(4, 5)
    assert_close(compiled(cpu, y), fn(cpu, y), "warm-up")
    with pytest.raises(type(eager_err)) as info:
        compiled(cpu, meta)
    assert "meta" in str(info.value)


# -- (d) recompiles are bounded: static specialisations, then one dynamic-shape graph ---------------

def test_recompiles_are_bounded_and_results_stay_correct() -> None:
    compiled = ember.compile(softmax_chain, target="aten", max_recompiles=2, warm_start=False)  # Dynamo's path
    for rows in (2, 3, 4, 5, 6):
        check_against_eager(compiled, softmax_chain, [torch.randn(rows, 7)])
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    # Two static specialisations, then one dynamic-shape graph serves rows 4, 5 and 6.
    assert [cid for cid, _ in log.frames] == ["0/0", "0/1", "0/2"], log.frames
    assert log.dynamic == ["0/2"]
    assert len(log.recompiles) == 2 and "dynamic-shape graph" in log.recompiles[-1], log.recompiles


MODE = {"name": "a"}


def by_mode(x: torch.Tensor) -> torch.Tensor:
    # Dynamo guards on the string's value: no dynamic shape can serve a new one.
    return (x * 2.0).softmax(-1) if MODE["name"].startswith("a") else x.exp()


def test_recompile_limit_is_per_compiled_function() -> None:
    bounded = ember.compile(by_mode, target="aten", max_recompiles=1, warm_start=False)  # Dynamo's limit
    ember.compile(lambda x: x * 3.0, target="aten")  # another model, default options: its own limit
    x = torch.randn(3, 7)
    with pytest.warns(RuntimeWarning, match="runs it eagerly"):  # Dynamo gives up on the frame: said once
        for name in ("a", "ab", "abc", "b", "bc", "abcd", "bcd", "abcde", "c"):
            MODE["name"] = name
            assert_close(bounded(x), by_mode(x), f"mode {name}")  # past the limit: eager, still correct
    # One static specialisation plus the DYNAMIC_RECOMPILES Dynamo allows after it; then eager.
    assert len(log_of(bounded).frames) == 1 + DYNAMIC_RECOMPILES, log_of(bounded).frames


# -- (e) wrong rank ----------------------------------------------------------------------------

def _conv_case():
    conv = torch.nn.Conv2d(3, 4, 3)
    return conv, torch.randn(1, 3, 6, 6), torch.randn(3, 6)


def _bmm_case():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, x.transpose(-1, -2)).relu()
    return fn, torch.randn(2, 3, 4), torch.randn(3, 4)


def _softmax_dim_case():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.softmax(x * 2.0, dim=2)
    return fn, torch.randn(2, 3, 4), torch.randn(3, 4)


def _layer_norm_case():
    ln = torch.nn.LayerNorm(8)
    return ln, torch.randn(3, 8), torch.randn(8, 3)


@pytest.mark.parametrize("case", [_conv_case, _bmm_case, _softmax_dim_case, _layer_norm_case],
                         ids=["conv2d", "bmm", "softmax-dim", "layer-norm"])
@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "after-good-call"])
def test_wrong_rank_raises_like_eager(case, warm: bool) -> None:
    fn, good, bad = case()
    eager_err = _eager_error(fn, bad)
    compiled = ember.compile(fn, target="aten")
    if warm:
        params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
        want, _ = forward_backward(fn, [good], params=params)
        got, _ = forward_backward(compiled, [good], params=params)
        assert_close(got, want, "good input")
    with pytest.raises(type(eager_err)) as info:
        compiled(bad)
    # The first line of eager's message (the part that names the problem) appears in Ember's.
    key = str(eager_err).splitlines()[0].split(",")[0]
    assert key in str(info.value), (key, str(info.value)[:400])


@pytest.mark.parametrize("warm_start", [False, True])
def test_a_bad_first_call_leaves_the_next_good_one_compiled(warm_start: bool) -> None:
    # With the user's settings (not the tests' strict mode): the bad call raises eager's error and
    # changes nothing, so the next call compiles. (Running a frame Dynamo failed on eagerly, through
    # Dynamo's suppress_errors, marked torch's shared call wrapper skipped for good.)
    from ember import config

    model = SmallNet()
    with config.patch(strict=False, warm_start=warm_start):
        compiled = ember.compile(model)
        with pytest.raises(RuntimeError):  # (Dynamo's, naming the shapes; eager: "cannot be multiplied")
            compiled(torch.randn(3, 5))
        x = torch.randn(3, 8)
        assert_close(compiled(x), model(x), "good call after a bad one")
        other = ember.compile(SmallNet())  # another model compiles too
        other(x)
    assert log_of(compiled).graphs and log_of(other).graphs
    assert not log_of(compiled).gave_up


def test_a_call_sets_dynamo_settings_only_while_it_runs() -> None:
    # ShapePolicy writes the settings that differ, restores exactly those, and a user's own
    # value (here a limit of 3) is what Dynamo sees again after the call.
    cfg = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    seen: list[tuple] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append((cfg.automatic_dynamic_shapes, cfg.assume_static_by_default, getattr(cfg, limit_name)))
        return x * 2.0

    setattr(cfg, limit_name, 3)
    before = (cfg.automatic_dynamic_shapes, cfg.assume_static_by_default, getattr(cfg, limit_name))
    compiled = ember.compile(lambda x: spy(x) + 1.0, target="aten", max_recompiles=2, warm_start=False)
    x = torch.randn(4)
    assert_close(compiled(x), x * 2.0 + 1.0, "first call")
    assert (cfg.automatic_dynamic_shapes, cfg.assume_static_by_default, getattr(cfg, limit_name)) == before
    # While Dynamo traced the call: static shapes first, this model's limit (2 static + dynamic ones).
    assert seen[0] == (False, True, 2 + DYNAMIC_RECOMPILES), seen
