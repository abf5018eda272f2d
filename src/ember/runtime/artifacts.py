"""Compiled programs on disk, so a new process compiling the same graph starts warm.

One SQLite database, ``<cache>/programs.sqlite``, one row per compiled graph. The key hashes
everything the result depends on: the captured graph's code, every input's shape, strides,
dtype, device and requires_grad, the values of small constant tensors in the graph, the
target, the device name, the torch/triton/ember versions, a hash of Ember's source files and
the code generator's block-size constants. A row holds the program text,
its generated kernels' module sources, its constants (``torch.save``, loaded with
``weights_only=True``), the graph attributes it reads, and the explain record; a SHA-256 of
the payload is checked on every load.

The same file has a second table, ``frames``: whole Dynamo frames (AOTAutograd's bundled entry
around Ember's programs, capture/frame_cache.py), stored as opaque checksummed bytes.

Safety: SQLite in WAL mode with a busy timeout lets concurrent processes read and write the
same file; ``INSERT OR REPLACE`` of identical payloads makes racing writers harmless. A row
that fails its checksum, cannot be decoded or does not execute is deleted and the graph is
compiled afresh; a database file that is not a database is moved aside and recreated.
Nothing here can make a compile fail: every error means "cache miss".
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from ember import compat
from ember.config import block_settings, settings
from ember.graph_utils import get_attr
from ember.report.records import GraphRecord

SCHEMA = 1
TABLES = ("programs", "frames")  # the compiled graphs; whole Dynamo frames (capture/frame_cache.py)
_RECORD_FIELDS = ("op_classes", "placement", "fallback_reasons", "steps", "fusion_decisions", "kernels", "unique_kernels",
                  "plan_text", "program", "kernel_sources", "layout", "tuned",
                  "matmul_padding", "merged_matmuls")
_SMALL_CONSTANT = 1 << 16  # constant tensors up to this many elements are hashed into the key


@dataclass
class StoredKernel:
    """A generated kernel as the cache keeps it (enough for ``runtime.kernels`` to load it)."""

    name: str
    text: str

    def module_source(self) -> str:
        return self.text


@dataclass
class StoredProgram:
    text: str
    kernels: list[StoredKernel]
    consts: list
    attrs: dict[str, str]
    record: dict[str, Any]
    library_calls: list[str] = field(default_factory=list)  # runtime/library_warmup.py


_SOURCE_DIGEST: str | None = None


def _source_digest() -> str:
    """Hash of Ember's own source: a development build whose code changed never reuses programs
    an older build compiled, even though the version number is the same."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()[:16]
    return _SOURCE_DIGEST


def _versions() -> str:
    import triton

    from ember import __version__
    # Block sizes are settings that tests and tuning change at run time (config.patch).
    tuning = block_settings()
    # Where a graph's writes into its inputs happen (capture/backend.py, codegen/input_writes.py):
    # the same graph gives another program, and a warm start another AOTAutograd graph.
    now = settings()
    writes = f"{int(now.input_mutations_in_graph)}{int(now.input_writes_as_stores)}"
    # Passes that pick Ember's kernels over a library call by a setting give another program.
    kernels = f"depthwise {int(now.depthwise_kernels)} small-bmm {int(now.small_bmm)}"
    # var_mean's form is chosen while decomposing: another setting gives another program.
    return (f"torch {torch.__version__} triton {triton.__version__} ember {__version__} "
            f"source {_source_digest()} tuning {tuning} input-writes {writes} {kernels} "
            f"var-mean {now.one_pass_var_mean}/{now.one_pass_var_mean_min} "
            f"merge-copy {now.merge_matmuls_max_copy_mb} schema {SCHEMA}")


def _device_name(inputs: list) -> str:
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return torch.cuda.get_device_name(t.device)
    return "cpu"


def graph_key(gm: fx.GraphModule, inputs: list, target: str, kind: str) -> str | None:
    """The cache key of one captured graph, or None when it must not be cached (a large
    constant tensor whose value the key would have to include)."""
    h = hashlib.sha256()
    h.update(f"{_versions()}|{target}|{kind}|{_device_name(inputs)}\n".encode())
    h.update(gm.code.encode())
    for t in inputs:
        if isinstance(t, torch.Tensor):
            h.update(f"{tuple(t.shape)}|{t.stride()}|{t.dtype}|{t.device.type}|{t.requires_grad}\n".encode())
        else:
            h.update(f"{type(t).__name__}:{t!r}\n".encode())
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = get_attr(gm, node.target)
        if isinstance(value, torch.Tensor):
            if value.numel() > _SMALL_CONSTANT:
                return None
            h.update(f"{node.target}|{value.dtype}|{tuple(value.shape)}".encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{node.target}|{type(value).__name__}".encode())
    return h.hexdigest()


def _record_dict(record: GraphRecord) -> dict[str, Any]:
    out = {}
    for name in _RECORD_FIELDS:
        value = getattr(record, name)
        if isinstance(value, dict):
            value = {k: dict(v) if isinstance(v, Counter) else v for k, v in value.items()}
        out[name] = value
    return out


def restore_record(record: GraphRecord, data: dict[str, Any]) -> None:
    """Fill ``record`` (what explain reads) from a cached row."""
    for name in _RECORD_FIELDS:
        value = data.get(name)
        if name == "placement":
            value = {k: Counter(v) for k, v in (value or {}).items()}
        elif name in ("op_classes", "fallback_reasons", "steps", "fusion_decisions"):
            value = Counter(value or {})
        if value is not None:
            setattr(record, name, value)


class ProgramStore:
    """The SQLite table of compiled programs in one cache folder."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.path = Path(folder) / "programs.sqlite"
        self.error = ""  # why the last open or save failed, for explain's cache line
        self.discarded = ""  # why load_bytes deleted the row it read ("" when it did not)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=30.0)
        conn.execute("PRAGMA journal_mode=WAL")
        for table in TABLES:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, payload BLOB NOT NULL, "
                         "sha256 TEXT NOT NULL, title TEXT, created REAL)")
        return conn

    def _open(self) -> sqlite3.Connection | None:
        try:
            return self._connect()
        except sqlite3.DatabaseError:
            # Not a database (truncated or overwritten): move it aside, start a new one.
            try:
                os.replace(self.path, self.path.with_suffix(f".corrupt-{os.getpid()}-{int(time.time())}"))
                for suffix in ("-wal", "-shm"):
                    Path(str(self.path) + suffix).unlink(missing_ok=True)
                return self._connect()
            except (OSError, sqlite3.Error) as err:
                self.error = f"cannot open {self.path}: {type(err).__name__}: {err}"
                return None
        except OSError as err:
            self.error = f"cannot open {self.path}: {type(err).__name__}: {err.strerror or err}"
            return None

    def load(self, key: str) -> StoredProgram | None:
        payload = self.load_bytes(key, "programs")
        if payload is None:
            return None
        try:
            return _decode(payload)
        except Exception:  # noqa: BLE001 - any damage means: discard and rebuild
            self.discard(key)
            return None

    def load_bytes(self, key: str, table: str) -> bytes | None:
        """A row's payload, its checksum checked (a row that fails it is deleted: None)."""
        assert table in TABLES
        self.discarded = ""
        conn = self._open()
        if conn is None:
            return None
        try:
            with conn:
                row = conn.execute(f"SELECT payload, sha256 FROM {table} WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error:
            return None
        finally:
            conn.close()
        if row is None:
            return None
        payload, digest = row
        if not isinstance(payload, bytes) or hashlib.sha256(payload).hexdigest() != digest:
            self.discarded = "checksum mismatch"
            self.discard(key, table)
            return None
        return payload

    def save(self, key: str, program: StoredProgram, title: str) -> bool:
        try:
            payload = _encode(program)
            _decode(payload)  # what cannot be read back is not stored
        except Exception as err:  # noqa: BLE001 - an uncacheable program is still a compiled program
            self.error = f"its constants cannot be stored ({type(err).__name__}: {err})"
            return False
        return self.save_bytes(key, payload, title, "programs")

    def save_bytes(self, key: str, payload: bytes, title: str, table: str) -> bool:
        assert table in TABLES
        conn = self._open()
        if conn is None:
            return False
        try:
            with conn:
                conn.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?, ?, ?)",
                             (key, payload, hashlib.sha256(payload).hexdigest(), title, time.time()))
            return True
        except sqlite3.Error as err:
            self.error = f"cannot write {self.path}: {type(err).__name__}: {err}"
            return False
        finally:
            conn.close()

    def discard(self, key: str, table: str = "programs") -> None:
        assert table in TABLES
        conn = self._open()
        if conn is None:
            return
        try:
            with conn:
                conn.execute(f"DELETE FROM {table} WHERE key = ?", (key,))
        except sqlite3.Error:
            pass
        finally:
            conn.close()

    def count(self, table: str = "programs") -> int:
        assert table in TABLES
        if not self.path.exists():
            return 0
        conn = self._open()
        if conn is None:
            return 0
        try:
            return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        except sqlite3.Error:
            return 0
        finally:
            conn.close()

    def clear(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)


def _encode(p: StoredProgram) -> bytes:
    consts = io.BytesIO()
    with compat.real_tensors():
        torch.save(p.consts, consts)
    meta = {"text": p.text, "kernels": [[k.name, k.text] for k in p.kernels], "attrs": p.attrs,
            "record": p.record, "library_calls": p.library_calls}
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + consts.getvalue()


def _decode(payload: bytes) -> StoredProgram:
    n = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8:8 + n].decode())
    with compat.real_tensors():  # inside a compile tensors would load as meta or fake (no data)
        consts = torch.load(io.BytesIO(payload[8 + n:]), weights_only=True)
    return StoredProgram(meta["text"], [StoredKernel(a, b) for a, b in meta["kernels"]], consts,
                         meta["attrs"], meta["record"], meta.get("library_calls", []))


def stored_program(text: str, kernels: list[tuple[str, str]], consts: list, attrs: dict[str, str],
                   record: GraphRecord, library_calls: list[str]) -> StoredProgram:
    return StoredProgram(text, [StoredKernel(n, t) for n, t in kernels], consts, attrs, _record_dict(record),
                         library_calls)
