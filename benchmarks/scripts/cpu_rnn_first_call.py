"""First call of a small model with a 2-layer LSTM in inference, unrolled or as one RNN call.

    python benchmarks/scripts/cpu_rnn_first_call.py STEPS [TARGET]

A projection-free model (LSTM 16 -> 16, two layers, then a linear head) compiled by Ember with
every cache off, oneDNN off so that the recurrence takes the GPU path's unrolled form on CPU
tensors (``TARGET`` default ``triton-interpret``, the GPU code path). Prints the first call's
seconds (capture and compile included), the largest difference from eager and the rewrites the
backend logged (a recurrence above ``rnn_unroll_max_steps`` runs as one ATen RNN call, ops/rnn.py).
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import ember


class LSTMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.head(self.rnn(x)[0]),)


def main() -> int:
    steps = int(sys.argv[1])
    target = sys.argv[2] if len(sys.argv) > 2 else "triton-interpret"
    model = LSTMHead().eval()
    compiled = ember.compile(model, target=target, cache=False, frame_cache=False, warm_start=False)
    torch.backends.mkldnn.enabled = False
    x = torch.randn(1, steps, 16)
    start = time.perf_counter()
    with torch.no_grad():
        out = compiled(x)[0]
    seconds = time.perf_counter() - start
    with torch.no_grad():
        err = (out - model(x)[0]).abs().max().item()
    rewrites = {k: v for k, v in compiled._ember_backend.log.rewrites.items() if v}
    print(f"steps {steps}: first call {seconds:.2f} s, max |ember - eager| {err:.2e}, rewrites {rewrites}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
