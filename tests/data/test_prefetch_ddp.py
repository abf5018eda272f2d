"""ember.data.prefetch in a DDP loop: two processes (gloo, CPU), one DataLoader with a
DistributedSampler per process, each wrapped by its own prefetcher, the model in
DistributedDataParallel compiled by Ember."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
SAMPLES, BATCH, EPOCHS = 24, 3, 2  # 4 steps per rank and epoch, batches of equal size on both ranks

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available in this build")


class Net(nn.Module):
    # A module of this file, not nn.Sequential: Dynamo does not start a frame in torch.nn's own code.
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g),
                                          torch.randint(0, 3, (SAMPLES,), generator=g), torch.arange(SAMPLES))


def _fresh_model() -> Net:
    torch.manual_seed(1)
    return Net()


def _sampler(rank: int) -> torch.utils.data.DistributedSampler:
    return torch.utils.data.DistributedSampler(_dataset(), num_replicas=WORLD, rank=rank, shuffle=True, seed=7)


def _prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ember-prefetch"]


def _worker(rank: int, store: str, out: str) -> None:
    import ember

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        sampler = _sampler(rank)
        loader = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, sampler=sampler)
        model = nn.parallel.DistributedDataParallel(_fresh_model())
        compiled = ember.compile(model, target="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        seen, expected, iterators = [], [], []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            expected.append(list(sampler))
            fetcher = ember.data.prefetch(loader, device="cpu")
            it = iter(fetcher)
            iterators.append(it)
            for x, y, idx in it:
                seen.append(idx.tolist())
                loss = nn.functional.cross_entropy(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        alive = [it.alive for it in iterators]
        del it, iterators
        gc.collect()
        end = time.monotonic() + 5
        while _prefetch_threads() and time.monotonic() < end:
            time.sleep(0.01)
        graphs = [g.title for g in compiled._ember_backend.log.graphs]
        torch.save({"seen": seen, "expected": expected, "alive": alive, "threads": _prefetch_threads(),
                    "graphs": graphs, "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _reference(steps: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """One process over the union of both ranks' batches, step by step: DDP's averaged gradient
    of equal-size batches is the gradient of the mean loss over their union."""
    x, y, _ = _dataset().tensors
    model = _fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for per_rank in zip(*steps):
        idx = torch.tensor([i for batch in per_rank for i in batch])
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_each_rank_gets_its_shard_in_order_and_gradients_are_all_reduced(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, res in enumerate(results):
        # Exactly the sampler's indices, in order: nothing lost, duplicated or reordered.
        want = [ep[i:i + BATCH] for ep in res["expected"] for i in range(0, len(ep), BATCH)]
        assert res["seen"] == want, f"rank {rank}"
        assert res["alive"] == [False] * EPOCHS and res["threads"] == [], f"rank {rank}: {res}"
        assert res["graphs"], "ember compiled nothing under DDP"
    shards = [sorted(i for batch in res["seen"][:SAMPLES // WORLD // BATCH] for i in batch) for res in results]
    assert sorted(shards[0] + shards[1]) == list(range(SAMPLES))  # the ranks split an epoch between them
    reference = _reference([res["seen"] for res in results])
    for name, value in results[0]["params"].items():
        torch.testing.assert_close(results[1]["params"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
    # The steps changed the weights: equal parameters are not the initial ones.
    assert not torch.equal(results[0]["params"]["a.weight"], _fresh_model().state_dict()["a.weight"])
