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
from ember.bench import cases
from ember.bench.check import acceptable, run_seed_step
from ember.bench.models import SEED_SUITE
from ember.passes.cpu_library import available as onednn_available

SEED_MODELS = SEED_SUITE
# fp32 against a float64 reference: Ember may be 4x as far off as eager, or under this floor.
FLOOR = 1e-5
# At batch 2 and 64x64 inputs resnetv2's last stages normalise 8 values per channel: ReLU masks
# flip under fp32 rounding and even eager is 4e-4 off float64, so the comparison is noise.
# Batch 4 keeps that model well conditioned.
BATCH = {"resnet50v2": 4}
# Image side of the triton-interpret test where the registry's small 64x64 is more than it needs.
# Triton's interpreter runs each kernel program in Python, so that test's time follows the pixel
# count, and style_transfer normalises each sample's channels (instance norm, not batch norm).
# 48x48 is the smallest side (a multiple of 4: the net downsamples by 4) that keeps every kernel
# kind of 64x64: its full-size instance norms reduce 2304 > 2048 values per row, so they stay
# looped reductions (persistent_rblock_max; at 32x32 all would be one-block), and the residual
# blocks still normalise 12x12 values per channel. 0.56x the pixels: 230 s -> 144 s on 2 cores.
# The batch-norm models stay at 64x64: at 32x32 their last stages normalise 2 values per channel.
INTERPRET_IMAGE_SIZE = {"style_transfer": 48}


# Deep normalised networks whose float32 training gradients are chaotic at test size: ReLU masks
# after a norm over few values flip under float32 rounding, so eager's own float32 error against
# float64 moves tenfold and more between random seeds (2-core AMD EPYC, 2026-11-26: cyclegan seeds
# 0-3 9.0e-5 to 3.6e-3, resnet50v2 at batch 4 4.7e-3 to 2.1e-2; Ember's within the same range).
# style_transfer's instance norms normalise few values per channel too: on a 2-core AVX2-only AMD
# EPYC (2026-11-28) eager's worst float32 gradient error was 7.3e-3 to 3.6e-2 over seeds 0-3, and
# at seed 0 one bias gradient that eager happened to get within 6.5e-6 Ember got within 2.1e-4.
# A float32 comparison there measures luck. They run in float64 instead, where eager equals the
# reference exactly and Ember's kernels must match it to FLOAT64_FLOOR.
FLOAT64_MODELS = {"cyclegan", "densenet121", "resnet50v2", "style_transfer"}
FLOAT64_FLOOR = 1e-8


def check_seed_model(name: str, compile_fn, image_size: int | None = None):
    """Train step + inference of ``name`` through ``compile_fn`` within the bounds above, on
    ``image_size`` square images if given (else the registry's small inputs)."""
    dtype = torch.float64 if name in FLOAT64_MODELS else torch.float32
    floor = FLOAT64_FLOOR if dtype == torch.float64 else FLOOR
    with pytest.MonkeyPatch.context() as mp:
        if image_size is not None:  # the registry's small images are 64x64 (bench/cases._image_size)
            mp.setattr(cases, "_image_size", lambda small, full: image_size if small else full)
        train, infer = run_seed_step(name, compile_fn, device="cpu", batch=BATCH.get(name, 2), small=True,
                                     dtype=dtype)
    for result in (train, infer):
        bad = {k: v for k, v in result.errors.items() if not acceptable(v[0], v[1], floor)}
        assert not bad, f"{name} {result.mode} ({dtype}): (ember, eager) error vs float64: {bad}"
    return train, infer


@pytest.mark.slow
@pytest.mark.parametrize("name", SEED_MODELS)
def test_seed_model_train_and_infer_match_eager(name: str) -> None:
    compiled = []

    def compile_fn(model: torch.nn.Module):
        fn = ember.compile(model, target="triton-interpret")
        compiled.append(fn)
        return fn

    train, infer = check_seed_model(name, compile_fn, INTERPRET_IMAGE_SIZE.get(name))
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


# The same step through Ember's default CPU path (``device="cpu"``: the "cpu" target's generated
# numba kernels, oneDNN for inference convolutions and linear layers): the whole suite.
CPU_TARGET_MODELS = SEED_MODELS


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_TARGET_MODELS)
def test_seed_model_cpu_target_matches_eager(name: str) -> None:
    """A training step, then inference in eval mode (batch-norm statistics updated by that step,
    so folding them is exercised), vs float64 eager."""
    pytest.importorskip("numba")
    compiled = []

    def compile_fn(model: torch.nn.Module):
        fn = ember.compile(model, device="cpu")
        compiled.append(fn)
        return fn

    check_seed_model(name, compile_fn)
    log = compiled[0]._ember_backend.log
    assert_compiled_cleanly(log)
    # CPU inference graphs may have nothing to generate (oneDNN calls with fused activations).
    assert sum(g.kernels for g in log.graphs) >= 1
    assert any(g.kind == "inference" for g in log.graphs)
    for g in log.graphs:
        assert g.target == "cpu", (g.title, g.target)
        assert not g.placement.get("fused-aten"), f"{g.title}: {dict(g.fallback_reasons)}"
    library: Counter = Counter()
    for g in log.graphs:
        library.update(g.placement.get("library", {}))
    if name in FLOAT64_MODELS or not onednn_available():
        return  # oneDNN has no float64 kernels: those convolutions stay ATen's
    if name == "bert":
        assert library["mkldnn._linear_pointwise"] > 0, library
    else:
        assert library["mkldnn._convolution_pointwise"] > 0, library
