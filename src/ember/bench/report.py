"""Benchmark results out: environment record, JSON file, rich table, speedup bar chart."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.config import settings

__all__ = ["env_info", "plot", "plot_ember_vs_peers", "plot_speedups", "print_env", "print_table", "row_provenance", "write_json"]

# What the less obvious fields mean, stored in every result file so it explains itself.
NOTES = {
    "ms_median": "median wall time of one step (ms), timer sync_each_step: the device is synchronised after "
    "every step and the host's wall clock taken per step (PyTorch's benchmark protocol); train = forward + "
    "loss + backward + SGD step",
    "host_ms_median": "median host time inside the step call (from calling the step until the Python call "
    "returns, before the synchronisation); close to ms_median means the step is bound by the host",
    "pipelined_ms_median": "CUDA only: median ms between CUDA events recorded around each step while the host "
    "runs ahead (synchronised once after all steps); hides host work, a second column, never the headline",
    "peer_mode": "how the backend compiles (torch.compile mode, or Ember's defaults)",
    "vs_peers": "Ember rows: each other backend's ms_median / this ms_median, same model, mode, batch and run",
    "compile_s": "wall time of the first call (s), including compilation; cold or warm disk cache "
    "as the process found it",
    "compile_split": "Ember rows: compile_s split into Ember's stages (summed over graphs), the compiled "
    "graphs' first run, and the rest (Dynamo + AOTAutograd capture, eager code such as the optimizer step); "
    "compile_notes: each graph's kernel compile (its kernels, the workers, when the first compile began)",
    "first_call_collections": "the garbage collections inside the first call: count and seconds per "
    "generation (0, 1, 2) and total_s (ember.bench.gc_time)",
    "peak_mem_bytes": "cuda_max_memory_allocated: torch.cuda.max_memory_allocated over the timed "
    "steps (reset after warm-up); cpu_profiler_step_peak (CPU): the most tensor memory one more step "
    "held at once on top of what was allocated when it started (weights, optimizer state, inputs), "
    "from the profiler's allocation events (ember.bench.memory)",
    "peak_reserved_bytes": "CUDA: torch.cuda.max_memory_reserved over the timed steps (reset after "
    "warm-up), what the process holds from the GPU. The figure to compare where a backend replays CUDA "
    "graphs: a replay allocates nothing, so the memory its graphs' private pool keeps for their "
    "intermediates is reserved but not counted by max_memory_allocated",
    "speedup_vs_eager": "eager ms_median / this ms_median, same model, mode, batch and run",
    "max_abs_diff_vs_eager": "inference only: max |output - eager output| on the first batch",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _ember_version() -> str:
    # The package's __init__ may not define __version__ (or import) yet; fall back to the
    # installed metadata, then to pyproject.toml when running from a source tree.
    try:
        import ember

        version = getattr(ember, "__version__", None)
        if version:
            return str(version)
    except Exception:
        pass
    version = _version("ember")
    if version:
        return version
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    try:
        import tomllib

        return str(tomllib.loads(pyproject.read_text())["project"]["version"]) + " (source tree)"
    except (OSError, KeyError, ValueError, ImportError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict[str, Any]:
    """The source tree's commit. ``EMBER_GIT_COMMIT`` overrides it for runs from a copy of the
    working tree whose ``.git`` is not the one the tree was committed in (the device machine)."""
    commit = settings().git_commit
    if commit:
        return {"git_commit": commit, "git_dirty": False}
    here = str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here)
    return {"git_commit": commit, "git_dirty": bool(status)}


def short_commit() -> str:
    """The short hash of the source tree's commit (``EMBER_GIT_COMMIT`` when set), else "unknown"."""
    if settings().git_commit:
        return settings().git_commit
    return _run(["git", "rev-parse", "--short", "HEAD"], cwd=str(Path(__file__).resolve().parent)) or "unknown"


def _gpu_driver() -> str | None:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return smi.splitlines()[0].strip() if smi else None


def row_provenance(device: Any) -> dict[str, Any]:
    """What every result row carries about how it was made (the date is added per row)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        name, driver = torch.cuda.get_device_name(dev), _gpu_driver()
    else:
        name, driver = f"CPU: {_cpu_name()}", None
    return {"device_name": name, "torch": torch.__version__,
            "triton": _version("triton") or _version("pytorch-triton"), "python": sys.version.split()[0],
            "cuda": torch.version.cuda, "gpu_driver": driver, "git_commit": short_commit()}


def env_info() -> dict[str, Any]:
    """Device, driver and versions to store with every result (BENCHMARKS.md asks for GPU
    name, driver, torch/triton versions, date and git commit)."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton") or _version("pytorch-triton"),
        "torchvision": _version("torchvision"),
        "timm": _version("timm"),
        "transformers": _version("transformers"),
        "ember": _ember_version(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info["device"] = torch.cuda.get_device_name(idx)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_bytes"] = props.total_memory
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["cuda_driver"] = _gpu_driver()
        if info["cuda_driver"] is None:
            from ember import compat
            # torch reports the driver's CUDA API version (e.g. 13000), not the driver build.
            version = compat.cuda_driver_version()
            info["cuda_driver"] = f"CUDA API {version}" if version is not None else None
    else:
        info["device"] = f"CPU: {info['cpu']}"
        info["cuda_driver"] = None
    info.update(git_commit())
    return info


def write_json(
    path: str | os.PathLike[str], results: Sequence[dict[str, Any]], env: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write ``{"env", "config", "notes", "results"}``; written to a temporary file and renamed
    so a reader (or a killed run) never sees half a file."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": env if env is not None else env_info(), "config": config or {}, "notes": NOTES,
           "results": list(results)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, out)
    return out


def _console(file: Any = None) -> Any:
    from rich.console import Console

    stream = file if file is not None else sys.stdout
    # In a pipe or a log file rich would wrap at 80 columns; a results table reads better wide.
    width = None if stream.isatty() else 200
    return Console(file=stream, width=width)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def print_table(results: Sequence[dict[str, Any]], file: Any = None, title: str | None = None) -> None:
    """One row per measurement; speedups above 1 in green, below in red, errors in red."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title or "ember bench", header_style="bold")
    for col, justify in [
        ("model", "left"), ("mode", "left"), ("batch", "right"), ("backend", "left"), ("prec", "left"),
        ("ms median", "right"), ("ms min", "right"), ("host ms", "right"), ("pipelined ms", "right"),
        ("samples/s", "right"), ("compile s", "right"),
        ("peak mem", "right"), ("peak rsv", "right"), ("vs eager", "right"), ("error", "left"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in results:
        speedup = r.get("speedup_vs_eager")
        sp = Text(_fmt(speedup, ".2f") + ("x" if speedup is not None else ""))
        if speedup is not None and r["backend"] != "eager":
            sp.stylize("green" if speedup >= 1.0 else "red")
        err = r.get("error") or ""
        table.add_row(
            str(r["model"]), str(r["mode"]), str(r["batch"]), str(r["backend"]), str(r["precision"]),
            _fmt(r.get("ms_median"), ".2f"), _fmt(r.get("ms_min"), ".2f"), _fmt(r.get("host_ms_median"), ".2f"),
            _fmt(r.get("pipelined_ms_median"), ".2f"), _fmt(r.get("samples_per_s"), ".1f"),
            _fmt(r.get("compile_s"), ".1f"), _fmt_bytes(r.get("peak_mem_bytes")),
            _fmt_bytes(r.get("peak_reserved_bytes")), sp,
            Text(err[:120] + ("..." if len(err) > 120 else ""), style="red"),
        )
    _console(file).print(table)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """The results as a GitHub-markdown table, with Ember's speed relative to Inductor."""
    lookup = {(r["model"], r["mode"], r["batch"], r["backend"]): r for r in results}
    lines = ["| model | mode | batch | backend | ms median | ms min | samples/s | compile s | peak mem "
             "| peak rsv | vs eager | vs inductor |", "|" + "---|" * 12]
    for r in results:
        ind = lookup.get((r["model"], r["mode"], r["batch"], "inductor"))
        vs_ind = (ind["ms_median"] / r["ms_median"]) if ind and ind.get("ms_median") and r.get("ms_median") else None
        err = f" error: {r['error'][:80]}" if r.get("error") else ""
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['batch']} | {r['backend']}{err} | {_fmt(r.get('ms_median'), '.2f')} "
            f"| {_fmt(r.get('ms_min'), '.2f')} | {_fmt(r.get('samples_per_s'), '.1f')} | {_fmt(r.get('compile_s'), '.1f')} "
            f"| {_fmt_bytes(r.get('peak_mem_bytes'))} | {_fmt_bytes(r.get('peak_reserved_bytes'))} "
            f"| {_times(r.get('speedup_vs_eager'))} | {_times(vs_ind)} |")
    return "\n".join(lines) + "\n"


def print_env(env: dict[str, Any], file: Any = None) -> None:
    from rich.table import Table

    table = Table(title="ember env", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in env.items():
        table.add_row(key, "-" if value is None else str(value))
    _console(file).print(table)


def plot_speedups(results: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str | None = None) -> Path:
    """PNG bar chart: one group per model/mode/batch, one bar per backend (speedup vs eager).

    Rows without a speedup (failed, or no eager row) get no bar but an "n/a" mark, so a
    missing bar is never mistaken for a slow one.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    groups: list[tuple[str, str, Any]] = []
    backends: list[str] = []
    for r in results:
        key = (r["model"], r["mode"], r["batch"])
        if key not in groups:
            groups.append(key)
        if r["backend"] not in backends:
            backends.append(r["backend"])
    lookup = {(r["model"], r["mode"], r["batch"], r["backend"]): r for r in results}

    n = max(len(backends), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * n / 2 + 3), 4.5))
    for i, backend in enumerate(backends):
        xs, ys, missing = [], [], []
        for g, key in enumerate(groups):
            x = g - 0.4 + width * (i + 0.5)
            r = lookup.get((*key, backend))
            sp = r.get("speedup_vs_eager") if r else None
            if sp is None:
                missing.append(x)
            else:
                xs.append(x)
                ys.append(sp)
        bars = ax.bar(xs, ys, width=width, label=backend)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        for x in missing:
            ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{mode} bs{b}" for m, mode, b in groups], fontsize=8)
    ax.set_ylabel("speedup vs eager (higher is better)")
    ax.set_title(title or "ember bench: speedup vs eager")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, format="png")
    plt.close(fig)
    return out


def _is_ember(backend: str) -> bool:
    return backend == "ember" or backend.startswith("ember-")


def plot_ember_vs_peers(results: Sequence[dict[str, Any]], path: str | os.PathLike[str],
                        title: str | None = None) -> Path:
    """PNG bar chart: per model/mode/batch, Ember's speedup against every other backend (peer
    median / Ember median, same run); above the dashed line Ember is faster. Groups without an
    Ember result are drawn with an "n/a" mark, never as a short bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[tuple[str, str, Any]] = []
    for r in results:
        key = (r["model"], r["mode"], r["batch"])
        if key not in groups:
            groups.append(key)
    embers = list(dict.fromkeys(r["backend"] for r in results if _is_ember(r["backend"])))
    peers = list(dict.fromkeys(r["backend"] for r in results if not _is_ember(r["backend"])))
    pairs = [(e, p) for e in embers for p in peers]  # (ember backend, peer)
    lookup = {(r["model"], r["mode"], r["batch"], r["backend"]): r for r in results}

    def ms(key: tuple[str, str, Any], backend: str) -> float | None:
        row = lookup.get((*key, backend))
        return row.get("ms_median") if row and not row.get("error") else None

    n = max(len(pairs), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(groups) * n + 3), 4.8))
    for i, (ember, peer) in enumerate(pairs):
        xs, ys, missing = [], [], []
        for g, key in enumerate(groups):
            x = g - 0.4 + width * (i + 0.5)
            e, p = ms(key, ember), ms(key, peer)
            if e and p:
                xs.append(x)
                ys.append(p / e)
            else:
                missing.append(x)
        label = f"vs {peer}" if len(embers) == 1 else f"{ember} vs {peer}"
        bars = ax.bar(xs, ys, width=width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
        for x in missing:
            ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="red")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{mode} bs{b}" for m, mode, b in groups], fontsize=7)
    ax.set_ylabel("Ember speedup (peer ms / Ember ms)")
    ax.set_title(title or "ember bench: Ember against every peer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, format="png")
    plt.close(fig)
    return out


def plot(results: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Ember against every peer when the results have Ember rows, else speedup vs eager."""
    if any(_is_ember(r["backend"]) and not r.get("error") for r in results):
        return plot_ember_vs_peers(results, path, title)
    return plot_speedups(results, path, title)
