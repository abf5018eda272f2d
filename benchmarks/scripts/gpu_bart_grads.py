"""Which Ember configuration gets BART's training gradients wrong on the GPU, at the size that failed.

One bf16-autocast training step of the zoo's bart at its FULL size (bart-base, batch 4, source 512,
target 128: what ``gpu_correctness.py zoo`` runs; its ``--small`` size passed on the H100), Ember
against eager bf16, both against eager fp32, in one fresh process:

    PYTHONPATH=src python benchmarks/scripts/gpu_bart_grads.py            # about 2 minutes on an H100
    PYTHONPATH=src python benchmarks/scripts/gpu_bart_grads.py --small    # the size that passed
    PYTHONPATH=src python benchmarks/scripts/gpu_bart_grads.py --after gpt2,llama,t5 --only defaults
                                                    # other zoo models first, as in the failing run

Variants (each a fresh compile):
  defaults          Ember as gpu_correctness runs it
  saved check       defaults, and every tensor autograd saves is checksummed when saved and again
                    when the backward unpacks it: "changed" means memory of a live saved activation
                    was overwritten between the forward and the backward (a memory hazard, not math)
  no split          split reductions off (split_target_programs=0)
  no first-call pool  EMBER_FIRST_CALL_POOL=0 (first calls allocate from the default pool)
  no workspace clearing  EMBER_CLEAR_WORKSPACES=0 (cuBLAS workspaces kept after first calls)
  cudagraphs off    no CUDA-graph runner at all (no first-call pool either)

Prints, per variant: the number of gradients worse than max(4 x eager's error, 3e-2) and the first
few by parameter order (encoder and decoder apart). Exit status 1 if the defaults fail.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator

import torch

import ember
from ember import config
from ember.bench.check import _no_dropout, _rel, acceptable, run_seed_step
from ember.bench.models import get_case, make_batches, primary_tensor

FLOOR = 3e-2


class SavedCheck:
    """Checksums of every tensor autograd saves, at save time and at unpack time."""

    def __init__(self) -> None:
        self.saved = 0
        self.changed: list[str] = []
        # (index, weak reference, checksum at save) for the call audit; weak, so that the
        # CUDA-graph runner's reference counts (is somebody holding an output?) stay as they are
        self.live: list[tuple[int, weakref.ref, torch.Tensor]] = []

    @staticmethod
    def _sum(t: torch.Tensor) -> torch.Tensor:
        x = t.detach().double()
        return torch.stack([x.sum(), x.abs().sum()])

    def pack(self, t: torch.Tensor) -> object:
        self.saved += 1
        if not t.is_floating_point() or t.numel() == 0:
            return (t, None, self.saved)
        before = self._sum(t)
        self.live.append((self.saved, weakref.ref(t), before))
        return (t, before, self.saved)

    def unpack(self, packed: object) -> torch.Tensor:
        t, before, k = packed
        if before is not None and not torch.equal(self._sum(t), before):
            self.changed.append(f"#{k} {tuple(t.shape)} {t.dtype}")
        return t


def step(case, model, inputs, target, amp: bool, hooks: SavedCheck | None = None) -> None:
    model.train()
    with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=amp):
        if hooks is not None:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                out = primary_tensor(model(*inputs))
        else:
            out = primary_tensor(model(*inputs))
        loss = case.loss(out, target)
    loss.backward()


def run(small: bool, options: dict, env: dict, patch: dict, check: bool, device: str = "cuda",
        setup: Callable[[], contextlib.AbstractContextManager] | None = None
        ) -> tuple[list[str], SavedCheck | None, int]:
    torch._dynamo.reset()
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        torch.manual_seed(0)
        case = get_case("bart")
        base = _no_dropout(case.build(small)).to(device)
        (inputs, target), = make_batches(case, 4, torch.device(device), small=small, count=1, seed=0)
        ref, eager, ours = copy.deepcopy(base).float(), copy.deepcopy(base), copy.deepcopy(base)
        del base
        step(case, ref, inputs, target, amp=False)
        step(case, eager, inputs, target, amp=True)
        hooks = SavedCheck() if check else None
        global AUDIT
        AUDIT = hooks
        with config.patch(**patch), (setup() if setup is not None else contextlib.nullcontext()):
            step(case, ember.compile(ours, **options), inputs, target, amp=True, hooks=hooks)
        if device == "cuda":
            torch.cuda.synchronize()
        bad = []
        for (name, p), pe, pr in zip(ours.named_parameters(), eager.parameters(), ref.parameters()):
            if pr.grad is None:
                continue
            e, g = _rel(p.grad, pr.grad), _rel(pe.grad, pr.grad)
            if not acceptable(e, g, FLOOR):
                bad.append(f"{name} {e:.2e} (eager {g:.2e})")
        return bad, hooks, sum(1 for _ in ours.parameters())
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


AUDIT: SavedCheck | None = None  # the saved-tensor check the call audit reads


@contextlib.contextmanager
def audit_runner_calls() -> Iterator[None]:
    """After every CUDA-graph runner call and every backward node: re-check every tensor saved so
    far, and name the first call after which one changed (the call that wrote over it)."""
    from ember.runtime.cudagraphs.runner import CudaGraphRunner

    original = CudaGraphRunner.__call__
    seen: set[int] = set()

    def sweep(where: str) -> None:
        if AUDIT is None:
            return
        torch.cuda.synchronize()
        for k, ref, before in AUDIT.live:
            t = ref()
            if k not in seen and t is not None and not torch.equal(SavedCheck._sum(t), before):
                seen.add(k)
                print(f"    #{k} {tuple(t.shape)} ptr {t.data_ptr():#x} changed {where}")

    def audited(self, args):  # noqa: ANN001, ANN202
        phase = "first" if self.calls == 0 else ("replay" if self.g is not None else "capture")
        sweep(f"before {self.title} call {self.calls + 1} (eager code between graphs)")
        out = original(self, args)
        sweep(f"by {self.title} call {self.calls} ({phase}); status: {self.status[:160]}")
        return out

    CudaGraphRunner.__call__ = audited
    try:
        yield
    finally:
        CudaGraphRunner.__call__ = original


@contextlib.contextmanager
def runner_without(method: str) -> Iterator[None]:
    """A CUDA-graph backend whose ``method`` does nothing (release_cached: no empty_cache after first calls)."""
    from ember.runtime.cudagraphs.device import CudaBackend

    original = getattr(CudaBackend, method)
    setattr(CudaBackend, method, lambda self, *a, **k: 0)
    try:
        yield
    finally:
        setattr(CudaBackend, method, original)


@contextlib.contextmanager
def no_cudnn_attention() -> Iterator[None]:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# name, compile options, environment, config.patch, saved-tensor check, context around the step
VARIANTS: list[tuple[str, dict, dict, dict, bool, Callable | None]] = [
    ("defaults", {}, {}, {}, False, None),
    ("saved check", {}, {}, {}, True, None),
    ("call audit", {}, {}, {}, True, audit_runner_calls),
    ("no split", {}, {}, {"split_target_programs": 0}, False, None),
    ("no first-call pool", {}, {"EMBER_FIRST_CALL_POOL": "0"}, {}, False, None),
    ("no workspace clearing", {}, {"EMBER_CLEAR_WORKSPACES": "0"}, {}, False, None),
    ("no presize", {}, {"EMBER_POOL_PRESIZE": "0"}, {}, False, None),
    ("no pooled inputs", {}, {"EMBER_POOLED_INPUTS": "0"}, {}, False, None),
    ("no cache release", {}, {}, {}, True, lambda: runner_without("release_cached")),
    ("no cudnn attention", {}, {}, {}, True, no_cudnn_attention),
    ("cudagraphs off+check", {"cudagraphs": False}, {}, {}, True, None),
    ("cudagraphs off", {"cudagraphs": False}, {}, {}, False, None),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the small config (passed on the H100)")
    parser.add_argument("--only", default=None, help="run one variant by name")
    parser.add_argument("--after", default="", help="comma-separated zoo models to run first in this process, "
                        "as gpu_correctness.py zoo does (e.g. gpt2,llama,t5)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="check this script on the CPU (target cpu)")
    args = parser.parse_args()
    if args.cpu_dry_run:
        bad, hooks, n = run(True, {"target": "cpu"}, {}, {}, True, device="cpu")
        print(f"cpu: {len(bad)}/{n} grads wrong; saved tensors changed: {len(hooks.changed)} of {hooks.saved}")
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"bart {'small' if args.small else 'full (bart-base, batch 4, source 512, target 128)'}, "
          f"bf16 autocast, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name in filter(None, args.after.split(",")):
        t0 = time.perf_counter()
        torch._dynamo.reset()
        run_seed_step(name, lambda m: ember.compile(m), device="cuda", batch=4, small=args.small,
                      autocast=torch.bfloat16)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(f"ran {name} first [{time.perf_counter() - t0:.0f} s]")
    failed_defaults = False
    for name, options, env, patch, check, setup in VARIANTS:
        if args.only and name != args.only:
            continue
        t0 = time.perf_counter()
        try:
            bad, hooks, n = run(args.small, options, env, patch, check, setup=setup)
        except Exception:  # noqa: BLE001 - report and go on with the next variant
            print(f"{name:20s} error\n{traceback.format_exc(limit=4)}")
            continue
        enc = [b for b in bad if ".encoder." in b]
        dec = [b for b in bad if ".decoder." in b]
        other = [b for b in bad if b not in enc and b not in dec]
        line = f"{name:20s} {len(bad)}/{n} grads wrong (encoder {len(enc)}, decoder {len(dec)}, other {len(other)})"
        if hooks is not None:
            line += f"; saved tensors changed before the backward: {len(hooks.changed)} of {hooks.saved}"
        print(f"{line}  [{time.perf_counter() - t0:.0f} s]")
        for b in (dec[-3:] + enc[-3:] + other[:2]):
            print(f"    {b}")
        if hooks is not None and hooks.changed:
            print(f"    changed: {', '.join(hooks.changed[:8])}")
        failed_defaults |= name == "defaults" and bool(bad)
    return 1 if failed_defaults else 0


if __name__ == "__main__":
    sys.exit(main())
