"""The benchmark model registry (see BENCHMARKS.md for the seed suite).

Every case builds a model with random weights (never a download) and synthetic random
inputs. torchvision, timm and transformers are optional (``pip install ember[bench]``), so
they are imported inside the build functions only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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

# (inputs, target) for one step; inputs are passed positionally to the model.
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class MissingDependencyError(ImportError):
    """An optional package a benchmark model needs is not installed."""


def _require(module: str, case: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"model {case!r} needs {module.split('.')[0]}: pip install ember[bench]"
        ) from err


def primary_tensor(out: Any) -> torch.Tensor:
    """The tensor a loss applies to: the output itself, ``.logits`` of a transformers
    ModelOutput, or the first element of a tuple/list/dict output."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        return primary_tensor(next(iter(out.values())))
    if isinstance(out, (tuple, list)) and out:
        return primary_tensor(out[0])
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


@dataclass(frozen=True)
class BenchCase:
    """One benchmark model.

    ``build(small)`` returns the model (random weights, CPU, fp32). ``make_batch(batch,
    device, generator, small)`` returns ``(inputs, target)``; the generator is a CPU
    ``torch.Generator`` so the data do not depend on the device. ``loss(output, target)``
    is the training loss.
    """

    name: str
    description: str
    build: Callable[[bool], nn.Module]
    make_batch: Callable[[int, torch.device, torch.Generator, bool], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    batch_train: int
    batch_infer: int
    extra: str | None = None  # pip extra that provides the model's dependencies

    def default_batch(self, mode: str) -> int:
        return self.batch_train if mode == "train" else self.batch_infer


# ---------------------------------------------------------------------------------------
# Inputs and losses
# ---------------------------------------------------------------------------------------


def _image_size(small: bool, full: int) -> int:
    return 64 if small else full


def _image_batch(full_size: int) -> Callable[[int, torch.device, torch.Generator, bool], Batch]:
    """Random normal images (roughly normalized pixels) and class labels in [0, 1000)."""

    def make(batch: int, device: torch.device, gen: torch.Generator, small: bool) -> Batch:
        s = _image_size(small, full_size)
        x = torch.randn(batch, 3, s, s, generator=gen)
        y = torch.randint(0, 1000, (batch,), generator=gen)
        return (x.to(device),), y.to(device)

    return make


def _image_to_image_batch(full_size: int) -> Callable[[int, torch.device, torch.Generator, bool], Batch]:
    """Random input image and a random target image of the same shape in [-1, 1]."""

    def make(batch: int, device: torch.device, gen: torch.Generator, small: bool) -> Batch:
        s = _image_size(small, full_size)
        x = torch.rand(batch, 3, s, s, generator=gen) * 2 - 1
        target = torch.rand(batch, 3, s, s, generator=gen) * 2 - 1
        return (x.to(device),), target.to(device)

    return make


def _token_batch(
    vocab: int, seq: int, small_seq: int, num_labels: int
) -> Callable[[int, torch.device, torch.Generator, bool], Batch]:
    """Random token ids (avoiding the special ids 0..999 of the BERT vocabulary where the
    vocabulary is large enough) with a full attention mask, and sequence labels."""

    def make(batch: int, device: torch.device, gen: torch.Generator, small: bool) -> Batch:
        n = small_seq if small else seq
        low = 1000 if vocab > 2000 else 1
        ids = torch.randint(low, vocab, (batch, n), generator=gen)
        mask = torch.ones(batch, n, dtype=torch.long)
        labels = torch.randint(0, num_labels, (batch,), generator=gen)
        return (ids.to(device), mask.to(device)), labels.to(device)

    return make


def _cross_entropy(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(primary_tensor(out), target)


def _l1(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(primary_tensor(out), target)


def _mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(primary_tensor(out), target)


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

# Imported here, after the helpers it uses are defined: zoo.py builds on this module.
from ember.bench.zoo import ZOO_CASES, ZOO_SUITE  # noqa: E402

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
