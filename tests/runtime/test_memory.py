"""Peak memory: Ember's programs hold no more tensor memory at once than eager does.

Measured on CPU from the profiler's allocation events (``ember.bench.memory``), for a training
step (forward + backward) and inference of small real models, with the default CPU target and
with ``target="triton-interpret"``, where fused groups become generated kernels whose outputs
the program allocates (and may place in the storage of a dead buffer: ``_reuse``). Results are
compared with eager on the same call, and every ``_reuse`` line of every program is checked
against the rules of ``ember.codegen.memory_plan``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from core_helpers import assert_compiled_cleanly, log_of

import ember
from ember.bench.check import acceptable
from ember.bench.memory import MemoryPeak, measure_cpu_peak
from ember.codegen.memory_plan import reuse_storage

# -- the measuring helper ---------------------------------------------------------------------


def test_peak_helper_counts_allocations_and_frees_in_order() -> None:
    held_before = torch.empty(3_000_000)  # allocated before the call: never counted

    def fn() -> torch.Tensor:
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(500_000)  # +2 MB = 6 MB
        del a  # 2 MB
        c = torch.empty(2_000_000)  # +8 MB = 10 MB: the peak
        del b
        return c  # 8 MB still held

    out, m = measure_cpu_peak(fn)
    assert (m.peak, m.end, m.allocations) == (10_000_000, 8_000_000, 3), m
    assert out.numel() == 2_000_000 and held_before.numel() == 3_000_000


# -- the runtime side of reuse ------------------------------------------------------------------

def test_reuse_takes_the_storage_only_when_nothing_else_holds_it() -> None:
    dead = torch.randn(4, 8)
    ptr = dead.data_ptr()
    out = reuse_storage(dead, (8, 4), (1, 8))
    assert out.data_ptr() == ptr and out.shape == (8, 4) and out.stride() == (1, 8)
    assert out._base is None  # not a view: it must not keep ``dead`` alive
    del dead
    again = reuse_storage(out, (32,), (1,))  # a reused buffer can be reused again
    assert again.data_ptr() == ptr

    held = torch.randn(4, 8)
    view = held[1:]  # still alive: the storage is not free
    fresh = reuse_storage(held, (4, 8), (8, 1))
    assert fresh.data_ptr() != held.data_ptr() and view.untyped_storage().data_ptr() == held.data_ptr()
    small = torch.randn(4)
    bigger = reuse_storage(small, (8,), (1,))  # a storage too small is never grown in place
    assert bigger.data_ptr() != small.data_ptr() and bigger.numel() == 8


# -- program-level checks ------------------------------------------------------------------------

_ASSIGN = re.compile(r"^(\w+) = (\S+?)\(")
_GETITEM = re.compile(r"^\w+ = \w+\[\d+\]$")


def check_reuse_lines(program: str) -> int:
    """Every ``x = _reuse(d, ...)`` line follows memory_plan's rules; returns how many there are.

    ``d`` was made by the program (``_empty``/``_reuse``: never an input or a library result), is
    not used afterwards except to delete it, and between its last use and the reuse only views,
    getitems, deletions and this kernel's own allocations run (no other allocation).
    """
    # Code only: comments name ATen ops ("mul") that may equal a buffer's name.
    lines = [ln.strip() if ln.strip().startswith("#") else ln.split("  #")[0].strip() for ln in program.splitlines()]
    made: set[str] = set()
    count = 0
    for i, line in enumerate(lines):
        m = _ASSIGN.match(line)
        if m is None:
            continue
        if m.group(2) == "_empty":
            made.add(m.group(1))
            continue
        if m.group(2) != "_reuse":
            continue
        count += 1
        new, dead = m.group(1), re.match(r"\w+ = _reuse\((\w+),", line).group(1)
        assert dead in made, f"reuses {dead}, which the program did not allocate: {line}"
        made.add(new)
        uses = re.compile(rf"\b{dead}\b")
        used = [j for j, ln in enumerate(lines) if uses.search(ln) and not ln.startswith(("#", "del "))]
        later = [lines[j] for j in used if j > i]
        assert not later, f"{dead} is used after its storage was reused: {later[:2]}"
        last = max(j for j in used if j < i)
        header = max(j for j in range(i) if lines[j].startswith("# [generated"))
        assert header > last, f"{dead} is read by the kernel that reuses it: {line}"
        for j in range(last + 1, i):
            between = lines[j]
            ok = (between.startswith(("#", "del ")) or _is_view(program, between) or _GETITEM.match(between)
                  or "= _expect(" in between
                  or (j > header and _ASSIGN.match(between) and _ASSIGN.match(between).group(2) in ("_empty", "_reuse")))
            assert ok, f"allocation between the last use of {dead} and its reuse: {between}"
    return count


def _is_view(program: str, code: str) -> bool:
    return any(ln.strip().startswith(code) and ln.rstrip().endswith("# [view]") for ln in program.splitlines())


def _programs(compiled: Callable) -> list[str]:
    log = log_of(compiled)
    assert_compiled_cleanly(log)
    return [g.program for g in log.graphs]


@contextlib.contextmanager
def _collect_after_launch(target: str) -> Iterator[None]:
    """Triton's interpreter keeps each launch's argument storages in a reference cycle (a recursive
    closure over a dict of storages) until Python's cyclic GC runs, so a buffer the program
    deletes may stay allocated long after; a GPU launch holds nothing. Collecting after each
    launch makes the interpreter free what the program freed, when it freed it."""
    if target != "triton-interpret":
        yield
        return
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def collecting(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect(1)

    interpreter.GridExecutor.__call__ = collecting
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12)).item()


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-4) -> None:
    err = _rel_error(got, want)
    assert err <= rel, f"{what}: max error {err:.3g} of the largest |value|"


def chain_with_library_calls(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x.sin() * 2.0
    m = a @ w
    b = m.cos() + 1.0
    m2 = b @ w
    return (m2.tanh() * b).sum(-1)


def test_kernel_outputs_reuse_dead_buffers_and_stay_correct() -> None:
    compiled = ember.compile(chain_with_library_calls, target="triton-interpret")
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    want = chain_with_library_calls(x, w)
    with torch.no_grad(), _collect_after_launch("triton-interpret"):
        _close(compiled(x, w), want, "first call")
        got, ember_peak = measure_cpu_peak(compiled, x, w)
        _, eager_peak = measure_cpu_peak(chain_with_library_calls, x, w)
    _close(got, want, "measured call")
    program, = _programs(compiled)
    # b (a kernel output) takes the storage of a (dead since the first mm, nothing allocated since).
    assert check_reuse_lines(program) >= 1, program
    assert ember_peak.peak <= eager_peak.peak, (ember_peak, eager_peak)


def test_no_reuse_across_an_allocation() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x.sin() * 2.0
        m = a @ w  # a's last use
        m2 = m @ w  # allocates while a's storage would be waiting for its next owner
        return m2.cos() + 1.0

    compiled = ember.compile(fn, target="triton-interpret")
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with torch.no_grad():
        _close(compiled(x, w), fn(x, w), "forward")
    program, = _programs(compiled)
    assert "_reuse(" not in program, program
    assert check_reuse_lines(program) == 0


def test_aten_fused_groups_free_intermediates_op_by_op() -> None:
    def layer_norm_chain(x: torch.Tensor) -> torch.Tensor:
        y = x + 1.0
        mean = y.mean(-1, keepdim=True)
        centered = y - mean
        var = (centered * centered).mean(-1, keepdim=True)
        return centered * torch.rsqrt(var + 1e-5) * 2.0 + 0.5

    compiled = ember.compile(layer_norm_chain, target="aten")
    x = torch.randn(64, 1024)
    with torch.no_grad():
        _close(compiled(x), layer_norm_chain(x), "forward")
        _, ember_peak = measure_cpu_peak(compiled, x)
        _, eager_peak = measure_cpu_peak(layer_norm_chain, x)
    program, = _programs(compiled)
    body = [ln.strip() for ln in program.splitlines()]
    group = body.index(next(ln for ln in body if ln.startswith("# [fused via ATen")))
    # A deletion between two ops of the group: intermediates go as soon as they are used up.
    assert any(ln.startswith("del ") for ln in body[group + 1:group + 6]), program
    assert ember_peak.peak <= eager_peak.peak, (ember_peak, eager_peak)


# -- small real models: peak memory at most eager's ------------------------------------------------

def _resnet18() -> tuple[torch.nn.Module, tuple]:
    torchvision = pytest.importorskip("torchvision")
    # Batch 4: at batch 2 its last stage normalises 2 values per channel, and ReLU masks flipped by
    # fp32 rounding put Ember's and eager's gradient errors against float64 4.1x apart (0.0129 vs
    # 0.0032 on a 2-core AMD EPYC), on either side of the 4x bound by the machine.
    return torchvision.models.resnet18(num_classes=10), (torch.randn(4, 3, 32, 32),)


def _mobilenet_v3_small() -> tuple[torch.nn.Module, tuple]:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.mobilenet_v3_small(num_classes=10), (torch.randn(2, 3, 32, 32),)


def _bert() -> tuple[torch.nn.Module, tuple]:
    transformers = pytest.importorskip("transformers")
    # Dropout off, so the compiled step can be compared with eager's value by value.
    cfg = transformers.BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=64, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(1, 256, (4, 32))
    return transformers.BertForSequenceClassification(cfg), (ids, torch.ones(4, 32, dtype=torch.long))


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _measure(model: torch.nn.Module, fn: Callable, inputs: tuple, train: bool,
             cotangent: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor], MemoryPeak]:
    """One call of ``fn`` (plus backward when ``train``) measured, after one unmeasured call."""
    def step() -> torch.Tensor:
        if not train:
            with torch.no_grad():
                return _logits(fn(*inputs))
        out = _logits(fn(*inputs))
        (out * cotangent).sum().backward()
        return out.detach()

    step()
    for p in model.parameters():
        p.grad = None
    # Garbage made before the window (earlier tests, the call above) and collected inside it would
    # count as frees of the window's own memory and hide its peak (eager's bert once measured 256 B,
    # ending 7.5 MB below where it started).
    gc.collect()
    out, peak = measure_cpu_peak(step)
    grads = [p.grad for p in model.parameters()] if train else []
    for p in model.parameters():
        p.grad = None
    return out, grads, peak


# The fusion plan starts a new group at an op whose inputs all come from outside fused groups, so
# GELU's backward becomes two kernels and its cdf half ([batch, seq, 4 * hidden]) is materialised
# next to the result, where eager's gelu_backward holds the result only: 1.07x eager at the
# backward's peak. A schedule/plan.py matter (sibling fusion), not the memory plan's.
_GELU_SPLIT = pytest.mark.xfail(strict=True, reason="GELU backward split into two kernels by the fusion plan")
# mobilenet_v3_small inference on the CPU target peaks at 534,224 B against eager's 347,520 B (1.537x;
# 2-core AMD EPYC, 2026-11-25, also at earlier commits): an open defect.
_CPU_INFER_PEAK = pytest.mark.xfail(strict=False, reason="mobilenet_v3_small CPU inference peak above eager's")


@pytest.mark.parametrize("target", ["auto", "triton-interpret"])
@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("build", [_resnet18, _mobilenet_v3_small, _bert], ids=["resnet18", "mobilenet_v3_small", "bert"])
def test_peak_memory_at_most_eager(build: Callable, mode: str, target: str, request: pytest.FixtureRequest) -> None:
    if build is _bert and mode == "train":
        request.applymarker(_GELU_SPLIT)
    if build is _mobilenet_v3_small and mode == "infer" and target == "auto":
        request.applymarker(_CPU_INFER_PEAK)
    torch.manual_seed(0)
    model, inputs = build()
    train = mode == "train"
    model.train(train)
    cotangent = torch.randn(_logits(model(*inputs)).shape) if train else None
    # Deep nets at batch 2 (batch norm over two samples) amplify fp32 rounding: compare Ember and
    # eager with a float64 run, as bench/check.py does, rather than with each other.
    ref = copy.deepcopy(model).double()
    ref_inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    ref_out, ref_grads, _ = _measure(ref, ref, ref_inputs, train, None if cotangent is None else cotangent.double())

    want, want_grads, eager_peak = _measure(model, model, inputs, train, cotangent)
    if target == "triton-interpret":
        # The GPU code path runs convolutions channels_last (passes/layout.py), through ATen on the
        # CPU here, and oneDNN's channels_last convolution backward may take scratch space the
        # NCHW one does not (on an AVX-512 EPYC: mobilenet_v3_small's training step peaks at 19.26
        # MiB in eager channels_last against 6.25 MiB in NCHW). The bound is eager's peak in the
        # larger of the two layouts: the memory plan never holds more than eager in either.
        cl_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        cl_inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
        eager_peak = max(eager_peak, _measure(cl_model, cl_model, cl_inputs, train, cotangent)[2],
                         key=lambda m: m.peak)
    compiled = ember.compile(model, target=target)
    with _collect_after_launch(target):
        got, grads, ember_peak = _measure(model, compiled, inputs, train, cotangent)

    checks = [("output", got, want, ref_out)] + [(f"gradient {i}", g, w, r)
                                                 for i, (g, w, r) in enumerate(zip(grads, want_grads, ref_grads))]
    scale = max(r.abs().max().item() for _, _, _, r in checks)
    for what, g, w, r in checks:
        if r.abs().max().item() < 1e-12 * scale:
            # Zero in exact arithmetic (a batch norm's bias feeding another batch norm: 1e-17 of the
            # largest gradient in float64); eager and Ember both return float32 rounding noise, whose
            # ratio depends on the machine. Check that Ember's is noise too.
            assert g.abs().max().item() <= 1e-5 * scale, (what, g.abs().max().item(), scale)
            continue
        assert acceptable(_rel_error(g, r), _rel_error(w, r), 1e-5), (what, _rel_error(g, r), _rel_error(w, r))
    reuses = sum(check_reuse_lines(p) for p in _programs(compiled))
    assert reuses > 0 or not train  # training programs always have dead kernel buffers to reuse
    # No tolerance: the same tensors are live at the start (weights, inputs) and the memory plan
    # never holds more than eager does at its peak.
    assert ember_peak.peak <= eager_peak.peak, (
        f"Ember {ember_peak.peak} B vs eager {eager_peak.peak} B ({ember_peak.peak / eager_peak.peak:.3f}x)")
