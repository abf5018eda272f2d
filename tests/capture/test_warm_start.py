"""Warm start across processes (capture/warm_start.py): a second process loads what the first saved
and traces nothing; results equal a cold compile's; every changed guard gives a fresh compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cold_cache import ColdCache

WORKER = Path(__file__).parents[1] / "support" / "warm_worker.py"
ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import enum
import functools

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))) * 2.0)


def passes_through(fn):  # a decorator like transformers' can_return_tuple: the wrapper takes fn's name
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


class Activation(nn.Module):  # holds a builtin, as transformers' GELUActivation does
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.act(x)


class Decorated(Net):
    def __init__(self, hidden, act=torch.nn.functional.gelu):
        super().__init__(hidden)
        self.act = Activation(act)

    @passes_through
    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


SCALE = 2.0  # module globals the forward reads: their values are guards a saved frame must keep
USE_RELU = True


class Layout(enum.Enum):  # an enum member read from a global, as timm's layers read Format.NCHW
    FLAT = "flat"
    FLIPPED = "flipped"


LAYOUT = Layout.FLAT


class Flagged(Net):
    def forward(self, x):
        h = self.norm(self.fc1(x))
        h = torch.relu(h) if USE_RELU else torch.tanh(h)
        if LAYOUT is Layout.FLIPPED:
            h = h.flip(-1)
        return self.fc2(h * SCALE)


class Broken(Net):
    def forward(self, x):
        y = self.fc1(x)
        print("a graph break")
        return self.fc2(torch.relu(self.norm(y)))
'''


def _run(cache: Path, models: Path, mode: str, *variants: str) -> tuple[list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "XDG_CACHE_HOME": str(cache / "xdg")}
    for name in ("EMBER_STRICT", "EMBER_WARM_START", "EMBER_CACHE_DIR"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(cache), str(models), mode, *variants], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:  # every run is correct, whatever the warm start did
        assert r["out_err"] < 1e-4 and r["grad_err"] < 1e-4, r
    return results, proc.stderr


def _models(tmp_path: Path, source: str = MODEL) -> Path:
    folder = tmp_path / "models"
    folder.mkdir(exist_ok=True)
    (folder / "warm_model.py").write_text(source)
    return folder


def _loaded(r: dict) -> bool:
    return any(line.startswith("loaded") for line in r["log"])


def _compiled(r: dict) -> bool:
    return any(line.startswith("compiled and traced") for line in r["log"])


def _cold(tmp_path_factory: pytest.TempPathFactory, mode: str) -> ColdCache:
    """The cache (and the model's folder inside it) after a first process, for each test that starts there."""
    return ColdCache(tmp_path_factory.mktemp(f"warm_start_{mode}"),
                     lambda cache: _run(cache, _models(cache), mode)[0][0])


@pytest.fixture(scope="module")
def cold_infer(tmp_path_factory: pytest.TempPathFactory) -> ColdCache:
    return _cold(tmp_path_factory, "infer")


@pytest.fixture(scope="module")
def cold_train(tmp_path_factory: pytest.TempPathFactory) -> ColdCache:
    return _cold(tmp_path_factory, "train")


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_second_process_loads_without_tracing(cold_infer: ColdCache, cold_train: ColdCache, mode: str) -> None:
    cache, cold = (cold_train if mode == "train" else cold_infer).fresh()
    models = cache / "models"
    assert _compiled(cold) and any(line.startswith("saved") for line in cold["log"]), cold["log"]
    assert cold["traced_graphs"] == 1
    (warm,), _ = _run(cache, models, mode)
    assert _loaded(warm) and not _compiled(warm), warm["log"]
    assert warm["traced_graphs"] == 0  # Dynamo traced nothing in this process
    assert set(warm["caches"]) == {"warm start"}
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]  # the same program ran
    if mode == "train":
        assert len(warm["grads"]) == 6 and len(warm["caches"]) == 2  # forward and backward


def test_every_changed_guard_compiles_afresh(cold_train: ColdCache) -> None:
    cache, _ = cold_train.fresh()
    models = cache / "models"
    variants = ("base", "weight_dtype", "weight_shape", "ember_version", "device_name")
    results, _ = _run(cache, models, "train", *variants)
    by = {r["variant"]: r for r in results}
    assert _loaded(by["base"]) and by["base"]["traced_graphs"] == 0
    for name in variants[1:]:
        assert _compiled(by[name]) and not _loaded(by[name]), (name, by[name]["log"])
    # The model's source changed (same class, same file): a fresh compile of the new code.
    _models(cache, MODEL.replace("* 2.0", "* 3.0"))
    (changed,), _ = _run(cache, models, "train")
    assert _compiled(changed) and not _loaded(changed), changed["log"]


def test_damaged_file_warns_and_compiles_afresh(cold_infer: ColdCache) -> None:
    cache, _ = cold_infer.fresh()
    (path,) = (cache / "warm_start").glob("*.ember-warm")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    (r,), stderr = _run(cache, cache / "models", "infer")
    assert "cannot be used (ValueError: checksum mismatch); compiling afresh" in stderr
    assert _compiled(r) and any("damaged" in line for line in r["log"])


def test_graph_break_falls_back_to_dynamo(tmp_path: Path) -> None:
    models = _models(tmp_path)
    (r,), _ = _run(tmp_path, models, "infer", "graph_break")
    assert any(line.startswith("off: no whole-graph capture") for line in r["log"]), r["log"]
    assert r["traced_graphs"] == 2  # Dynamo's own path: two graphs around the break
    assert not list((tmp_path / "warm_start").glob("*.ember-warm"))
    # A later process goes straight to Dynamo's path: it does not trace up to the break again.
    assert list((tmp_path / "warm_start").glob("*.ember-warm-off"))
    (again,), _ = _run(tmp_path, models, "infer", "graph_break")
    assert any("found by an earlier process" in line for line in again["log"]), again["log"]
    assert again["traced_graphs"] == 2


def test_identity_guards_are_rechecked(tmp_path: Path) -> None:
    # Dynamo guards the decorated forward's code and the builtin the activation holds by object
    # identity, which torch cannot save; Ember re-checks them by what they are (warm_rechecks.py).
    models = _models(tmp_path)
    (cold,), _ = _run(tmp_path, models, "train", "decorated")
    assert any("re-checked by Ember" in line for line in cold["log"]), cold["log"]
    assert any(line.startswith("saved") for line in cold["log"]), cold["log"]
    results, _ = _run(tmp_path, models, "train", "decorated", "decorated_other_act")
    by = {r["variant"]: r for r in results}
    warm = by["decorated"]
    assert _loaded(warm) and warm["traced_graphs"] == 0, warm["log"]
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]
    # Another builtin in the same attribute: same key, same saved guards, the re-check fails.
    other = by["decorated_other_act"]
    assert any("a re-checked guard fails" in line for line in other["log"]), other["log"]
    assert _compiled(other) and not _loaded(other)


def test_builtins_read_as_globals_pass_the_external_reference_check() -> None:
    # torch 2.11 saves no builtins with an ahead-of-time compiled function yet checks every global
    # its bytecode reads, so bert ("Missing required external references: ['type']") got no warm start.
    import types

    from ember import compat
    env_class = getattr(__import__("torch._dynamo.convert_frame", fromlist=["x"]), "GraphRuntimeEnv", None)
    if env_class is None or not hasattr(env_class, "_check_external_refs"):
        pytest.skip("this torch has no external-reference check")
    reads_builtins = types.SimpleNamespace(external_refs={"type", "len", "helper"})
    reads_unknown = types.SimpleNamespace(external_refs={"type", "not_saved_anywhere"})
    with pytest.raises(RuntimeError, match="type"):
        env_class._check_external_refs(reads_builtins, {"helper": 1})  # torch's own check
    with compat.builtin_references_allowed():
        env_class._check_external_refs(reads_builtins, {"helper": 1})
        with pytest.raises(RuntimeError, match=r"\['not_saved_anywhere'\]"):
            env_class._check_external_refs(reads_unknown, {"helper": 1})


def test_a_guard_on_a_default_argument_is_saved_in_a_form_that_loads() -> None:
    # torch 2.11 pickles a guard source as its class called with every dataclass field, also those
    # __post_init__ sets, so a saved guard on a function's default argument (a model's forward
    # inlined into a whole step's train_fn: bert's) could not be loaded. Simulated here with 2.11's
    # reducer on this torch's DefaultsSource.
    import dataclasses
    import pickle

    from torch._dynamo.source import DefaultsSource, GlobalSource

    from ember import compat

    def every_field(self):  # torch 2.11's dataclass_with_cached_hash.__reduce__
        return (self.__class__, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    every_field.__qualname__ = "dataclass_with_cached_hash.<locals>.wrap.<locals>.__reduce__"
    own = DefaultsSource.__dict__.get("__reduce__")
    source = DefaultsSource(GlobalSource("forward"), 1)
    DefaultsSource.__reduce__ = every_field
    try:
        with pytest.raises(TypeError, match="positional argument"):
            pickle.loads(pickle.dumps(source))
        with compat.guard_sources_pickled_by_init_fields():
            data = pickle.dumps(source)
        assert DefaultsSource.__reduce__ is every_field  # put back after the block
    finally:
        if own is None:
            del DefaultsSource.__reduce__
        else:
            DefaultsSource.__reduce__ = own
    loaded = pickle.loads(data)
    assert loaded == source and loaded.name == source.name


def test_an_inlined_functions_source_is_recorded_once_with_the_same_record() -> None:
    # Dynamo records the source of a function each time it inlines it (a model's identical layers:
    # one forward many times); within a compile Ember records each code object once.
    from unittest import mock

    package = pytest.importorskip("torch._dynamo.package")
    if not hasattr(getattr(package, "SourceInfo", None), "add_code"):
        pytest.skip("this torch's package records no inlined sources")
    from ember import compat

    codes = [torch.nn.Linear.forward.__code__, torch.nn.ReLU.forward.__code__, torch.nn.functional.relu.__code__]
    plain = package.SourceInfo(inlined_sources=set())
    for code in codes * 4:
        plain.add_code(code)
    real = package.SourceInfo.add_code
    calls = []
    with mock.patch.object(package.SourceInfo, "add_code", lambda self, code: (calls.append(code), real(self, code))):
        with compat.inlined_sources_recorded_once():
            once, other = package.SourceInfo(inlined_sources=set()), package.SourceInfo(inlined_sources=set())
            for code in codes * 4:
                once.add_code(code)
            other.add_code(codes[0])  # another package records it again
    assert once.inlined_sources == plain.inlined_sources and len(plain.inlined_sources) == 3
    assert calls == codes + [codes[0]]
    assert package.SourceInfo.add_code is real


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(a) * b + a


def test_an_input_passed_twice_has_its_own_saved_program() -> None:
    # Dynamo traces model(x, x) with one input for both; that program must never run model(x, y).
    # The pattern of inputs passed twice is part of the key, so each call finds its own file
    # (without relying on a guard torch may not save) and the two do not replace each other.
    import ember

    torch.manual_seed(0)
    model = _Pair()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    first = ember.compile(model, warm_start=True)
    with torch.no_grad():
        torch.testing.assert_close(first(x, x), model(x, x))
        torch.testing.assert_close(first(x, y), model(x, y))
    saved = [line for line in first._ember_backend.log.warm_start if line.startswith("saved")]
    assert len(saved) == 2 and saved[0].split()[1] != saved[1].split()[1], first._ember_backend.log.warm_start
    torch._dynamo.reset()
    second = ember.compile(model, warm_start=True)  # a new compile finds both files
    with torch.no_grad():
        torch.testing.assert_close(second(x, y), model(x, y))
        torch.testing.assert_close(second(x, x), model(x, x))
    log = second._ember_backend.log.warm_start
    assert sum(line.startswith("loaded") for line in log) == 2 and not any("fails" in line for line in log), log


def test_module_globals_the_forward_reads_are_rechecked(tmp_path: Path) -> None:
    # torch drops a module forward's guards on globals when it saves; Ember re-checks them, so a
    # flag or constant set differently (by a script, not in the source) never runs the saved program.
    models = _models(tmp_path)
    (cold,), _ = _run(tmp_path, models, "train", "flagged")
    assert any("re-checked by Ember" in line for line in cold["log"]), cold["log"]
    assert any(line.startswith("saved") for line in cold["log"]), cold["log"]
    results, _ = _run(tmp_path, models, "train", "flagged", "flagged_scale", "flagged_tanh", "flagged_layout",
                      "flagged_between_calls")
    by = {r["variant"]: r for r in results}  # _run checked every result against eager
    assert _loaded(by["flagged"]) and by["flagged"]["traced_graphs"] == 0, by["flagged"]["log"]
    for name in ("flagged_scale", "flagged_tanh", "flagged_layout"):
        assert any("a re-checked guard fails" in line for line in by[name]["log"]), (name, by[name]["log"])
        assert _compiled(by[name]) and not _loaded(by[name]), (name, by[name]["log"])
    # Each setting keeps its own file. In one process, the flag flipped after a loaded program ran:
    # the next call does not run that program; it loads the one saved for the other setting.
    assert len(list((tmp_path / "warm_start").glob("*.ember-warm"))) == 4
    between = by["flagged_between_calls"]
    loads = [line for line in between["log"] if line.startswith("loaded")]
    assert len(loads) == 2 and loads[0].split()[1] != loads[1].split()[1], between["log"]
    assert between["traced_graphs"] == 0, between["log"]


def test_two_lambdas_of_one_function_never_share_a_saved_program(tmp_path: Path) -> None:
    # Both are "<locals>.<lambda>" of this test in this file: the key also holds each one's code.
    import ember

    x = torch.randn(4, 5)
    double = lambda t: t * 2 + 1  # noqa: E731
    shifted_sine = lambda t: t.sin() - 3  # noqa: E731
    for fn in (double, shifted_sine, double):
        torch._dynamo.reset()
        compiled = ember.compile(fn, warm_start=True, cache_dir=str(tmp_path), target="cpu")
        torch.testing.assert_close(compiled(x), fn(x))
    assert len(list((tmp_path / "warm_start").glob("*.ember-warm"))) == 2


def test_eval_module_called_with_gradients_keeps_dynamos_path() -> None:
    # A saved frame holds its backward compiled; an eval-mode call with gradients on is most likely
    # inference no backward follows, so it takes Dynamo's path (backward compiled only if one runs),
    # and the same model under no_grad warm-starts. Both give eager's results.
    import ember

    torch.manual_seed(0)
    model = _Pair().eval()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    compiled = ember.compile(model, warm_start=True)
    out = compiled(a, b)
    torch.testing.assert_close(out, model(a, b))
    log = compiled._ember_backend.log.warm_start
    assert any("eval mode with gradients on" in line for line in log), log
    assert not any(line.startswith("saved") for line in log), log
    out.sum().backward()  # a backward still works on Dynamo's path
    assert model.fc.weight.grad is not None

    torch._dynamo.reset()
    again = ember.compile(model, warm_start=True)
    with torch.no_grad():
        torch.testing.assert_close(again(a, b), model(a, b))
    assert any(line.startswith("saved") for line in again._ember_backend.log.warm_start), again._ember_backend.log.warm_start
