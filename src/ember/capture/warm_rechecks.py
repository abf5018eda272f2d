"""Guards torch cannot save, re-checked by Ember by what the guarded value is.

Two kinds of Dynamo guard do not survive torch's save of a traced frame:
- Identity guards (``ID_MATCH`` behind a ``CONSTANT_MATCH`` or ``BUILTIN_MATCH``): e.g. transformers'
  BERT guards the ``__code__`` of a method and of a decorator's wrapper, and the builtin ``gelu`` an
  activation module holds. An object's id means nothing in another process, so torch refuses them.
- Guards on module globals (a module's forward reads ``G['config_flag']``, a registry dict, a class,
  an imported module, a helper function): torch's default filter drops them for a module's forward.
  Without them a program traced with ``FLAG = True`` would run after ``FLAG = False``.

Each such guard becomes a re-check: its source expression, a kind (what the guard compares) and a
description of the value that holds in any process where the value is the same (a constant's repr,
a module's name, a class's qualified name and source-file hash, an enum member's class and name, a
function's code, a length, a key list). On load every expression is evaluated (against the model, its forward's globals and the
call's arguments) and described; any difference or error is a failed guard (a fresh compile). Once a
file's re-checks hold, each call checks them as Dynamo's guards do in a process: identity of the
objects found at load, equality of constants, lengths, keys, in one generated function.

A guard no kind covers (``DICT_VERSION``, a global tensor, an object without a stable description)
makes the frame unsaveable: the caller then keeps Dynamo's own path for the model.
"""

from __future__ import annotations

import ast
import builtins
import enum
import hashlib
import importlib
import inspect
import os
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The guard kinds whose derived ID_MATCH is replaced by a re-check when the value can be described.
RECHECKED = ("CONSTANT_MATCH", "BUILTIN_MATCH", "EQUALS_MATCH")

# Dynamo guard -> the re-check kind that compares what it compares.
_KIND = {
    "CONSTANT_MATCH": "eq", "EQUALS_MATCH": "eq", "BOOL_MATCH": "eq", "NONE_MATCH": "eq",
    "ID_MATCH": "is", "CLASS_MATCH": "is", "MODULE_MATCH": "is", "FUNCTION_MATCH": "is", "BUILTIN_MATCH": "is",
    "CLOSURE_MATCH": "code", "TYPE_MATCH": "type", "SEQUENCE_LENGTH": "len", "DICT_LENGTH": "len",
    "LIST_LENGTH": "len", "TUPLE_ITERATOR_LEN": None, "DICT_KEYS_MATCH": "keys", "MAPPING_KEYS_CHECK": "keys",
    "DICT_CONTAINS": "contains", "DICT_NOT_CONTAINS": "contains", "NOT_PRESENT_IN_GENERIC_DICT": "generic_dict",
    "HASATTR": "hasattr", "DUPLICATE_INPUT": "same", "NOT_NONE_MATCH": "notnone",
}

# Per-call form of each kind: ``E`` the expression, ``O`` the value found at load (see module doc).
_CALL_FORM = {
    "is": "({e}) is O[{i}]",
    "code": "({e}).__code__ is O[{i}]",
    "eq": "__ember_eq(({e}), O[{i}])",
    "type": "type({e}) is O[{i}]",
    "len": "len({e}) == O[{i}]",
    "keys": "list(({e}).keys()) == O[{i}]",
    "contains": "(O[{i}][0] in ({e})) is O[{i}][1]",
    "generic_dict": "(O[{i}][0] in ({e}).__dict__) is O[{i}][1]",
    "hasattr": "hasattr(({e}), O[{i}][0]) is O[{i}][1]",
    "same": "({e}) is ({a})",
    "notnone": "({e}) is not None",
}

CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_FILE_HASHES: dict[tuple[str, float], str] = {}


def file_hash(path: str | None) -> str:
    """A short hash of a file's bytes ("?" when there is no such file), cached by modification time."""
    if not path or not os.path.exists(path):
        return "?"
    stamp = (path, os.path.getmtime(path))
    if stamp not in _FILE_HASHES:
        _FILE_HASHES[stamp] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return _FILE_HASHES[stamp]


def class_source(cls: type) -> str:
    """A class's qualified name and the hash of its source file."""
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    return f"{cls.__module__}.{cls.__qualname__}@{file_hash(path)}"


def closure_values(fn: types.FunctionType) -> dict[str, object]:
    """A function's closure variables by name (raises ValueError for an empty cell)."""
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def constant(value: object) -> str | None:
    """``value``'s repr when it is a plain constant (equal reprs: equal values), else None."""
    if type(value) in CONSTANT_TYPES:
        return f"{type(value).__name__} {value!r}"
    if type(value) in (tuple, frozenset):
        parts = [constant(v) for v in (sorted(value, key=repr) if type(value) is frozenset else value)]
        return None if None in parts else f"{type(value).__name__}({', '.join(parts)})"  # type: ignore[arg-type]
    return None


def code_digest(code: types.CodeType) -> str:
    """A hash of what a code object does: bytecode, names, constants, and the code nested in it."""
    consts = [code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return hashlib.sha256(b"|".join([code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(),
                                     repr(consts).encode()])).hexdigest()[:24]


def describe(value: object) -> str | None:
    """A description of ``value`` that is equal in any process where it is the same object (None: none)."""
    if isinstance(value, types.CodeType):
        qualname = getattr(value, "co_qualname", value.co_name)
        return f"code {value.co_filename}:{value.co_firstlineno} {qualname} {code_digest(value)}"
    if isinstance(value, types.BuiltinFunctionType):
        module = getattr(value, "__module__", None) or type(getattr(value, "__self__", None)).__qualname__
        return f"builtin {module}.{value.__qualname__}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return f"class {class_source(value)}"
    if isinstance(value, types.FunctionType):
        return f"function {value.__module__}.{value.__qualname__} {describe(value.__code__)}"
    if isinstance(value, (types.WrapperDescriptorType, types.MethodDescriptorType)):
        return f"descriptor {value.__objclass__.__module__}.{value.__objclass__.__qualname__}.{value.__name__}"
    if isinstance(value, enum.Enum):  # a member is its class's one object of that name (timm's Format.NCHW)
        name = value.name
        try:
            named = isinstance(name, str) and type(value)[name] is value
        except KeyError:  # a combination of flags: no member of that name
            named = False
        return f"enum {class_source(type(value))}.{name}" if named else None
    return constant(value)


def _want(kind: str, value: object, arg: object) -> str | None:
    """What a re-check of ``kind`` records of ``value`` (None: nothing that survives a new process)."""
    if kind == "eq":
        return constant(value)
    if kind == "is":
        return describe(value)
    if kind == "code":
        return describe(getattr(value, "__code__", None))
    if kind == "type":
        return describe(type(value))
    if kind == "len":
        return str(len(value))  # type: ignore[arg-type]
    if kind == "keys":
        keys = [describe(k) for k in value.keys()]  # type: ignore[attr-defined]
        return None if None in keys else repr(keys)
    if kind == "contains":
        return str(arg in value)  # type: ignore[operator]
    if kind == "generic_dict":
        return str(arg in value.__dict__)
    if kind == "hasattr":
        return str(hasattr(value, arg))  # type: ignore[arg-type]
    return ""  # same, notnone: nothing to describe, checked as is


def _reference(kind: str, value: object, arg: object) -> object:
    """The per-call comparand (``O[i]``) of a re-check that held for ``value``."""
    if kind == "code":
        return value.__code__  # type: ignore[attr-defined]
    if kind == "type":
        return type(value)
    if kind == "len":
        return len(value)  # type: ignore[arg-type]
    if kind == "keys":
        return list(value.keys())  # type: ignore[attr-defined]
    if kind == "contains":
        return (arg, arg in value)  # type: ignore[operator]
    if kind == "generic_dict":
        return (arg, arg in value.__dict__)
    if kind == "hasattr":
        return (arg, hasattr(value, arg))  # type: ignore[arg-type]
    return value


def replaceable(entry: Any, unserializable: tuple[str, ...]) -> list | None:
    """The re-check that stands in for torch's identity guard ``entry`` (a GuardFilterEntry), or None."""
    if entry.guard_type not in RECHECKED or not set(entry.derived_guard_types or ()) & set(unserializable):
        return None
    want = describe(entry.value) if entry.has_value else None
    return None if want is None else ["is", entry.name, want, None]


_INSTALLED = re.compile(r"G\['(_\d+_c\d+|___[^']*\d[^']*)'\]")


def portable(expression: str, f_globals: dict) -> str | None:
    """``expression`` with the globals Dynamo installed under a name holding an object's id
    (``G['_140164627608688_c0']``) named by module import instead (None: one is not a module)."""
    def by_import(match: re.Match) -> str:
        value = f_globals.get(match.group(1))
        if not isinstance(value, types.ModuleType):
            raise LookupError(match.group(1))
        return f"G['__import_{value.__name__.replace('.', '_dot_')}']"

    try:
        return _INSTALLED.sub(by_import, expression)
    except LookupError:
        return None


def recheck_for(entry: Any, f_globals: dict) -> list | None:
    """The re-check of a guard torch does not save (on a module global, or by an object's identity;
    a GuardFilterEntry), or None when no kind covers it; ``f_globals``: the traced frame's globals."""
    kind = _KIND.get(entry.guard_type)
    name = portable(entry.name, f_globals)
    if kind is None or not entry.has_value or name is None:
        return None
    keywords = getattr(getattr(entry.orig_guard, "create_fn", None), "keywords", None) or {}
    arg: object = None
    if kind in ("contains", "generic_dict", "hasattr"):
        arg = keywords.get("key", keywords.get("attr"))
        if constant(arg) is None or not isinstance(arg, (str, int)):
            return None
    elif kind == "same":
        other = keywords.get("source_b")
        if other is None:
            return None
        arg = getattr(other, "name", None)
        arg = arg() if callable(arg) else arg  # a method in older torch, a property in newer
        arg = portable(arg, f_globals) if isinstance(arg, str) else None
        if arg is None:
            return None
        try:
            from torch._dynamo.guards import strip_local_scope
            arg = strip_local_scope(arg)  # L['x'] -> x, as Dynamo names the entry itself
        except ImportError:
            pass
    elif kind == "eq" and constant(entry.value) is None:
        kind = "is"  # an object compared by identity behind the constant guard
    try:
        want = _want(kind, entry.value, arg)
    except Exception:  # noqa: BLE001 - cannot describe it: not covered
        return None
    return None if want is None else [kind, name, want, arg]


def _eq(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def _guard_names() -> dict[str, object]:
    """The helpers Dynamo's guard expressions call (``___odict_getitem`` ...), where torch has them."""
    from torch._dynamo import guards
    getter = getattr(guards, "_get_closure_vars", None)
    found = getter() if getter is not None else getattr(guards, "CLOSURE_VARS", {})
    return {**found, "__builtins__": builtins, "__ember_eq": _eq}


class GuardGlobals:
    """A frame's live globals as Dynamo's guard expressions name them (``G[...]``), with the names
    Dynamo installs in them while tracing, which a new process has not: ``__builtins_dict___N`` (the
    builtins dict) and ``__import_a_dot_b`` (module ``a.b``, symbolic_convert.py's alias for an
    import). A view, not a copy: a global assigned after the check is made is seen by the next call."""

    def __init__(self, f_globals: dict) -> None:
        self.f_globals = f_globals

    def __getitem__(self, key: str) -> Any:
        try:
            return self.f_globals[key]
        except KeyError:
            if key.startswith("__builtins_dict__"):
                return builtins.__dict__
            if key.startswith("__import_"):
                return importlib.import_module(key[len("__import_"):].replace("_dot_", "."))
            raise


def _compile_all(expressions: list[str]) -> list[types.CodeType]:
    """Each expression's code, ``eval``-able with a scope dict: compiled in one pass as the bodies of
    lambdas (one ``compile`` per expression took 0.2 s for bert's 320 re-checks on an H100 host)."""
    source = "__e = [\n" + "".join(f"    lambda: ({e}),\n" for e in expressions) + "]\n"
    try:
        namespace: dict[str, Any] = {}
        exec(compile(source, "<ember warm-start guard>", "exec"), namespace)  # noqa: S102 - Dynamo's expressions
        return [f.__code__ for f in namespace["__e"]]
    except SyntaxError:  # one of them does not parse alone: compile each, so the error names it
        return [compile(e, "<ember warm-start guard>", "eval") for e in expressions]


class Rechecks:
    """The re-checks of one saved frame (``[kind, expression, description, argument]`` items)."""

    def __init__(self, items: list[list]) -> None:
        self.items = [list(i) for i in items]
        self._compiled = _compile_all([i[1] for i in self.items])
        self._fast: Any = None
        self._refs: list[object] = []
        # A function's warm start (warm_function.py): the closure the loaded frame holds, checked per call.
        self.closure: dict[str, Any] | None = None

    def _values(self, names: dict[str, Any], forward: Any, args: tuple, kwargs: dict) -> Any:
        scope: dict[str, Any] = {**_guard_names(), **names}
        bound = False
        for code in self._compiled:
            try:
                yield eval(code, scope)  # noqa: S307 - Dynamo's source expression
            except NameError:
                if bound:
                    raise
                bound = True  # it names an argument of forward
                scope.update(inspect.signature(forward).bind(*args, **kwargs).arguments)
                scope["L"] = dict(scope)
                yield eval(code, scope)  # noqa: S307

    def failing(self, names: dict[str, Any], forward: Any, args: tuple, kwargs: dict) -> str | None:
        """The first re-check whose value is not what the file describes ("expression: why"), None when
        all hold; then later calls are checked by ``holds``. ``names``: what the expressions may name
        besides ``forward``'s arguments (``self``, ``G`` the globals; a function's closure variables)."""
        refs: list[object] = []
        values = self._values(names, forward, args, kwargs)
        for kind, name, want, arg in self.items:
            try:
                value = next(values)
                got = str(value is _other(names, arg)) if kind == "same" else _want(kind, value, arg)
                if kind == "same" and got != "True" or kind == "notnone" and value is None:
                    return f"{name}: {kind} does not hold"
                if kind not in ("same", "notnone") and got != want:
                    return f"{name}: {got} where the file has {want}"
                refs.append(_reference(kind, value, arg))
            except Exception as err:  # noqa: BLE001 - cannot evaluate it here: the guard fails
                return f"{name}: {type(err).__name__}"
        self._refs = refs
        self._fast = self._generate(names)
        return None

    def _generate(self, names: dict[str, Any]) -> Any:
        """One function checking every re-check against the values found by ``failing``; each
        sub-expression the checks share is evaluated once per call (see ``_SharedReads``)."""
        reads = _SharedReads()
        seen: set[tuple] = set()
        namespace: dict[str, Any] = {**_guard_names(), **names}
        aliases = _AliasReads(names.get("G"), namespace)
        for i, (kind, name, _, arg) in enumerate(self.items):
            if (kind, name, str(arg)) in seen:
                continue
            seen.add((kind, name, str(arg)))
            other = reads.value(aliases.rewrite(arg)) if kind == "same" else arg
            expression = reads.value(aliases.rewrite(name))
            reads.lines.append(f"if not ({_CALL_FORM[kind].format(e=expression, i=i, a=other)}): return False")
        body = "\n        ".join(reads.lines or ["pass"])
        source = (f"def __ember_rechecks(O):\n    try:\n        {body}\n    except NameError:\n        raise\n"
                  f"    except Exception:\n        return False\n    return True\n")
        exec(compile(source, "<ember warm-start guards>", "exec"), namespace)  # noqa: S102 - Dynamo's expressions
        return namespace["__ember_rechecks"]

    def holds(self, names: Callable[[], dict[str, Any]], forward: Any, args: tuple, kwargs: dict) -> bool:
        """Whether every re-check holds for this call (after ``failing`` found them holding once).
        ``names`` gives ``failing``'s names; it is called only when the generated check cannot run."""
        if self._fast is None:
            return self.failing(names(), forward, args, kwargs) is None
        try:
            return bool(self._fast(self._refs))
        except NameError:  # an expression names an argument of forward: the slow path binds them
            return self._slow(names(), forward, args, kwargs)
        except Exception:  # noqa: BLE001 - cannot evaluate it now: the guard fails
            return False

    def _slow(self, names: dict[str, Any], forward: Any, args: tuple, kwargs: dict) -> bool:
        try:
            values = list(self._values(names, forward, args, kwargs))
        except Exception:  # noqa: BLE001
            return False
        for (kind, _, _, arg), value, ref in zip(self.items, values, self._refs):
            if kind == "same" and value is not _other(names, arg) or kind == "notnone" and value is None:
                return False
            if kind not in ("same", "notnone") and not _eq_or_is(_reference(kind, value, arg), ref):
                return False
        return True


class _AliasReads:
    """The per-call check reads the frame's globals as a plain dict, not through ``GuardGlobals``:
    the names Dynamo installs while tracing (an imported module's alias, the builtins dict) are
    looked up once, when the check is generated, as Dynamo itself installs them once in the frame's
    globals. Through ``GuardGlobals`` a small BERT's check made 24 Python-level reads and 14
    ``import_module`` calls per call (23.9 us of a 0.43 ms call on the CI CPU)."""

    _ALIAS = re.compile(r"""G\[(['"])((?:__import_|__builtins_dict__)\w*)\1\]""")

    def __init__(self, g: object, namespace: dict[str, Any]) -> None:
        self.g = g if isinstance(g, GuardGlobals) else None
        self.namespace = namespace
        if self.g is not None:
            namespace["G"] = self.g.f_globals

    def rewrite(self, expression: str | None) -> str | None:
        if self.g is None or not isinstance(expression, str):
            return expression
        return self._ALIAS.sub(self._resolve, expression)

    def _resolve(self, match: re.Match) -> str:
        local = f"__ember_G{match.group(2)}"
        if local not in self.namespace:
            try:
                self.namespace[local] = self.g[match.group(2)]
            except Exception:  # noqa: BLE001 - no such module here: read through GuardGlobals per call
                self.namespace["G"] = self.g
                return match.group(0)
        return local


class _SharedReads:
    """Straight-line code reading Dynamo's guard expressions with every repeated sub-expression in a
    local: 221 re-checks of a small BERT share prefixes such as ``G['__import_transformers...']``
    and ``type(self.config).__mro__[1].__dict__``, which evaluated each time cost ~200 us a call.
    Reads have no side effects, so reading one once per call is what reading it each time reads."""

    _PLAIN = (ast.Name, ast.Constant)
    _LAZY = (ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
             ast.NamedExpr)

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.known: dict[str, str] = {}

    def value(self, expression: str) -> str:
        """A local holding ``expression``'s value (its own text when it has parts read lazily)."""
        tree = ast.parse(expression, mode="eval").body
        if any(isinstance(n, self._LAZY) for n in ast.walk(tree)):
            return f"({expression})"
        return self._local(tree)

    def _local(self, node: ast.expr) -> str:
        if isinstance(node, self._PLAIN):
            return ast.unparse(node)
        key = ast.dump(node)
        if key not in self.known:
            # In place: each node of a freshly parsed tree is replaced once, after its key is taken.
            node = _Replace(self).visit(node)
            self.known[key] = f"t{len(self.known)}"
            self.lines.append(f"{self.known[key]} = {ast.unparse(node)}")
        return self.known[key]


class _Replace(ast.NodeTransformer):
    """Each direct sub-expression of a node becomes the local that holds it."""

    def __init__(self, reads: _SharedReads) -> None:
        self.reads = reads
        self.top = True

    def visit(self, node: ast.AST) -> ast.AST:
        if self.top:
            self.top = False
            return self.generic_visit(node)
        if isinstance(node, ast.expr) and not isinstance(node, (ast.Starred, ast.Slice)):
            return ast.Name(self.reads._local(node), ast.Load())
        return self.generic_visit(node)


def _eq_or_is(a: object, b: object) -> bool:
    return a is b or (constant(a) is not None and _eq(a, b)) or (type(a) in (list, tuple) and a == b)


def _other(names: dict[str, Any], expression: str) -> object:
    """The object of a DUPLICATE_INPUT guard's second source."""
    return eval(expression, {**_guard_names(), **names})  # noqa: S307 - Dynamo's source expression
