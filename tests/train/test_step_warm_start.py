"""Warm start of a whole-step program (``ember.compile_step(..., warm_start=True)``; capture/
warm_function.py): a second process loads what the first saved and traces nothing; its losses and
parameters after N steps equal the cold process's and eager's; a changed weight shape or dtype, a
changed closure constant or a changed source compiles afresh; a damaged file warns and compiles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

WORKER = Path(__file__).parents[1] / "support" / "step_warm_worker.py"
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


model = None  # set by the worker, read by train_fn as a script's global


def train_fn(x, y):
    return F.cross_entropy(model(x), y) * 2.0


def closure_train_fn(net, scale):
    def train_fn(x, y):
        return F.cross_entropy(net(x), y) * scale
    return train_fn
'''


def _run(cache: Path, models: Path, *variants: str) -> tuple[list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "XDG_CACHE_HOME": str(cache / "xdg")}
    # Cold and warm processes compare losses bit for bit, so both run the kernels' program from the
    # first call (the module's cold process starts before the tests' own environment pins this).
    env["EMBER_CPU_ATEN_FIRST"] = "0"
    for name in ("EMBER_STRICT", "EMBER_WARM_START", "EMBER_CACHE_DIR"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(cache), str(models), str(STEPS), *variants], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:  # every run trains as eager does, whatever the warm start did
        assert len(r["losses"]) == STEPS
        assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
    return results, proc.stderr


def _models(folder: Path, source: str = MODEL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step_model.py").write_text(source)
    return folder


def _loaded(r: dict) -> bool:
    return any(line.startswith("loaded") for line in r["log"])


def _compiled(r: dict) -> bool:
    return any(line.startswith("compiled and traced") for line in r["log"])


def _function(path: Path) -> str:
    """The function a warm-start file was saved for, from its readable header."""
    from ember.capture.warm_start import MAGIC
    blob = path.read_bytes()
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
    return json.loads(blob[len(MAGIC) + 8:len(MAGIC) + 8 + n])["key"]["function"]


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """One cold process (both train_fn forms) whose caches each test starts from: the costly part, once.
    Kept as a copy and put back at the same path for each test (Ember's CPU kernel modules are
    named after their cache folder, so a cache moved elsewhere does not load)."""
    base = tmp_path_factory.mktemp("step_warm")
    models = _models(base / "models")
    results, _ = _run(base / "cache", models, "global", "closure")
    for r in results:
        assert _compiled(r) and any(line.startswith("saved") for line in r["log"]), r["log"]
        assert r["traced_graphs"] == 1 and "warm start" not in r["caches"]
    shutil.copytree(base / "cache", base / "pristine")
    return base / "cache", models, {r["variant"]: r for r in results}


def _fresh(cold: tuple[Path, Path, dict]) -> Path:
    """The cache as the cold process left it."""
    cache = cold[0]
    shutil.rmtree(cache)
    shutil.copytree(cache.parent / "pristine", cache)
    return cache


def test_second_process_loads_without_tracing(cold: tuple[Path, Path, dict]) -> None:
    cache, models, saved = _fresh(cold), cold[1], cold[2]
    warm, _ = _run(cache, models, "global", "closure")
    for w in warm:
        c = saved[w["variant"]]
        assert _loaded(w) and not _compiled(w), w["log"]
        assert w["traced_graphs"] == 0  # Dynamo traced nothing in this process
        assert w["caches"] == ["warm start", "warm start"]  # forward and backward, both from the file
        assert w["losses"] == c["losses"] and w["params"] == c["params"]  # the same programs ran
        assert "warm start: loaded" in w["report"]


def test_changed_weights_constants_or_damaged_file_compile_afresh(cold: tuple[Path, Path, dict]) -> None:
    cache, models, saved = _fresh(cold), cold[1], cold[2]
    (damaged,) = [p for p in (cache / "warm_start").glob("*.ember-warm") if "closure_train_fn" in _function(p)]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    variants = ("global", "closure", "weight_dtype", "weight_shape", "closure_scale")
    results, stderr = _run(cache, models, *variants)
    by = {r["variant"]: r for r in results}
    assert _loaded(by["global"]) and by["global"]["losses"] == saved["global"]["losses"]
    # The damaged file: a warning, the file removed, a fresh compile, the same training.
    assert "cannot be used (ValueError: checksum mismatch); compiling afresh" in stderr
    assert any("damaged" in line for line in by["closure"]["log"]) and _compiled(by["closure"])
    assert by["closure"]["losses"] == saved["closure"]["losses"]
    for name in variants[2:]:  # another weight dtype or shape, another closure constant: another key
        assert _compiled(by[name]) and not _loaded(by[name]), (name, by[name]["log"])


def test_changed_source_compiles_afresh(cold: tuple[Path, Path, dict], tmp_path: Path) -> None:
    cache = _fresh(cold)
    models = _models(tmp_path / "models", MODEL.replace("model(x), y) * 2.0", "model(x), y) * 2.0 + 0.0"))
    (changed,), _ = _run(cache, models, "global")
    assert _compiled(changed) and not _loaded(changed), changed["log"]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


_NET: torch.nn.Module | None = None  # a module global that is also train_fn's closure model (one object)


def test_reassigned_closure_variable_runs_the_new_model(tmp_path: Path) -> None:
    # torch saves a reference to an external object by its id, so the file saved while the closure's
    # model was also the global _NET names it by one of the two; after the closure is reassigned that
    # file must not load (it would run the old model): the key records which names share an object.
    global _NET
    import ember
    torch.manual_seed(0)
    _NET = model = _Net()

    def outer() -> tuple:
        net = model

        def train_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(net(x), y)

        def swap(new: torch.nn.Module) -> None:
            nonlocal net
            net = new
        return train_fn, swap

    train_fn, swap = outer()
    step = ember.compile_step(train_fn, torch.optim.SGD(model.parameters(), lr=0.1), warm_start=True,
                              cache_dir=str(tmp_path), target="cpu")
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    step(x, y)
    other = _Net()
    swap(other)
    want = F.cross_entropy(other(x), y)
    assert torch.allclose(step(x, y), want.detach(), atol=1e-6)
    for p in other.parameters():  # the backward reached the new model's parameters
        assert p.grad is not None
    log = step.backend.log.warm_start
    assert sum(line.startswith("compiled and traced") for line in log) == 2 and not any(x.startswith("loaded") for x in log)
