"""A folder of JPEG files and a Dataset that decodes them: a real input pipeline for benchmarks.

``make_jpeg_folder`` writes images that compress like photographs (smooth shapes plus a little
noise, not white noise) with ``torchvision.io.encode_jpeg``; ``JpegFolder`` reads and decodes one
per item with ``torchvision.io.decode_jpeg`` on the CPU, as an ImageFolder pipeline would.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchvision >= 0.29 warns on every codec call that they move to TorchCodec; they still work,
    and the GPU machine's torchvision 0.26 is the version this benchmark targets."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        yield


def make_jpeg_folder(folder: str | Path, count: int, size: int, quality: int = 90, seed: int = 0) -> list[Path]:
    """Write ``count`` JPEG files of ``size`` x ``size`` pixels into ``folder``; returns their paths."""
    from torchvision.io import encode_jpeg, write_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        low = torch.rand(1, 3, 8, 8, generator=gen) * 255
        image = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)[0]
        image = (image + torch.randn(image.shape, generator=gen) * 8).clamp(0, 255).to(torch.uint8)
        path = folder / f"{i:06d}.jpg"
        with _quiet():
            write_file(str(path), encode_jpeg(image, quality=quality))
        paths.append(path)
    return paths


class JpegFolder(torch.utils.data.Dataset):
    """(uint8 CxHxW image decoded on the CPU, int label) per file; ``size``: resized to that many
    pixels a side after decoding (antialiased, as a training pipeline shrinks large photographs)."""

    def __init__(self, paths: list[Path], classes: int = 10, size: int | None = None) -> None:
        self.paths = [str(p) for p in paths]
        self.classes = classes
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import decode_jpeg, read_file

        with _quiet():
            image = decode_jpeg(read_file(self.paths[index]))
        if self.size is not None and tuple(image.shape[1:]) != (self.size, self.size):
            image = torch.nn.functional.interpolate(image[None].float(), size=(self.size, self.size), mode="bilinear",
                                                    antialias=True, align_corners=False)[0]
            image = image.round_().clamp_(0, 255).to(torch.uint8)
        return image, index % self.classes
