"""The frame cache across processes (capture/frame_cache.py): a second process loads every frame of a
model with a graph break without AOTAutograd or Ember's stages; results equal eager's and the cold
process's; a changed input, dtype or option compiles afresh; a damaged entry is discarded."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cold_cache import ColdCache

from ember.capture import frame_cache

WORKER = Path(__file__).parents[1] / "support" / "frame_cache_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def _run(cache: Path, mode: str, *variants: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "XDG_CACHE_HOME": str(cache / "xdg")}
    for name in ("EMBER_STRICT", "EMBER_WARM_START", "EMBER_CACHE_DIR", "EMBER_FRAME_CACHE", "EMBER_CACHE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(cache), mode, *variants], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:  # every run is correct, whatever the cache did
        tol = 1e-4
        assert r["out_err"] < tol and r["grad_err"] < tol, r
    return results


def _loaded(r: dict) -> int:
    return sum("loaded from the frame cache" in line for line in r["log"])


def _stored(r: dict) -> int:
    return sum("compiled and stored in the frame cache" in line for line in r["log"])


@pytest.fixture(scope="module")
def cold_train(tmp_path_factory: pytest.TempPathFactory) -> ColdCache:
    """The cache after a first process's training step, for each test that starts there."""
    return ColdCache(tmp_path_factory.mktemp("frame_cache"), lambda cache: _run(cache, "train")[0])


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_second_process_loads_every_frame(tmp_path: Path, mode: str, cold_train: ColdCache) -> None:
    # Training starts from the module's cold process; inference runs its own.
    cache, cold = cold_train.fresh() if mode == "train" else (tmp_path, _run(tmp_path, mode)[0])
    assert _stored(cold) == 2 and cold["aot_traces"] == 2, cold["log"]  # two frames around the break
    (warm,) = _run(cache, mode)
    assert _loaded(warm) == 2 and not _stored(warm), warm["log"]
    assert warm["aot_traces"] == 0  # AOTAutograd traced nothing in this process
    assert set(warm["caches"]) == {"frame cache"}
    assert len(warm["caches"]) == (4 if mode == "train" else 2)  # forward and backward of each frame
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]  # the same programs ran
    if mode == "train":
        assert len(warm["grads"]) == 6


def test_changed_input_dtype_or_option_compiles_afresh(cold_train: ColdCache) -> None:
    cache, _ = cold_train.fresh()
    variants = ("base", "input_shape", "dtype", "option", "off")
    by = {r["variant"]: r for r in _run(cache, "train", *variants)}
    assert _loaded(by["base"]) == 2 and by["base"]["aot_traces"] == 0
    for name in ("input_shape", "dtype", "option"):
        r = by[name]
        assert _stored(r) == 2 and not _loaded(r) and r["aot_traces"] == 2, (name, r["log"])
    off = by["off"]
    assert not _loaded(off) and not _stored(off) and off["aot_traces"] == 2, off["log"]
    assert all("not cached: off (frame_cache=False)" in line for line in off["log"])
    # Each changed case now loads in a new process too (its own entries).
    by = {r["variant"]: r for r in _run(cache, "train", "dtype", "option")}
    assert _loaded(by["dtype"]) == 2 and _loaded(by["option"]) == 2


def _damage(cache: Path, how: str) -> int:
    conn = sqlite3.connect(cache / "programs.sqlite")
    try:
        with conn:
            rows = conn.execute("SELECT key, payload FROM frames").fetchall()
            for key, payload in rows:
                data = bytearray(payload)
                data[len(data) // 2] ^= 0xFF
                if how == "checksum":  # the stored checksum no longer matches
                    conn.execute("UPDATE frames SET payload = ? WHERE key = ?", (bytes(data), key))
                else:  # consistent checksum, bytes that do not unpickle
                    import hashlib
                    junk = b"not a pickle" + bytes(data[:64])
                    conn.execute("UPDATE frames SET payload = ?, sha256 = ? WHERE key = ?",
                                 (junk, hashlib.sha256(junk).hexdigest(), key))
    finally:
        conn.close()
    return len(rows)


@pytest.mark.parametrize("how", ["checksum", "payload"])
def test_damaged_entry_is_discarded_and_rebuilt(cold_train: ColdCache, how: str) -> None:
    cache, cold = cold_train.fresh()
    assert _damage(cache, how) == 2
    (r,) = _run(cache, "train")
    assert sum("damaged frame-cache entry was discarded" in line for line in r["log"]) == 2, r["log"]
    assert _stored(r) == 2 and not _loaded(r)
    assert r["out"] == cold["out"]  # the program cache still serves Ember's programs
    (again,) = _run(cache, "train")
    assert _loaded(again) == 2, again["log"]


def test_warm_start_and_compile_step_use_it(tmp_path: Path) -> None:
    # warm_start=True on a model with a graph break: the warm start is off, Dynamo's path caches frames.
    cold = {r["variant"]: r for r in _run(tmp_path, "train", "warm_start", "step")}
    assert any(line.startswith("off: no whole-graph capture") for line in cold["warm_start"]["warm_start"])
    assert _stored(cold["warm_start"]) == 2
    assert _stored(cold["step"]) >= 1, cold["step"]["log"]
    warm = {r["variant"]: r for r in _run(tmp_path, "train", "warm_start", "step")}
    assert _loaded(warm["warm_start"]) == 2 and warm["warm_start"]["aot_traces"] == 0
    step = warm["step"]
    assert _loaded(step) == _stored(cold["step"]) and not _stored(step) and step["aot_traces"] == 0, step["log"]
    assert step["out"] == cold["step"]["out"] and step["grads"] == cold["step"]["grads"]


def _graph(fn, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    seen: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list):  # noqa: ANN202
        seen.append((gm, list(example_inputs)))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=False)(*inputs)
    return seen[0]


def _user_function(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def test_unsafe_graphs_are_refused() -> None:
    x = torch.randn(3, 4)
    gm, inputs = _graph(lambda t: torch.relu(t) + 1.0, x)
    assert frame_cache.graph_blocker(gm, inputs) is None
    allowed = torch._dynamo.allow_in_graph(_user_function)
    gm, inputs = _graph(lambda t: allowed(t) + 1.0, x)
    assert "not torch's" in (frame_cache.graph_blocker(gm, inputs) or ""), gm.code
    gm, inputs = _graph(lambda t: torch.relu(t), x)
    gm.add_submodule("child", torch.nn.Identity())
    with gm.graph.inserting_before(list(gm.graph.nodes)[-1]):
        gm.graph.call_module("child", (next(iter(gm.graph.nodes)),))
    assert "call_module" in (frame_cache.graph_blocker(gm, inputs) or "")


def test_key_follows_grad_mode_autocast_and_aliasing() -> None:
    from ember.config import Options
    from ember.targets import BY_NAME
    x = torch.randn(3, 4)
    gm, inputs = _graph(lambda a, b: a + b, x, torch.randn(3, 4))
    options, target = Options.from_env(target="cpu"), BY_NAME["cpu"]
    base = frame_cache.frame_key(gm, inputs, options, target)
    assert base == frame_cache.frame_key(gm, [t.clone() for t in inputs], options, target)
    with torch.no_grad():
        assert frame_cache.frame_key(gm, inputs, options, target) != base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert frame_cache.frame_key(gm, inputs, options, target) != base
    assert frame_cache.frame_key(gm, [inputs[0], inputs[0]], options, target) != base  # one storage, twice
    assert frame_cache.frame_key(gm, inputs, Options.from_env(target="cpu", freeze=False), target) != base
