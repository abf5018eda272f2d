"""The tuning database: measured kernel configurations per kernel and device, in SQLite.

A row is one candidate configuration of one kernel on one device: its measured time, or why it
failed (a wrong result, a compile or launch error). ``best`` returns the fastest candidate that
passed its check; a failed candidate is never returned. The default configuration is stored as
the config ``{}``, so a kernel's gain is ``default_ms / best_ms``.

Safe under concurrent tuners: WAL journal, a busy timeout, and every write in one ``BEGIN
IMMEDIATE`` transaction. Safe against damage: a file SQLite cannot read is renamed to
``tuning.corrupt-<time>`` beside it, a new database is built, and a warning says so.

Layered (``LayeredTuningDB``): a read-only shared database (``EMBER_TUNING_SHARED``) under the
user's own; for a kernel the user's database has any entry for, the user's answer wins.
"""

from __future__ import annotations

import json
import sqlite3
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    kernel TEXT NOT NULL,      -- the default kernel's name (content hash of source and shapes)
    device TEXT NOT NULL,      -- tune.device.device_key
    config TEXT NOT NULL,      -- canonical JSON of the overrides; '{}' is the default config
    ms REAL,                   -- median time; NULL for a failed candidate
    status TEXT NOT NULL,      -- 'ok', 'failed', 'incomplete' (the marker of a kernel the budget cut short),
                               -- or 'slower_in_model' (checked and faster alone, slower in the whole model)
    detail TEXT NOT NULL DEFAULT '',
    label TEXT NOT NULL DEFAULT '',   -- what the kernel computes, for people
    tuned_at REAL NOT NULL,
    PRIMARY KEY (kernel, device, config)
);
CREATE INDEX IF NOT EXISTS results_best ON results (kernel, device, status, ms);
CREATE TABLE IF NOT EXISTS devices (device TEXT PRIMARY KEY, fingerprint TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_COLUMNS = "kernel, device, config, ms, status, detail, label, tuned_at"


def config_text(config: dict[str, int]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Result:
    kernel: str
    device: str
    config: dict[str, int]
    ms: float | None
    status: str  # "ok", "failed", "incomplete" or "slower_in_model" (see the schema)
    detail: str = ""
    label: str = ""
    tuned_at: float = 0.0

    @property
    def failed(self) -> bool:
        """A wrong result or an error: never used."""
        return self.status == "failed"

    @property
    def usable(self) -> bool:
        """Checked, measured and not demoted by the whole-model check: a choice compile may use."""
        return self.status == "ok"

    def row(self) -> tuple:
        return (self.kernel, self.device, config_text(self.config), self.ms, self.status, self.detail,
                self.label, self.tuned_at or time.time())


@dataclass(frozen=True)
class Choice:
    """The answer for one kernel: the best checked configuration and what it gains."""

    config: dict[str, int]
    ms: float
    default_ms: float | None
    source: str  # "user" or "shared"

    @property
    def gain(self) -> float | None:
        return self.default_ms / self.ms if self.default_ms and self.ms else None


def _result(row: tuple) -> Result:
    return Result(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6], row[7])


class TuningDB:
    """One tuning database file (``read_only``: opened without writing, never rebuilt)."""

    def __init__(self, path: Path | str, read_only: bool = False, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self.timeout = timeout
        self._conn: sqlite3.Connection | None = None

    # -- opening, damage -----------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        if self.read_only:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=self.timeout,
                                   check_same_thread=False)
            conn.execute("SELECT count(*) FROM results").fetchone()  # raises on a damaged file
            self._conn = conn
            return conn
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = self._open_writable_waiting()
        except sqlite3.OperationalError:
            raise  # locked, busy, an I/O error: another tuner holds the file, which is not damaged
        except sqlite3.DatabaseError as err:  # not a database, malformed: damaged
            self._set_aside(err)
            conn = self._open_writable_waiting()
        self._conn = conn
        return conn

    def _open_writable_waiting(self) -> sqlite3.Connection:
        """Open for writing; while other tuners hold the file (SQLite's OperationalError: locked,
        busy, or an I/O error on the WAL index they are setting up) try again until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._open_writable()
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _open_writable(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            conn.execute("SELECT count(*) FROM results").fetchone()
        except sqlite3.DatabaseError:
            conn.close()
            raise
        return conn

    def _set_aside(self, err: Exception) -> None:
        """Rename a damaged file (and its WAL files) to ``<stem>.corrupt-<time>`` and warn."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.stem}.corrupt-{stamp}")
        n = 0
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.stem}.corrupt-{stamp}-{n}")
        try:
            self.path.replace(aside)
        except FileNotFoundError:
            pass
        for suffix in ("-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        warnings.warn(f"ember: the tuning database {self.path} was damaged ({err}); it was moved to {aside} "
                      "and a new one built (tuning results are measured again by `ember tune`)", stacklevel=3)

    def _query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        try:
            return self._connect().execute(sql, tuple(params)).fetchall()
        except sqlite3.DatabaseError as err:
            # Only a damaged file is set aside: an OperationalError (locked, busy, I/O) is another
            # tuner at work, and setting the file aside would lose its records.
            if self.read_only or isinstance(err, sqlite3.OperationalError):
                raise
            self.close()
            self._set_aside(err)
            return self._connect().execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- writing ---------------------------------------------------------------------------------
    def record(self, results: Iterable[Result], fingerprint: dict | None = None) -> int:
        """Store ``results`` in one transaction (a later measurement of a config replaces the earlier)."""
        if self.read_only:
            raise PermissionError(f"the tuning database {self.path} is read-only")
        rows = [r.row() for r in results]
        conn = self._connect()
        with self._transaction(conn):
            conn.executemany(f"INSERT OR REPLACE INTO results ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)", rows)
            if fingerprint is not None and rows:
                conn.execute("INSERT OR REPLACE INTO devices VALUES (?, ?)",
                             (rows[0][1], json.dumps(fingerprint, sort_keys=True)))
        return len(rows)

    def forget(self, kernel: str, device: str, config: dict) -> None:
        """Delete one row (the marker of an interrupted kernel, once its candidates are all measured)."""
        if self.read_only or not self.path.exists():
            return
        conn = self._connect()
        with self._transaction(conn):
            conn.execute("DELETE FROM results WHERE kernel = ? AND device = ? AND config = ?",
                         (kernel, device, config_text(config)))

    def demote(self, results: Iterable[Result], detail: str) -> int:
        """Mark ``results`` (checked choices, from this database or a shared one) as slower in the
        whole model: compile stops using them and falls back to the next answer, in the end the
        rule; ``ember tune`` does not measure them again."""
        rows = [Result(r.kernel, r.device, r.config, r.ms, "slower_in_model", detail, r.label, r.tuned_at)
                for r in results]
        return self.record(rows)

    def note(self, key: str, value: dict | None = None) -> dict | None:
        """Read (``value`` None) or write one JSON note in the meta table (whole-model checks)."""
        if value is None:
            rows = self._query("SELECT value FROM meta WHERE key = ?", (key,))
            return json.loads(rows[0][0]) if rows else None
        conn = self._connect()
        with self._transaction(conn):
            conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value, sort_keys=True)))
        return value

    def notes(self) -> dict[str, dict]:
        """Every whole-model verdict (they travel with export and import)."""
        return {k: json.loads(v) for k, v in self._query("SELECT key, value FROM meta WHERE key LIKE 'model_check:%'")}

    @staticmethod
    def _transaction(conn: sqlite3.Connection):
        class _Tx:
            def __enter__(self) -> None:
                conn.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind, value, tb) -> None:
                conn.execute("COMMIT" if kind is None else "ROLLBACK")
        return _Tx()

    # -- reading ---------------------------------------------------------------------------------
    def results(self, kernel: str, device: str) -> list[Result]:
        """Every candidate of ``kernel`` on ``device``: checked ones fastest first, then failures."""
        rows = self._query(f"SELECT {_COLUMNS} FROM results WHERE kernel = ? AND device = ? "
                           "ORDER BY status != 'ok', ms", (kernel, device))
        return [_result(r) for r in rows]

    def top(self, kernel: str, device: str, k: int = 3) -> list[Result]:
        rows = self._query(f"SELECT {_COLUMNS} FROM results WHERE kernel = ? AND device = ? AND status = 'ok' "
                           "ORDER BY ms LIMIT ?", (kernel, device, k))
        return [_result(r) for r in rows]

    def choices(self, kernels: Iterable[str], device: str, source: str = "user") -> dict[str, Choice]:
        """The best checked config of each of ``kernels`` with an entry (one indexed query)."""
        names = sorted(set(kernels))
        out: dict[str, Choice] = {}
        for start in range(0, len(names), 500):  # SQLite's host-parameter limit
            part = names[start:start + 500]
            marks = ",".join("?" * len(part))
            rows = self._query(
                f"SELECT kernel, config, ms FROM results WHERE device = ? AND status = 'ok' AND kernel IN ({marks}) "
                "ORDER BY kernel, ms", [device, *part])
            for kernel, config, ms in rows:
                choice = out.get(kernel)
                if choice is None:
                    out[kernel] = Choice(json.loads(config), ms, None, source)
                if config == "{}":
                    best = out[kernel]
                    out[kernel] = Choice(best.config, best.ms, ms, source)
        return out

    def tuned_kernels(self, device: str) -> set[str]:
        return {r[0] for r in self._query("SELECT DISTINCT kernel FROM results WHERE device = ?", (device,))}

    def tuned_kernels_among(self, kernels: list[str], device: str) -> set[str]:
        out: set[str] = set()
        for start in range(0, len(kernels), 500):
            part = kernels[start:start + 500]
            marks = ",".join("?" * len(part))
            out |= {r[0] for r in self._query(
                f"SELECT DISTINCT kernel FROM results WHERE device = ? AND kernel IN ({marks})", [device, *part])}
        return out

    def all(self) -> Iterator[Result]:
        for row in self._query(f"SELECT {_COLUMNS} FROM results ORDER BY kernel, device, config"):
            yield _result(row)

    def fingerprints(self) -> dict[str, dict]:
        return {d: json.loads(fp) for d, fp in self._query("SELECT device, fingerprint FROM devices")}

    def __len__(self) -> int:
        return int(self._query("SELECT count(*) FROM results")[0][0])

    # -- moving results between machines -----------------------------------------------------------
    def export(self, path: Path | str) -> int:
        """Write every result to ``path``: JSON when it ends in ``.json``, else an SQLite database
        (usable as ``EMBER_TUNING_SHARED``)."""
        path = Path(path)
        results = list(self.all())
        notes = self.notes()
        if path.suffix == ".json":
            doc = {"schema": SCHEMA_VERSION, "devices": self.fingerprints(),
                   "results": [dict(zip(_COLUMNS.split(", "), r.row())) for r in results], "notes": notes}
            path.write_text(json.dumps(doc, indent=1))
            return len(results)
        path.unlink(missing_ok=True)
        out = TuningDB(path)
        try:
            out.record(results)
            for device, fp in self.fingerprints().items():
                out._connect().execute("INSERT OR REPLACE INTO devices VALUES (?, ?)", (device, json.dumps(fp)))
            for key, value in notes.items():
                out.note(key, value)
            out._connect().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            out.close()
        return len(results)

    def import_from(self, path: Path | str) -> int:
        """Merge the results of ``path`` (JSON or SQLite, as ``export`` writes) into this database."""
        path = Path(path)
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            cols = _COLUMNS.split(", ")
            results = [_result(tuple(r[c] for c in cols)) for r in doc["results"]]
            devices, notes = doc.get("devices", {}), doc.get("notes", {})
        else:
            src = TuningDB(path, read_only=True)
            try:
                results, devices, notes = list(src.all()), src.fingerprints(), src.notes()
            finally:
                src.close()
        self.record(results)
        for key, value in notes.items():
            self.note(key, value)
        conn = self._connect()
        for device, fp in devices.items():
            conn.execute("INSERT OR REPLACE INTO devices VALUES (?, ?)", (device, json.dumps(fp, sort_keys=True)))
        return len(results)


class LayeredTuningDB:
    """The user's database over a read-only shared one; either may be absent."""

    def __init__(self, user: Path | None, shared: Path | None = None) -> None:
        self.user_path, self.shared_path = user, shared
        self._user: TuningDB | None = None
        self._shared: TuningDB | None = None

    def exists(self) -> bool:
        return any(p is not None and p.exists() for p in (self.user_path, self.shared_path))

    def user(self) -> TuningDB:
        if self._user is None:
            assert self.user_path is not None
            self._user = TuningDB(self.user_path)
        return self._user

    def _shared_db(self) -> TuningDB | None:
        if self._shared is None and self.shared_path is not None and self.shared_path.exists():
            self._shared = TuningDB(self.shared_path, read_only=True)
        return self._shared

    def choices(self, kernels: Iterable[str], device: str) -> dict[str, Choice]:
        """Per kernel the user's answer, else the shared one's (no query on a missing file)."""
        names = list(kernels)
        out: dict[str, Choice] = {}
        shared = self._shared_db()
        if shared is not None:
            try:
                out.update(shared.choices(names, device, source="shared"))
            except sqlite3.DatabaseError as err:
                warnings.warn(f"ember: the shared tuning database {self.shared_path} cannot be read ({err}); "
                              "ignoring it", stacklevel=2)
                self._shared = None
                self.shared_path = None
        if self.user_path is not None and self.user_path.exists():
            user = self.user()
            mine = user.choices(names, device)
            if out:  # a kernel the user measured (even with failures only) is the user's
                for kernel in user.tuned_kernels_among(names, device):
                    out.pop(kernel, None)
            out.update(mine)
        return out

    def stamp(self) -> str:
        """Changes whenever either file changes (part of the compiled-program cache key)."""
        parts = []
        for p in (self.user_path, self.shared_path):
            if p is not None:
                try:
                    st = p.stat()
                    wal = Path(f"{p}-wal")
                    wst = wal.stat().st_mtime_ns if wal.exists() else 0
                    parts.append(f"{st.st_mtime_ns}:{st.st_size}:{wst}")
                except OSError:
                    parts.append("-")
        return "|".join(parts)

    def close(self) -> None:
        for db in (self._user, self._shared):
            if db is not None:
                db.close()
