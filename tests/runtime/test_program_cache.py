"""The compiled-program cache across processes: warm starts, damaged entries, concurrent writers."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cold_cache import ColdCache

from ember.runtime.artifacts import ProgramStore

WORKER = Path(__file__).parents[1] / "support" / "cache_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def _spawn(cache: Path, batch: int = 2) -> subprocess.Popen:
    # The frame cache and the warm start off: with them, a warm process loads whole frames and
    # never asks this cache.
    env = {**os.environ, "EMBER_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src"), "EMBER_FRAME_CACHE": "0",
           "EMBER_WARM_START": "0"}
    env.pop("EMBER_STRICT", None)
    return subprocess.Popen([sys.executable, str(WORKER), str(batch)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    bad = {k: v for k, v in result["errors"].items() if not v < 1e-4}
    assert not bad, bad
    return result


def _run(cache: Path, batch: int = 2) -> dict:
    return _result(_spawn(cache, batch))


KINDS = {"forward", "backward", "inference"}


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> ColdCache:
    """The cache after a first process (every graph compiled and stored), for each test that starts there."""
    return ColdCache(tmp_path_factory.mktemp("program_cache"), _run)


def test_second_process_starts_warm(cold: ColdCache) -> None:
    cache, first = cold.fresh()
    assert set(first["cache"]) == KINDS and set(first["cache"].values()) == {"stored"}
    second = _run(cache)
    assert set(second["cache"].values()) == {"hit"}
    for kind in KINDS:  # a hit skips every compile stage
        assert set(second["stages"][kind]) == {"cache_load"}
    assert ProgramStore(cache).count() == 3
    # A new input shape is a different graph: compiled and stored, the old entries stay.
    other = _run(cache, batch=3)
    assert set(other["cache"].values()) == {"stored"}
    assert ProgramStore(cache).count() == 6


def _db(cache: Path) -> sqlite3.Connection:
    return sqlite3.connect(cache / "programs.sqlite")


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated payload", "broken program with valid checksum"])
def test_damaged_entries_are_discarded_and_rebuilt(cold: ColdCache, damage: str) -> None:
    cache, _ = cold.fresh()
    with _db(cache) as conn:
        rows = conn.execute("SELECT key, payload FROM programs").fetchall()
        for key, payload in rows:
            if damage == "flipped bytes":
                payload = payload[:40] + bytes(b ^ 0xFF for b in payload[40:80]) + payload[80:]
                conn.execute("UPDATE programs SET payload = ? WHERE key = ?", (payload, key))
            elif damage == "truncated payload":
                conn.execute("UPDATE programs SET payload = ? WHERE key = ?", (payload[: len(payload) // 3], key))
            else:
                import hashlib
                n = int.from_bytes(payload[:8], "little")
                meta = json.loads(payload[8:8 + n])
                meta["text"] = meta["text"].replace("def run(args):", "def run(args):\n    raise SyntaxError(", 1)
                head = json.dumps(meta).encode()
                payload = len(head).to_bytes(8, "little") + head + payload[8 + n:]
                conn.execute("UPDATE programs SET payload = ?, sha256 = ? WHERE key = ?",
                             (payload, hashlib.sha256(payload).hexdigest(), key))
    rebuilt = _run(cache)  # correct results (checked in _run), every graph compiled again
    assert set(rebuilt["cache"].values()) == {"stored"}
    assert set(_run(cache)["cache"].values()) == {"hit"}


def test_a_database_file_that_is_not_a_database_is_replaced(cold: ColdCache) -> None:
    cache, _ = cold.fresh()
    db = cache / "programs.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    db.write_bytes(b"this is not an SQLite file" * 100)
    assert set(_run(cache)["cache"].values()) == {"stored"}
    assert list(cache.glob("programs.corrupt-*")), "the damaged file is kept aside for inspection"
    assert set(_run(cache)["cache"].values()) == {"hit"}


def test_concurrent_writers_share_one_database(tmp_path: Path) -> None:
    procs = [_spawn(tmp_path) for _ in range(4)]
    results = [_result(p) for p in procs]  # every process correct
    for r in results:
        assert set(r["cache"].values()) <= {"stored", "hit"}
    assert ProgramStore(tmp_path).count() == 3
    assert set(_run(tmp_path)["cache"].values()) == {"hit"}


def test_key_covers_code_generator_settings() -> None:
    import torch
    from torch import fx

    from ember import config
    from ember.runtime.artifacts import graph_key

    gm = fx.symbolic_trace(lambda x: torch.ops.aten.sum.default(x))
    x = torch.randn(4)
    key = graph_key(gm, [x], "triton-interpret", "inference")
    assert key == graph_key(gm, [x], "triton-interpret", "inference")
    assert key != graph_key(gm, [torch.randn(5)], "triton-interpret", "inference")
    assert key != graph_key(gm, [x], "aten", "inference")
    with config.patch(loop_rblock=config.settings().loop_rblock // 2):
        assert key != graph_key(gm, [x], "triton-interpret", "inference")


def test_zero_dim_constant_is_keyed_by_value(tmp_path: Path) -> None:
    """A 0-dim tensor constant (swin_t's stochastic depth makes one) is hashed into the key by
    its value; reading its bytes once failed and sent the whole graph to ATen."""
    import torch
    from torch import fx

    import ember
    from ember import config
    from ember.runtime.artifacts import graph_key

    class Scaled(torch.nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = torch.tensor(scale)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.mul.Tensor(x, self.scale)

    x = torch.randn(4)
    keys = {graph_key(fx.symbolic_trace(Scaled(s)), [x], "cpu", "inference") for s in (0.5, 2.0)}
    assert len(keys) == 2 and None not in keys

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * torch.tensor(0.75)

    x = torch.randn(3, 5)
    with config.patch(strict=True):
        compiled = ember.compile(Model(), target="triton-interpret", cache_dir=str(tmp_path))
        torch.testing.assert_close(compiled(x), torch.relu(x) * 0.75)


def test_stored_constants_keep_their_data_under_an_active_fake_mode() -> None:
    # The frame cache links stored programs inside Dynamo's compile, where a fake mode may be
    # active: torch.load there made FakeTensors (torch 2.14) or raised (torch 2.11).
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from ember.runtime.artifacts import StoredProgram, _decode, _encode

    t = torch.randn(5)
    with FakeTensorMode():
        (back,) = _decode(_encode(StoredProgram("text", [], [t], {}, {}))).consts
    assert not isinstance(back, FakeTensor)
    torch.testing.assert_close(back, t)


def test_a_frame_entry_made_under_an_active_fake_mode_keeps_its_attribute_data() -> None:
    import io
    import types

    import torch
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from ember.capture.warm_artifact import EmberOutputCode
    from ember.report.records import GraphRecord
    from ember.runtime.artifacts import StoredProgram

    root = torch.nn.Module()
    root.register_buffer("c", torch.randn(4))
    graph = fx.Graph()
    graph.output(graph.get_attr("c"))
    gm = fx.GraphModule(root, graph)
    program = StoredProgram("text", [], [], {"c_in_program": "c"}, {})
    compiled = types.SimpleNamespace(ember_graph=types.SimpleNamespace(
        saved={"program": program, "blocker": None, "read_only": []}))
    with FakeTensorMode(allow_non_fake_inputs=True):
        code = EmberOutputCode.wrap(compiled, gm, GraphRecord(title="forward 0", kind="forward", frame="0/0",
                                                              target="cpu"))
    assert code.unserializable == ""
    attrs = torch.load(io.BytesIO(code.attrs), weights_only=True)
    assert not isinstance(attrs["c_in_program"], FakeTensor)
    torch.testing.assert_close(attrs["c_in_program"], root.c)


def test_a_stored_programs_text_is_compiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A program loaded from the cache (a new process, here a new compile after Dynamo's reset) runs
    # the code object kept beside the kernels instead of compiling its text again.
    import torch
    import torch.nn as nn

    import ember
    from ember.runtime import kernel_module

    seen: list[str] = []

    def counting(source, filename, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(filename)
        return compile(source, filename, *args, **kwargs)
    monkeypatch.setattr(kernel_module, "compile", counting, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    for _ in range(2):
        torch._dynamo.reset()
        compiled = ember.compile(model, target="aten", cache_dir=str(tmp_path), warm_start=False)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
    assert len([f for f in seen if f.startswith("<ember program")]) == 1
    assert list((tmp_path / "kernels" / "__pycache__").glob("program-*.code"))
