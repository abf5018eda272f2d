"""Run in a fresh process by tests/capture/test_warm_start.py: compile a small model with
``warm_start=True``, run it once (inference, or a training step), and print one JSON line: what
the warm start did, how many graphs Dynamo traced in this process, the output and gradient sums,
and the largest difference from eager.

    python warm_worker.py CACHE_DIR MODEL_DIR MODE [VARIANT ...]

MODE is infer or train. MODEL_DIR holds ``warm_model.py`` (the test writes it; a changed source
is a changed file). Each VARIANT compiles a fresh ember.compile of a changed case in this same
process: base, weight_dtype, weight_shape, ember_version, device_name, graph_break, decorated (a
decorated forward and a module holding a builtin), decorated_other_act (another builtin there),
flagged (a forward reading module globals, an enum member among them), flagged_scale / flagged_tanh /
flagged_layout (those globals set otherwise before the compile), flagged_between_calls (a global set otherwise after the first call).
"""

from __future__ import annotations

import copy
import importlib
import json
import sys

import torch
from torch._dynamo.utils import counters
from worker_step import run_beside_eager  # tests/support, the script's folder

import ember
from ember.capture import warm_start


def run(cache_dir: str, mode: str, variant: str) -> dict:
    import warm_model
    importlib.reload(warm_model)  # the file may have changed since this process imported it
    torch.manual_seed(0)
    hidden = 12 if variant == "weight_shape" else 8
    if variant == "flagged_scale":
        warm_model.SCALE = 3.0
    if variant == "flagged_tanh":
        warm_model.USE_RELU = False
    if variant == "flagged_layout":
        warm_model.LAYOUT = warm_model.Layout.FLIPPED
    if variant.startswith("decorated"):
        act = torch.relu if variant == "decorated_other_act" else torch.nn.functional.gelu
        model = warm_model.Decorated(hidden, act)
    elif variant.startswith("flagged"):
        model = warm_model.Flagged(hidden)
    else:
        model = (warm_model.Broken if variant == "graph_break" else warm_model.Net)(hidden)
    x = torch.randn(4, 6)
    if variant == "weight_dtype":
        model, x = model.double(), x.double()
    if mode == "infer":
        model.eval()
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, warm_start=True, cache_dir=cache_dir, target="cpu")
    graphs_before = counters["stats"]["unique_graphs"]
    out, want, grads, grad_err = run_beside_eager(compiled, model, ref, x, mode)
    if variant == "flagged_between_calls":  # a global flipped after the first call
        warm_model.USE_RELU = False
        for m in (model, ref):
            m.zero_grad()
        out, want, grads, grad_err = run_beside_eager(compiled, model, ref, x, mode)
    return {"variant": variant, "log": compiled._ember_backend.log.warm_start,
            "traced_graphs": counters["stats"]["unique_graphs"] - graphs_before,
            "caches": [g.cache for g in compiled._ember_backend.log.graphs],
            "out": out.double().sum().item(), "grads": grads,
            "out_err": (out - want).abs().max().item(), "grad_err": grad_err}


def main() -> None:
    cache_dir, model_dir, mode, *variants = sys.argv[1:]
    sys.path.insert(0, model_dir)
    results = []
    for variant in variants or ["base"]:
        if variant == "ember_version":
            ember.__version__ = "0.0.0-patched"  # part of the file's key (runtime/artifacts._versions)
        if variant == "device_name":
            warm_start._device_name = lambda *a: "another device"  # what a different GPU changes
        results.append(run(cache_dir, mode, variant))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
