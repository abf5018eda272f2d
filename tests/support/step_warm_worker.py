"""Run in a fresh process by tests/train/test_step_warm_start.py: train a small model for a few
steps with ``ember.compile_step(..., warm_start=True)`` next to an eager copy, and print one JSON
line per variant: what the warm start did, how many graphs Dynamo traced, the losses and parameter
sums, the largest difference from eager, and the first call's seconds.

    python step_warm_worker.py CACHE_DIR MODEL_DIR STEPS VARIANT [VARIANT ...]

MODEL_DIR holds ``step_model.py`` (the test writes it). VARIANT is global (train_fn reads the
module global ``model``, as a script does), closure (train_fn holds the model in its closure),
closure_scale (the closure's constant differs), weight_dtype and weight_shape (of global).
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch._dynamo.utils import counters

import ember


def run(cache_dir: str, steps: int, variant: str) -> dict:
    import step_model
    importlib.reload(step_model)  # the file may have changed since this process imported it
    torch.manual_seed(0)
    model = step_model.Net(12 if variant == "weight_shape" else 8)
    dtype = torch.float64 if variant == "weight_dtype" else torch.float32
    model = model.to(dtype)
    ref = copy.deepcopy(model)
    scale = 3.0 if variant == "closure_scale" else 2.0
    if variant.startswith("closure"):
        train_fn = step_model.closure_train_fn(model, scale)
    else:
        step_model.model = model
        train_fn = step_model.train_fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = ember.compile_step(train_fn, opt, model=model, warm_start=True, cache_dir=cache_dir, target="cpu")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (8,), generator=gen))
               for _ in range(steps)]
    graphs_before = counters["stats"]["unique_graphs"]
    losses, loss_err, first_call = [], 0.0, 0.0
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        loss = step(x, y)
        if i == 0:
            first_call = time.perf_counter() - start
        ref_opt.zero_grad()
        want = F.cross_entropy(ref(x), y) * scale
        want.backward()
        ref_opt.step()
        losses.append(loss.item())
        loss_err = max(loss_err, abs(loss.item() - want.item()))
    param_err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    backend = step.backend
    return {"variant": variant, "log": backend.log.warm_start, "report": str(step.explain()),
            "traced_graphs": counters["stats"]["unique_graphs"] - graphs_before,
            "caches": [g.cache for g in backend.log.graphs], "losses": losses,
            "params": [p.double().sum().item() for p in model.parameters()],
            "loss_err": loss_err, "param_err": param_err, "first_call_s": first_call}


def main() -> None:
    cache_dir, model_dir, steps, *variants = sys.argv[1:]
    sys.path.insert(0, model_dir)
    print(json.dumps([run(cache_dir, int(steps), v) for v in variants]))


if __name__ == "__main__":
    main()
