"""``ember bench --first-call``: each backend's first call as a user meets it, in a new process.

For every model x mode x backend, two new processes run ``ember bench`` on that one row:
  cold  Ember's, Triton's and Inductor's caches point at empty folders (EMBER_CACHE_DIR,
        TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR);
  warm  the same folders again, as the cold process left them.
Each row is the child's first-call row (``compile_s``: the first step, compile included) with
``cache`` ("cold" | "warm"), ``first_call_s`` and ``process_s`` (the child's whole life: Python
start, imports, model build, first call, one timed step). Nothing else ran in the child before
the first call, so no other backend's compile warmed it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CACHES = {"EMBER_CACHE_DIR": "ember", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
KEPT = ("model", "mode", "backend", "precision", "batch", "device", "compile_split", "launch_compiles", "first_call_collections", "error")
CHILD_TIMEOUT_S = 3600


def child_command(model: str, mode: str, backend: str, device: str, precision: str, batch: int | None,
                  small: bool, json_path: Path) -> list[str]:
    """The ``ember bench`` command line of one row, its first call and one timed step."""
    cmd = [sys.executable, "-m", "ember", "bench", model, "--mode", mode, "--backend", backend,
           "--device", device, "--precision", precision, "--warmup", "0", "--iters", "1", "--no-progress",
           "--json", str(json_path)]
    if small:
        cmd.append("--small")
    if batch is not None:
        cmd += ["--batch", str(batch)]
    return cmd


def cache_env(folder: Path) -> dict[str, str]:
    """The environment of a child whose caches live under ``folder``."""
    return {**os.environ, **{var: str(folder / sub) for var, sub in CACHES.items()}}


def run_one(cmd: list[str], env: dict[str, str], json_path: Path, cache: str) -> dict[str, Any]:
    """Run one child; its first row with ``cache``, ``first_call_s`` and ``process_s``."""
    json_path.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        output = f"timed out after {err.timeout} s"
    process_s = time.perf_counter() - start
    row: dict[str, Any] = {}
    if json_path.exists():
        results = json.loads(json_path.read_text()).get("results") or []
        row = results[0] if results else {}
    out = {k: row[k] for k in KEPT if k in row}
    out.update(cache=cache, first_call_s=row.get("compile_s"), process_s=process_s)
    if not row or out.get("error"):
        out["error"] = out.get("error") or output.strip()[-2000:] or "the child wrote no result"
    return out


def run_first_calls(models: Sequence[str], modes: Sequence[str], backends: Sequence[str], device: str,
                    precision: str, batches: Sequence[int] | None, small: bool,
                    keep_caches: bool = False) -> list[dict[str, Any]]:
    """Cold then warm first call of every model x mode x backend x batch, each in a new process."""
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="ember-first-call-"))
    try:
        for model in models:
            for mode in modes:
                for batch in (batches or [None]):
                    for backend in backends:
                        folder = root / f"{model}-{mode}-{batch}-{backend}"
                        json_path = folder / "row.json"
                        folder.mkdir(parents=True)
                        cmd = child_command(model, mode, backend, device, precision, batch, small, json_path)
                        for cache in ("cold", "warm"):
                            row = run_one(cmd, cache_env(folder), json_path, cache)
                            rows.append(row)
                            print_row(row)
    finally:
        if not keep_caches:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def print_row(row: dict[str, Any]) -> None:
    first = row.get("first_call_s")
    what = f"{first:.2f} s first call" if first is not None else f"failed: {str(row.get('error'))[-200:]}"
    collected = row.get("first_call_collections")
    if first is not None and collected:
        what += f", {collected['total_s']:.2f} s of it collecting garbage"
    print(f"{row.get('model', '?')} {row.get('mode', '?')} {row.get('backend', '?')} {row['cache']}: {what} "
          f"({row['process_s']:.1f} s process)", flush=True)
