"""What the first-call benchmarks share: run a snippet in a new Python process with empty Ember
and Triton caches, and read back the one ``RESULT {json}`` line it prints.

Used by ``gpu_warm_start.py`` (cold, then warm, in one cache), ``gpu_compile_profile.py`` and
``cpu_warm_start_call_bench.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

# Child code: ``ember.explain`` on one bf16 training step of the model named by ``sys.argv[1]`` at
# its benchmark batch size, leaving the report in ``r`` (needs json, sys, torch, ember, models).
EXPLAIN_TRAIN_STEP = r"""
case = models.get_case(sys.argv[1])
torch.manual_seed(0)
model = case.build(False).cuda().train()
(inputs, _t), = models.make_batches(case, case.default_batch("train"), torch.device("cuda"), count=1)
with torch.autocast("cuda", dtype=torch.bfloat16):
    r = ember.explain(model, *inputs)
"""


@contextlib.contextmanager
def fresh_caches(**extra: str) -> Iterator[dict[str, str]]:
    """An environment with a new EMBER_CACHE_DIR and TRITON_CACHE_DIR (removed afterwards)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as triton_cache:
        yield {**os.environ, "EMBER_CACHE_DIR": cache, "TRITON_CACHE_DIR": triton_cache, **extra}


def child_result(code: str, args: Sequence[str], env: dict[str, str]) -> tuple[dict | None, str]:
    """(the child's RESULT object or None, its stderr)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    return (json.loads(line[len("RESULT "):]) if line else None), proc.stderr


def write_rows(path: str | None, rows: list[dict]) -> int:
    """Write the rows as JSON (when a path is given); exit status 1 if any row is an error."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0
