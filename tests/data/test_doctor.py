"""The starvation doctor's verdict on hand-made input-bound and compute-bound loops."""

from __future__ import annotations

import time

import pytest
import torch

import ember
from ember.data import StepTimer, doctor, prefetch


class SlowItems(torch.utils.data.Dataset):
    """Each item costs ``cost`` seconds to make (a stand-in for reading and decoding)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.cost)
        return torch.tensor(i)


def _loop(iterable, step_s: float) -> list[int]:
    seen = []
    for b in iterable:
        seen.extend(b.flatten().tolist())
        time.sleep(step_s)
    return seen


def test_input_bound_loader_slower_than_step() -> None:
    loader = torch.utils.data.DataLoader(SlowItems(7, 0.04), batch_size=1, num_workers=0)
    doc = doctor(loader, sync=False)
    assert _loop(doc, 0.005) == list(range(7))  # same batches as the loader
    rep = doc.report()
    assert rep.verdict == "input-bound" and rep.steps == 6
    assert rep.wait_share > 0.6 and rep.headline.startswith("input-bound: ")
    assert rep.headline.endswith("% of step time waiting for data")
    assert rep.wait_ms > rep.compute_ms
    text = " ".join(rep.advice)
    assert "num_workers=" in text and "ember.data.prefetch" in text


def test_compute_bound_step_slower_than_loader() -> None:
    loader = torch.utils.data.DataLoader(SlowItems(7, 0.008), batch_size=1, num_workers=0)
    doc = doctor(loader, sync=False)
    _loop(doc, 0.04)
    rep = doc.report()
    assert rep.verdict == "compute-bound" and rep.headline.startswith("compute-bound: ")
    assert 0.03 < rep.wait_share < 0.5
    # The wait is real but shorter than the step: prefetching hides it, and the advice says so.
    assert any("would hide" in a for a in rep.advice)


def test_prefetched_compute_bound_waits_nothing() -> None:
    pre = prefetch(torch.utils.data.DataLoader(SlowItems(8, 0.01), batch_size=1), device="cpu")
    doc = doctor(pre, sync=False)
    assert _loop(doc, 0.04) == list(range(8))
    rep = doc.report()
    assert rep.verdict == "compute-bound" and rep.wait_share < 0.1
    assert rep.data_ms is not None and 8 < rep.data_ms < 40  # the prefetch thread's loader calls
    assert rep.facts["prefetcher"] == {"depth": 2, "device": "cpu"}


def test_prefetched_input_bound_when_loader_is_slower() -> None:
    pre = prefetch(torch.utils.data.DataLoader(SlowItems(7, 0.04), batch_size=1), device="cpu")
    doc = doctor(pre, sync=False)
    _loop(doc, 0.005)
    rep = doc.report()
    assert rep.verdict == "input-bound" and rep.wait_share > 0.5
    assert not any("ember.data.prefetch(loader" in a for a in rep.advice)  # it is already prefetched


def test_report_dict_text_and_break() -> None:
    doc = doctor([torch.tensor([i]) for i in range(10)], sync=False, warmup=1)
    for b in doc:
        time.sleep(0.002)
        if int(b[0]) == 5:
            break
    rep = doc.report()
    assert rep.steps == 4  # steps 2..5: the first of the pass apart, one warm-up left out
    d = rep.to_dict()
    assert {"verdict", "headline", "wait_share", "step_ms", "wait_ms", "compute_ms", "advice", "facts"} <= d.keys()
    text = str(rep)
    assert rep.headline in text and "share of step time waiting" in text and "compute ms" in text


def test_step_timer_by_hand() -> None:
    timer = StepTimer(sync=False)
    for _ in range(4):
        with timer.waiting():
            time.sleep(0.03)
        with timer.computing():
            time.sleep(0.005)
    rep = timer.report()
    assert rep.verdict == "input-bound" and rep.steps == 4
    assert StepTimer(sync=False).report().verdict == "no steps"


def test_advice_for_workers_already_using_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    doctor_module = sys.modules["ember.data.doctor"]  # the module; ember.data.doctor is the function
    monkeypatch.setattr(doctor_module, "_cores", lambda: 2)
    loader = torch.utils.data.DataLoader(SlowItems(4, 0.0), batch_size=1, num_workers=2)
    timer = StepTimer(sync=False)
    for _ in range(3):
        timer.add(0.03, 0.01)
    rep = timer.report(loader)
    assert rep.verdict == "input-bound"
    assert any("already uses all 2 cores" in a for a in rep.advice)
    assert any("prefetch_factor=4" in a for a in rep.advice)
    assert ember.data.doctor is doctor
