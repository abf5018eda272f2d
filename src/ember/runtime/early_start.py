"""Start the Triton compile workers when ``ember.compile()`` is called, not at the first frame.

A worker needs seconds to import torch and Triton and to compile its warm-up kernel
(runtime/precompile.py). Started in the backend's first frame, that start-up overlaps only
AOTAutograd's capture; started at ``ember.compile()``, it also overlaps whatever the user's script
does between compiling and the first call (moving the model, building the optimizer and the data
loader) and Dynamo's trace of the first frame.

Only where the compile will produce compiled Triton kernels: a CUDA device is present, the target
may be Triton, ``device`` is not "cpu", and the model's parameters (if it has any) are on a CUDA
device. A CPU-only process pays nothing: one ``torch.cuda.is_available()`` call (microseconds
without a GPU). The backend still calls ``start_workers`` in its first frame (idempotent), so a
model compiled while on the CPU and moved to the GPU later still gets its workers then.
"""

from __future__ import annotations

from collections.abc import Callable

from ember.config import Options


def wants_workers(model: Callable, options: Options) -> bool:
    """Whether this compile is expected to hand kernels to the Triton compile workers."""
    if options.target not in ("auto", "triton") or options.device == "cpu":
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        try:
            devices = {p.device.type for p in parameters()}
        except Exception:  # noqa: BLE001 - an unusual module: decide by the device alone
            devices = set()
        if devices and "cuda" not in devices:
            return False  # a CPU model (compiled before .cuda(): the first frame starts them)
    return True


def start_workers_early(model: Callable, options: Options) -> bool:
    """Start the compile workers now if this compile will use them; returns whether it did."""
    if not wants_workers(model, options):
        return False
    from ember.runtime.precompile import start_workers, worker_count

    if worker_count() == 0:
        return False
    start_workers()
    return True
