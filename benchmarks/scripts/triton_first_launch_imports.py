"""What a Triton kernel's first launch imports, and how long the first and second launches take.

    python benchmarks/scripts/triton_first_launch_imports.py     # on a machine with a CUDA GPU

Prints whether Triton's gluon package is loaded after ``import triton`` and after the first launch,
and the call stack of the first import of it inside the launch.
"""

from __future__ import annotations

import builtins
import sys
import time
import traceback

import torch
import triton
import triton.language as tl


def gluon_loaded() -> bool:
    return any(m.startswith("triton.experimental.gluon") for m in sys.modules)


@triton.jit
def add_one(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


def main() -> None:
    print("after import triton: gluon loaded:", gluon_loaded())
    x = torch.zeros(16, device="cuda")
    original = builtins.__import__

    def spying_import(name, *args, **kwargs):
        if "gluon" in name and not gluon_loaded():
            traceback.print_stack(limit=10)
        return original(name, *args, **kwargs)

    builtins.__import__ = spying_import
    start = time.perf_counter()
    add_one[(1,)](x, 16, BLOCK=16)
    torch.cuda.synchronize()
    print(f"first launch {time.perf_counter() - start:.3f} s")
    builtins.__import__ = original
    print("after the first launch: gluon loaded:", gluon_loaded())
    start = time.perf_counter()
    add_one[(1,)](x, 16, BLOCK=16)
    torch.cuda.synchronize()
    print(f"second launch {time.perf_counter() - start:.6f} s")


if __name__ == "__main__":
    main()
