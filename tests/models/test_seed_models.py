"""The eight seed models of BENCHMARKS.md, at small input sizes, through Ember on the CPU.

One training step (output, loss, every parameter gradient, every float buffer such as BN
running stats) and one inference call, Ember vs eager, both measured against a float64
eager reference. The fused groups run as generated Triton kernels through Triton's
interpreter (``target="triton-interpret"``): the kernels the GPU runs, on CPU tensors.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from core_helpers import assert_compiled_cleanly

import ember
from ember.bench.check import acceptable, run_seed_step
from ember.bench.models import SEED_SUITE

SEED_MODELS = SEED_SUITE
# fp32 against a float64 reference: Ember may be 4x as far off as eager, or under this floor.
FLOOR = 1e-5
# At batch 2 and 64x64 inputs resnetv2's last stages normalise 8 values per channel: ReLU masks
# flip under fp32 rounding and even eager is 4e-4 off float64, so the comparison is noise.
# Batch 4 keeps that model well conditioned.
BATCH = {"resnet50v2": 4}


# Training gradients against float64 far above eager's on a 2-core AMD EPYC (2026-11-25), also at
# earlier commits (cyclegan at dc5ad1b): cyclegan ~60x (0.0027 vs 4.4e-05, every weight alike),
# densenet121 ~85x (0.0025 vs 3.0e-05 from denseblock2 on). Open defects, kept visible.
_TRAIN_OPEN = {m: pytest.mark.xfail(strict=False, reason=f"{m} training gradients above 4x eager's error against "
                                                         "float64 on some CPUs (an open defect)")
               for m in ("cyclegan", "densenet121")}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=_TRAIN_OPEN[n]) if n in _TRAIN_OPEN else n
                                  for n in SEED_MODELS])
def test_seed_model_train_and_infer_match_eager(name: str) -> None:
    compiled = []

    def compile_fn(model: torch.nn.Module):
        fn = ember.compile(model, target="triton-interpret")
        compiled.append(fn)
        return fn

    train, infer = run_seed_step(name, compile_fn, device="cpu", batch=BATCH.get(name, 2), small=True)
    for result in (train, infer):
        bad = {k: v for k, v in result.errors.items() if not acceptable(v[0], v[1], FLOOR)}
        assert not bad, f"{name} {result.mode}: (ember, eager) error vs float64: {bad}"
    n_grads = sum(1 for k in train.errors if k.startswith("grad "))
    assert n_grads > 0 and "loss" in train.errors and "output" in infer.errors

    log = compiled[0]._ember_backend.log
    assert_compiled_cleanly(log)
    kinds = Counter(g.kind for g in log.graphs)
    assert kinds["forward"] >= 1 and kinds["backward"] >= 1 and kinds["inference"] >= 1, kinds
    for g in log.graphs:
        assert g.target == "triton-interpret"
        assert g.kernels >= 1, f"{g.title}: no generated kernel"
        assert not g.placement.get("fused-aten"), f"{g.title}: fused groups ran through ATen"


# The same step through Ember's generated CPU kernels (target "cpu", numba): the whole suite.
CPU_TARGET_MODELS = SEED_MODELS


# resnet50v2 on the CPU target: gradients of its later stages 4.1x eager's error against float64
# (0.0135 vs 0.0033 on a 2-core AMD EPYC, 2026-11-25; also at earlier commits): an open defect.
_CPU_TRAIN_OPEN = pytest.mark.xfail(strict=False, reason="resnet50v2 CPU training gradients above 4x eager's "
                                                         "error against float64 (an open defect)")


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=_CPU_TRAIN_OPEN) if n == "resnet50v2" else
                                  pytest.param(n, marks=_TRAIN_OPEN[n]) if n == "cyclegan" else n
                                  for n in CPU_TARGET_MODELS])
def test_seed_model_cpu_target_matches_eager(name: str) -> None:
    pytest.importorskip("numba")
    compiled = []

    def compile_fn(model: torch.nn.Module):
        fn = ember.compile(model, target="cpu")
        compiled.append(fn)
        return fn

    train, infer = run_seed_step(name, compile_fn, device="cpu", batch=BATCH.get(name, 2), small=True)
    for result in (train, infer):
        bad = {k: v for k, v in result.errors.items() if not acceptable(v[0], v[1], FLOOR)}
        assert not bad, f"{name} {result.mode}: (ember, eager) error vs float64: {bad}"
    log = compiled[0]._ember_backend.log
    assert_compiled_cleanly(log)
    # CPU inference graphs may have nothing to generate (oneDNN calls with fused activations).
    assert sum(g.kernels for g in log.graphs) >= 1
    for g in log.graphs:
        assert g.target == "cpu", (g.title, g.target)
        assert not g.placement.get("fused-aten"), f"{g.title}: {dict(g.fallback_reasons)}"
