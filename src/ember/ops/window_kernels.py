"""The Triton kernels behind Ember's custom ops on (N, C, H, W) tensors: overlapping max pooling
(ops/max_pool.py), reflection padding (ops/reflection_pad.py) and depthwise convolution
(ops/depthwise_conv.py), forward and backward.

Each program handles ``BLOCK`` consecutive elements of its output in that tensor's memory format,
so neighbouring lanes touch neighbouring addresses (channels for NHWC, columns for NCHW). Every
backward is a gather: an input element sums what reaches it, in float32, rounded once, without
atomics. Load this file with ``runtime.kernels.load_module``: the kernels and the helpers they
call are then interpreted (CPU tensors) or compiled together. The padding kernels do
not specialise on their integer arguments, so the compile workers can build them ahead of the first
call from dtypes alone (``reflection_pad.compile_jobs``). The pooling kernels do (unspecialised they
made a ResNet-50 training step 2.4 ms slower on an H100): their jobs carry the integer values the
graph's shapes give (``max_pool.compile_jobs``).
"""

import triton
import triton.language as tl


@triton.jit
def split_index(idx, C, H, W, CHANNELS_LAST: tl.constexpr):
    """(n, c, h, w) of flat element indices into an (N, C, H, W) tensor in its memory format."""
    if CHANNELS_LAST:  # neighbouring lanes: neighbouring channels
        c = idx % C
        t = idx // C
        w = t % W
        t = t // W
        h = t % H
        n = t // H
    else:
        w = idx % W
        t = idx // W
        h = t % H
        t = t // H
        c = t % C
        n = t // C
    return n, c, h, w


@triton.jit
def round_bf16(acc):
    """float32 rounded to the nearest bfloat16, ties to even, as GPUs convert (the interpreter
    truncates)."""
    bits = acc.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(acc != acc, acc, (bits & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def max_pool2d_forward(x_ptr, out_ptr, pos_ptr, total, C, H, W, OH, OW,
                       sxn, sxc, sxh, sxw, son, soc, soh, sow,
                       KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                       PH: tl.constexpr, PW: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    n, c, oh, ow = split_index(idx, C, OH, OW, CHANNELS_LAST)
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    # A window of only -inf points at its first real element, as ATen's does.
    pos = (tl.maximum(h0, 0) - h0) * KW + (tl.maximum(w0, 0) - w0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    base = n.to(tl.int64) * sxn + c.to(tl.int64) * sxc
    for i in tl.static_range(KH):
        h = h0 + i
        for j in tl.static_range(KW):
            w = w0 + j
            ok = mask & (h >= 0) & (h < H) & (w >= 0) & (w < W)
            v = tl.load(x_ptr + base + h * sxh + w * sxw, mask=ok, other=float("-inf")).to(tl.float32)
            take = ok & ((v > best) | (v != v))
            best = tl.where(take, v, best)
            pos = tl.where(take, i * KW + j, pos)
    out = n.to(tl.int64) * son + c.to(tl.int64) * soc + oh * soh + ow * sow
    tl.store(out_ptr + out, best.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(pos_ptr + out, pos.to(tl.int8), mask=mask)


@triton.jit
def max_pool2d_backward(g_ptr, pos_ptr, dx_ptr, total, C, H, W, OH, OW,
                        sgn, sgc, sgh, sgw, sdn, sdc, sdh, sdw,
                        KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                        PH: tl.constexpr, PW: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr,
                        ROUND_BF16: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    n, c, h, w = split_index(idx, C, H, W, CHANNELS_LAST)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    base = n.to(tl.int64) * sgn + c.to(tl.int64) * sgc
    # The windows holding (h, w): oh from (h + PH) // SH down while the window still reaches h.
    oh_last = (h + PH) // SH
    ow_last = (w + PW) // SW
    for a in tl.static_range((KH + SH - 1) // SH):
        oh = oh_last - a
        i = h - (oh * SH - PH)
        okh = (oh >= 0) & (oh < OH) & (i < KH)
        for b in tl.static_range((KW + SW - 1) // SW):
            ow = ow_last - b
            j = w - (ow * SW - PW)
            ok = mask & okh & (ow >= 0) & (ow < OW) & (j < KW)
            at = base + oh * sgh + ow * sgw
            p = tl.load(pos_ptr + at, mask=ok, other=-1).to(tl.int32)
            hit = ok & (p == i * KW + j)
            acc += tl.load(g_ptr + at, mask=hit, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(dx_ptr + n.to(tl.int64) * sdn + c.to(tl.int64) * sdc + h * sdh + w * sdw,
             acc.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reflect(i, size):
    """The source index of a padded position ``i`` (already shifted by the leading pad)."""
    i = tl.where(i < 0, -i, i)
    return tl.where(i >= size, 2 * (size - 1) - i, i)


@triton.jit
def reflected_from(i, size, LEAD, TRAIL, K: tl.constexpr):
    """Source K (0, 1, 2) of the padded positions that reflect onto input index ``i``, and where
    it exists: ``i`` shifted by the leading pad, its mirror in the leading pad (for i in
    1..LEAD), its mirror in the trailing pad (for i in size-1-TRAIL..size-2)."""
    if K == 0:
        return i + LEAD, i >= 0
    elif K == 1:
        return LEAD - i, (i >= 1) & (i <= LEAD)
    else:
        return 2 * (size - 1) - i + LEAD, (i >= size - 1 - TRAIL) & (i <= size - 2)


# The padding kernels' integer arguments (after the two pointers): not specialised on.
_PAD_INTS = list(range(2, 20))


@triton.jit(do_not_specialize=_PAD_INTS)
def reflection_pad2d_forward(x_ptr, out_ptr, total, C, H, W, OH, OW, PT, PB, PL, PR,
                             sxn, sxc, sxh, sxw, son, soc, soh, sow,
                             CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    n, c, oh, ow = split_index(idx, C, OH, OW, CHANNELS_LAST)
    h = reflect(oh - PT, H)
    w = reflect(ow - PL, W)
    v = tl.load(x_ptr + n.to(tl.int64) * sxn + c.to(tl.int64) * sxc + h * sxh + w * sxw, mask=mask)
    tl.store(out_ptr + n.to(tl.int64) * son + c.to(tl.int64) * soc + oh * soh + ow * sow, v, mask=mask)


@triton.jit(do_not_specialize=_PAD_INTS)
def reflection_pad2d_backward(g_ptr, dx_ptr, total, C, H, W, OH, OW, PT, PB, PL, PR,
                              sgn, sgc, sgh, sgw, sdn, sdc, sdh, sdw,
                              CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    n, c, h, w = split_index(idx, C, H, W, CHANNELS_LAST)
    base = n.to(tl.int64) * sgn + c.to(tl.int64) * sgc
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for a in tl.static_range(3):
        oh, okh = reflected_from(h, H, PT, PB, a)
        for b in tl.static_range(3):
            ow, okw = reflected_from(w, W, PL, PR, b)
            ok = mask & okh & okw
            acc += tl.load(g_ptr + base + oh * sgh + ow * sgw, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(dx_ptr + n.to(tl.int64) * sdn + c.to(tl.int64) * sdc + h * sdh + w * sdw,
             acc.to(dx_ptr.dtype.element_ty), mask=mask)


# Depthwise convolution (ops/depthwise_conv.py). A program covers BLOCK_P positions (n, h, w) of
# its output and BLOCK_C channels: in NHWC neighbouring lanes read neighbouring channels. VEC: a
# power of two dividing every position's offset (the op computes it from the strides): Triton
# only knows divisibility by 16 of an argument, so with 72 channels (offsets multiples of 72) it
# loaded element by element, 10x slower than with the hint.

@triton.jit
def _aligned(offsets, VEC: tl.constexpr):
    """1-D ``offsets`` marked as multiples of VEC (1: no mark; strides divisible by 16 need none,
    and a mark there made some kernels slower)."""
    if VEC > 1:
        offsets = tl.multiple_of(offsets, [VEC])
    return offsets


@triton.jit
def _aligned_2d(offsets, VEC: tl.constexpr):
    if VEC > 1:
        offsets = tl.multiple_of(offsets, [VEC, VEC])
    return offsets


@triton.jit
def _positions(pid, P, H, W, BLOCK_P: tl.constexpr):
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    w = p % W
    t = p // W
    return p < P, t // H, t % H, w


@triton.jit
def depthwise_forward(x_ptr, w_ptr, b_ptr, y_ptr, P, C, H, W, OH, OW,
                      sxn, sxc, sxh, sxw, swc, swh, sww, syn, syc, syh, syw,
                      KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                      PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                      ROUND_BF16: tl.constexpr, VEC: tl.constexpr):
    pm, n, oh, ow = _positions(tl.program_id(0), P, OH, OW, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    xc = (c * sxc)[None, :]
    xn = n.to(tl.int64) * sxn
    acc = tl.full([BLOCK_P, BLOCK_C], 0.0, tl.float32)
    for i in tl.static_range(KH):
        h = oh * SH - PH + i * DH
        okh = pm & (h >= 0) & (h < H)
        for j in tl.static_range(KW):
            w = ow * SW - PW + j * DW
            ok = okh & (w >= 0) & (w < W)
            v = tl.load(x_ptr + _aligned(xn + h * sxh + w * sxw, VEC)[:, None] + xc,
                        mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
            k = tl.load(w_ptr + c * swc + i * swh + j * sww, mask=cm, other=0.0).to(tl.float32)
            acc += v * k[None, :]
    if HAS_BIAS:  # added before the one rounding, as cuDNN does
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_bf16(acc)
    out = _aligned(n.to(tl.int64) * syn + oh * syh + ow * syw, VEC)[:, None] + (c * syc)[None, :]
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=pm[:, None] & cm[None, :])


@triton.jit
def depthwise_backward_input(g_ptr, w_ptr, dx_ptr, P, C, H, W, OH, OW,
                             sgn, sgc, sgh, sgw, swc, swh, sww, sdn, sdc, sdh, sdw,
                             KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                             PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROUND_BF16: tl.constexpr,
                      VEC: tl.constexpr):
    """A gather: input position (h, w) sums the output gradients of the taps that read it, where
    ``h + PH - i * DH`` is a multiple of the stride."""
    pm, n, h, w = _positions(tl.program_id(0), P, H, W, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    gc = (c * sgc)[None, :]
    gn = n.to(tl.int64) * sgn
    acc = tl.full([BLOCK_P, BLOCK_C], 0.0, tl.float32)
    for i in tl.static_range(KH):
        th = h + PH - i * DH
        oh = th // SH
        okh = pm & (th >= 0) & (oh * SH == th) & (oh < OH)
        for j in tl.static_range(KW):
            tw = w + PW - j * DW
            ow = tw // SW
            ok = okh & (tw >= 0) & (ow * SW == tw) & (ow < OW)
            g = tl.load(g_ptr + _aligned(gn + oh * sgh + ow * sgw, VEC)[:, None] + gc,
                        mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
            k = tl.load(w_ptr + c * swc + i * swh + j * sww, mask=cm, other=0.0).to(tl.float32)
            acc += g * k[None, :]
    if ROUND_BF16:
        acc = round_bf16(acc)
    out = _aligned(n.to(tl.int64) * sdn + h * sdh + w * sdw, VEC)[:, None] + (c * sdc)[None, :]
    tl.store(dx_ptr + out, acc.to(dx_ptr.dtype.element_ty), mask=pm[:, None] & cm[None, :])


@triton.jit
def depthwise_backward_weight(g_ptr, x_ptr, part_ptr, P, C, H, W, OH, OW, TILES,
                                   sgn, sgc, sgh, sgw, sxn, sxc, sxh, sxw,
                                   KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                                   PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                                   TAPS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    """One chunk's partial weight gradient, float32 (TAPS, C) at ``part_ptr[chunk]``: the sum over
    ``TILES`` tiles of output positions of gradient x shifted input. Every tap's products of a tile
    form one [TAPS, BLOCK_P, BLOCK_C] block summed in registers across tiles, and the positions are
    reduced once at the end (a reduction per tap and tile took 15% longer on an H100). The op sums
    the chunks (no atomics: the result does not depend on scheduling)."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    tap = tl.arange(0, TAPS)
    ki = (tap // KW)[:, None]
    kj = (tap % KW)[:, None]
    tap_ok = (tap < KH * KW)[:, None]
    acc = tl.full([TAPS, BLOCK_P, BLOCK_C], 0.0, tl.float32)
    for t in range(TILES):
        pm, n, oh, ow = _positions(chunk * TILES + t, P, OH, OW, BLOCK_P)
        g = tl.load(g_ptr + _aligned(n.to(tl.int64) * sgn + oh * sgh + ow * sgw, VEC)[:, None] + (c * sgc)[None, :],
                    mask=pm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        h = (oh * SH - PH)[None, :] + ki * DH
        w = (ow * SW - PW)[None, :] + kj * DW
        ok = tap_ok & pm[None, :] & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        at = _aligned_2d((n.to(tl.int64) * sxn)[None, :] + h * sxh + w * sxw, VEC)
        v = tl.load(x_ptr + at[:, :, None] + (c * sxc)[None, None, :], mask=ok[:, :, None] & cm[None, None, :],
                    other=0.0).to(tl.float32)
        acc += v * g[None, :, :]
    part = tl.reduce(acc, 1, tl.standard._sum_combine)
    out = chunk.to(tl.int64) * TAPS * C + tl.arange(0, TAPS)[:, None] * C + c[None, :]
    tl.store(part_ptr + out, part, mask=tap_ok & cm[None, :])
