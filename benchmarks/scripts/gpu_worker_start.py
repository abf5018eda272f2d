"""Compile workers with and without torch on a GPU host: Triton's key and the workers' start.

1. Triton's key: a kernel compiled by Triton's own CUDA driver with torch dtypes (this process,
   the GPU's target) and by a worker compiling for the target text without torch (a new process,
   ``runtime/worker_triton.py``) must be the same binary under the same key.
2. Start-up: a new process initialises CUDA, then spawns the compile workers
   (``precompile.start_workers``) and times each worker's start (imports and warm-up compile),
   once with the target passed on (no torch in the workers) and once without (Triton's driver:
   torch imported, CUDA initialised in every worker).

    PYTHONPATH=src python benchmarks/scripts/gpu_worker_start.py [--workers 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def ember_scale_rows(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, offs < n, other=0).to(tl.float32)
    tl.store(out_ptr + offs, tl.exp(x) * 2.0, offs < n)
'''

STUB_KEY = textwrap.dedent('''
    import importlib.util, json, sys
    from ember.runtime import worker_triton
    assert worker_triton.install_target_driver(sys.argv[2])
    spec = importlib.util.spec_from_file_location("kernel", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    k = module.ember_scale_rows.warmup(worker_triton.pointer_arg("bfloat16"), worker_triton.pointer_arg("float32"),
                                       4096, grid=(1,), BLOCK=256)
    print(json.dumps({"hash": k.hash, "torch": "torch" in sys.modules}))
''')


def key_check(folder: Path) -> dict:
    import importlib.util

    import torch
    from triton.runtime import driver

    from ember.runtime import worker_triton
    path = folder / "ember_scale_rows.py"
    path.write_text(KERNEL)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    target = worker_triton.target_text(driver.active.get_current_target())
    spec = importlib.util.spec_from_file_location("kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4096, device="cuda")
    module.ember_scale_rows[(16,)](x, out, 4096, BLOCK=256)
    torch.cuda.synchronize()
    ok = torch.allclose(out, torch.exp(x.float()) * 2.0, rtol=1e-5, atol=1e-5)
    real = module.ember_scale_rows.warmup(torch.bfloat16, torch.float32, 4096, grid=(1,), BLOCK=256)
    done = subprocess.run([sys.executable, "-c", STUB_KEY, str(path), target], capture_output=True, text=True,
                          env={**os.environ, "EMBER_COMPILE_WORKER": "1"}, timeout=300)
    stub = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    return {"target": target, "launch_correct": bool(ok), "real_hash": real.hash, "worker": stub,
            "same_key": stub.get("hash") == real.hash}


def start_times(workers: int, with_target: bool) -> dict:
    """Run in a new process: CUDA initialised here, then the workers spawned and timed."""
    import torch

    from ember import config
    from ember.runtime import precompile, worker_triton
    torch.zeros(1, device="cuda")
    precompile._worker_triton_env()
    if not with_target:
        precompile._WORKER_ENV[worker_triton.TARGET_ENV] = ""
    began = time.time()
    with config.patch(compile_workers=workers):
        precompile.start_workers()
    ready = sorted(f.result() - began for f in precompile._STARTED)
    return {"with_target": with_target, "workers": workers, "first_ready_s": round(ready[0], 3),
            "median_ready_s": round(statistics.median(ready), 3), "last_ready_s": round(ready[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--one", choices=["target", "torch"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(start_times(args.workers, args.one == "target")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results: dict = {"key": key_check(Path(tmp))}
    print("key:", json.dumps(results["key"]))
    results["start"] = []
    for mode in ("torch", "target", "torch", "target"):
        done = subprocess.run([sys.executable, __file__, "--one", mode, "--workers", str(args.workers)],
                              capture_output=True, text=True, timeout=300)
        row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
            "mode": mode, "error": done.stderr[-2000:]}
        results["start"].append(row)
        print("start:", json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
