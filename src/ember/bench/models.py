"""The benchmark model registry (see BENCHMARKS.md for the seed suite).

Every case builds a model with random weights (never a download) and synthetic random
inputs. torchvision, timm and transformers are optional (``pip install ember[bench]``), so
they are imported inside the build functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ember.bench.cases import (
    Batch,
    BenchCase,
    MissingDependencyError,
    _cross_entropy,
    _image_batch,
    _image_to_image_batch,
    _l1,
    _mse,
    _require,
    _token_batch,
    primary_tensor,
)
from ember.bench.zoo import ZOO_CASES, ZOO_SUITE

__all__ = [
    "CASES",
    "BenchCase",
    "MissingDependencyError",
    "SUITES",
    "expand_names",
    "get_case",
    "list_cases",
    "make_batches",
    "primary_tensor",
]

# ---------------------------------------------------------------------------------------
# Builders (lazy imports of the optional packages)
# ---------------------------------------------------------------------------------------


def _torchvision(name: str, case: str) -> Callable[[bool], nn.Module]:
    def build(small: bool) -> nn.Module:
        models = _require("torchvision.models", case)
        # weights=None: random initialization, nothing is downloaded.
        return getattr(models, name)(weights=None, num_classes=1000)

    return build


def _build_resnet50v2(small: bool) -> nn.Module:
    timm = _require("timm", "resnet50v2")
    return timm.create_model("resnetv2_50", pretrained=False, num_classes=1000)


def _bert_builder(case: str, **config: Any) -> Callable[[bool], nn.Module]:
    def build(small: bool) -> nn.Module:
        transformers = _require("transformers", case)
        cfg = transformers.BertConfig(**config)
        return transformers.BertForSequenceClassification(cfg)

    return build


def _build_cyclegan(small: bool) -> nn.Module:
    from ember.bench.nets import CycleGANGenerator

    return CycleGANGenerator()


def _build_style_transfer(small: bool) -> nn.Module:
    from ember.bench.nets import StyleTransferNet

    return StyleTransferNet()


# The small BERT of the quick CPU case; the same code path as the bert-base case.
_TINY_BERT = dict(
    vocab_size=8192,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=256,
    max_position_embeddings=512,
    num_labels=2,
)

_CASE_LIST = [
    BenchCase(
        "resnet50", "torchvision resnet50, 3x224x224", _torchvision("resnet50", "resnet50"),
        _image_batch(224), _cross_entropy, batch_train=128, batch_infer=128, extra="bench",
    ),
    BenchCase(
        "bert", "transformers BertForSequenceClassification(BertConfig()), seq 128",
        _bert_builder("bert"), _token_batch(30522, 128, 32, 2), _cross_entropy,
        batch_train=64, batch_infer=1, extra="bench",
    ),
    BenchCase(
        "vgg16", "torchvision vgg16, 3x224x224", _torchvision("vgg16", "vgg16"),
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=64, extra="bench",
    ),
    BenchCase(
        "mobilenet_v3", "torchvision mobilenet_v3_large, 3x224x224",
        _torchvision("mobilenet_v3_large", "mobilenet_v3"), _image_batch(224), _cross_entropy,
        batch_train=128, batch_infer=128, extra="bench",
    ),
    BenchCase(
        "densenet121", "torchvision densenet121, 3x224x224", _torchvision("densenet121", "densenet121"),
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=64, extra="bench",
    ),
    BenchCase(
        "resnet50v2", "timm resnetv2_50 (fine-tuning case), 3x224x224", _build_resnet50v2,
        _image_batch(224), _cross_entropy, batch_train=64, batch_infer=64, extra="bench",
    ),
    BenchCase(
        "cyclegan", "CycleGAN ResNet generator (9 blocks), 3x256x256, L1 loss", _build_cyclegan,
        _image_to_image_batch(256), _l1, batch_train=1, batch_infer=1,
    ),
    BenchCase(
        "style_transfer", "Johnson et al. fast style transfer net, 3x256x256, MSE loss",
        _build_style_transfer, _image_to_image_batch(256), _mse, batch_train=4, batch_infer=4,
    ),
    # Quick cases for CPU machines and tests.
    BenchCase(
        "resnet18", "torchvision resnet18, 3x224x224 (quick CPU case)", _torchvision("resnet18", "resnet18"),
        _image_batch(224), _cross_entropy, batch_train=8, batch_infer=8, extra="bench",
    ),
    BenchCase(
        "tiny_transformer", "2-layer BERT, hidden 128, seq 128 (quick CPU case)",
        _bert_builder("tiny_transformer", **_TINY_BERT), _token_batch(8192, 128, 32, 2),
        _cross_entropy, batch_train=8, batch_infer=8, extra="bench",
    ),
]

CASES: dict[str, BenchCase] = {case.name: case for case in _CASE_LIST + ZOO_CASES}
# The eight models of BENCHMARKS.md's seed suite (the rest of CASES are quick cases and the zoo).
SEED_SUITE = ["resnet50", "vgg16", "mobilenet_v3", "densenet121", "resnet50v2", "bert", "cyclegan",
              "style_transfer"]
# Named groups of models: ``ember bench zoo`` or ``--suite zoo``.
SUITES: dict[str, list[str]] = {
    "seed": SEED_SUITE,
    "zoo": ZOO_SUITE,
    "quick": ["resnet18", "tiny_transformer"],
}


def expand_names(names: list[str]) -> list[str]:
    """Model names with every suite name replaced by its models, in order, without repeats."""
    out: list[str] = []
    for name in names:
        for model in SUITES.get(name, [name]):
            if model not in out:
                out.append(model)
    return out


def list_cases() -> list[str]:
    return list(CASES)


def get_case(name: str) -> BenchCase:
    """The case called ``name``; ValueError naming the known models otherwise."""
    if name not in CASES:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(CASES)}")
    return CASES[name]


def make_batches(
    case: BenchCase, batch: int, device: torch.device, small: bool = False, count: int = 3, seed: int = 0
) -> list[Batch]:
    """``count`` distinct random batches to rotate through, so no backend is timed on one
    cached input (and no input is all zeros)."""
    gen = torch.Generator().manual_seed(seed)
    return [case.make_batch(batch, device, gen, small) for _ in range(count)]
