"""The ``Tuning`` section of ``ember.explain``: per kernel, whether a tuned choice was used and
what it measured against the default configuration."""

from __future__ import annotations

from collections.abc import Sequence

from ember.report.html import Section, Table
from ember.report.records import GraphRecord


def _config(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(config.items())) or "default (the rules)"


def tuning_section(graphs: Sequence[GraphRecord]) -> Section:
    rows = []
    for g in graphs:
        for default, t in g.tuned.items():
            gain = f"{t['gain']:.2f}x" if t.get("gain") else "-"
            default_ms = f"{t['default_ms']:.4f}" if t.get("default_ms") else "-"
            rows.append([g.title, default, _config(t["config"]), default_ms, f"{t['ms']:.4f}", gain, t["source"]])
    kernels = sum(g.kernels for g in graphs)
    if not rows:
        return Section("Tuning", [f"No tuned choice used: all {kernels} kernel(s) use the generator's rules "
                                  "(`ember tune` measures and stores better configurations)."])
    lines = [f"{len(rows)} of {kernels} kernel(s) compiled with a configuration from the tuning database; "
             "gain is the measured default time over the tuned time on this device."]
    return Section("Tuning", lines, [Table(["graph", "kernel", "config", "default ms", "tuned ms", "gain", "from"],
                                           rows, numeric_from=3)])
