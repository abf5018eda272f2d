"""The H100 measurement of the seed suite and the zoo against every peer, in device calls of
at most ~8 minutes: each job is one ``ember bench`` run (one model, one mode, every backend of
the plan) in a fresh Python process, writing ``<plan>_<job>.json`` and a log under ``--out``.

    PYTHONPATH=src EMBER_GIT_COMMIT=$(git rev-parse --short HEAD) \\
        python benchmarks/scripts/gpu_suite.py --group 1 --out "$OUT"       # then --group 2, 3, ...
    python benchmarks/scripts/gpu_suite.py --list                           # the groups and their jobs
    python benchmarks/scripts/gpu_suite.py --jobs gpt2_train,t5_infer --out "$OUT"   # chosen jobs
    python benchmarks/scripts/gpu_suite.py ... --out "$OUT/suite" --archive   # one $OUT/suite.tgz

Plans: ``main`` (default): seed suite training in bf16, bert and resnet50 inference at batch 1,
the zoo in training and inference; backends eager, inductor, inductor-cudagraphs, ember.
``compiled-optimizer``: training rows with Inductor's CUDA graphs plus the compiled optimizer
step. ``max-autotune``: every row with ``inductor-max-autotune`` alone (compiles for minutes:
groups of one or two jobs). ``adamw``: transformers trained with AdamW (``--optimizer adamw``)
against every peer and the compiled optimizer. Rows of several plans merge in ``readme_table.py``, which takes the
best Inductor mode per row.

Jobs are packed into groups by an estimate of their seconds (compile of each backend plus the
timed steps); a group stops starting jobs when less than ``--min-left`` of ``--budget`` is left
and names the jobs it skipped, and each job is killed at the budget's end (``ember bench``
rewrites its JSON after every row, so what was measured stays). ``--gpus N`` runs N jobs side by
side, one per GPU (``CUDA_VISIBLE_DEVICES``), each pinned to 1/N of the cores with Inductor's
compile workers sized to match, so one job's compile does not steal the host time another job is
measuring. The device copy of the tree has
no ``.git``: pass the commit in ``EMBER_GIT_COMMIT`` so the rows record it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = "eager,inductor,inductor-cudagraphs,ember"


@dataclass(frozen=True)
class Job:
    name: str
    model: str
    mode: str
    est_s: int  # all backends of the main plan, compile included
    batch: int | None = None
    optimizer: str | None = None  # ember bench's default (SGD) when None

    def args(self) -> list[str]:
        batch = ["--batch", str(self.batch)] if self.batch else []
        optimizer = ["--optimizer", self.optimizer] if self.optimizer else []
        return [self.model, "--mode", self.mode, *batch, "--precision", "bf16", *optimizer]


# Estimates from the H100 runs so far (Inductor default-mode compile times in docs/benchmarks.md;
# the CUDA-graph mode compiles again, partly from Triton's cache); the zoo's are guesses.
SEED_JOBS = [
    Job("resnet50_train", "resnet50", "train", 170),
    Job("bert_train", "bert", "train", 120),
    Job("vgg16_train", "vgg16", "train", 70),
    Job("mobilenet_v3_train", "mobilenet_v3", "train", 230),
    Job("densenet121_train", "densenet121", "train", 420),
    Job("resnet50v2_train", "resnet50v2", "train", 140),
    Job("cyclegan_train", "cyclegan", "train", 80),
    Job("style_transfer_train", "style_transfer", "train", 90),
    Job("bert_infer_bs1", "bert", "infer", 70, batch=1),
    Job("resnet50_infer_bs1", "resnet50", "infer", 70, batch=1),
]
ZOO_EST = {"vit_b16": 140, "swin_t": 220, "convnext_t": 150, "efficientnet_b0": 220, "gpt2": 150, "llama": 150,
           "t5": 180, "bart": 180, "lstm_lm": 70}
ZOO_JOBS = [Job(f"{m}_{mode}", m, mode, est if mode == "train" else est // 2)
            for m, est in ZOO_EST.items() for mode in ("train", "infer")]

# Transformers as they are usually trained: AdamW, against Inductor's compiled optimizer too.
ADAMW_JOBS = [Job(f"{m}_train_adamw", m, "train", est, optimizer="adamw")
              for m, est in (("bert", 150), ("gpt2", 180), ("vit_b16", 170), ("swin_t", 260))]

PLANS: dict[str, tuple[list[Job], str, float]] = {
    # plan -> (jobs, backends, estimate factor against the main plan's four backends)
    "main": (SEED_JOBS + ZOO_JOBS, PEERS, 1.0),
    "compiled-optimizer": ([j for j in SEED_JOBS + ZOO_JOBS if j.mode == "train"],
                           "inductor-cudagraphs-compiled-optimizer", 0.5),
    "max-autotune": (SEED_JOBS + ZOO_JOBS, "inductor-max-autotune", 2.5),
    "adamw": (ADAMW_JOBS, f"{PEERS},inductor-cudagraphs-compiled-optimizer", 1.5),
}


def groups(jobs: list[Job], factor: float, budget: float) -> list[list[Job]]:
    """Jobs packed first-fit, in order, into groups whose estimates fit in ``budget`` seconds
    (a job longer than the budget gets a group of its own)."""
    out: list[list[Job]] = []
    used: list[float] = []
    for job in jobs:
        est = job.est_s * factor
        slot = next((i for i, u in enumerate(used) if u + est <= budget), None)
        if slot is None:
            out.append([])
            used.append(0.0)
            slot = len(out) - 1
        out[slot].append(job)
        used[slot] += est
    return out


@dataclass(frozen=True)
class Lane:
    """Where a job runs: one GPU and its share of the host's cores (jobs on other GPUs compile
    meanwhile; each job's host-side timing keeps cores of its own)."""

    gpu: int | None
    cpus: frozenset[int] | None


def lanes(gpus: int) -> list[Lane]:
    if gpus <= 1:
        return [Lane(None, None)]
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // gpus
    return [Lane(k, frozenset(cores[k * share:(k + 1) * share])) for k in range(gpus)]


def run_job(job: Job, backends: str, out: Path, plan: str, timeout: float, extra: list[str],
            lane: Lane = Lane(None, None)) -> dict:
    stem = f"{plan}_{job.name}"
    if job.mode == "train" and "ember" in backends.split(",") and "ember-whole-step" not in backends:
        backends += ",ember-whole-step"  # Ember's whole-step program: training rows only
    if job.mode == "infer" and "ember" in backends.split(",") and "ember-whole-call" not in backends:
        backends += ",ember-whole-call"  # the inference call as one CUDA graph: inference rows only
    cmd = [sys.executable, "-m", "ember.cli", "bench", *job.args(), "--backend", backends, "--no-progress",
           "--json", str(out / f"{stem}.json"), *extra]
    # A PYTHONPATH given by the caller decides which Ember runs (another checkout's src, to time
    # two versions on one machine); without one, this checkout's.
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT / "src")}
    if lane.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(lane.gpu)
    if lane.cpus:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(len(lane.cpus))
    pin = (lambda: os.sched_setaffinity(0, lane.cpus)) if lane.cpus else None
    t0 = time.perf_counter()
    with open(out / f"{stem}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                preexec_fn=pin).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    where = {} if lane.gpu is None else {"gpu": lane.gpu, "cpus": len(lane.cpus or ())}
    return {"job": job.name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "json": f"{stem}.json", **where}


def summary(out: Path, stems: list[str]) -> None:
    """One line per model/mode/batch: median ms of each backend, Ember against the best Inductor mode."""
    for stem in stems:
        path = out / stem
        if not path.exists():
            print(f"{stem}: no results")
            continue
        rows = json.loads(path.read_text())["results"]
        groups: dict[tuple, dict[str, dict]] = {}
        for r in rows:
            groups.setdefault((r["model"], r["mode"], r["batch"]), {})[r["backend"]] = r
        for (model, mode, batch), by in groups.items():
            cells = []
            for name, r in by.items():
                if r.get("ms_median"):
                    cell = f"{r['ms_median']:.2f}"
                else:
                    cell = f"ERR({str(r['error'])[:40]})" if r.get("error") else "unfinished"
                if r.get("host_ms_median"):
                    cell += f" h{r['host_ms_median']:.2f}"
                if r.get("compile_s") is not None:
                    cell += f" c{r['compile_s']:.0f}s"
                cells.append(f"{name} {cell}")
            ind = [r["ms_median"] for b, r in by.items() if b.startswith("inductor") and r.get("ms_median")]
            em = by.get("ember", {}).get("ms_median")
            ratio = f" | Ember vs best Inductor {min(ind) / em:.2f}x" if ind and em else ""
            print(f"{model} {mode} bs{batch}: " + "; ".join(cells) + ratio, flush=True)


def archive(out: Path) -> Path:
    """``out``'s JSON and log files packed into ``<out>.tgz`` beside it, then removed from ``out``."""
    files = sorted(p for p in out.iterdir() if p.suffix in (".json", ".log"))
    target = out.with_suffix(".tgz")
    with tarfile.open(target, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"{out.name}/{f.name}")
    for f in files:
        f.unlink()
    print(f"archived {len(files)} files into {target}", flush=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="main", choices=list(PLANS))
    parser.add_argument("--group", type=int, help="which group of the plan's jobs (1-based); see --list")
    parser.add_argument("--jobs", help="comma list of job names to run instead of a group")
    parser.add_argument("--list", action="store_true", help="print the groups of the plan and exit")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_suite_out"))
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for this call (default 480)")
    parser.add_argument("--min-left", type=float, default=45.0, help="start no job with fewer seconds left")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per backend (ember bench default 30)")
    parser.add_argument("--backends", help="comma list replacing the plan's backends")
    parser.add_argument("--gpus", type=int, default=1,
                        help="run jobs side by side, one per GPU, each pinned to its share of the cores "
                             "(longest estimate first)")
    parser.add_argument("--archive", action="store_true",
                        help="end by packing the folder's JSON and logs into one <out>.tgz beside it and "
                             "removing them (the device returns only a few files a call)")
    args = parser.parse_args()

    jobs, backends, factor = PLANS[args.plan]
    backends = args.backends or backends
    plan_groups = groups(jobs, factor, args.budget - 30)
    if args.list:
        for i, group in enumerate(plan_groups, 1):
            est = sum(j.est_s * factor for j in group)
            print(f"group {i} (~{est:.0f} s): {', '.join(j.name for j in group)}")
        print(f"{len(plan_groups)} groups, ~{sum(j.est_s * factor for j in jobs) / 60:.0f} min estimated; backends {backends}")
        return 0
    if args.jobs:
        by_name = {j.name: j for j in jobs}
        unknown = [n for n in args.jobs.split(",") if n not in by_name]
        if unknown:
            print(f"unknown jobs {unknown}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        chosen = [by_name[n] for n in args.jobs.split(",")]
    elif args.group and 1 <= args.group <= len(plan_groups):
        chosen = plan_groups[args.group - 1]
    else:
        print(f"give --group 1..{len(plan_groups)} or --jobs (see --list)", file=sys.stderr)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("EMBER_GIT_COMMIT"):
        print("note: EMBER_GIT_COMMIT is not set; rows record `git rev-parse` here or 'unknown'", flush=True)
    extra = ["--iters", str(args.iters)] if args.iters else []
    start = time.perf_counter()
    done: list[dict] = []
    skipped: list[str] = []
    queue = sorted(chosen, key=lambda j: -j.est_s) if args.gpus > 1 else list(chosen)
    lock = threading.Lock()

    def worker(lane: Lane) -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop(0)
                left = args.budget - (time.perf_counter() - start)
                if left < args.min_left:
                    skipped.append(job.name)
                    continue
            res = run_job(job, backends, out, args.plan, timeout=left, extra=extra, lane=lane)
            where = f" gpu {lane.gpu}" if lane.gpu is not None else ""
            print(f"{res['job']:<24} rc={res['rc']!s:<8} {res['seconds']:>6.1f} s{where}", flush=True)
            with lock:
                done.append(res)

    threads = [threading.Thread(target=worker, args=(lane,)) for lane in lanes(args.gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (out / f"{args.plan}_group{args.group or 'jobs'}_runs.json").write_text(json.dumps(done, indent=1))
    summary(out, [r["json"] for r in done])
    if skipped:
        print(f"skipped (budget): --jobs {','.join(skipped)}")
    if args.archive:
        archive(out)
    return 0 if done and all(r["rc"] == 0 for r in done) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
