"""Cold and warm compile time of whole models on the CPU: Ember (target cpu) vs Inductor.

Run from the repo root:
    python benchmarks/scripts/cpu_compile_bench.py --json benchmarks/cpu_compile_<date>.json
    python benchmarks/scripts/cpu_compile_bench.py --cases resnet18:train:8 --backends ember

Every measurement runs in a fresh Python process (imports included in nothing: the clock
starts right before the first call). "cold": empty Ember cache folder (kernel modules, numba
machine code, compiled programs) or empty Inductor cache folder; "warm": a second process on the
cache the cold run filled. For Ember the record also has the per-stage compile seconds summed
over the model's graphs, the number of fused groups that became kernels, the distinct compiled
kernels (op structures), and numba's compile seconds per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent("""
    import json, sys, time, torch
    from ember.bench.models import get_case, make_batches, primary_tensor
    name, mode, batch, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    case = get_case(name)
    torch.manual_seed(0)
    model = case.build(False).train(mode == "train")
    (inputs, target), = make_batches(case, batch, torch.device("cpu"), count=1)
    if backend == "ember":
        import ember
        fn = ember.compile(model, target="cpu")
    else:
        fn = torch.compile(model)
    start = time.perf_counter()
    if mode == "train":
        case.loss(primary_tensor(fn(*inputs)), target).backward()
    else:
        with torch.no_grad():
            fn(*inputs)
    out = {"first_step_s": time.perf_counter() - start}
    if backend == "ember":
        graphs = fn._ember_backend.log.graphs
        stages = {}
        for g in graphs:
            for k, v in g.stage_seconds.items():
                stages[k] = stages.get(k, 0.0) + v
        out.update(stages={k: round(v, 3) for k, v in stages.items()}, graphs=len(graphs),
                   kernels=sum(g.kernels for g in graphs),
                   compiled_kernels=len({n.split("_")[2] for g in graphs for n in g.kernel_sources}),
                   on_aten={k: v for g in graphs for k, v in g.fallback_reasons.items() if k.startswith("fused group")},
                   cache=[g.cache for g in graphs])
    print("RESULT " + json.dumps(out))
""")


def run_child(name: str, mode: str, batch: int, backend: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, mode, str(batch), backend], env=env,
                          capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": proc.stderr[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="resnet18:train:8,resnet50:infer:1,bert:infer:1,mobilenet_v3:infer:1",
                    help="comma list of model:mode:batch")
    ap.add_argument("--backends", default="ember,inductor")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    load_at_start = os.getloadavg()
    rows = []
    for spec in args.cases.split(","):
        name, mode, batch = spec.split(":")
        for backend in args.backends.split(","):
            cache = tempfile.mkdtemp(prefix=f"compile-bench-{backend}-")
            env = {**os.environ, "EMBER_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": cache}
            for phase in ("cold", "warm"):
                r = run_child(name, mode, int(batch), backend, env)
                row = {"model": name, "mode": mode, "batch": int(batch), "backend": backend, "phase": phase, **r}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        from cpu_kernel_bench import environment  # noqa: PLC0415 - same folder, only for the JSON header
        with open(args.json, "w") as f:
            json.dump({"environment": environment(load_at_start), "runs": rows}, f, indent=1)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
