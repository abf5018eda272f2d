"""The ``Tuning`` section of ``ember.explain``: per kernel, whether a tuned choice was used and
what it measured against the default configuration."""

from __future__ import annotations

from collections.abc import Sequence

from ember.report.html import Section, Table
from ember.report.records import GraphRecord

_RULE_NAMES = {"onednn": "oneDNN", "cublas": "cuBLAS", "small_bmm": "Ember's small products"}


def config_label(config: dict, library: bool = False, rule: str = "onednn") -> str:
    """A tuned choice in a few words: a tiled matmul as its tile, other settings as ``key=value``."""
    if not config:
        return f"the rule ({_RULE_NAMES.get(rule, rule)})" if library else "default (the rules)"
    if config.get("impl") == "tiled" and "BLOCK_M" in config:
        split = f", K in {config['SPLIT_K']} slices" if config.get("SPLIT_K", 1) > 1 else ""
        return (f"impl=tiled {config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} "
                f"(group {config['GROUP_M']}, {config['num_warps']} warps, {config['num_stages']} stages{split})")
    return ", ".join(f"{k}={v}" for k, v in sorted(config.items()))


def tuning_section(graphs: Sequence[GraphRecord]) -> Section:
    rows = []
    for g in graphs:
        for default, t in g.tuned.items():
            gain = f"{t['gain']:.2f}x" if t.get("gain") else "-"
            default_ms = f"{t['default_ms']:.4f}" if t.get("default_ms") else "-"
            library = t.get("kind") == "library"
            what = t.get("label", default) if library else default
            config = config_label(t["config"], library, t.get("rule", "onednn"))
            rows.append([g.title, what, config, default_ms, f"{t['ms']:.4f}", gain, t["source"]])
    kernels = sum(g.kernels for g in graphs)
    if not rows:
        return Section("Tuning", [f"No tuned choice used: all {kernels} kernel(s) use the generator's rules and "
                                  "every library call the fixed rule (`ember tune` measures and stores better "
                                  "configurations and implementations)."])
    library = sum(t.get("kind") == "library" for g in graphs for t in g.tuned.values())
    lines = [f"{len(rows) - library} of {kernels} kernel(s) compiled with a configuration from the tuning database, "
             f"{library} library call(s) with a measured implementation choice; gain is the measured time of the "
             "default (the rules) over the tuned choice's on this device."]
    return Section("Tuning", lines, [Table(["graph", "kernel / library call", "config", "default ms", "tuned ms",
                                            "gain", "from"], rows, numeric_from=3)])
