"""The README's headline table, regenerated from committed ``ember bench --json`` files.

    python benchmarks/scripts/readme_table.py RUN.json [RUN.json ...] [--readme README.md] [--ember ember]

For every model / mode / batch / precision with an Ember row: eager, the best Inductor mode of
that row (the smallest median among the ``inductor*`` backends present: default,
``inductor-cudagraphs``, ``inductor-max-autotune``, the compiled-optimizer variant), Ember, and
Ember's speedup against both; then the geometric mean and one line saying how the numbers were
measured (timer, device, versions, dates, commits, files), read from the rows (older files:
from the file's ``env``). Prints the markdown; with ``--readme`` it replaces the text between
``<!-- headline-table:begin -->`` and ``<!-- headline-table:end -->`` in that file. Files are
read in order; a later file's row for the same model, mode, batch, precision and backend wins.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- headline-table:begin -->", "<!-- headline-table:end -->"
INDUCTOR_PREFIX = "inductor"
# Row field -> the file env field older result files keep it in.
ENV_FALLBACK = {"device_name": "device", "torch": "torch", "triton": "triton", "python": "python",
                "cuda": "torch_cuda", "gpu_driver": "cuda_driver", "git_commit": "git_commit", "date": "date"}
TIMER_TEXT = {
    "sync_each_step": "device synchronised after every step, host wall-clock time per step: PyTorch's "
    "benchmark protocol",
    "cuda_events": "CUDA events around each step while the host runs ahead",
}


def load_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every row of every file, with the file's name and any provenance the row lacks from its env."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        envs = [doc["env"]] if "env" in doc else [run.get("env", {}) for run in doc.get("runs", [])]
        env = envs[0] if envs else {}
        for row in doc["results"]:
            row = dict(row, file=Path(path).name)
            for field, env_field in ENV_FALLBACK.items():
                if row.get(field) is None and env.get(env_field) is not None:
                    row[field] = env[env_field]
            if row.get("git_commit") and len(str(row["git_commit"])) == 40:
                row["git_commit"] = str(row["git_commit"])[:7]
            rows.append(row)
    return rows


def _ms(row: dict[str, Any] | None) -> float | None:
    if row is None or row.get("error") or not row.get("ms_median"):
        return None
    return float(row["ms_median"])


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ratio(value: float | None) -> str:
    """A speedup cut (never rounded up) to three decimals."""
    return "-" if value is None else f"{math.floor(value * 1000) / 1000:.3f}x"


def _distinct(rows: Iterable[dict[str, Any]], field: str) -> str:
    values = sorted({str(r[field]) for r in rows if r.get(field) is not None})
    return ", ".join(values) if values else "unknown"


def headline(rows: Sequence[dict[str, Any]], ember: str = "ember") -> str:
    """The markdown: table, geometric means, and how it was measured. ``ember`` is one Ember backend
    or a comma list (``ember,ember-whole-step``): a column and a ratio for each."""
    embers = [e for e in ember.split(",") if e]
    table: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for row in rows:
        # A training row with another optimizer than the suite's SGD is a row of its own.
        optimizer = row.get("optimizer")
        model = row["model"] + (f" ({optimizer})" if optimizer not in (None, "sgd") else "")
        key = (model, row["mode"], row["batch"], row.get("precision"))
        table.setdefault(key, {})[row["backend"]] = row
    names = ([f"{e} ms" for e in embers] + [f"{e} vs best Inductor" for e in embers]
             + [f"{e} vs eager" for e in embers])
    lines = ["| model | mode | batch | precision | eager ms | best Inductor ms | best Inductor mode | "
             + " | ".join(names) + " | compile s best Inductor / " + " / ".join(embers) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * (len(names) + 1)]
    ratios: dict[str, list[float]] = {e: [] for e in embers}
    best_of: list[float] = []
    used: list[dict[str, Any]] = []
    for (model, mode, batch, precision), by_backend in table.items():
        present = [e for e in embers if e in by_backend]
        if not present:
            continue
        inductors = {b: r for b, r in by_backend.items() if b.startswith(INDUCTOR_PREFIX) and _ms(r) is not None}
        best_name = min(inductors, key=lambda b: _ms(inductors[b]) or math.inf) if inductors else None
        best = inductors.get(best_name) if best_name else None
        b_ms, eager_ms = _ms(best), _ms(by_backend.get("eager"))
        ms_cells, ratio_cells, eager_cells, compile_cells, row_ratios = [], [], [], [], []
        for e in embers:
            e_row = by_backend.get(e)
            e_ms = _ms(e_row)
            vs_best = b_ms / e_ms if e_ms and b_ms else None
            if vs_best is not None:
                ratios[e].append(vs_best)
                row_ratios.append(vs_best)
            if e_row is not None:
                used.append(e_row)
            ms_cells.append("-" if e_row is None else _fmt(e_ms) if e_row.get("error") is None
                            else f"error: {str(e_row['error'])[:60]}")
            ratio_cells.append(_ratio(vs_best))
            eager_cells.append(_ratio(eager_ms / e_ms if e_ms and eager_ms else None))
            compile_cells.append(_fmt(e_row.get("compile_s") if e_row else None, ".1f"))
        if row_ratios:
            best_of.append(max(row_ratios))
        used += [r for r in (best, by_backend.get("eager")) if r is not None]
        lines.append(f"| {model} | {mode} | {batch} | {precision or '-'} | {_fmt(eager_ms)} | {_fmt(b_ms)} "
                     f"| {best_name or '-'} | " + " | ".join(ms_cells + ratio_cells + eager_cells)
                     + f" | {_fmt(best.get('compile_s') if best else None, '.1f')} / {' / '.join(compile_cells)} |")
    out = "\n".join(lines) + "\n\n"
    for e in embers:
        if ratios[e]:
            geo = math.exp(sum(math.log(r) for r in ratios[e]) / len(ratios[e]))
            out += (f"Geometric mean of {e} against the best Inductor mode: {_ratio(geo)} over {len(ratios[e])} rows "
                    f"(above 1: Ember faster).\n")
    if len(embers) > 1 and best_of:
        geo = math.exp(sum(math.log(r) for r in best_of) / len(best_of))
        out += f"Geometric mean of the faster Ember variant of each row: {_ratio(geo)} over {len(best_of)} rows.\n"
    out += "\n"
    timers = sorted({str(r.get("timer")) for r in used if r.get("timer")})
    timer_text = "; ".join(f"`{t}` ({TIMER_TEXT.get(t, 'see the result files')})" for t in timers) or "unknown"
    iters = _distinct(used, "iters")
    warmup = _distinct(used, "warmup")
    out += (f"Measured: timer {timer_text}; median of {iters} timed steps after {warmup} warm-up steps; "
            f"device {_distinct(used, 'device_name')}, GPU driver {_distinct(used, 'gpu_driver')}; "
            f"torch {_distinct(used, 'torch')}, triton {_distinct(used, 'triton')}, "
            f"python {_distinct(used, 'python')}, CUDA {_distinct(used, 'cuda')}; "
            f"dates {_distinct([{'d': str(r['date'])[:10]} for r in used if r.get('date')], 'd')}; "
            f"commits {_distinct(used, 'git_commit')}; files {_distinct(used, 'file')}.\n")
    return out


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with everything between the headline markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {BEGIN} ... {END} not found in order")
    return text[: start + len(BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="ember bench --json files (or benchmarks/collect.py output)")
    parser.add_argument("--ember", default="ember", help="the Ember backend(s) to compare, a comma list (default ember)")
    parser.add_argument("--readme", help="replace the block between the headline markers in this file")
    args = parser.parse_args(argv)
    block = headline(load_rows(args.files), ember=args.ember)
    if args.readme:
        path = Path(args.readme)
        path.write_text(replace_between_markers(path.read_text(), block))
        print(f"headline table written to {path}")
    print(block, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
