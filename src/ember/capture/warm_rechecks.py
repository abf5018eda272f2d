"""Identity guards torch cannot save, re-checked by what the object is rather than where it lives.

Dynamo guards some values by object identity (``ID_MATCH`` behind a ``CONSTANT_MATCH`` or
``BUILTIN_MATCH``): e.g. transformers' BERT has guards on the ``__code__`` of a method and of a
decorator's wrapper, and on the builtin ``gelu`` an activation module holds. An object's id means
nothing in another process, so torch refuses to serialise these guards (``PackageError: ID_MATCH
guard cannot be serialized``) and a warm start was off for such a model.

For a value that has a stable description, the warm start drops the guard from torch's set and
keeps it here instead: the guard's source expression (``self._modules['bert']...act``) and the
description of the value it had. On load the expression is evaluated against the model and the call's
arguments and the description compared; any difference or error is a failed guard (a fresh compile).
Described: code objects (file, first line, qualified name, bytecode, names, constants that are not
code), builtin functions (module and name). Anything else keeps torch's guard (then torch refuses and
the warm start is off, as before).
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import types
from typing import Any

# The guard kinds whose derived ID_MATCH is replaced by a re-check when the value can be described.
RECHECKED = ("CONSTANT_MATCH", "BUILTIN_MATCH", "EQUALS_MATCH")


def describe(value: object) -> str | None:
    """A description of ``value`` that is equal in any process where it is the same object (None: none)."""
    if isinstance(value, types.CodeType):
        consts = [c for c in value.co_consts if not isinstance(c, types.CodeType)]
        digest = hashlib.sha256(b"|".join([value.co_code, repr(value.co_names).encode(),
                                           repr(value.co_varnames).encode(), repr(consts).encode()])).hexdigest()
        qualname = getattr(value, "co_qualname", value.co_name)
        return f"code {value.co_filename}:{value.co_firstlineno} {qualname} {digest[:24]}"
    if isinstance(value, types.BuiltinFunctionType):
        module = getattr(value, "__module__", None) or type(getattr(value, "__self__", None)).__qualname__
        return f"builtin {module}.{value.__qualname__}"
    return None


def replaceable(entry: Any, unserializable: tuple[str, ...]) -> str | None:
    """The description to re-check instead of torch's guard ``entry`` (a GuardFilterEntry), or None."""
    if entry.guard_type not in RECHECKED or not set(entry.derived_guard_types or ()) & set(unserializable):
        return None
    return describe(entry.value) if entry.has_value else None


class Rechecks:
    """The re-checks of one saved frame (``[expression, description]`` pairs), compiled once."""

    def __init__(self, items: list[list[str]]) -> None:
        self.items = [list(i) for i in items]
        self._compiled = [(name, want, compile(name, "<ember warm-start guard>", "eval")) for name, want in items]
        # A function's warm start (warm_function.py): the closure the loaded frame holds, checked per call.
        self.closure: dict[str, Any] | None = None

    def failing(self, names: dict[str, Any], forward: Any, args: tuple, kwargs: dict) -> str | None:
        """The first re-check that fails for this call ("expression: why"), None when all hold.
        ``names``: what the expressions may name besides ``forward``'s arguments (``self``; a
        function's closure variables and ``G``, its globals)."""
        scope: dict[str, Any] = dict(names)
        for name, want, code in self._compiled:
            try:
                try:
                    value = eval(code, {"__builtins__": builtins}, scope)  # noqa: S307 - Dynamo's source expression
                except NameError:  # it names an argument of forward
                    scope.update(inspect.signature(forward).bind(*args, **kwargs).arguments)
                    scope["L"] = scope
                    value = eval(code, {"__builtins__": builtins}, scope)  # noqa: S307
            except Exception as err:  # noqa: BLE001 - cannot evaluate it here: the guard fails
                return f"{name}: {type(err).__name__}"
            got = describe(value)
            if got != want:
                return f"{name}: {got} where the file has {want}"
        return None
