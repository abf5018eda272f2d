"""Where a warm first call goes: one bench case's first call in THIS process, as
``ember bench --first-call`` runs it (the harness's own step), with time stamps and optionally cProfile.

    EMBER_WARM_START=1 EMBER_CACHE_DIR=/tmp/c/ember TORCHINDUCTOR_CACHE_DIR=/tmp/c/inductor \
      PYTHONPATH=src python benchmarks/scripts/warm_first_call_profile.py resnet18 infer ember \
      [--device cuda] [--profile out.prof] [--top 40]

Run it twice with the same caches: the first run compiles (cold), the second is the warm first call.
Prints one line per stamp (seconds since the script started) and the warm-start and frame-cache
logs, then, with ``--profile``, the functions with the largest cumulative time in the first call.
On the CPU: small inputs, fp32 (~10 s warm); on CUDA: the bench's full-size inputs, bf16.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

T0 = time.perf_counter()


def stamp(what: str) -> None:
    print(f"{time.perf_counter() - T0:7.3f} s  {what}", flush=True)


def _probe_constant_loads() -> None:
    """Wrap the stored programs' decoder: each constants load timed, then the same bytes loaded again."""
    import io

    import torch

    import ember.capture.warm_artifact as warm_artifact
    import ember.runtime.artifacts as artifacts
    decode = artifacts._decode

    def timed(payload: bytes):
        t0 = time.perf_counter()
        out = decode(payload)
        first = time.perf_counter() - t0
        n = int.from_bytes(payload[:8], "little")
        t0 = time.perf_counter()
        torch.load(io.BytesIO(payload[8 + n:]), weights_only=True)
        again = time.perf_counter() - t0
        tensors = [c for c in out.consts if isinstance(c, torch.Tensor)]
        size = sum(t.numel() * t.element_size() for t in tensors)
        devices = sorted({str(t.device) for t in tensors})
        print(f"  constants load: {first * 1e3:.1f} ms, same bytes again {again * 1e3:.1f} ms; "
              f"{len(out.consts)} constants, {len(tensors)} tensors, {size / 2**20:.2f} MiB on {devices}; "
              f"payload {len(payload) / 2**20:.2f} MiB", flush=True)
        return out
    artifacts._decode = timed
    warm_artifact._decode = timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("mode", choices=["infer", "train"])
    parser.add_argument("backend")
    parser.add_argument("--profile")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--torch-profile", action="store_true",
                        help="torch.profiler over the first call (every thread, CPU and CUDA): top ops")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--numba-before", choices=["none", "sync", "thread"], default="none",
                        help="experiment: load numba before the timed call (sync) or in a thread at compile")
    parser.add_argument("--alias-analysis", choices=["skip-idle", "keep"], default="skip-idle",
                        help="keep: run AOTAutograd's first-call aliasing analysis over every program "
                        "(what Ember did before runtime/program.without_idle_alias_analysis)")
    parser.add_argument("--inlined-sources", choices=["once", "every"], default="once",
                        help="every: Dynamo records an inlined function's source at each inlining "
                        "(what Ember's warm-start compile did before compat.inlined_sources_recorded_once)")
    parser.add_argument("--probe-load", action="store_true",
                        help="time each stored program's constants load (twice) and list modules first "
                        "imported inside the first call")
    args = parser.parse_args()
    if args.alias_analysis == "keep":
        import contextlib

        import ember.runtime.program as program
        program.without_idle_alias_analysis = lambda source: contextlib.nullcontext()

    if args.inlined_sources == "every":
        import contextlib

        import ember.compat as compat
        compat.inlined_sources_recorded_once = contextlib.nullcontext
    import torch
    stamp("torch imported")
    from ember.bench import harness, models
    stamp("ember.bench imported")

    case = models.get_case(args.model)
    device = torch.device(args.device)
    small = device.type == "cpu"
    torch.manual_seed(0)
    model = case.build(small).train(args.mode == "train").to(device)
    batch = args.batch or (1 if args.mode == "infer" and small else case.default_batch(args.mode))
    batches = models.make_batches(case, batch, device, small=small, count=2)
    if device.type == "cuda":
        torch.cuda.synchronize()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if args.mode == "train" else None
    stamp("model and batches built")
    if args.numba_before != "none":
        import threading

        def numba_ready() -> None:
            from ember.runtime.numba_import import import_numba_without_scipy_blas
            import_numba_without_scipy_blas()
            import ember.runtime.cpu_support  # noqa: F401
        if args.numba_before == "sync":
            numba_ready()
        else:
            threading.Thread(target=numba_ready, daemon=True).start()
        stamp(f"numba: {args.numba_before}")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    step, fn = harness._backend_step(case, args.backend, model, args.mode, precision, device, optimizer)
    stamp("compiled (ember.compile / torch.compile returned)")

    if args.probe_load:
        _probe_constant_loads()
        modules_before = set(sys.modules)
    prof = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    tprof = None
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        tprof = profile(activities=[ProfilerActivity.CPU]
                        + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
        tprof.__enter__()
    from ember.bench.gc_time import describe, timed_collections
    if prof:
        prof.enable()
    with timed_collections() as collections:
        step(*batches[0])
        if device.type == "cuda":
            torch.cuda.synchronize()
    if prof:
        prof.disable()
    if tprof is not None:
        tprof.__exit__(None, None, None)
    first = time.perf_counter() - start
    stamp(f"first call done: {first:.3f} s; {describe(collections)}")
    start = time.perf_counter()
    step(*batches[1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    stamp(f"second call: {time.perf_counter() - start:.3f} s")
    if args.probe_load:
        new = sorted(set(sys.modules) - modules_before)
        from collections import Counter
        families = Counter(".".join(m.split(".")[:2]) if m.startswith(("torch.", "triton.")) else m.split(".")[0]
                           for m in new if not m.startswith(("ember_cpu_", "ember_kernel")))
        print(f"  modules first imported inside the first call: {len(new)}: "
              + ", ".join(f"{k} {v}" for k, v in sorted(families.items())))
    from ember.runtime import cubin_launch
    if any(cubin_launch.STATS.values()):
        print("  cubin launches: " + ", ".join(f"{k} {v}" for k, v in cubin_launch.STATS.items()))
    backend = harness.ember_backend_of(fn if fn is not None else step)
    if backend is not None:
        for line in backend.log.warm_start:
            print("  warm start:", line)
        for line in backend.log.frame_cache:
            print("  frame cache:", line)
        for g in backend.log.graphs:
            print(f"  graph {g.title}: cache {g.cache}, first run {g.first_call_s}; {g.compile_note}")
            print(f"  graph {g.title} stages: " + ", ".join(f"{k} {v:.3f} s" for k, v in g.stage_seconds.items()))
    if tprof is not None:
        averages = tprof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
        print(averages.table(sort_by="cpu_time_total", row_limit=args.top))
    if prof:
        prof.dump_stats(args.profile)
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
