"""AOTAutograd checks custom operators' outputs for aliasing on a compiled function's first call
through a Python dispatch mode that every op of the call passes through. Ember sets it aside for
programs with no third-party operator in them (``runtime/program.without_idle_alias_analysis``),
and keeps it where it has something to check."""

from __future__ import annotations

import pytest
import torch
from torch._functorch._aot_autograd import runtime_wrappers
from torch.utils._python_dispatch import _get_current_dispatch_mode

import ember
from ember.runtime.program import analysis_checks_nothing, without_idle_alias_analysis

Mode = runtime_wrappers._AnalyzeCustomOpInputOutputMode

ATEN_ONLY = "def run(args):\n    a = aten.mm.default(x, y)\n    b = torch.ops.ember.small_bmm.default(a, a)\n" \
            "    return torch.ops.higher_order.wrap(b)"
FOREIGN = ATEN_ONLY + "\n    c = torch.ops.mylib.scale.default(b)"


def test_programs_with_and_without_a_third_party_operator() -> None:
    assert analysis_checks_nothing(ATEN_ONLY)
    assert analysis_checks_nothing("def run(args):\n    return prims.convert_element_type.default(x, t)")
    assert not analysis_checks_nothing(FOREIGN)


@pytest.mark.parametrize("source, kept", [(ATEN_ONLY, False), (FOREIGN, True)])
def test_the_mode_is_set_aside_only_where_it_checks_nothing(source: str, kept: bool) -> None:
    with Mode() as mode:
        with without_idle_alias_analysis(source):
            assert (_get_current_dispatch_mode() is mode) == kept
        assert _get_current_dispatch_mode() is mode


def test_another_mode_on_top_is_left_alone() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Counting() as counting, without_idle_alias_analysis(ATEN_ONLY):
        assert _get_current_dispatch_mode() is counting


def test_a_compiled_first_call_skips_the_analysis_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    original = Mode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(Mode, "__torch_dispatch__", counted)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    compiled = ember.compile(model)
    got = compiled(x)
    got.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(x)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    # AOTAutograd ran the analysis mode on the first call (the config is on by default); none of
    # the compiled programs' ATen calls went through it.
    assert runtime_wrappers.config.check_custom_op_aliasing
    assert not any(name.startswith("aten.") for name in seen), seen[:5]
