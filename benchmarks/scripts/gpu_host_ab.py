"""One Ember setting on and off in one process, calls alternating: host time per inference call.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_host_ab.py bert resnet50 --env EMBER_MODULE_GUARD_TAGS=1,0

The host of the GPU machines changes speed between processes and within one (up to 2.5x between
runs of one setting), so two processes compare badly when the difference sought is tens of
microseconds. Here two compiled copies of each model (bf16 inference at ``--batch``) are made,
the environment variable set to the first value while the first copy is compiled (Ember reads its
options at ``ember.compile``) and to the second for the other; then ``--steps`` synchronised calls
alternate between them, so both see the same host. Each copy gets a class of its own whose
``forward`` is a new code object: Dynamo keeps its compiled frames per code object and checks them
in turn, so copies sharing one would each pay for failing the others' guards first. Prints, per copy, the median host time (call
start to return) and step time (to the device's end), and ``--peer``'s the same way if given.
``--profile DIR``: then ``cProfile`` over 200 more calls of each variant, the top functions by own
time written to ``DIR/<model>_<variant>.txt``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import types
from pathlib import Path

import torch

import ember
from ember.bench import harness, models
from ember.bench.backends import BACKENDS


def _own_code(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as an instance of a subclass whose ``forward`` runs a code object of its own."""
    cls = type(model)
    f = cls.forward
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    own.__kwdefaults__ = f.__kwdefaults__
    own.__dict__.update(f.__dict__)
    model.__class__ = type(cls.__name__, (cls,), {"forward": own})
    return model


def _steps(name: str, env: str, values: list[str], peer: str | None) -> dict:
    device = torch.device("cuda")
    case = models.get_case(name)
    torch.manual_seed(0)
    base = case.build(False).to(device).eval()
    steps = {}
    for value in values:
        os.environ[env] = value
        steps[f"ember {env}={value}"] = harness._make_step(case, ember.compile(_own_code(copy.deepcopy(base))), "infer", "bf16",
                                                          device, None)
    if peer:
        steps[peer] = harness._make_step(case, BACKENDS[peer](_own_code(copy.deepcopy(base))), "infer", "bf16", device, None)
    return steps


def _profile(fn, batch: tuple, path: Path) -> None:
    """200 synchronised calls of ``fn`` under cProfile; the top 40 functions by own time to ``path``."""
    prof = cProfile.Profile()
    for _ in range(200):
        prof.enable()
        fn(*batch)
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def measure(name: str, env: str, values: list[str], batch: int, steps: int, warmup: int, peer: str | None,
            profile_dir: str | None = None) -> dict:
    device = torch.device("cuda")
    case = models.get_case(name)
    fns = _steps(name, env, values, peer)
    batches = models.make_batches(case, batch, device, count=2)
    host: dict[str, list[float]] = {k: [] for k in fns}
    step: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + steps):
        for label, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn(*batches[i % 2])
            done = time.perf_counter()
            torch.cuda.synchronize()
            synced = time.perf_counter()
            if i >= warmup:
                host[label].append((done - start) * 1e6)
                step[label].append((synced - start) * 1e6)
    if profile_dir:
        for label, fn in fns.items():
            _profile(fn, batches[0], Path(profile_dir) / f"{name}_{label.replace(' ', '_').replace('=', '')}.txt")
    return {"model": name, "batch": batch, "steps": steps,
            "rows": [{"variant": k, "host_us": statistics.median(host[k]), "step_us": statistics.median(step[k]),
                      "host_us_all": host[k], "step_us_all": step[k]} for k in fns]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--env", required=True, help="NAME=A,B: the variable and its two values")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--peer", default=None, help="a bench backend timed alongside (inductor-cudagraphs)")
    parser.add_argument("--profile", default=None, help="a folder for cProfile tables of each variant")
    parser.add_argument("--out", default="host_ab.json")
    args = parser.parse_args()
    env, _, values = args.env.partition("=")
    results = []
    for name in args.models:
        r = measure(name, env, values.split(","), args.batch, args.steps, args.warmup, args.peer, args.profile)
        results.append(r)
        print(f"{name} bs{args.batch}: " + "  ".join(f"{row['variant']}: host {row['host_us']:.1f} step "
                                                    f"{row['step_us']:.1f} us" for row in r["rows"]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("EMBER_GIT_COMMIT", "")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
