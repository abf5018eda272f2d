"""``ember::rnn``: a whole recurrence (LSTM, GRU, Elman RNN) as one opaque op in inference graphs.

Ember's inference calls let Dynamo trace RNN modules (``trace_rnn``), and AOTAutograd then unrolls
the recurrence on the GPU path into a matmul and gate ops per step and layer: the fastest form for
the short sequences of a language model (lstm_lm, 35 steps x 2 layers), but its capture and compile
time grow with the sequence (a 2-layer LSTM's first call on the CI CPU's interpreter target: 1.87 s
at 35 steps, 6.71 s at 128; 1.97 s at 512 through this op). Past
``rnn_unroll_max_steps`` step-layers, ``rewrite_long_rnns`` (on the Dynamo graph, before
AOTAutograd) calls this op instead: ATen's own RNN (cuDNN's on the GPU, oneDNN's on the CPU) as
one call inside Ember's program and its CUDA graph, compiled in constant time.

Inference only (gradients off): the op has no backward. Packed sequences keep the unrolled form.
The dtype the recurrence runs in (autocast's, where it was on while tracing) is fixed by the
rewrite: the op casts to it and runs with autocast off, so the compiled graph and a run agree.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_KINDS = {"lstm": torch.lstm, "gru": torch.gru, "rnn_tanh": torch.rnn_tanh, "rnn_relu": torch.rnn_relu}


@torch.library.custom_op("ember::rnn", mutates_args=())
def rnn(kind: str, x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], has_biases: bool,
        num_layers: int, bidirectional: bool, batch_first: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """``torch.<kind>(x, hx, params, ...)`` in ``dtype`` (eval: no dropout): [output, h_n(, c_n)]."""
    cast = [t.to(dtype) for t in (x, *hx, *params)]
    x, hx, params = cast[0], cast[1:1 + len(hx)], cast[1 + len(hx):]
    with torch.autocast(x.device.type, enabled=False):
        out = _KINDS[kind](x, tuple(hx) if kind == "lstm" else hx[0], params, has_biases, num_layers, 0.0, False,
                           bidirectional, batch_first)
    return list(out)


@rnn.register_fake
def _(kind: str, x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], has_biases: bool,
      num_layers: int, bidirectional: bool, batch_first: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    width = hx[0].shape[-1] * (2 if bidirectional else 1)  # proj_size where the LSTM projects
    return [x.new_empty((*x.shape[:-1], width), dtype=dtype)] + [h.new_empty(h.shape, dtype=dtype) for h in hx]


_TARGETS = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh", torch.rnn_relu: "rnn_relu"}


def _value(arg: object) -> object:
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg


def rewrite_long_rnns(gm: fx.GraphModule, max_steps: int) -> int:
    """Route the Dynamo graph's recurrences whose unrolled form would exceed ``max_steps``
    step-layers through ``ember::rnn``. Call only for graphs traced with gradients off. Returns
    how many calls it rewrote."""
    count = 0
    for node in list(gm.graph.nodes):
        kind = _TARGETS.get(node.target) if node.op == "call_function" else None
        if kind is None or len(node.args) != 9 or node.kwargs:
            continue  # the packed-sequence form (a batch-sizes tensor second) keeps the unrolled path
        x, hx, params, has_biases, num_layers, _dropout, _train, bidirectional, batch_first = node.args
        xv, out = _value(x), node.meta.get("example_value")
        states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        if not (isinstance(xv, torch.Tensor) and isinstance(out, (list, tuple)) and isinstance(out[0], torch.Tensor)
                and isinstance(params, (list, tuple)) and all(isinstance(a, (bool, int)) for a in
                                                               (has_biases, num_layers, bidirectional, batch_first))):
            continue
        steps = (xv.shape[1] if batch_first and xv.dim() == 3 else xv.shape[0]) * num_layers * (2 if bidirectional else 1)
        if not isinstance(steps, int) or steps <= max_steps:
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.ember.rnn.default,
                                          (kind, x, states, list(params), has_biases, num_layers, bidirectional,
                                           batch_first, out[0].dtype))
            call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
