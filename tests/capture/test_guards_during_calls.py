"""Dynamo's guards of frames Ember compiles: every change a guard exists for is seen (a reassigned
attribute, a swapped submodule or parameter, the training flag); Dynamo's recursive dict-tag guards
(whose fast path torch turned off after segfaults) follow ``dict_tag_guards`` where it is given,
else the process's setting, which is left as it was.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import assert_close, log_of

import ember
from ember.capture import backend as capture_backend

nn = torch.nn
_TAGS = "use_recursive_dict_tags_for_guards"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.5)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.fc(x).relu())) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _frame_guards(model: nn.Module) -> list[str]:
    """The text of each guard tree Dynamo keeps for the model's forward."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return [str(e.guard_manager) for e in _debug_get_cache_entry_list(type(model).forward.__code__)]


@pytest.mark.skipif(capture_backend._DICT_TAGS is None, reason="this torch has no recursive dict-tag guards")
@pytest.mark.parametrize("users", [True, False])
@pytest.mark.parametrize("option", [None, False, True])
def test_dict_tag_guards_follow_the_option_and_the_users_setting_is_kept(users: bool, option: bool | None) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    torch._dynamo.reset()
    before = getattr(torch._dynamo.config, _TAGS)
    try:
        setattr(torch._dynamo.config, _TAGS, users)
        compiled = ember.compile(model, target="aten", cache=False, dict_tag_guards=option)
        x = torch.randn(4, 8)
        with torch.no_grad():
            for _ in range(2):
                assert_close(compiled(x), model(x), "inference")
        assert getattr(torch._dynamo.config, _TAGS) is users  # restored after each call
        guards = _frame_guards(model)
        assert len(guards) == 1
        # A module checked by its dict tag alone is a tag-safe root.
        assert ("tag_safe=(True, True)" in guards[0]) == (users if option is None else option)
        torch._dynamo.reset()
        if users:  # the same model under Dynamo alone has them: the test can see them
            opt = torch.compile(model, backend="eager")
            with torch.no_grad():
                opt(x)
            assert "tag_safe=(True, True)" in _frame_guards(model)[0]
    finally:
        setattr(torch._dynamo.config, _TAGS, before)


@pytest.mark.parametrize("tags", [False, True])
def test_every_change_a_guard_exists_for_is_still_seen(tags: bool) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    torch._dynamo.reset()
    compiled = ember.compile(model, target="aten", cache=False, dict_tag_guards=tags)
    x = torch.randn(4, 8)

    def check(what: str) -> None:
        with torch.no_grad():
            for _ in range(2):
                assert_close(compiled(x), model(x), what)

    check("first calls")
    model.blocks[0].scale = 3.0  # a Python attribute the graph baked in
    check("a float attribute reassigned")
    model.blocks[1].norm.eps = 0.5  # an attribute of a library module
    check("LayerNorm's eps reassigned")
    model.blocks[1].fc = nn.Linear(8, 8)  # a submodule swapped for another of the same shape
    check("a submodule swapped")
    model.head.weight = nn.Parameter(torch.randn(3, 8))  # a parameter replaced
    check("a parameter replaced")
    with torch.no_grad():
        model.head.bias.add_(1.0)  # changed in place: no guard, the frozen values' check
    check("a parameter changed in place")
    recompiles = len(log_of(compiled).recompiles)
    assert recompiles >= 2, log_of(compiled).recompiles  # the baked-in floats made new graphs

    # The training flag of one block: dropout turns on in that block only.
    model.blocks[0].train()
    torch.manual_seed(1)
    got = compiled(x)
    torch.manual_seed(1)
    want = model(x)
    assert_close(got, want, "one block in training mode")
    assert len(log_of(compiled).recompiles) > recompiles
