"""Parameter-only values on the GPU code path (passes/freeze.py for GPU inference graphs): computed
once per parameter version, recomputed on the host before a CUDA-graph replay when a parameter
changed, in place where they can be, and a new capture where they moved."""

from __future__ import annotations

import pytest
import torch
from cudagraph_fakes import cuda_graphs_on_cpu, fake_runner  # noqa: F401 - a fixture

import ember

nn = torch.nn


class Head(nn.Module):
    """A conv + batch norm + linear head: under autocast every weight is cast to bf16 per call in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def _graph(compiled: object) -> object:
    return next(g for g in compiled._ember_backend.log.graphs if g.kind == "inference")


def _check(compiled: object, model: nn.Module, autocast: bool) -> None:
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, want = compiled(x), model(x)
    tol = 3e-2 if autocast else 1e-4
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_parameter_changes_reach_the_replayed_graph(cuda_graphs_on_cpu: None, autocast: bool,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.runtime.frozen import FrozenValues
    checks: list[bool] = []  # addresses_known of each validity check
    valid = FrozenValues.valid
    monkeypatch.setattr(FrozenValues, "valid", lambda self, params, addresses_known=False:
                        checks.append(addresses_known) or valid(self, params, addresses_known))
    torch.manual_seed(0)
    model = Head().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    compiled = ember.compile(model, target="triton-interpret")
    for _ in range(4):  # uncaptured, captured, replayed
        _check(compiled, model, autocast)
    graph = _graph(compiled)
    assert "[frozen]" in graph.program and "def refresh_frozen(args, addresses_known=False):" in graph.program
    assert "replay" in graph.cudagraph or "captured" in graph.cudagraph, graph.cudagraph
    # Before a replay only the versions are read: the replay checked the addresses (the stand-in's
    # replays run the program, whose own check reads both).
    assert True in checks, checks
    with torch.no_grad():  # in place: the frozen values are recomputed where they were
        model.fc.weight.mul_(-2.0)
        model.bn.running_var.add_(1.0)
    for _ in range(2):
        _check(compiled, model, autocast)
    with torch.no_grad():  # load_state_dict copies in place too
        state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        state["bn.running_var"] = state["bn.running_var"].abs() + 0.5
        model.load_state_dict(state)
    _check(compiled, model, autocast)
    with torch.no_grad():  # a parameter's data replaced: another address, the same version count
        model.fc.weight.data = torch.randn_like(model.fc.weight)
    for _ in range(3):
        _check(compiled, model, autocast)


def test_freeze_off_keeps_casts_in_the_program(cuda_graphs_on_cpu: None) -> None:  # noqa: F811
    torch.manual_seed(0)
    model = Head().eval()
    compiled = ember.compile(model, target="triton-interpret", freeze=False)
    _check(compiled, model, True)
    assert "[frozen]" not in _graph(compiled).program


class _Program:
    """A boxed program with parameter-only values, as the generated ones: ``refresh_frozen`` says
    whether the values moved; ``run`` reads them."""

    def __init__(self) -> None:
        self.values = torch.randn(4)
        self.refreshed = 0
        self.move_next = False

    def refresh_frozen(self, args: list, addresses_known: bool = False) -> bool:
        self.refreshed += 1
        if self.move_next:
            self.move_next = False
            self.values = self.values.clone()
            return True
        return False

    def __call__(self, args: list) -> torch.Tensor:
        (x,) = args
        args.clear()
        return x * self.values


def test_the_runner_refreshes_before_each_replay_and_captures_again_when_values_move() -> None:
    program = _Program()
    runner = fake_runner(program)
    assert runner.refresh_frozen is not None
    x = torch.randn(4)
    for _ in range(4):
        torch.testing.assert_close(runner([x]), x * program.values)
    assert runner.captures == 1 and runner.replays == 3  # a capture replays at once
    assert program.refreshed == 3  # before the capture and before each replay, not on the first call
    program.move_next = True
    torch.testing.assert_close(runner([x]), x * program.values)
    assert runner.captures == 2 and runner.replays == 4
    torch.testing.assert_close(runner([x]), x * program.values)
    assert runner.captures == 2 and runner.replays == 5 and program.refreshed == 5


def test_frozen_check_sees_each_kind_of_parameter_change() -> None:
    # The state read through map (all tensors) and one by one (a non-tensor among them): a version
    # bump, a new tensor at another address and another non-tensor object each invalidate it;
    # with the addresses known (a replay checked them), a version bump still does.
    from ember.runtime.frozen import FrozenValues

    w, b = torch.randn(4, 3), torch.randn(4)
    marker = object()
    for params in ((w, b), (w, b, marker)):
        frozen = FrozenValues()
        assert not frozen.valid(params)
        frozen.get(lambda *p: (p[0] * 2,), params)
        assert frozen.valid(params) and frozen.valid(params, addresses_known=True)
        with torch.no_grad():
            w.mul_(2)  # in place: the version counter moves
        assert not frozen.valid(params) and not frozen.valid(params, addresses_known=True)
        frozen.get(lambda *p: (p[0] * 2,), params)
        torch.testing.assert_close(frozen.values[0], w * 2)
        assert not frozen.valid((w.clone(), b, marker)[:len(params)])  # another tensor: another address
    frozen.get(lambda *p: (p[0],), (w, marker))
    assert frozen.valid((w, marker)) and not frozen.valid((w, object()))
