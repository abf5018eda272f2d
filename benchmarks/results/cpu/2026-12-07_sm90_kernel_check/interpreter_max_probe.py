"""The interpreter's max/min probe: softmax, amax, amin and max over a [2, 12, 128, 128] float32
tensor holding NaNs, through ``ember.compile(..., target="triton-interpret")``, checked against
eager; prints the first and second call's seconds.

    python interpreter_max_probe.py
"""

import os
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import ember  # noqa: E402


def probe(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.softmax(x, -1), x.amax(-1), x.amin(1), (x * 2).max(dim=-1).values


def main() -> None:
    x = torch.randn(2, 12, 128, 128)
    x[0, 0, 3, 5] = float("nan")
    x[1, 2, :, 7] = float("nan")
    compiled = ember.compile(probe, target="triton-interpret")
    for call in ("first", "second"):
        start = time.time()
        out = compiled(x)
        print(call, time.time() - start)
    for got, want in zip(out, probe(x)):
        torch.testing.assert_close(got, want, equal_nan=True)
    print("ok")


if __name__ == "__main__":
    main()
