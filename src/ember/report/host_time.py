"""Host time per step, and what ran outside the CUDA graphs: the steady-state part of ``ember.explain``.

After the first call (which compiles), explain runs a few more steps of the same call: warm-up
steps (the CUDA-graph runner captures on a graph's second call and replays from its third), then
timed ones. While they run, every compiled program is wrapped with timers:

- *in Ember's programs*: time inside a compiled graph's call, split into CUDA-graph replays (the
  launch of one graph), uncaptured program runs (every kernel launched from Python, or on a CPU the
  whole computation) and Ember's runner around them (input copies, output handling);
- *outside Ember's programs*: the rest of the step on the host: Dynamo's guard checks, AOTAutograd's
  and the autograd engine's wrappers, and eager code between graphs (graph breaks).

Host time is measured without waiting for the device (that is what a step costs the host; a GPU
that is slower hides it); with CUDA tensors each step is also timed synchronised. The wrappers are
removed afterwards. Per graph: how many of its calls replayed, how many ran uncaptured, and why.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ember.report.html import Section, Table
from ember.report.records import GraphRecord


@dataclass
class GraphCalls:
    """One compiled graph's calls during the timed steps (times summed over them)."""

    title: str
    cudagraph: str  # the graph's CUDA-graph status after the steps ("captured ..." or "not captured: why")
    calls: int = 0
    replays: int = 0
    uncaptured: int = 0  # calls that ran the program itself (a graph never captured: every call)
    captures: int = 0  # captures during the timed steps (none in a steady state)
    in_graph_s: float = 0.0  # the whole call, runner included
    program_s: float = 0.0  # uncaptured program runs (and captures)
    replay_s: float = 0.0  # graph replays, launch only
    reason: str = ""  # why calls of a captured graph ran uncaptured (the runner's last reason)

    @property
    def runner_s(self) -> float:
        return max(0.0, self.in_graph_s - self.program_s - self.replay_s)

    @property
    def captured(self) -> bool:
        return self.cudagraph.startswith("captured")


@dataclass
class HostTimes:
    """What ``measure_steps`` saw: per-step times and each graph's calls."""

    warmup: int
    steps: int
    step_s: list[float] = field(default_factory=list)  # host time of each timed step
    synced_s: list[float] = field(default_factory=list)  # the same steps with the device synchronised
    graphs: list[GraphCalls] = field(default_factory=list)
    new_graphs: int = 0  # graphs compiled during the warm-up and timed steps (recompiles)

    @property
    def step_ms(self) -> float:
        """Mean host time per timed step (the breakdown below adds up to it)."""
        return 1e3 * statistics.fmean(self.step_s) if self.step_s else 0.0

    @property
    def median_step_ms(self) -> float:
        return 1e3 * statistics.median(self.step_s) if self.step_s else 0.0

    @property
    def synced_ms(self) -> float | None:
        return 1e3 * statistics.median(self.synced_s) if self.synced_s else None

    def per_step_ms(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.steps)

    @property
    def in_programs_ms(self) -> float:
        return self.per_step_ms(sum(g.in_graph_s for g in self.graphs))

    @property
    def outside_ms(self) -> float:
        """Host time per step outside Ember's programs (mean over the timed steps)."""
        return max(0.0, self.step_ms - self.in_programs_ms)

    def outside_graphs(self) -> list[str]:
        """What ran outside the CUDA graphs, one line each."""
        out = []
        for g in self.graphs:
            if not g.calls:
                continue
            if not g.captured:
                out.append(f"{g.title}: {g.cudagraph} ({g.calls // max(1, self.steps)} call(s) per step, "
                           f"{self.per_step_ms(g.program_s):.2f} ms per step in the program)")
            elif g.uncaptured or g.captures:
                why = f": {g.reason}" if g.reason else ""
                out.append(f"{g.title}: captured, but {g.uncaptured} of {g.calls} call(s) ran uncaptured and "
                           f"{g.captures} captured again during the timed steps{why}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "warmup_steps": self.warmup, "timed_steps": self.steps,
            "step_host_ms": self.step_ms, "step_host_median_ms": self.median_step_ms,
            "step_synchronised_median_ms": self.synced_ms,
            "in_programs_ms": self.in_programs_ms, "outside_programs_ms": self.outside_ms,
            "replay_ms": self.per_step_ms(sum(g.replay_s for g in self.graphs)),
            "program_ms": self.per_step_ms(sum(g.program_s for g in self.graphs)),
            "runner_ms": self.per_step_ms(sum(g.runner_s for g in self.graphs)),
            "new_graphs": self.new_graphs, "outside_graphs": self.outside_graphs(),
            "graphs": [{"title": g.title, "cudagraph": g.cudagraph, "calls": g.calls, "replays": g.replays,
                        "uncaptured": g.uncaptured, "captures": g.captures,
                        "in_graph_ms": self.per_step_ms(g.in_graph_s), "program_ms": self.per_step_ms(g.program_s),
                        "replay_ms": self.per_step_ms(g.replay_s), "runner_ms": self.per_step_ms(g.runner_s),
                        "reason": g.reason} for g in self.graphs],
        }


def _add_time(entry: GraphCalls, attr: str, fn: Callable) -> Callable:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            setattr(entry, attr, getattr(entry, attr) + time.perf_counter() - start)
    return timed


@contextmanager
def _timers(programs: list[tuple[GraphRecord, Any]]) -> Iterator[list[tuple[GraphCalls, Any]]]:
    """Timers around every program's call, its runner's program runs and its backend's replays."""
    from ember.runtime.cudagraphs.runner import CudaGraphRunner

    entries: list[tuple[GraphCalls, Any]] = []
    undo: list[Callable[[], None]] = []
    current: list[GraphCalls | None] = [None]  # the graph being called: a backend may serve several runners
    wrapped_backends: set[int] = set()
    try:
        for record, graph in programs:
            entry = GraphCalls(record.title, record.cudagraph)
            runner = graph.run
            entries.append((entry, runner if isinstance(runner, CudaGraphRunner) else None))
            undo.append(lambda g=graph, r=runner: setattr(g, "run", r))

            def call(args: list, entry: GraphCalls = entry, runner: Callable = runner) -> Any:
                outer, current[0] = current[0], entry
                entry.calls += 1
                start = time.perf_counter()
                try:
                    return runner(args)
                finally:
                    entry.in_graph_s += time.perf_counter() - start
                    current[0] = outer
            graph.run = call
            if not isinstance(runner, CudaGraphRunner):
                continue
            program = runner.run
            runner.run = _add_time(entry, "program_s", program)
            undo.append(lambda r=runner, p=program: setattr(r, "run", p))
            backend = runner.backend
            if id(backend) not in wrapped_backends:
                wrapped_backends.add(id(backend))
                replay = backend.replay

                def timed_replay(*args: Any, replay: Callable = replay) -> Any:
                    start = time.perf_counter()
                    try:
                        return replay(*args)
                    finally:
                        if current[0] is not None:
                            current[0].replay_s += time.perf_counter() - start
                own = backend.__dict__.get("replay")  # an instance attribute of its own, if any
                backend.replay = timed_replay
                undo.append(lambda b=backend, own=own: b.__dict__.update(replay=own) if own is not None
                            else b.__dict__.pop("replay", None))
        yield entries
    finally:
        for step in reversed(undo):
            step()


def measure_steps(step: Callable[[], None], programs: Callable[[], list[tuple[GraphRecord, Any]]],
                  steps: int, warmup: int = 2, synchronize: Callable[[], None] | None = None) -> HostTimes:
    """Run ``step`` ``warmup`` times, then ``steps`` times with every compiled program timed.
    ``programs()``: the (record, CompiledGraph) pairs compiled so far."""
    result = HostTimes(warmup=warmup, steps=steps)
    before = len(programs())
    for _ in range(warmup):
        step()
    from ember.runtime.cpu_compile import wait_behind
    if not wait_behind(timeout=0.0):  # CPU kernels still compiling (runtime/aten_first.py): time them, not ATen
        wait_behind()
        step()
    with _timers(programs()) as entries:
        counts = [(r.replays, r.uncaptured, r.captures) if r is not None else None for _, r in entries]
        for _ in range(steps):
            if synchronize is not None:
                synchronize()
            start = time.perf_counter()
            step()
            result.step_s.append(time.perf_counter() - start)
            if synchronize is not None:
                synchronize()
                result.synced_s.append(time.perf_counter() - start)
    for (entry, runner), count in zip(entries, counts):
        if runner is None or count is None:
            entry.uncaptured = entry.calls
            entry.program_s = entry.in_graph_s  # the program is the call
            continue
        entry.cudagraph = runner.status if runner.disabled is None else f"not captured: {runner.disabled}"
        entry.replays = runner.replays - count[0]
        entry.captures = runner.captures - count[2]
        # Calls that neither replayed nor captured ran the program (first calls, held outputs, deferrals).
        entry.uncaptured = max(0, entry.calls - entry.replays)
        if entry.uncaptured or entry.captures:
            entry.reason = runner.last_reason
    result.graphs = [entry for entry, _ in entries]
    result.new_graphs = len(programs()) - before
    return result


def host_time_section(host: HostTimes | None, graph_breaks: int, dynamo_graphs: int,
                      break_lines: list[str], note: str = "not measured") -> Section:
    """The report's section: host milliseconds per step and what ran outside the graphs."""
    heading = "Host time per step, and what ran outside the graphs"
    if host is None or not host.step_s:
        return Section(heading, [note[:1].upper() + note[1:] + "."])
    synced = (f"; synchronised with the device, median {host.synced_ms:.2f} ms" if host.synced_ms is not None
              else "")
    per = host.per_step_ms
    lines = [
        f"{host.steps} step(s) timed after {host.warmup} warm-up step(s) (the first call compiled). Host time per "
        f"step: mean {host.step_ms:.2f} ms, median {host.median_step_ms:.2f} ms{synced}. Means per step below.",
        f"In Ember's programs: {host.in_programs_ms:.2f} ms per step: CUDA-graph replays "
        f"{per(sum(g.replay_s for g in host.graphs)):.2f} ms, uncaptured program runs "
        f"{per(sum(g.program_s for g in host.graphs)):.2f} ms, Ember's runner around them "
        f"{per(sum(g.runner_s for g in host.graphs)):.2f} ms (input copies, output handling).",
        f"Outside Ember's programs: {host.outside_ms:.2f} ms per step (Dynamo's guard checks, AOTAutograd's "
        "and the autograd engine's wrappers, eager code between graphs).",
        "Outside the graphs:",
    ]
    outside = []
    if graph_breaks:
        outside.append(f"{graph_breaks} graph break(s): eager code runs between the {dynamo_graphs} Dynamo graphs")
        outside += [f"  {line}" for line in break_lines]
    outside += host.outside_graphs()
    if host.new_graphs:
        outside.append(f"{host.new_graphs} graph(s) compiled after the first call (recompiles): see Recompiles")
    lines += [f"  {line}" for line in outside] or ["  nothing: every call of every graph replayed a CUDA graph"]
    rows = [[g.title, "yes" if g.captured else "no", str(g.calls), str(g.replays), str(g.uncaptured),
             f"{per(g.in_graph_s):.3f}", f"{per(g.replay_s):.3f}", f"{per(g.program_s):.3f}",
             f"{per(g.runner_s):.3f}"] for g in host.graphs]
    table = Table(["graph", "CUDA graph", "calls", "replays", "uncaptured", "in graph ms/step", "replay ms/step",
                   "program ms/step", "runner ms/step"], rows, numeric_from=2,
                  caption=f"Per graph, over the {host.steps} timed step(s)")
    return Section(heading, lines, [table])
