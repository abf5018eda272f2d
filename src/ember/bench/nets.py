"""Two benchmark networks that torchvision/timm do not ship, written from their papers.

- ``CycleGANGenerator``: the ResNet generator of Zhu et al. 2017 ("Unpaired Image-to-Image
  Translation using Cycle-Consistent Adversarial Networks"), laid out like the official
  pytorch-CycleGAN-and-pix2pix ``ResnetGenerator`` with its default ``norm='instance'``.
- ``StyleTransferNet``: the image transformation network of Johnson et al. 2016 ("Perceptual
  Losses for Real-Time Style Transfer"), laid out like the ``TransformerNet`` of the
  pytorch/examples fast_neural_style example.

Both are conv nets dominated by reflection padding and instance norm, which stress a
compiler differently from batch-norm classifiers (small reductions per channel and image).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CycleGANGenerator", "StyleTransferNet"]


# ---------------------------------------------------------------------------------------
# CycleGAN ResNet generator
# ---------------------------------------------------------------------------------------


def _cyclegan_norm(ch: int) -> nn.InstanceNorm2d:
    # The official default norm='instance' is InstanceNorm2d without affine parameters or
    # running statistics; the convs keep their bias because the norm has none.
    return nn.InstanceNorm2d(ch, affine=False, track_running_stats=False)


class _CycleGANResBlock(nn.Module):
    """pad-conv-IN-ReLU-pad-conv-IN with an identity skip (no dropout, as in the default)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(ch, ch, kernel_size=3, padding=0, bias=True),
            _cyclegan_norm(ch),
            nn.ReLU(inplace=True),
            nn.ReflectionPad2d(1),
            nn.Conv2d(ch, ch, kernel_size=3, padding=0, bias=True),
            _cyclegan_norm(ch),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class CycleGANGenerator(nn.Module):
    """ResNet-based CycleGAN generator: c7s1-ngf, d2ngf, d4ngf, n_blocks x R4ngf, u2ngf, uNgf, c7s1-out.

    With the defaults (ngf=64, 9 blocks) it has about 11.38 M parameters, the figure the
    official repository prints for its 256x256 generator.
    """

    def __init__(self, in_ch: int = 3, out_ch: int = 3, ngf: int = 64, n_blocks: int = 9) -> None:
        super().__init__()
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        layers: list[nn.Module] = [
            nn.ReflectionPad2d(3),
            nn.Conv2d(in_ch, ngf, kernel_size=7, padding=0, bias=True),
            _cyclegan_norm(ngf),
            nn.ReLU(inplace=True),
        ]
        # Two stride-2 downsampling convs: ngf -> 2ngf -> 4ngf.
        ch = ngf
        for _ in range(2):
            layers += [
                nn.Conv2d(ch, ch * 2, kernel_size=3, stride=2, padding=1, bias=True),
                _cyclegan_norm(ch * 2),
                nn.ReLU(inplace=True),
            ]
            ch *= 2
        layers += [_CycleGANResBlock(ch) for _ in range(n_blocks)]
        # Two fractionally strided convs back up: 4ngf -> 2ngf -> ngf; output_padding=1
        # restores exactly twice the spatial size.
        for _ in range(2):
            layers += [
                nn.ConvTranspose2d(
                    ch, ch // 2, kernel_size=3, stride=2, padding=1, output_padding=1, bias=True
                ),
                _cyclegan_norm(ch // 2),
                nn.ReLU(inplace=True),
            ]
            ch //= 2
        layers += [
            nn.ReflectionPad2d(3),
            nn.Conv2d(ch, out_ch, kernel_size=7, padding=0, bias=True),
            nn.Tanh(),
        ]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


# ---------------------------------------------------------------------------------------
# Johnson et al. fast style transfer network
# ---------------------------------------------------------------------------------------


class _ConvLayer(nn.Module):
    """Reflection padding of k//2 then an unpadded conv: keeps borders free of zero artifacts."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        self.pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pad(x))


class _UpsampleConvLayer(nn.Module):
    """Nearest-neighbour upsampling followed by a ConvLayer, instead of a transposed conv
    (the choice of the pytorch/examples network, which avoids checkerboard artifacts)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, upsample: int = 2) -> None:
        super().__init__()
        self.upsample = upsample
        self.conv = _ConvLayer(in_ch, out_ch, kernel_size, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=self.upsample, mode="nearest")
        return self.conv(x)


class _StyleResBlock(nn.Module):
    """conv-IN-ReLU-conv-IN with an identity skip and no activation after the sum."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = _ConvLayer(ch, ch, 3)
        self.in1 = nn.InstanceNorm2d(ch, affine=True)
        self.conv2 = _ConvLayer(ch, ch, 3)
        self.in2 = nn.InstanceNorm2d(ch, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + x


class StyleTransferNet(nn.Module):
    """Johnson et al. image transformation network (about 1.68 M parameters).

    Input and output are 3-channel images of the same size (the size must be divisible by 4).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = _ConvLayer(3, 32, kernel_size=9, stride=1)
        self.in1 = nn.InstanceNorm2d(32, affine=True)
        self.conv2 = _ConvLayer(32, 64, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(64, affine=True)
        self.conv3 = _ConvLayer(64, 128, kernel_size=3, stride=2)
        self.in3 = nn.InstanceNorm2d(128, affine=True)
        self.res = nn.Sequential(*[_StyleResBlock(128) for _ in range(5)])
        self.deconv1 = _UpsampleConvLayer(128, 64, kernel_size=3, upsample=2)
        self.in4 = nn.InstanceNorm2d(64, affine=True)
        self.deconv2 = _UpsampleConvLayer(64, 32, kernel_size=3, upsample=2)
        self.in5 = nn.InstanceNorm2d(32, affine=True)
        self.deconv3 = _ConvLayer(32, 3, kernel_size=9, stride=1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.in1(self.conv1(x)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res(y)
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        return self.deconv3(y)
