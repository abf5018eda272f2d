"""Whole-call inference programs on the GPU: are replays right, and do they stay right when the
model changes under them?

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_whole_call.py resnet50 bert --batch 1 --out $OUT

For each model (bf16 autocast, no_grad, the bench's own model and inputs), ``ember.compile(model,
whole_call=True)`` against eager on fresh random inputs:

- ``replays``: six calls of one form, each compared with eager; the outputs of all six are kept
  and compared again at the end (a replay must not overwrite what a caller holds);
- ``weights``: every parameter scaled in place (``load_state_dict``), then four calls;
- ``flag``: a Python attribute the forward reads changed (Hugging Face models:
  ``config.output_hidden_states`` set to True, so forward returns the hidden states too; Dynamo's
  guards must send it down the normal path);
- ``batch``: another batch size, then the first one again.

Each check prints the largest difference from fp32 eager relative to its largest magnitude, for
Ember's whole call and for bf16 eager (a check passes within twice eager's, or 3e-2), the calls
that replayed a graph, and the whole-call status. Rows go to ``whole_call_checks.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import ember
from ember.bench.models import get_case, make_batches

TOLERANCE = 3e-2  # bf16 autocast: Ember and eager round at different places


def tensor_leaves(out: object) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def relative_difference(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference from ``ref`` relative to ``ref``'s largest magnitude."""
    scale = ref.float().abs().max().item() or 1.0
    return (a.float() - ref.float()).abs().max().item() / scale


def _difference(out: object, ref: object) -> float:
    return max((relative_difference(a, b) for a, b in zip(tensor_leaves(out), tensor_leaves(ref), strict=True)),
               default=0.0)


def run_model(name: str, batch: int) -> list[dict]:
    case = get_case(name)
    device = torch.device("cuda")
    eager = case.build(False).to(device).eval()
    model = copy.deepcopy(eager)
    compiled = ember.compile(model, whole_call=True)
    whole = compiled._ember_backend.whole_call
    rows = []

    def call(fn: object, inputs: tuple) -> object:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(*inputs)

    def check(label: str, batches: list) -> None:
        try:
            checked(label, batches)
        except Exception as err:  # noqa: BLE001 - recorded with the status; the next check goes on
            rows.append({"model": name, "batch": batch, "check": label, "ok": False,
                         "error": f"{type(err).__name__}: {str(err)[:300]}", "status": whole.describe()})
            print(f"{name:10s} bs{batch:<3d} {label:8s} ERROR {type(err).__name__}: {str(err)[:200]}", flush=True)

    def checked(label: str, batches: list) -> None:
        before = whole.replays
        diffs, kept, floor = [], [], 0.0
        for inputs, _ in batches:
            out, ref = call(compiled, inputs), call(eager, inputs)
            with torch.no_grad():  # fp32 eager: both bf16 answers are measured against it
                exact = eager(*inputs)
            diffs.append(_difference(out, exact))
            kept.append((out, exact))
            floor = max(floor, _difference(ref, exact))  # eager's own bf16 rounding
        held = max(_difference(o, r) for o, r in kept)
        if any(type(o) is not type(r) for o, r in kept):
            held = float("inf")  # another output structure than eager's
        row = {"model": name, "batch": batch, "check": label, "calls": len(batches),
               "replayed": whole.replays - before, "max_rel_diff": max(diffs), "held_outputs_rel_diff": held,
               "eager_bf16_vs_fp32": floor, "ok": max(diffs + [held]) <= max(TOLERANCE, 2 * floor),
               "status": whole.describe()}
        rows.append(row)
        print(f"{name:10s} bs{batch:<3d} {label:8s} replayed {row['replayed']}/{len(batches)}  "
              f"rel diff from fp32 eager {row['max_rel_diff']:.2e} (held {held:.2e}; eager bf16's {floor:.2e})  "
              f"{'ok' if row['ok'] else 'FAIL'}", flush=True)

    check("replays", make_batches(case, batch, device, count=6, seed=1))
    if whole.graphs:
        rows.append(host_split(name, batch, compiled, whole, make_batches(case, batch, device, count=1, seed=6)[0][0]))
    with torch.no_grad():
        gen = torch.Generator(device).manual_seed(0)
        state = {k: v * (1 + 0.1 * torch.randn(v.shape, generator=gen, device=device, dtype=v.dtype))
                 if v.is_floating_point() else v for k, v in eager.state_dict().items()}
        eager.load_state_dict(state)
        model.load_state_dict(state)
    check("weights", make_batches(case, batch, device, count=4, seed=2))
    if hasattr(getattr(model, "config", None), "output_hidden_states"):  # Hugging Face: a flag forward reads
        model.config.output_hidden_states = eager.config.output_hidden_states = True  # more outputs from now on
        check("flag", make_batches(case, batch, device, count=4, seed=3))
        model.config.output_hidden_states = eager.config.output_hidden_states = False
    check("batch", make_batches(case, batch * 2, device, count=4, seed=4)
          + make_batches(case, batch, device, count=4, seed=5))
    rows.append({"model": name, "batch": batch, "check": "status", "ok": True, "status": whole.describe()})
    return rows


def host_split(name: str, batch: int, compiled: object, whole: object, inputs: tuple, n: int = 200) -> dict:
    """Where a synchronised replayed call's time goes. Each call is stamped in place
    (``time.perf_counter``, the whole call's own steps wrapped on the instance): ``before_launch``
    (the call path, its form, until the input copy starts), ``launch`` (the copy and the graph's
    launch), ``checks`` (the checks that run while the device replays), ``outputs`` (handing out),
    ``synchronised_call`` (to the end of the device's work). ``graph_device`` is the graph's own
    device time (50 replays back to back between CUDA events); ``host_on_critical_path`` is the
    synchronised call less that. Medians over ``n`` calls, in microseconds."""
    stamps: dict[str, float] = {}
    clock = time.perf_counter

    def stamped(key: str, fn: object) -> object:
        def run(*a: object) -> object:
            out = fn(*a)
            stamps[key] = clock()
            return out
        return run

    def launch(graph: object, given: list) -> None:
        stamps["launch_start"] = clock()
        original_launch(graph, given)
        stamps["launched"] = clock()

    original_launch = whole._launch
    spans: dict[str, list[float]] = {k: [] for k in ("before_launch", "launch", "checks", "outputs", "call",
                                                       "synchronised_call")}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(5):
            compiled(*inputs)
        graph = next(iter(whole.graphs.values()))
        whole._launch, whole._check = launch, stamped("checked", whole._check)
        whole._outputs = stamped("outputs", whole._outputs)
        try:
            replays = whole.replays
            for _ in range(n):
                torch.cuda.synchronize()
                stamps.clear()
                t0 = clock()
                compiled(*inputs)
                t1 = clock()
                torch.cuda.synchronize()
                t2 = clock()
                if "launched" not in stamps:
                    continue
                for key, (a, b) in {"before_launch": (t0, stamps["launch_start"]),
                                    "launch": (stamps["launch_start"], stamps["launched"]),
                                    "checks": (stamps["launched"], stamps["checked"]),
                                    "outputs": (stamps["checked"], stamps["outputs"]),
                                    "call": (t0, t1), "synchronised_call": (t0, t2)}.items():
                    spans[key].append((b - a) * 1e6)
        finally:
            for key in ("_launch", "_check", "_outputs"):
                del whole.__dict__[key]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
    row = {"model": name, "batch": batch, "check": "host_us", "ok": True, "replayed": whole.replays - replays,
           **{k: statistics.median(v) if v else None for k, v in spans.items()},
           "graph_device": start.elapsed_time(end) * 1e3 / 50}
    row["host_on_critical_path"] = row["synchronised_call"] - row["graph_device"] if spans["call"] else None
    print(f"{name:10s} bs{batch:<3d} us: before launch {row['before_launch']:.1f}, launch {row['launch']:.1f}, "
          f"checks {row['checks']:.1f}, outputs {row['outputs']:.1f}, call {row['call']:.1f}; synchronised "
          f"{row['synchronised_call']:.1f} = graph on the device {row['graph_device']:.1f} + "
          f"{row['host_on_critical_path']:.1f} ({row['replayed']}/{n} replayed)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in args.models:
        try:
            rows += run_model(name, args.batch)
        except Exception as err:  # noqa: BLE001 - report and go on with the next model
            traceback.print_exc()
            rows.append({"model": name, "error": f"{type(err).__name__}: {err}"})
        torch._dynamo.reset()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    (args.out / "whole_call_checks.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
