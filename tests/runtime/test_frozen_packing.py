"""Parameter-only values packed into one buffer (runtime/frozen.pack_device_values).

The packing is for the CUDA caching allocator; on the CPU (CI) the same code runs with the CPU
added to the device types it packs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.runtime import frozen
from ember.runtime.frozen import FrozenValues, pack_device_values


@pytest.fixture
def pack_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frozen, "PACKED_DEVICE_TYPES", ("cuda", "cpu"))


def _assert_packed(before: tuple, after: tuple, moved: frozenset[int]) -> None:
    spans = []
    for i, (a, b) in enumerate(zip(before, after)):
        if not isinstance(a, torch.Tensor):
            assert b is a
            continue
        assert (b.shape, b.stride(), b.dtype) == (a.shape, a.stride(), a.dtype)
        assert torch.equal(a, b)
        if i in moved:
            offset = b.data_ptr() - b.untyped_storage().data_ptr()
            assert offset % 512 == 0  # the alignment a block of its own would have
            spans.append((offset, offset + frozen._span(b)))
        else:
            assert b is a
    bases = {after[i].untyped_storage().data_ptr() for i in moved}
    assert len(bases) <= 1  # one buffer
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two values overlap


def test_values_keep_sizes_strides_and_contents_in_one_buffer(pack_on_cpu: None) -> None:
    torch.manual_seed(0)
    param = torch.randn(8, 3)
    transposed = torch.empty_strided((4, 6), (1, 4)).normal_()  # dense, not contiguous, no base
    channels_last = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)
    whole = torch.randn(7, 9).to(torch.bfloat16)
    values = (whole, transposed, 3, channels_last, torch.randn(1), torch.randint(0, 9, (5,)))
    packed, moved = pack_device_values(values, [param])
    assert moved == {0, 1, 3, 4, 5}
    _assert_packed(values, packed, moved)


def test_values_that_share_memory_stay_where_they_are(pack_on_cpu: None) -> None:
    torch.manual_seed(0)
    param, own, other = torch.randn(6, 4), torch.randn(5, 5), torch.randn(3, 3)
    view_of_own = own[1:]  # shares own's memory: moving own apart would split them
    values = (param, own, view_of_own, other, param.t(), torch.randn(2, 2))
    packed, moved = pack_device_values(values, [param])
    assert moved == {3, 5}
    _assert_packed(values, packed, moved)
    assert packed[0] is param and packed[4] is values[4]


def test_nothing_packed_off_the_packed_devices() -> None:
    values = (torch.randn(3, 3), torch.randn(4))
    packed, moved = pack_device_values(values, [])
    assert moved == frozenset() and all(a is b for a, b in zip(values, packed))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=0, max_size=4),
                          st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]),
                          st.booleans()), min_size=1, max_size=6))
def test_packing_keeps_every_value(specs: list) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frozen, "PACKED_DEVICE_TYPES", ("cuda", "cpu"))
        _pack_and_check(specs)


def _pack_and_check(specs: list) -> None:
    values = []
    for shape, dtype, permute in specs:
        t = (torch.randn(shape) * 10).to(dtype)
        if permute and t.dim() > 1:  # a dense layout that is not row-major, owning its memory
            order = list(reversed(range(t.dim())))
            layout = t.permute(*order).contiguous().permute(*order).stride()
            t = torch.empty_strided(t.shape, layout, dtype=dtype).copy_(t)
        values.append(t)
    values_t = tuple(values)
    packed, moved = pack_device_values(values_t, [])
    assert len(moved) == (len(values_t) if len(values_t) >= 2 else 0)
    _assert_packed(values_t, packed, moved)


def test_frozen_values_refresh_into_the_packed_buffer(pack_on_cpu: None) -> None:
    """A parameter changed in place: the values are recomputed into the same addresses (a captured
    graph reads them there); a parameter of another shape moves them."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(4, 8), torch.randn(8, 2)

    def prepare(a: torch.Tensor, b: torch.Tensor) -> tuple:
        return a.to(torch.bfloat16), b.t().contiguous() * 2

    values = FrozenValues()
    first = values(prepare, w1, w2)
    assert values.packed == {0, 1}
    addresses = [t.data_ptr() for t in first]
    assert first[0].untyped_storage().data_ptr() == first[1].untyped_storage().data_ptr()
    with torch.no_grad():
        w1.mul_(3)
        w2.add_(1)
    second = values(prepare, w1, w2)
    assert [t.data_ptr() for t in second] == addresses and values.moved == 0
    for got, want in zip(second, prepare(w1, w2)):
        assert torch.equal(got, want)
    third = values(prepare, w1, torch.randn(8, 3))
    assert values.moved == 1 and third[1].shape == (3, 8)
