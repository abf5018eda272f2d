"""Host time per call with the warm start on and off, and the warm start's per-call parts (CPU).

Run from the repo root:
    python benchmarks/scripts/cpu_warm_start_call_bench.py --rounds 3 --json OUT.json

A BERT built from a transformers config (``--size tiny``: 2 layers of 64, sequence 16, where
host work shows; ``base``: bert-base, sequence 128), inference at batch 1 under ``torch.no_grad()``.
For each setting a first process fills the cache; then ``--rounds`` rounds of one process per
setting, alternating, each timing ``--calls`` calls after 50 (median us) beside eager's median.
With the warm start on, the process also times the parts of ``WarmStart.__call__``: the call key,
torch's preparation of the saved guards' locals and their check, Ember's re-checks and the program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import child_result, write_rows  # noqa: E402 - the script's sibling

CONFIGS = {"tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                         vocab_size=1000), 16),
           "base": (dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=30522), 128)}


def _median_us(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def _dynamo_guard_check(model: object, ids: object) -> Callable[[], object] | None:
    """Dynamo's check of its cached frame of ``model``'s forward (None with the warm start on)."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forward = type(model).forward
    entries = _debug_get_cache_entry_list(forward.__code__)
    if not entries:
        return None
    bound = inspect.signature(forward, follow_wrapped=False).bind(model, ids)  # the compiled code's own
    bound.apply_defaults()
    f_locals = {name: cell.cell_contents for name, cell in zip(forward.__code__.co_freevars, forward.__closure__ or ())}
    f_locals.update(bound.arguments)
    manager = entries[0].guard_manager
    return (lambda: manager.check(f_locals)) if manager.check(f_locals) else None


def child(size: str, cache: str, calls: int) -> dict:
    import torch
    from transformers import BertConfig, BertModel

    import ember
    from ember.capture import warm_start

    torch.manual_seed(0)
    config, length = CONFIGS[size]
    model = BertModel(BertConfig(**config)).eval()
    ids = torch.randint(0, 1000, (1, length))
    compiled = ember.compile(model, cache_dir=cache)
    row: dict = {"warm_start": os.environ.get("EMBER_WARM_START"), "size": size}
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(ids)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        for _ in range(50):
            compiled(ids)
        row["call_us"] = _median_us(lambda: compiled(ids), calls)
        row["eager_us"] = _median_us(lambda: model(ids), max(50, calls // 3))
        dynamo_check = _dynamo_guard_check(model, ids)
        if dynamo_check is not None:  # what Dynamo's own path checks per call, for comparison
            row["dynamo_guard_check_us"] = _median_us(dynamo_check, calls)
        warm = next((v for v in vars(compiled).values() if isinstance(v, warm_start.WarmStart)), None)
        if warm is not None and warm.entries:
            _, fn, rechecks = warm.entries[0]
            args: tuple = (ids,)
            bound = warm.bound(args)
            f_locals = fn.prepare_f_locals(*bound)
            row["parts_us"] = {
                "call_key": _median_us(lambda: warm_start.call_key(args, {}), calls),
                "prepare_f_locals (torch)": _median_us(lambda: fn.prepare_f_locals(*bound), calls),
                "saved guards' check (torch)": _median_us(lambda: fn._artifacts.guard_manager.check(f_locals), calls),
                "re-checks (Ember)": _median_us(lambda: warm.rechecks_hold(rechecks, args, {}), calls),
                "program": _median_us(lambda: fn.fn(*bound), calls),
                "re-checks": len(rechecks.items)}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args.calls)))
        return 0
    rows = []
    rerun = f"import runpy, sys; sys.argv[0] = {__file__!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds + 1):  # round 0 fills each setting's cache
            for setting in ("1", "0"):
                row, err = child_result(rerun, ["--calls", str(args.calls), "--child", args.size,
                                                os.path.join(tmp, setting)], {**os.environ, "EMBER_WARM_START": setting})
                row = {**(row or {"error": err[-500:]}), "round": rnd}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return write_rows(args.json, rows)

if __name__ == "__main__":
    sys.exit(main())
