"""Where the channels_last layout pass spends its time on the GPU machine: each metadata re-run
by op, fake-tensor dispatches against the pointwise shortcut, for one bf16 training step.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_layout_timing.py vgg16 [--json $OUT/layout_timing.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch

import ember
from ember.bench import models
from ember.passes import layout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="vgg16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # calls, s, changed, shortcut
    rerun, shortcut = layout._rerun, layout._pointwise_val
    hits = [0]

    def timed_shortcut(*a, **k):
        out = shortcut(*a, **k)
        hits[0] += out is not None
        return out

    def timed_rerun(node, mode):
        before, start = hits[0], time.perf_counter()
        changed = rerun(node, mode)
        s = stats[str(node.target)]
        s[0] += 1
        s[1] += time.perf_counter() - start
        s[2] += changed
        s[3] += hits[0] - before
        return changed

    layout._rerun, layout._pointwise_val = timed_rerun, timed_shortcut
    case = models.get_case(args.model)
    torch.manual_seed(0)
    model = case.build(False).cuda().train()
    (inputs, _t), = models.make_batches(case, case.default_batch("train"), torch.device("cuda"), count=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        report = ember.explain(model, *inputs)
    passes = collections.Counter()
    for g in report.graphs:
        for name, secs, _ in g.passes:
            passes[name] += secs
    total = sum(v[1] for v in stats.values())
    print(f"{args.model}: passes " + ", ".join(f"{k} {v:.3f} s" for k, v in passes.items()))
    print(f"metadata re-runs: {sum(v[0] for v in stats.values())} nodes, {total:.3f} s, "
          f"{sum(v[3] for v in stats.values())} by the pointwise shortcut")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    for target, (n, s, changed, short) in rows[:20]:
        print(f"  {target:55s} {n:5d} nodes {s * 1e3:8.1f} ms  {s / n * 1e6:7.0f} us/node  changed {changed:4d}"
              f"  shortcut {short:4d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "passes": dict(passes), "reruns": {k: v for k, v in rows}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
