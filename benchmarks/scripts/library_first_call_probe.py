"""Whether the libraries' first-call costs (cuDNN plans, cuBLAS handles, their kernels' lazy loading)
carry from one host thread to another: one eager bf16 training step of a bench model, timed in a
new process after one of three openings.

    PYTHONPATH=src python benchmarks/scripts/library_first_call_probe.py resnet50 --opening main|busy|thread

- ``main``: nothing first; the step is the process's first.
- ``busy``: the main thread runs Python for ``--busy`` seconds first (as a warm start's guard
  building does), then the step.
- ``thread``: the same, while a second thread runs one step of a copy of the model on other
  tensors of the batch's shapes; then the main thread's step.

Prints one line: the opening, the busy time, the helper thread's step time, and the main thread's
first and second step times. If ``thread``'s first step is near the second, a warm start could run
the libraries' first calls beside the work it does on the host before the program's first run.
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--opening", choices=["main", "busy", "thread"], required=True)
    parser.add_argument("--busy", type=float, default=0.6)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--switch-interval", type=float, default=1e-4,
                        help="sys.setswitchinterval while the helper runs (Python's default: 0.005 s)")
    args = parser.parse_args()

    import torch

    from ember.bench import models

    case = models.get_case(args.model)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = case.build(False).train().to(device)
    batch = args.batch or case.default_batch("train")
    batches = models.make_batches(case, batch, device, small=False, count=2)
    torch.cuda.synchronize()

    def step(m: torch.nn.Module, data: tuple) -> None:
        inputs, target = data
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = case.loss(m(*inputs), target)
        loss.backward()

    helper_s = float("nan")
    if args.opening == "thread":
        other = copy.deepcopy(model)
        inputs, target = batches[1]
        scratch = (tuple(x.clone() for x in inputs), target.clone())
        done: dict[str, float] = {}

        def helper() -> None:
            t0 = time.perf_counter()
            step(other, scratch)
            torch.cuda.synchronize()
            done["s"] = time.perf_counter() - t0

        worker = threading.Thread(target=helper)
        sys.setswitchinterval(args.switch_interval)  # the helper gets the GIL back soon after each op
        worker.start()
    busy_s = 0.0
    if args.opening in ("busy", "thread"):
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < args.busy:  # Python work holding the GIL between bytecodes
            for i in range(1000):
                x += i * i
        busy_s = time.perf_counter() - t0
    if args.opening == "thread":
        worker.join()
        sys.setswitchinterval(0.005)
        helper_s = done.get("s", float("nan"))
        del other
    t0 = time.perf_counter()
    step(model, batches[0])
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(model, batches[1])
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    print(f"{args.model} opening={args.opening} busy={busy_s:.3f}s helper_step={helper_s:.3f}s "
          f"first_step={first:.3f}s second_step={second:.3f}s", flush=True)


if __name__ == "__main__":
    main()
