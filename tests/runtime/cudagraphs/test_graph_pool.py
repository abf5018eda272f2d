"""Pre-sizing the memory pool of a model's training graphs (runtime/cudagraphs/pool.py): the decision
logic, on the CPU stand-in of the CUDA-graph backend (CI has no GPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from cudagraph_fakes import FakeGraphs, fake_runner, new_batch, runner_pair, train_step

from ember import config
from ember.runtime.cudagraphs.pool import GraphPool, PoolSizing


class CountingGraphs(FakeGraphs):
    """FakeGraphs with scripted allocator counters and a record of the reservations."""

    def __init__(self, counters: list[tuple[int, int]], fail_reserve: bool = False) -> None:
        super().__init__()
        self.counters = list(counters)
        self.reserved: list[tuple[object, int]] = []
        self.events: list[str] = []
        self.fail_reserve = fail_reserve

    def release_cached(self, device: torch.device) -> int:
        self.events.append("release")
        return 3 * 2**20

    @contextlib.contextmanager
    def first_call_pool(self, device: torch.device) -> Iterator[None]:
        self.events.append("first call in its own pool")
        yield
        self.events.append("pool handed back")

    def memory_counters(self, device: torch.device) -> tuple[int, int] | None:
        return self.counters.pop(0) if self.counters else None

    def reserve(self, pool: object, nbytes: int, device: torch.device) -> object:
        if self.fail_reserve:
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.reserved.append((pool, nbytes))
        self.events.append("reserve")
        return object()


# The first forward call begins at 100 allocated bytes (peak 100) and ends at peak 300; the first
# backward call ends at peak 450: the step needs 350 bytes above where it began.
STEP_COUNTERS = [(100, 100), (150, 300), (150, 300), (120, 450)]


def test_the_first_calls_measure_the_pool_and_the_first_capture_reserves_it() -> None:
    backend = CountingGraphs(STEP_COUNTERS)
    fw, bw, pool = runner_pair(backend)
    w = torch.randn(8, 4)
    train_step(fw, bw, w)  # uncaptured: measured
    assert pool.sizing.need == 350 and not backend.reserved
    for _ in range(3):
        train_step(fw, bw, w)
    assert fw.captures == bw.captures == 1
    assert backend.reserved == [(pool.state.handle, 350)]  # once, into the pool both graphs use
    assert backend.pools[0] is backend.pools[1] is pool.state.handle
    assert pool.state.keeper is not None
    # each first call runs in a pool of its own, handed back after it; cached memory is released
    # after each first call, before the reservation and after each capture
    first_call = ["first call in its own pool", "pool handed back", "release"]
    assert backend.events == [*first_call, *first_call, "release", "reserve", "release", "release"]
    assert pool.sizing.released == 15 * 2**20
    assert "pre-sized to" in fw.status and "pre-sized to" in bw.status
    assert "15 MiB of cached memory released after first calls and captures" in bw.status


def test_a_renewed_pool_is_reserved_again() -> None:
    backend = CountingGraphs(STEP_COUNTERS)
    fw, bw, pool = runner_pair(backend)
    w = torch.randn(8, 4)
    train_step(fw, bw, w)
    train_step(fw, bw, w)
    pool.renew()
    for _ in range(2):
        train_step(fw, bw, w)
    assert [n for _, n in backend.reserved] == [350, 350]
    assert backend.reserved[0][0] is not backend.reserved[1][0]


@pytest.mark.parametrize("case", ["no new peak", "switched off", "reserve fails", "no counters"])
def test_no_reservation_and_the_reason(case: str) -> None:
    counters = {"no new peak": [(100, 900), (150, 900), (150, 900), (120, 900)], "no counters": []}
    backend = CountingGraphs(counters.get(case, STEP_COUNTERS), fail_reserve=case == "reserve fails")
    with config.patch(**({"pool_presize": False} if case == "switched off" else {})):
        fw, bw, pool = runner_pair(backend)
        w = torch.randn(8, 4)
        for _ in range(3):
            train_step(fw, bw, w)  # results still match eager (checked in train_step)
    assert fw.captures == bw.captures == 1 and not backend.reserved and pool.state.keeper is None
    # after each first call, before the pool's first capture and after each capture, pre-sized or not
    assert [e for e in backend.events if e in ("release", "reserve")] == ["release"] * 5
    note = {"no new peak": "set no new allocation peak", "switched off": "EMBER_POOL_PRESIZE=0",
            "reserve fails": "reserving 0 MiB failed (OutOfMemoryError)", "no counters": ""}[case]
    assert note in pool.describe(), pool.describe()


def test_the_measurement_keeps_the_largest_rise() -> None:
    s = PoolSizing()
    s.begin((10, 10))
    s.begin((50, 60))  # only the first call's start counts
    s.end((40, 100))
    s.end((40, 80))  # a lower peak later changes nothing
    assert s.window == (10, 10) and s.need == 90


def test_parameter_only_values_are_made_before_the_measured_first_call() -> None:
    """An inference program's parameter-only values (bf16 weights under autocast) live as long as
    the model: made inside the first call, they stayed in its private pool and counted in the
    graph pool's need. They are made first, outside that pool and before the counters are read."""
    backend = CountingGraphs([(100, 100), (120, 130)])
    w = torch.randn(8, 4)
    made: list[str] = []

    def refresh_frozen(args: list, addresses_known: bool = False) -> bool:
        made.append(backend.events[-1] if backend.events else "before anything")
        return False

    def program(args: list) -> tuple:
        x, weight = args
        args.clear()
        return (torch.tanh(x @ weight),)

    program.refresh_frozen = refresh_frozen  # type: ignore[attr-defined]
    runner = fake_runner(program, backend)
    runner.pool = GraphPool(training=False)
    x = new_batch()
    (out,) = runner([x, w])
    torch.testing.assert_close(out, torch.tanh(x @ w))
    assert made == ["before anything"]  # not inside "first call in its own pool"
    assert backend.counters == [] and runner.pool.sizing.need == 30  # counters read after the values were made
    for _ in range(3):
        x = new_batch()
        (out,) = runner([x, w])
        torch.testing.assert_close(out, torch.tanh(x @ w))
    assert runner.replays == 2 and [n for _, n in backend.reserved] == [30]
