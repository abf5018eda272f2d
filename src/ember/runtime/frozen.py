"""Values a program derives from parameters alone, computed once and kept while they stay valid."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's data address (one C call per tensor, no Python method lookups)."""
    return list(map(_DATA_PTR, tensors))


def param_state(params: Sequence[object]) -> tuple[list, list]:
    """(addresses, versions) of ``params``: a new tensor, an in-place update (optimizer step,
    ``copy_`` under no_grad, load_state_dict) or a reassigned parameter changes one of them.
    Read through map, one C call per tensor and no tuples per element: 320 parameters of a
    ResNet-50 in 28 us on the CI CPU instead of 36 (checked before every replay)."""
    try:
        return addresses(params), list(map(_VERSION, params))  # type: ignore[arg-type]
    except (TypeError, AttributeError):  # not all tensors: a non-tensor by identity
        return ([t.data_ptr() if isinstance(t, torch.Tensor) else id(t) for t in params],
                [t._version if isinstance(t, torch.Tensor) else None for t in params])


class FrozenValues:
    """``frozen(prepare, *params)`` -> ``prepare(*params)``, recomputed only when a param changed."""

    def __init__(self) -> None:
        self.addresses: list | None = None  # param_state of the params the values were computed from
        self.versions: list | None = None
        self.values: tuple = ()
        self.computed = 0  # how often ``prepare`` ran (explain and tests read it)
        self.moved = 0  # how often the values were recomputed at new addresses (not in place)
        self.packed: frozenset[int] = frozenset()  # indices of values that are views of one packed buffer

    def valid(self, params: Sequence[object], addresses_known: bool = False) -> bool:
        """Whether the values were computed from ``params`` as they are now. ``addresses_known``:
        the caller has just checked that every param lies where it lay (a CUDA-graph replay's
        check of its static inputs), so only the version counters are read."""
        if self.versions is None:
            return False
        try:
            if list(map(_VERSION, params)) != self.versions:
                return False
            return addresses_known or addresses(params) == self.addresses  # type: ignore[arg-type]
        except (TypeError, AttributeError):
            return param_state(params) == (self.addresses, self.versions)

    def __call__(self, prepare: Callable[..., tuple], *params: object) -> tuple:
        return self.get(prepare, params)

    def get(self, prepare: Callable[..., tuple], params: Sequence[object], addresses_known: bool = False) -> tuple:
        if not self.valid(params, addresses_known):
            self.versions = None  # a failing prepare must not leave stale values marked valid
            with torch.no_grad():
                values = prepare(*params)
                if _same_layout(values, self.values, self.packed):
                    # Where the old values were: a captured CUDA graph reads them at their addresses.
                    torch._foreach_copy_([o for o in self.values if isinstance(o, torch.Tensor)],
                                         [v for v in values if isinstance(v, torch.Tensor)])
                else:
                    self.moved += bool(self.values)
                    self.values, self.packed = pack_device_values(values, params)
            self.addresses, self.versions = param_state(params)
            self.computed += 1
        return self.values

    def refresh(self, prepare: Callable[..., tuple], params: Sequence[object], addresses_known: bool = False) -> bool:
        """Recompute if a parameter changed; True when the values now lie elsewhere (a CUDA graph
        that read the old ones must be captured again)."""
        moved = self.moved
        self.get(prepare, params, addresses_known)
        return self.moved != moved


def _same_layout(new: tuple, old: tuple, packed: frozenset[int] = frozenset()) -> bool:
    """Whether ``new`` can be copied into ``old`` tensor by tensor (a parameter changed in place).
    ``packed``: indices of old values that are views of the packed buffer, each its own span."""
    if len(new) != len(old) or not old:
        return False
    for i, (a, b) in enumerate(zip(new, old)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if a != b:
                return False
            continue
        if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype or a.device != b.device:
            return False
        if i not in packed and (a.storage_offset() != b.storage_offset() or a._base is not None
                                or b._base is not None):
            return False
    return True


PACKED_DEVICE_TYPES = ("cuda",)  # the caching allocator's segments are what packing is for (tests add "cpu")
_ALIGN = 512  # the caching allocator's block alignment: each value keeps the alignment it had


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (non-negative strides)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 62


def _packable(t: object) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type in PACKED_DEVICE_TYPES and type(t) is torch.Tensor
            and t.layout == torch.strided and t.numel() > 0 and t._base is None and t.storage_offset() == 0
            and all(st >= 0 for st in t.stride()) and _span(t) == t.untyped_storage().nbytes())


def pack_device_values(values: tuple, params: Sequence[object]) -> tuple[tuple, frozenset[int]]:
    """``values`` with its CUDA tensors moved into one buffer per device, each at its own aligned
    span with its size and strides; returns (values, indices moved).

    Made one by one, parameter-only values (a model's bf16 weight casts under autocast) fill
    20 MiB segments of the caching allocator with blocks of 1-10 MiB and leave a hole at each
    segment's end that nothing allocates once the graphs replay (40 MiB of the 634 MiB the
    default pool reserved for bert at batch 1 on an H200, which put Ember's reserved memory
    above eager's). One buffer is one segment of its exact size. Values that share memory
    with each other or with a parameter stay where they are. The old blocks are freed here; the
    caller's release of cached memory hands their segments back. When the device lacks room for
    a second copy they stay as they are."""
    if not any(isinstance(t, torch.Tensor) and t.device.type in PACKED_DEVICE_TYPES for t in values):
        return values, frozenset()
    users: dict[int, int] = {}  # storage address -> how many values and parameters use it
    for t in (*values, *params):
        if isinstance(t, torch.Tensor) and t.device.type in PACKED_DEVICE_TYPES and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            users[ptr] = users.get(ptr, 0) + 1
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(values):
        if _packable(t) and users[t.untyped_storage().data_ptr()] == 1:
            by_device.setdefault(t.device, []).append(i)
    out = list(values)
    moved: list[int] = []
    for device, idx in by_device.items():
        if len(idx) < 2:
            continue
        offsets, total = [], 0
        for i in idx:
            offsets.append(total)
            total += -(-_span(values[i]) // _ALIGN) * _ALIGN
        if _free_bytes(device) < 2 * total:  # packing is for memory: never the reason a compile runs out of it
            continue
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        for i, off in zip(idx, offsets):
            src = values[i]
            view = buffer[off:off + _span(src)].view(src.dtype).as_strided(src.shape, src.stride())
            view.copy_(src)
            out[i] = view
        moved += idx
    return tuple(out), frozenset(moved)
