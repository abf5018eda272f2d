"""cuDNN's LSTM captured whole in one CUDA graph: the reference for a traced recurrence.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/gpu_rnn_graphs.py --out $OUT/rnn_graphs.json

The zoo's lstm_lm (2 x 1500, vocabulary 10k, sequence 35; bf16 autocast) run eagerly, where
every backend that breaks the graph at ``nn.LSTM`` runs it, and the same eager model captured by
hand with ``torch.cuda.graph``: inference at batch 1, and a training step's forward and backward
at batch 20 (no optimizer). The captured rows have no host work left but the replay, so they
bound what an opaque cuDNN call inside a compiled program could reach; compare them with the
bench's rows for Ember, which traces the LSTM into per-step matmuls and generated gate kernels.
Host synchronised after every step; median of ``--iters`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ember.bench import models


def _median_ms(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def captured_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured as one CUDA graph after three warm-up runs on a side stream; its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default="rnn_graphs.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    case = models.get_case("lstm_lm")
    rows = []
    for mode, batch in (("infer", 1), ("train", 20)):
        torch.manual_seed(0)
        model = case.build(False).to(device).train(mode == "train")
        ids = models.make_batches(case, batch, device, count=1)[0][0][0]

        def run(model: torch.nn.Module = model, ids: torch.Tensor = ids, mode: str = mode) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(mode == "train"):
                out = model(ids)
            if mode == "train":
                out.float().square().mean().backward()

        row = {"mode": mode, "batch": batch, "eager_ms": _median_ms(run, args.iters)}
        try:
            row["captured_ms"] = _median_ms(captured_replay(run), args.iters)
        except Exception as err:  # noqa: BLE001 - a capture torch refuses is the finding
            row["captured_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
