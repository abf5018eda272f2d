"""Re-checks of guards torch does not save (capture/warm_rechecks.py): each kind holds for the
values it was made from, fails for a changed value, and the generated per-call check agrees."""

from __future__ import annotations

import collections
import enum
import math
from typing import Any

import pytest
import torch

from ember.capture.warm_rechecks import GuardGlobals, Rechecks, describe, portable


def helper(x: int) -> int:
    return x + 1


def other_helper(x: int) -> int:
    return x + 2


class Config:
    mode = "fast"


class Layout(enum.Enum):
    NCHW = "NCHW"
    NHWC = "NHWC"


class Access(enum.Flag):
    READ = 1
    WRITE = 2


def _globals() -> dict[str, Any]:
    return {"FLAG": True, "SCALE": 2.0, "REG": collections.OrderedDict(a=1, b=2), "helper": helper,
            "Config": Config, "maths": math, "cfg": Config(), "alias": math, "items": [1, 2, 3],
            "LAYOUT": Layout.NCHW}


# (kind, expression, argument); the description is what the kind records of the value
CHECKS = [
    ("eq", "G['FLAG']", None),
    ("eq", "G['SCALE']", None),
    ("is", "G['maths']", None),
    ("is", "G['Config']", None),
    ("is", "G['maths'].sqrt", None),
    ("code", "G['helper']", None),
    ("type", "G['REG']", None),
    ("len", "G['items']", None),
    ("keys", "G['REG']", None),
    ("contains", "G['REG']", "a"),
    ("contains", "G['REG']", "z"),
    ("generic_dict", "G['cfg']", "mode"),
    ("hasattr", "G['cfg']", "mode"),
    ("same", "G['maths']", "G['alias']"),
    ("notnone", "G['cfg']", None),
    ("eq", "G['REG']['a']", None),  # shares G['REG'] with the checks above
    ("is", "G['LAYOUT']", None),  # an enum member (timm's layers read Format.NCHW)
]

CHANGES = {
    "G['FLAG']": lambda g: g.__setitem__("FLAG", False),
    "G['SCALE']": lambda g: g.__setitem__("SCALE", 3.0),
    "G['maths']": lambda g: g.__setitem__("maths", collections),
    "G['Config']": lambda g: g.__setitem__("Config", type("OtherConfig", (), {})),
    "G['helper']": lambda g: g.__setitem__("helper", other_helper),
    "G['REG']": lambda g: g.__setitem__("REG", dict(g["REG"])),  # same keys, another type
    "G['items']": lambda g: g["items"].append(4),
    "keys": lambda g: g["REG"].move_to_end("a"),
    "contains": lambda g: g["REG"].__setitem__("z", 0),
    "G['cfg']": lambda g: vars(g["cfg"]).__setitem__("mode", "slow"),
    "same": lambda g: g.__setitem__("alias", collections),
    "notnone": lambda g: g.__setitem__("cfg", None),
    "G['REG']['a']": lambda g: g["REG"].__setitem__("a", 5),
    "G['LAYOUT']": lambda g: g.__setitem__("LAYOUT", Layout.NHWC),
}


def _rechecks(values: dict[str, Any]) -> Rechecks:
    from ember.capture.warm_rechecks import _want
    G = GuardGlobals(values)
    items = []
    for kind, expression, arg in CHECKS:
        value = eval(expression, {"G": G})  # noqa: S307 - the test's own expressions
        items.append([kind, expression, _want(kind, value, arg), arg])
    return Rechecks(items)


def _holds(r: Rechecks, values: dict[str, Any]) -> bool:
    return r.holds(lambda: {"G": GuardGlobals(values)}, helper, (1,), {})


def test_every_kind_holds_for_the_values_it_was_made_from() -> None:
    values = _globals()
    r = _rechecks(values)
    assert r.failing({"G": GuardGlobals(values)}, helper, (1,), {}) is None
    assert _holds(r, values)
    # A new process: equal values, other objects of the same description (a fresh OrderedDict).
    again = {**_globals(), "REG": collections.OrderedDict(a=1, b=2)}
    assert Rechecks(r.items).failing({"G": GuardGlobals(again)}, helper, (1,), {}) is None


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_value_fails_the_load_check_and_the_per_call_check(change: str) -> None:
    values = _globals()
    r = _rechecks(values)
    assert r.failing({"G": GuardGlobals(values)}, helper, (1,), {}) is None
    CHANGES[change](values)
    assert not _holds(r, values), change  # the generated per-call check (live globals)
    fresh = Rechecks(r.items)  # a new process loading the file
    assert fresh.failing({"G": GuardGlobals(values)}, helper, (1,), {}) is not None, change


def test_a_global_assigned_later_is_seen_by_the_next_call() -> None:
    values = _globals()
    r = _rechecks(values)
    assert r.failing({"G": GuardGlobals(values)}, helper, (1,), {}) is None
    values["FLAG"] = False  # GuardGlobals is a view, not a copy made at load
    assert not _holds(r, values)
    values["FLAG"] = True
    assert _holds(r, values)


def test_an_expression_naming_an_argument_is_checked_through_the_binding() -> None:
    r = Rechecks([["eq", "x", "int 1", None]])
    assert r.failing({}, helper, (1,), {}) is None
    assert r.holds(lambda: {}, helper, (1,), {})
    assert not r.holds(lambda: {}, helper, (2,), {})


def test_descriptions_name_what_a_value_is() -> None:
    assert describe(math) == "module math"
    assert describe(helper).startswith("function test_warm_rechecks.helper code ")
    assert describe(helper) != describe(other_helper)
    assert describe(torch.relu) == "builtin torch._VariableFunctionsClass.relu"
    assert describe((1, "a", None)) == "tuple(int 1, str 'a', NoneType None)"
    assert describe(object()) is None  # no description that survives a new process
    assert describe(Layout.NCHW).startswith("enum test_warm_rechecks.Layout@") and describe(Layout.NCHW).endswith(".NCHW")
    assert describe(Layout.NCHW) != describe(Layout.NHWC)
    assert describe(Access.READ).endswith(".READ")
    assert describe(Access.READ | Access.WRITE) is None  # a combination has no member of its own


def test_globals_dynamo_names_by_an_id_are_named_by_import() -> None:
    f_globals = {"_140164627608688_c0": torch, "_99_c0": object()}
    assert portable("G['_140164627608688_c0'].Tensor", f_globals) == "G['__import_torch'].Tensor"
    assert portable("G['_99_c0'].x", f_globals) is None
    assert eval(portable("G['_140164627608688_c0'].Tensor", f_globals), {"G": GuardGlobals({})}) is torch.Tensor  # noqa: S307


def test_per_call_check_resolves_dynamos_aliases_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo names an imported module ``G['__import_a_dot_b']`` and the builtins dict
    # ``G['__builtins_dict___0']``; the per-call check looks them up when it is generated (as Dynamo
    # installs them once) and reads the frame's globals as a plain dict, not through GuardGlobals.
    import sys
    import types

    module = types.ModuleType("ember_alias_probe")
    module.fn = helper
    monkeypatch.setitem(sys.modules, "ember_alias_probe", module)
    reads = []

    class Counting(GuardGlobals):
        def __getitem__(self, key: str) -> Any:
            reads.append(key)
            return super().__getitem__(key)

    values = {"FLAG": True}
    items = [["code", "G['__import_ember_alias_probe'].fn", None, None],
             ["is", "G['__builtins_dict___0']['len']", None, None], ["eq", "G['FLAG']", "bool True", None]]
    from ember.capture.warm_rechecks import _want
    for item in items[:2]:
        item[2] = _want(item[0], eval(item[1], {"G": GuardGlobals(values)}), None)  # noqa: S307
    r = Rechecks(items)
    assert r.failing({"G": Counting(values)}, helper, (1,), {}) is None
    reads.clear()
    assert _holds(r, values) and reads == []
    module.fn = other_helper  # the module's attribute changes: the check reads it from the module
    assert not _holds(r, values)
    module.fn = helper
    values["FLAG"] = False  # a global assigned later is still seen
    assert not _holds(r, values)
