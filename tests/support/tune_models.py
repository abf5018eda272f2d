"""A small model for the tuning tests: a convolution and two linear layers (three library choices
on the CPU) and a generated softmax."""

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
