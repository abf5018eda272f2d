"""Which ATen calls of Ember's generated programs launch a given op, on the GPU machine.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_op_sites.py vgg16 --op aten::copy_ --dump $OUT/vgg16_programs

One bf16 training step of the model, compiled by Ember without CUDA graphs (so every op runs
where the profiler sees it), is profiled with input shapes after two warm-up steps. Each call of
the op is attributed to the chain of ops that called it (``aten::copy_ < aten::clone <
aten::contiguous < aten::cudnn_convolution ...``) and its input shapes; the table counts calls
and CUDA time per site. ``--dump`` keeps the programs and kernel plans (EMBER_DEBUG_DIR).
"""

from __future__ import annotations

import argparse
import collections
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--op", default="aten::copy_")
    parser.add_argument("--dump", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--graphs", action="store_true", help="keep CUDA graphs on: ops outside the graphs "
                        "(the autograd engine's, the optimizer's) still show")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ember
    from ember.bench import harness, models

    device = torch.device(args.device)
    case = models.get_case(args.model)
    torch.manual_seed(0)
    model = case.build(False).to(device).train()
    batches = models.make_batches(case, args.batch or case.default_batch("train"), device, count=2,
                                  small=args.device == "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = "bf16" if device.type == "cuda" else "fp32"
    step = harness._make_step(case, ember.compile(model, cudagraphs=args.graphs, **({"debug_dir": args.dump} if args.dump else {})), "train", precision, device, optimizer)
    for i in range(2):
        step(*batches[i % 2])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step(*batches[0])
        sync()
    sites: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.name != args.op:
            continue
        chain, parent = [], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = f"{' < '.join(chain[:5]) or '(top level)'}  shapes {ev.input_shapes}"
        sites[key][0] += 1
        sites[key][1] += ev.device_time_total / 1e3
    total = sum(v[1] for v in sites.values())
    print(f"{args.op}: {sum(v[0] for v in sites.values())} calls, {total:.3f} ms CUDA in one {args.model} step")
    for key, (calls, ms) in sorted(sites.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"{calls:4d} {ms:8.3f} ms  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
