"""ember.data.prefetch on the CPU: order, nesting, transforms, errors, shutdown, overlap."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections import namedtuple

import pytest
import torch

import ember
from ember.data import DevicePrefetcher, prefetch
from ember.data.prefetch import resolve_device

Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    tag: str


def _batches(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        out.append({
            "pair": Pair(torch.randn(2, 3, 4, 4, generator=g), torch.tensor([i, i + 1])),
            "list": [torch.randint(0, 9, (3,), generator=g), "name", i, None],
            "nested": ({"deep": torch.randn(5, generator=g)}, 2.5),
            "sample": Sample(torch.randn(2, generator=g), f"s{i}"),
        })
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def _wait_threads(baseline: int, timeout: float = 5.0) -> int:
    gc.collect()
    end = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < end:
        time.sleep(0.01)
        gc.collect()
    return threading.active_count()


def _jittery(items: list, seed: int = 1):
    """A generator that takes a random time per batch, so the producer and consumer interleave."""
    g = torch.Generator().manual_seed(seed)
    for item in items:
        time.sleep(float(torch.rand(1, generator=g)) * 0.004)
        yield item


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_every_batch_once_in_order_nested(depth: int) -> None:
    items = _batches(30)
    g = torch.Generator().manual_seed(2)
    out = []
    for batch in prefetch(_jittery(items), device="cpu", depth=depth):
        time.sleep(float(torch.rand(1, generator=g)) * 0.004)
        out.append(batch)
    assert len(out) == len(items)
    assert all(_same(a, b) for a, b in zip(out, items))
    assert [b["list"][2] for b in out] == list(range(30))


def test_dataloader_unchanged_and_epochs() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=False)
    pre = prefetch(loader, device="cpu")
    assert len(pre) == len(loader) == 7
    for _epoch in range(2):  # every iter() is a new pass, as with the DataLoader
        got = list(pre)
        want = list(loader)
        assert len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))


def test_dataloader_with_workers() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(64.0).view(32, 2), torch.arange(32))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    got = list(prefetch(loader, device="cpu", depth=3))
    assert torch.equal(torch.cat([y for _, y in got]), torch.arange(32))


def test_distributed_sampler_one_loader_per_rank() -> None:
    """DDP-style: each rank's loader (a DistributedSampler shard) through its own prefetcher."""
    ds = torch.utils.data.TensorDataset(torch.arange(24))
    seen = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)
        eager = [b[0] for b in loader]
        got = [b[0] for b in prefetch(loader, device="cpu")]
        assert all(torch.equal(a, b) for a, b in zip(got, eager)) and len(got) == len(eager)
        seen.append(torch.cat(got))
    assert sorted(torch.cat(seen).tolist()) == list(range(24))


def test_transforms_match_eager() -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    feats = torch.randn(4, 7, generator=g)
    mean, std = [120.0, 110.0, 100.0], [60.0, 55.0, 50.0]
    seen = []

    def user(batch: dict) -> dict:
        seen.append(batch["image"].dtype)
        return {**batch, "extra": batch["label"] * 2}

    (out,) = list(prefetch([{"image": images, "label": labels, "feats": feats, "id": "a"}], device="cpu",
                           dtype=torch.bfloat16, normalize=(mean, std), channels_last=True, transform=user))
    want = ((images.float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1))
    assert out["image"].dtype == torch.bfloat16 and seen == [torch.bfloat16]
    assert out["image"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out["image"].float(), want.bfloat16().float(), rtol=0, atol=0)
    assert torch.equal(out["label"], labels) and out["label"].dtype == torch.int64  # labels kept
    assert out["feats"].dtype == torch.bfloat16 and torch.equal(out["feats"], feats.bfloat16())
    assert torch.equal(out["extra"], labels * 2) and out["id"] == "a"


def test_normalize_only_gives_float32_and_rejects_wrong_channels() -> None:
    images = torch.full((2, 3, 2, 2), 200, dtype=torch.uint8)
    (out,) = list(prefetch([images], device="cpu", normalize=(100.0, 50.0)))
    assert out.dtype == torch.float32 and torch.all(out == 2.0)
    with pytest.raises(ValueError, match="one per channel"):
        list(prefetch([images], device="cpu", normalize=([1.0, 2.0], [1.0, 2.0])))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="depth"):
        prefetch([], device="cpu", depth=0)
    with pytest.raises(ValueError, match="floating-point"):
        prefetch([], device="cpu", dtype=torch.int32)
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device(None) == torch.device("cpu") and resolve_device("auto") == torch.device("cpu")


class _Boom(Exception):
    pass


def _raising(n_good: int, exc: BaseException):
    for i in range(n_good):
        yield torch.tensor([i])
    raise exc


def _run(iterable) -> tuple[list[int], BaseException | None]:
    got: list[int] = []
    try:
        for b in iterable:
            got.append(int(b[0]))
    except BaseException as err:  # noqa: BLE001
        return got, err
    return got, None


@pytest.mark.parametrize("exc", [ValueError("bad batch 5"), _Boom("custom", 3), KeyError("k")])
def test_loader_exception_reaches_user_unchanged_at_the_same_step(exc: BaseException) -> None:
    baseline = threading.active_count()
    eager_got, eager_err = _run(_raising(5, exc))
    got, err = _run(prefetch(_raising(5, exc), device="cpu", depth=3))
    assert got == eager_got == [0, 1, 2, 3, 4]
    assert type(err) is type(eager_err) and str(err) == str(eager_err) and err.args == eager_err.args
    assert _wait_threads(baseline) == baseline


def test_dataset_exception_through_dataloader_same_as_eager() -> None:
    class Bad(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 6:
                raise IndexError(f"cannot read item {i}")
            return torch.tensor(i)

    loader = torch.utils.data.DataLoader(Bad(), batch_size=2)
    eager_got, eager_err = _run(loader)
    got, err = _run(prefetch(loader, device="cpu"))
    assert got == eager_got and type(err) is type(eager_err) and str(err) == str(eager_err)


def test_error_in_iter_raises_at_iter() -> None:
    class NoIter:
        def __iter__(self):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        iter(prefetch(NoIter(), device="cpu"))


def test_transform_exception_reaches_user() -> None:
    def fail_on_3(x: torch.Tensor) -> torch.Tensor:
        if int(x[0]) == 3:
            raise ArithmeticError("transform failed on 3")
        return x

    got, err = _run(prefetch([torch.tensor([i]) for i in range(6)], device="cpu", transform=fail_on_3))
    assert got == [0, 1, 2] and isinstance(err, ArithmeticError) and str(err) == "transform failed on 3"


def test_threads_end_on_break_close_exhaustion_and_gc() -> None:
    baseline = threading.active_count()
    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield torch.tensor([i])
                i += 1
        finally:
            closed.append(True)  # a break in an eager loop closes the generator too

    for b in prefetch(endless(), device="cpu", depth=2):
        if int(b[0]) == 3:
            break
    assert _wait_threads(baseline) == baseline and closed == [True]

    it = iter(prefetch(endless(), device="cpu"))
    next(it)
    assert threading.active_count() == baseline + 1 and it.alive
    it.close()
    assert not it.alive and threading.active_count() == baseline
    with pytest.raises(StopIteration):
        next(it)

    it = iter(prefetch(endless(), device="cpu"))
    next(it)
    del it  # collected with batches queued and the producer blocked on a full queue
    assert _wait_threads(baseline) == baseline

    list(prefetch([torch.zeros(1)] * 3, device="cpu"))
    assert _wait_threads(baseline) == baseline


def test_stays_depth_ahead() -> None:
    made = []

    def counting():
        for i in range(100):
            made.append(i)
            yield torch.tensor([i])

    for depth in (1, 3):
        made.clear()
        it = iter(prefetch(counting(), device="cpu", depth=depth))
        next(it)
        time.sleep(0.3)
        # depth batches ready in the queue, one more made and waiting for room
        assert len(made) == 1 + depth + 1
        it.close()


def test_overlap_hides_the_shorter_of_data_and_compute() -> None:
    """Loader and step each sleep 40 ms: eager takes their sum, prefetched about the max."""
    steps, cost = 8, 0.04

    def slow():
        for i in range(steps + 1):
            time.sleep(cost)
            yield torch.tensor([i])

    def timed(iterable) -> float:
        it = iter(iterable)
        next(it)  # the first batch cannot overlap anything
        t0 = time.perf_counter()
        for _ in it:
            time.sleep(cost)
        return (time.perf_counter() - t0) / steps

    eager = timed(slow())
    pre = timed(prefetch(slow(), device="cpu"))
    assert eager > 1.8 * cost
    assert pre < 1.35 * cost, f"prefetched step {pre * 1e3:.1f} ms, eager {eager * 1e3:.1f} ms"


def test_public_names() -> None:
    assert ember.data.prefetch is prefetch and ember.data.DevicePrefetcher is DevicePrefetcher
    assert "DevicePrefetcher" in repr(prefetch([], device="cpu"))


def test_cpu_producer_runs_one_intra_op_thread_and_the_step_keeps_its_own() -> None:
    """A second OpenMP team in the producer would compete with the step's on every core."""
    before = torch.get_num_threads()
    seen = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return x

    for _ in prefetch([torch.zeros(2)] * 3, device="cpu", transform=record):
        assert torch.get_num_threads() == before
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == before
