"""One captured graph per call site: a compiled graph that runs several times in one step.

A model whose layers each end in a graph break (a data-dependent branch, a print, an op Dynamo
cannot trace) compiles one frame per layer *class*, and that frame's forward and backward graphs
run once per layer in every step: with parameters that differ per call, and outputs (the saved
activations) still held when the next layer calls the same graph. One CUDA graph can serve only
one of those calls: its parameters would be copied in on every replay, and its outputs handed out
as copies (or the call run uncaptured) because the earlier calls' outputs are still alive.

So a runner counts its calls since the compiled model was last called (``CallClock``, advanced
by the model's per-call context, capture/backend.py ``ShapePolicy``): its k-th call of a model
call (the backward's: since the forward's model call) goes to its k-th *site runner*, a
``CudaGraphRunner`` of the same program sharing its memory pool, made on first use. Each site
then sees the same parameters and pool-resident activations on every step, captures them in
place and replays, as Inductor's CUDA-graph trees record one node per call path. A step whose
calls differ from the last (another branch taken, an evaluation pass) only makes a site's
inputs move, which the site's own checks handle as for any graph (capture again, or copy).
Without the clock (``torch.compile(backend="ember")`` does not enter the model's context) every
call goes to the runner itself, as before.
"""

from __future__ import annotations

from typing import Any

MAX_SITES = 128  # calls of one graph per model call that get a captured graph of their own


class CallClock:
    """Calls of one compiled model so far (0: none seen, call sites are off)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0


def site_runner(parent: Any, k: int) -> Any:
    """The runner of ``parent``'s program for its ``k``-th call (k >= 1) of a model call; it
    captures into the parent's pool, and reports through the parent's status."""
    child = type(parent)(parent.run, f"{parent.title} [call {k + 1} of a step]", backend=parent.backend,
                         read_only=parent.read_only, on_status=lambda _text: parent.describe_sites())
    child.pool = parent.pool
    return child
