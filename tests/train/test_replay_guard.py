"""Whole-step replays on CPU objects (a recording stand-in for the CUDA graph): the replay guard
(``train/replay_guard.py``) sends every change the full check knows through it, and the captured
gradients go back before or after the launch as the micro-step needs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_whole_step import TARGET, batch_for, clean_dynamo, loss_of, mlp  # noqa: F401 - an autouse fixture

import ember
from ember.train.capture import CudaWholeStep, PhaseGraph
from ember.train.replay_guard import TrainFlags


class _RecordingGraph:
    """Stands in for a CUDA graph: records what each parameter's .grad was when it was replayed."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.seen: list[list[torch.Tensor | None]] = []

    def replay(self) -> None:
        self.seen.append([p.grad for p in self.params])


def test_replay_puts_gradients_back_after_a_first_micro_step_and_before_an_accumulating_one() -> None:
    # A first micro-step overwrites the captured gradients: putting them back can wait until the
    # launch is out. An accumulating one adds to them: the user's gradients must be in them first.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ember.compile_step(loss_of(model), opt, target=TARGET, accumulate=2)
    cuda = CudaWholeStep(step, torch.device("cpu"))
    params = step.params
    statics = [torch.randn_like(p) for p in params]
    x, y = batch_for(model)
    cuda.static_batch = (torch.empty_like(x), torch.empty_like(y))
    for phase in ("first", "last"):
        cuda.graphs[phase] = PhaseGraph(_RecordingGraph(params), torch.randn(()), list(statics))
    opt.zero_grad(set_to_none=True)  # the user's zero_grad between steps
    cuda._replay(cuda.graphs["first"], (x, y))
    assert cuda.graphs["first"].graph.seen == [[None] * len(params)]  # launched before the put-back
    assert all(p.grad is s for p, s in zip(params, statics))
    torch.testing.assert_close(cuda.static_batch[0], x)
    mine = [torch.randn_like(p) for p in params]
    for p, g in zip(params, mine):
        p.grad = g.clone()  # the user's own gradients mid-accumulation
    cuda._replay(cuda.graphs["last"], (x, y))
    assert all(a is s for a, s in zip(cuda.graphs["last"].graph.seen[0], statics))  # in place before the launch
    for s, g in zip(statics, mine):
        torch.testing.assert_close(s, g)


def _holds(cuda: CudaWholeStep, batch: tuple) -> bool:
    """Whether the call passes the last replay's guard (no full check)."""
    assert cuda.fast is not None
    return cuda.fast.holds(batch, cuda.step.optimizer, cuda.step.scaler, "cpu")


def _guarded_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, CudaWholeStep, tuple]:
    """A CudaWholeStep on CPU objects whose last call replayed (a captured graph stands in), so
    that the next call is checked through its replay guard."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = ember.compile_step(loss_of(model), opt, target=TARGET, model=model)
    cuda = CudaWholeStep(step, torch.device("cpu"))
    batch = batch_for(model)
    assert cuda._check(batch, True) is None  # no graph yet: capture next
    cuda.graphs["full"] = PhaseGraph(_RecordingGraph(step.params), torch.randn(()), [None] * len(step.params))
    cuda._snapshot()
    assert cuda._check(batch, True) is None and cuda.fast is not None  # replay; the guard is made
    assert cuda._check(batch, True) is None and _holds(cuda, batch)
    return model, opt, cuda, batch


CHANGES = {  # what the user does between two steps -> what the check says (None: captured again;
    # "same": nothing that matters changed, so the step replays under a new guard)
    "batch shape": (lambda m, o, b: (b[0][:-1], b[1][:-1]), "the batch"),
    "batch dtype": (lambda m, o, b: (b[0].double(), b[1]), "the batch"),
    "eval mode": (lambda m, o, b: m.eval() and b, "train/eval mode"),
    "one module's flag": (lambda m, o, b: setattr(m[1], "training", False) or b, "train/eval mode"),
    "no grad": (None, "grad/autocast mode"),
    "parameter moved": (lambda m, o, b: setattr(next(m.parameters()), "data", torch.randn_like(next(m.parameters())))
                        or b, None),
    "learning rate": (lambda m, o, b: o.param_groups[0].__setitem__("lr", 0.05) or b, None),
    "new key": (lambda m, o, b: o.param_groups[0].__setitem__("extra", 1) or b, None),
    "load_state_dict": (lambda m, o, b: o.load_state_dict(o.state_dict()) or b, None),
    "params list": (lambda m, o, b: o.param_groups[0].__setitem__("params", list(o.param_groups[0]["params"])) or b,
                    "same"),
    "parameter swapped in the list": (lambda m, o, b: o.param_groups[0]["params"].__setitem__(
        0, torch.nn.Parameter(o.param_groups[0]["params"][0].detach().clone())) or b, None),
    "added group": (lambda m, o, b: o.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]}) or b,
                    None),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_replay_guard_sends_every_change_through_the_full_check(change: str) -> None:
    model, opt, cuda, batch = _guarded_step()
    make, says = CHANGES[change]
    if make is None:
        with torch.no_grad():
            assert not _holds(cuda, batch)
            why = cuda._check(batch, True)
            assert "grad/autocast mode" in why and not _holds(cuda, batch)
        return
    batch = make(model, opt, batch)
    assert not _holds(cuda, batch)
    why = cuda._check(batch, True)
    if says is None:  # a first micro-step captures the step again
        assert why is None and not cuda.graphs and cuda.fast is None
    elif says == "same":
        assert why is None and cuda.graphs and _holds(cuda, batch)
    else:
        assert why is not None and says in why, why
        assert cuda.fast is not None and not _holds(cuda, batch)  # checked in full again next time


def test_a_value_equal_to_the_captured_one_makes_a_new_guard() -> None:
    # A scheduler may write the same rate as a new float object: the full check finds no change
    # and the next calls take the guard again.
    _, opt, cuda, batch = _guarded_step()
    opt.param_groups[0]["lr"] = float(str(opt.param_groups[0]["lr"]))
    assert not _holds(cuda, batch)
    assert cuda._check(batch, True) is None and cuda.graphs
    assert _holds(cuda, batch)


class _FlagProperty(torch.nn.Module):
    """A module whose train/eval flag is a property over another attribute (read via getattr)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = True

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.mode

    @training.setter
    def training(self, value: bool) -> None:
        self.mode = value


@given(flags=st.lists(st.booleans(), min_size=1, max_size=12), flips=st.lists(st.integers(0, 11), max_size=4),
       property_at=st.integers(0, 12))
@settings(max_examples=60, deadline=None)
def test_train_flags_hold_exactly_when_every_flag_is_as_found(flags: list[bool], flips: list[int],
                                                              property_at: int) -> None:
    modules: list[torch.nn.Module] = [torch.nn.Identity() for _ in flags]
    if property_at < len(flags):
        modules[property_at] = _FlagProperty()
    for m, f in zip(modules, flags):
        m.training = f
    held = TrainFlags.of(modules)
    assert held.hold()
    for i in flips:
        if i < len(modules):
            modules[i].training = not modules[i].training
    assert held.hold() == ([m.training for m in modules] == flags)


def test_train_flags_of_a_partly_frozen_model_and_a_deleted_flag() -> None:
    model, opt, cuda, batch = _guarded_step()
    model.eval()
    model[2].train()  # one module trains while the rest are frozen: a new guard holds it
    assert not _holds(cuda, batch)
    assert "train/eval mode" in cuda._check(batch, True)
    cuda.signature = None
    assert cuda._check(batch, True) is None and _holds(cuda, batch)
    model[2].eval()
    assert not _holds(cuda, batch)
    model[2].train()
    assert _holds(cuda, batch)
    del model[0].__dict__["training"]  # read through the class now: the guard cannot say
    assert not _holds(cuda, batch)
