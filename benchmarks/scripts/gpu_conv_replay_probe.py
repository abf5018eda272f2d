"""What cuDNN's per-shape convolution set-up, replayed by Ember's library warm-up in a helper
thread (runtime/library_warmup.py), saves the threads that run the convolutions afterwards
(torch keeps cuDNN's plans per host thread).

For every convolution shape of a model (forward and both gradients, bf16, channels_last), each
mode in a new process: the helper's replay, then every call made first by the main thread and by
a fresh thread (as autograd's device thread runs a backward), then by the main thread again.

    PYTHONPATH=src python benchmarks/scripts/gpu_conv_replay_probe.py mobilenet_v3 \\
        --batch 128 --modes none all rule [--json F]

Modes: ``none`` no replay; ``all`` every call replayed; ``rule`` the warm-up's own choice (one
depthwise convolution per op, ``DEPTHWISE_PER_OP``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHILD = r"""
import json, sys, threading, time, torch
from ember.runtime import library_warmup as lw
mode, calls = sys.argv[1], json.loads(sys.argv[2])
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
every = 10**9
out = {"mode": mode, "calls": len(calls)}
if mode != "none":
    lw.DEPTHWISE_PER_OP = every if mode == "all" else 1
    t = time.perf_counter()
    done = {}
    helper = threading.Thread(target=lambda: done.setdefault("r", lw.replay(calls)))
    helper.start(); helper.join()
    out["replay_s"] = time.perf_counter() - t
    out["replay_failed"] = done["r"].failed
    out["replay_left"] = done["r"].left
    out["replay_error"] = done["r"].first_error[:200]
lw.DEPTHWISE_PER_OP = every  # the running threads make every call
def run_all():
    t = time.perf_counter()
    r = lw.replay(calls)
    return time.perf_counter() - t, r.failed
out["main_first_s"], out["main_failed"] = run_all()
box = {}
fresh = threading.Thread(target=lambda: box.setdefault("r", run_all()))
fresh.start(); fresh.join()
out["fresh_thread_s"] = box["r"][0]
out["main_again_s"] = run_all()[0]
out["reserved_mib"] = torch.cuda.memory_reserved() / 2**20
out["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
print("RESULT " + json.dumps(out))
"""


def conv_calls(model: str, batch: int) -> list[str]:
    """aten.convolution and aten.convolution_backward of every conv shape, as the warm-up's text."""
    from conv_first_call import model_convs

    calls = []
    for c in model_convs(model, batch):
        x = [batch, *c["x"][1:]]
        w = c["w"]
        y = [batch, w[0]] + [
            (x[2 + i] + 2 * c["padding"][i] - c["dilation"][i] * (w[2 + i] - 1) - 1) // c["stride"][i] + 1
            for i in range(2)]
        geometry = [c["stride"], c["padding"], c["dilation"], False, [0, 0], c["groups"]]
        calls.append(json.dumps({"op": ["aten", "convolution", "default"],
                                 "args": [_nhwc(x), _nhwc(w), None, *geometry], "kwargs": {}}))
        calls.append(json.dumps({"op": ["aten", "convolution_backward", "default"],
                                 "args": [_nhwc(y), _nhwc(x), _nhwc(w), None, *geometry, [True, True, False]],
                                 "kwargs": {}}))
    return calls


def _nhwc(shape: list[int]) -> dict:
    n, c, h, w = shape
    return {"tensor": [shape, [h * w * c, 1, w * c, c], 0, "bfloat16", "cuda"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, nargs="+", default=[128])
    parser.add_argument("--modes", nargs="+", default=["none", "all", "rule"])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    batches = args.batch * len(args.models) if len(args.batch) == 1 else args.batch
    for model, batch in zip(args.models, batches):
        calls = conv_calls(model, batch)
        for mode in args.modes:
            proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(calls)],
                                  capture_output=True, text=True, env=dict(os.environ))
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(model, mode, "ERROR", proc.stderr[-1500:])
                continue
            row = {"model": model, "batch": batch, **json.loads(line[7:])}
            rows.append(row)
            print(f"{model:14s} bs{batch:<4d} {mode:4s}: replay {row.get('replay_s', 0):7.3f} s"
                  f" (failed {row.get('replay_failed', 0)}, left {row.get('replay_left', 0)}), then main thread {row['main_first_s']:7.3f} s,"
                  f" fresh thread {row['fresh_thread_s']:7.3f} s, main again {row['main_again_s']:6.3f} s;"
                  f" reserved {row['reserved_mib']:.0f} MiB (peak {row['peak_reserved_mib']:.0f}),"
                  f" {row['calls']} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
