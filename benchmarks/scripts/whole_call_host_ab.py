"""Host time of a replayed whole call: straight into ``WholeCall`` against through
``OptimizedModule.__call__`` (nn.Module's call path), alternating in one process.

    PYTHONPATH=src python benchmarks/scripts/whole_call_host_ab.py resnet50 bert --out $OUT   # GPU
    PYTHONPATH=src python benchmarks/scripts/whole_call_host_ab.py resnet18 --small          # CPU

On a GPU the graphs are real (bf16 autocast, no_grad). On the CPU a stand-in replays nothing
(capture runs the call once, a replay launches nothing), so the numbers are the host's own
work around a replay, not a step. Rounds of ``--calls`` calls per path, alternating; the median
microseconds per call of each path's rounds. Rows go to ``whole_call_host_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import ember
from ember.bench.models import get_case, make_batches
from ember.runtime.cudagraphs.device import CudaBackend
from ember.runtime.cudagraphs.whole_call import WholeCallModule


class _HostOnly(CudaBackend):
    """The CPU stand-in: capture runs the call once for its outputs, a replay does nothing."""

    def on_device(self, t: torch.Tensor) -> bool:
        return True

    def new_pool(self, device: torch.device, shared: bool) -> object:
        return object()

    def release_cached(self, device: torch.device) -> int:
        return 0

    def capture(self, run, inputs, device, pool=None, prepare=None):  # noqa: ANN001, ANN201
        return object(), run(inputs)

    def replay(self, graph: object, args: list) -> None:
        pass


def run_model(name: str, small: bool, rounds: int, calls: int) -> dict:
    case = get_case(name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = case.build(small).to(device).eval()
    compiled = ember.compile(model, whole_call=True, warm_start=False)
    whole = compiled._ember_backend.whole_call
    if device.type == "cpu":
        whole.backend = _HostOnly()
    inputs = make_batches(case, 1, device, small=small, count=1)[0][0]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    paths = {"direct": lambda: compiled(*inputs),
             "module_call": lambda: torch._dynamo.eval_frame.OptimizedModule.__call__(compiled, *inputs)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    with torch.no_grad(), autocast:
        for _ in range(4):
            compiled(*inputs)
        for _ in range(rounds):
            for key, fn in paths.items():
                spent = []
                for _ in range(calls):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn()
                    spent.append((time.perf_counter() - t) * 1e6)
                times[key].append(statistics.median(spent))
    row = {"model": name, "device": str(device), "small": small, "class": type(compiled).__name__,
           "is_whole_call_module": isinstance(compiled, WholeCallModule), "status": whole.describe()[:300],
           **{f"{k}_us": statistics.median(v) for k, v in times.items()}, "rounds": rounds, "calls": calls}
    print(f"{name}: direct {row['direct_us']:.1f} us, through OptimizedModule.__call__ {row['module_call_us']:.1f} us "
          f"({whole.replays} replays)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    rows = [run_model(m, args.small, args.rounds, args.calls) for m in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "whole_call_host_ab.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
