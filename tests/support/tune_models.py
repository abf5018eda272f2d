"""Small models for the tuning tests: a convolution and two linear layers (three library choices
on the CPU) and a generated softmax; two linear layers with a scaled ReLU between them, whose
generated kernels differ with the first layer's library choice (its rule fuses the ReLU)."""

from __future__ import annotations

import torch


class ConvLinearNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 6 * 6, 32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x)).flatten(1)
        return torch.softmax(self.head(torch.nn.functional.gelu(self.fc(y))), -1)


class ScaleNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(torch.relu(self.fc1(x)) * 2.0 + 1.0), -1)
