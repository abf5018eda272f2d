"""What a benchmark case is, and the inputs and losses the cases share (the seed registry in
``bench/models.py`` and the zoo in ``bench/zoo.py`` both build on it).

Every case builds a model with random weights (never a download) and synthetic random inputs;
optional packages (torchvision, timm, transformers) are imported inside the build functions only
(``_require``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
