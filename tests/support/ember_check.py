"""Shared helpers for the codegen tests: inputs of any layout, Ember-vs-eager comparison.

Not a test module (no ``test_`` prefix); the test files import it from their own folder
(pytest's default ``prepend`` import mode puts ``tests/codegen`` on ``sys.path``).

Every comparison runs ``ember.compile(fn, target="triton-interpret")`` in strict mode
(internal compile errors raise instead of falling back to ATen), resets Dynamo first, and
asserts that the ops really went into generated Triton kernels.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from hypothesis import strategies as st

import ember
from ember import config

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "transposed", "permuted", "channels_last", "sliced", "offset", "expanded")


# -- environment -------------------------------------------------------------------------------

@contextlib.contextmanager
def strict_env(looped: bool = False, persistent_max: int = 16, loop_rblock: int = 8) -> Iterator[None]:
    """Strict mode and, with ``looped``, tiny reduction blocks (forces the looped path)."""
    blocks = {"persistent_rblock_max": persistent_max, "loop_rblock": loop_rblock} if looped else {}
    torch._dynamo.reset()
    try:
        with config.patch(strict=True, **blocks):
            yield
    finally:
        torch._dynamo.reset()


# -- inputs ------------------------------------------------------------------------------------

def random_values(shape: Sequence[int], dtype: torch.dtype, kind: str = "normal",
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh random values (never all zeros). kind: normal | positive | int | bool | unit."""
    shape = tuple(shape)
    if dtype == torch.bool or kind == "bool":
        return (torch.rand(shape, generator=generator) > 0.5).to(dtype)
    if not dtype.is_floating_point or kind == "int":
        return torch.randint(-6, 7, shape, generator=generator).to(dtype)
    if kind == "positive":
        t = torch.rand(shape, generator=generator, dtype=torch.float32) * 2.0 + 0.25
    elif kind == "unit":
        t = torch.rand(shape, generator=generator, dtype=torch.float32) * 1.8 - 0.9
    else:
        t = torch.randn(shape, generator=generator, dtype=torch.float32)
    return t.to(dtype)


def make_input(shape: Sequence[int], layout: str, dtype: torch.dtype = torch.float32, kind: str = "normal",
               perm: Sequence[int] | None = None, expand_dims: Sequence[int] = (),
               requires_grad: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` whose memory layout is ``layout`` (see LAYOUTS).

    transposed: last two dims swapped in memory; permuted: memory order ``perm`` (a random
    permutation); channels_last: 4-D NHWC; sliced: every other element of a larger buffer along
    each dim >= 2 (or a column slice); offset: a slice with a storage offset; expanded: size-1
    dims in ``expand_dims`` (or the first dim) broadcast with stride 0.
    """
    shape = tuple(shape)
    rank = len(shape)
    if layout == "contiguous" or rank == 0:
        t = random_values(shape, dtype, kind)
    elif layout == "transposed" and rank >= 2:
        base = random_values(shape[:-2] + (shape[-1], shape[-2]), dtype, kind)
        t = base.transpose(-1, -2)
    elif layout == "permuted" and rank >= 2:
        perm = list(perm) if perm is not None else list(reversed(range(rank)))
        # memory holds dims in order ``perm``; permute back with the inverse permutation
        base = random_values(tuple(shape[p] for p in perm), dtype, kind)
        inv = [perm.index(d) for d in range(rank)]
        t = base.permute(inv)
    elif layout == "channels_last" and rank == 4:
        t = random_values(shape, dtype, kind).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced" and rank >= 1:
        big = tuple(2 * s for s in shape)
        base = random_values(big, dtype, kind)
        t = base[tuple(slice(None, None, 2) for _ in shape)]
    elif layout == "offset" and rank >= 1:
        big = shape[:-1] + (shape[-1] + 3,)
        base = random_values(big, dtype, kind)
        t = base[..., 2:2 + shape[-1]]
    elif layout == "expanded" and rank >= 1:
        dims = list(expand_dims) or [0]
        small = tuple(1 if d in dims else s for d, s in enumerate(shape))
        t = random_values(small, dtype, kind).expand(shape)
    else:
        t = random_values(shape, dtype, kind)
    assert t.shape == shape, (t.shape, shape, layout)
    t = t.detach()
    if requires_grad:
        t.requires_grad_(True)
    return t


@st.composite
def shapes(draw: Callable, min_rank: int = 1, max_rank: int = 4, min_side: int = 1, max_side: int = 9,
           max_numel: int = 2048) -> tuple[int, ...]:
    rank = draw(st.integers(min_rank, max_rank))
    out: list[int] = []
    for _ in range(rank):
        out.append(draw(st.integers(min_side, max_side)))
    numel = 1
    for s in out:
        numel *= s
    while numel > max_numel:
        i = out.index(max(out))
        numel //= out[i]
        out[i] = max(1, out[i] // 2)
        numel *= out[i]
    return tuple(out)


@st.composite
def layouts(draw: Callable, shape: Sequence[int], allow_expanded: bool = True) -> dict:
    """Keyword arguments of ``make_input`` describing a layout valid for ``shape``."""
    rank = len(shape)
    choices = ["contiguous", "sliced", "offset"]
    if rank >= 2:
        choices += ["transposed", "permuted"]
    if rank == 4:
        choices.append("channels_last")
    if allow_expanded and rank >= 1:
        choices.append("expanded")
    layout = draw(st.sampled_from(choices))
    kw: dict = {"layout": layout}
    if layout == "permuted":
        kw["perm"] = draw(st.permutations(list(range(rank))))
    if layout == "expanded":
        kw["expand_dims"] = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return kw


@st.composite
def broadcast_shape(draw: Callable, shape: Sequence[int]) -> tuple[int, ...]:
    """A shape that broadcasts against ``shape``: a suffix with some dims set to 1."""
    rank = len(shape)
    keep = draw(st.integers(0, rank))
    suffix = list(shape[rank - keep:])
    for i in range(len(suffix)):
        if draw(st.booleans()):
            suffix[i] = 1
    return tuple(suffix)


# -- comparison --------------------------------------------------------------------------------

def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in (torch.bfloat16, torch.float16):
        return 2e-2, 2e-2
    if dtype == torch.float64:
        return 1e-9, 1e-11
    return 1e-4, 1e-5


def assert_close(got: object, want: object, what: str = "output", rtol: float | None = None,
                 atol: float | None = None, norm_rtol: float | None = None, exact: bool = False) -> None:
    """Elementwise check at dtype tolerance; ``norm_rtol`` adds a relative-to-norm bound to
    ``atol`` (for reductions: accumulation order differs from ATen)."""
    if isinstance(got, (list, tuple)):
        assert isinstance(want, (list, tuple)) and len(got) == len(want), f"{what}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{what}[{i}]", rtol, atol, norm_rtol, exact)
        return
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{what}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != eager {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != eager {want.dtype}"
    if exact or not want.is_floating_point():
        if not torch.equal(got, want) and not (want.is_floating_point()
                                                 and torch.equal(got.isnan(), want.isnan())
                                                 and torch.equal(got.nan_to_num(), want.nan_to_num())):
            diff = (got != want).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: not bit-equal to eager ({want.dtype}); first differing indices {diff}; "
                                 f"got {got[tuple(zip(*diff))] if diff else ''} want "
                                 f"{want[tuple(zip(*diff))] if diff else ''}")
        return
    d_rtol, d_atol = tolerance(want.dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    if norm_rtol is not None and want.numel():
        atol = max(atol, norm_rtol * want.double().norm().item() / max(1.0, want.numel()) ** 0.5)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def kernel_text(compiled: Callable) -> str:
    """Every generated kernel's source of an ``ember.compile`` result, one text."""
    return "\n".join(src for g in compiled._ember_backend.log.graphs for src in g.kernel_sources.values())


def placement(compiled: Callable, kinds: Sequence[str] = ("forward", "inference")) -> Counter:
    """Ops that went into generated kernels, over the graphs of ``kinds``."""
    total: Counter = Counter()
    for g in compiled._ember_backend.log.graphs:
        if g.kind in kinds:
            total.update(g.placement.get("generated", Counter()))
    return total


def assert_generated(compiled: Callable, expect_ops: Sequence[str] = (), allow_fallback: Sequence[str] = (),
                     require_backward: bool = False) -> None:
    """Every compiled graph compiled without error, ran at least one generated kernel, put
    nothing into ATen fallbacks (except ``allow_fallback``), and ``expect_ops`` (e.g.
    ``"aten.exp"``) are in generated kernels of the forward graph."""
    graphs = compiled._ember_backend.log.graphs
    assert graphs, "nothing was compiled"
    kinds = {g.kind for g in graphs}
    if require_backward:
        assert "backward" in kinds, f"no backward graph compiled ({kinds})"
    for g in graphs:
        assert g.error is None, f"{g.title}: {g.error}"
        assert g.target == "triton-interpret", g.target
        fallback = {k: v for k, v in g.placement.get("fallback", Counter()).items() if k not in allow_fallback}
        assert not fallback, f"{g.title}: ops fell back to ATen: {fallback}\n{g.plan_text}"
        assert not g.placement.get("fused-aten"), f"{g.title}: fused groups ran through ATen\n{g.plan_text}"
    for g in graphs:
        if g.placement.get("generated"):
            assert g.kernels >= 1, g.title
    fw = placement(compiled)
    missing = [op for op in expect_ops if fw[op] == 0]
    assert not missing, f"not in generated kernels: {missing}; generated: {dict(fw)}\n" + "\n".join(
        g.plan_text for g in graphs)


def _clone_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out


def check(fn: Callable, args: Sequence[object], *, grad: bool | None = None, expect_ops: Sequence[str] = (),
          allow_fallback: Sequence[str] = (), mutated: Sequence[int] = (), looped: bool = False,
          rtol: float | None = None, atol: float | None = None, norm_rtol: float | None = None,
          grad_rtol: float | None = None, grad_atol: float | None = None, exact: bool = False,
          kwargs: dict | None = None) -> tuple[object, object]:
    """Run ``fn(*args)`` eagerly and through Ember; compare outputs (and mutated args, and the
    gradients of every float32 arg that requires grad, against random cotangents).

    ``mutated``: indices of args the function updates in place (each side gets its own copy,
    the copies are compared afterwards). ``grad`` defaults to "some arg requires grad".
    """
    kwargs = kwargs or {}
    grad_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if grad is None:
        grad = bool(grad_args)

    def fresh() -> list[object]:
        return [_clone_like(a) if i in mutated else a for i, a in enumerate(args)]

    eager_args = fresh()
    with strict_env(looped=looped):
        compiled = ember.compile(fn, target="triton-interpret")
        ember_args = fresh()
        want = fn(*eager_args, **kwargs)
        got = compiled(*ember_args, **kwargs)
        assert_close(got, want, "output", rtol, atol, norm_rtol, exact)
        for i in mutated:
            assert_close(ember_args[i], eager_args[i], f"mutated arg {i}", rtol, atol, norm_rtol)
        if grad:
            outs_w = [t for t in _tensors(want) if t.requires_grad]
            outs_g = [t for t in _tensors(got) if t.requires_grad]
            assert len(outs_w) == len(outs_g) and outs_w, "outputs that require grad differ"
            cots = [random_values(t.shape, t.dtype) for t in outs_w]
            leaves = [args[i] for i in grad_args]
            gw = torch.autograd.grad(outs_w, leaves, cots, allow_unused=True)
            gg = torch.autograd.grad(outs_g, leaves, cots, allow_unused=True)
            gr = grad_rtol if grad_rtol is not None else rtol
            ga = grad_atol if grad_atol is not None else atol
            for i, g_got, g_want in zip(grad_args, gg, gw):
                if g_want is None:
                    continue
                assert_close(g_got, g_want, f"grad of arg {i}", gr, ga, norm_rtol)
        assert_generated(compiled, expect_ops, allow_fallback, require_backward=grad)
    return got, want
