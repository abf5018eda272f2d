"""What generated CPU kernels (codegen/cpu_kernel.py) import: raw-pointer access, bit casts,
vectorisable float32 math, and the one parallel driver every kernel runs through.

Imported only when a CPU kernel is loaded (it imports numba). Every generated module names a
hash of this file in its header, so editing it renames every kernel and numba never reuses
machine code that was linked against an older helper.

Why these pieces:
* Kernels read tensors through their data pointers (``_p_f32(addr)[index]``) with the strides
  in the index arithmetic, as Triton kernels do: no numpy array objects, any strides and
  storage offsets, and one integer per tensor to pass.
* numba has no vector math library here (no SVML), and a loop that calls libm's ``expf`` or
  ``erff`` does not vectorise. ``exp32``/``erf32``/``tanh32`` are branch-free polynomials
  that LLVM vectorises; they are accurate to a few float32 ulp (tests/codegen/test_cpu_kernels.py).
* Kernels are numba ``cfunc``s with one signature ``(unit_lo, unit_hi, argv)``: each compiles
  serially (no parfor pass, a third of the compile time) and ``drive`` (compiled once, cached)
  splits the units over threads with ``prange``. numba's OpenMP threading layer shares the
  machine well with ATen's OpenMP pool (measured: numba's workqueue layer costs ~80 us per
  launch, OpenMP ~1.5 us).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# The signature of every kernel: first unit, end unit, address of the int64 argument vector.
KERNEL_SIGNATURE = types.void(types.int64, types.int64, types.int64)
# Per-unit scratch in elements (codegen uses the same numbers): accumulators of column
# reductions, and the values a persistent row reduction keeps instead of recomputing them.
STACK_BLOCK = 512
SCRATCH = 2048
# Iteration spaces smaller than this run on one thread (a parallel region costs ~2 us).
PARALLEL_MIN = 32768


def _pointer_intrinsic(nbtype: types.Type):
    @intrinsic
    def pointer(typingctx, addr):  # noqa: ARG001 - numba's intrinsic protocol
        sig = types.CPointer(nbtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(nbtype)))
        return sig, codegen
    return pointer


_p_f32 = _pointer_intrinsic(types.float32)
_p_f64 = _pointer_intrinsic(types.float64)
_p_i64 = _pointer_intrinsic(types.int64)
_p_i32 = _pointer_intrinsic(types.int32)
_p_i16 = _pointer_intrinsic(types.int16)
_p_i8 = _pointer_intrinsic(types.int8)
_p_u8 = _pointer_intrinsic(types.uint8)
_p_u16 = _pointer_intrinsic(types.uint16)  # bfloat16 data: the top half of a float32's bits


def _stack_intrinsic(nbtype: types.Type, count: int):
    """A scratch array of ``count`` elements on the kernel's stack (allocated once, at entry)."""
    @intrinsic
    def stack(typingctx):  # noqa: ARG001
        sig = types.CPointer(nbtype)()

        def codegen(context, builder, signature, args):
            ty = context.get_value_type(nbtype)
            return cgutils.alloca_once(builder, ty, size=ir.Constant(ir.IntType(64), count))
        return sig, codegen
    return stack


_stack_f64 = _stack_intrinsic(types.float64, STACK_BLOCK)
_stack_f32 = _stack_intrinsic(types.float32, STACK_BLOCK)
_stack_i64 = _stack_intrinsic(types.int64, STACK_BLOCK)
_stack_i32 = _stack_intrinsic(types.int32, STACK_BLOCK)
_stack_i16 = _stack_intrinsic(types.int16, STACK_BLOCK)
_stack_i8 = _stack_intrinsic(types.int8, STACK_BLOCK)
_stack_u8 = _stack_intrinsic(types.uint8, STACK_BLOCK)
_scratch_f32 = _stack_intrinsic(types.float32, SCRATCH)
_scratch_f64 = _stack_intrinsic(types.float64, SCRATCH)


@intrinsic
def _i64_as_f64(typingctx, bits):  # noqa: ARG001
    """Float scalars travel in the int64 argument vector as their bit pattern."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return sig, codegen


@intrinsic
def _i32_as_f32(typingctx, bits):  # noqa: ARG001
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


# bfloat16: kernels compute in float32 (as Triton kernels do); loads widen, stores and casts round
# to nearest even. Integer shifts, adds and one select: LLVM keeps the loops vectorised.
def _emit_bf16_widen(builder, half):
    return builder.bitcast(builder.shl(builder.zext(half, ir.IntType(32)), ir.Constant(ir.IntType(32), 16)),
                           ir.FloatType())


def _emit_bf16_round(builder, x):
    """float32 -> bfloat16 bits (i16): round to nearest even, as c10::BFloat16 does; a NaN stays
    a NaN (sign and top payload kept, quiet bit set), however its low bits would round."""
    i32 = ir.IntType(32)
    bits = builder.bitcast(x, i32)
    lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))
    quiet_nan = builder.or_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 0x40))
    is_nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(is_nan, quiet_nan, rounded), ir.IntType(16))


@intrinsic
def _bf16_to_f32(typingctx, half):  # noqa: ARG001
    """A bfloat16 element (read through ``_p_u16``) as the float32 it stands for (exact)."""
    if half not in (types.uint16, types.int16):
        return None

    def codegen(context, builder, signature, args):
        return _emit_bf16_widen(builder, args[0])
    return types.float32(half), codegen


def _f32_intrinsic(result: types.Type, emit, doc: str):
    """A numba intrinsic of one float32 argument whose body ``emit(builder, x)`` writes."""
    @intrinsic
    def op(typingctx, x):  # noqa: ARG001
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return emit(builder, args[0])
        return result(x), codegen
    op.__doc__ = doc
    return op


_f32_to_bf16 = _f32_intrinsic(types.uint16, _emit_bf16_round,
                              "The bfloat16 bits a store writes (``_p_u16(out)[i] = _f32_to_bf16(v)``).")
_round_bf16 = _f32_intrinsic(types.float32, lambda b, x: _emit_bf16_widen(b, _emit_bf16_round(b, x)),
                             "float32 rounded to the nearest bfloat16, still float32: a cast to bfloat16 "
                             "inside a kernel.")


def _llvm_binary(name: str):
    """llvm.maximum / llvm.minimum: NaN-propagating, and LLVM vectorises their reductions."""
    @intrinsic
    def op(typingctx, a, b):  # noqa: ARG001
        if a != b or a not in (types.float32, types.float64):
            return None
        sig = a(a, b)

        def codegen(context, builder, signature, args):
            ty = context.get_value_type(a)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]),
                                                f"{name}.{'f32' if a == types.float32 else 'f64'}")
            return builder.call(fn, args)
        return sig, codegen
    return op


_fmax = _llvm_binary("llvm.maximum")
_fmin = _llvm_binary("llvm.minimum")

_F = np.float32


@numba.njit(fastmath={"contract"}, error_model="numpy", cache=True)
def exp32(x):
    """e**x in float32: Cody-Waite range reduction, Cephes' degree-5 polynomial, 2**n from bits
    (in two halves so that results down to the smallest subnormals come out right)."""
    xc = x if x > _F(-104.0) else _F(-104.0)
    xc = xc if xc < _F(89.0) else _F(89.0)
    n = np.floor(xc * _F(1.44269504088896341) + _F(0.5))
    r = xc - n * _F(0.693359375)
    r = r + n * _F(2.12194440e-4)
    z = r * r
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    p = p * z + r + _F(1.0)
    ni = np.int32(n)
    n1 = ni >> 1
    n2 = ni - n1
    res = p * _i32_as_f32((n1 + 127) << 23) * _i32_as_f32((n2 + 127) << 23)
    return x if x != x else res


@numba.njit(fastmath={"contract"}, error_model="numpy", cache=True)
def erf32(x):
    """erf in float32: a rational approximation on [-4, 4] (erf is +-1 in float32 beyond)."""
    xc = x if x < _F(4.0) else _F(4.0)
    xc = xc if xc > _F(-4.0) else _F(-4.0)
    x2 = xc * xc
    p = _F(-2.72614225801306e-10)
    p = p * x2 + _F(2.77068142495902e-08)
    p = p * x2 + _F(-2.10102402082508e-06)
    p = p * x2 + _F(-5.69250639462346e-05)
    p = p * x2 + _F(-7.34990630326855e-04)
    p = p * x2 + _F(-2.95459980854025e-03)
    p = p * x2 + _F(-1.60960333262415e-02)
    p = p * xc
    q = _F(-1.45660718464996e-05)
    q = q * x2 + _F(-2.13374055278905e-04)
    q = q * x2 + _F(-1.68282697438203e-03)
    q = q * x2 + _F(-7.37332916720468e-03)
    q = q * x2 + _F(-1.42647390514189e-02)
    return x if x != x else p / q


@numba.njit(fastmath={"contract"}, error_model="numpy", cache=True)
def tanh32(x):
    """tanh in float32: odd Taylor polynomial near 0 (no cancellation), (1-e)/(1+e) with
    e = exp(-2|x|) elsewhere."""
    ax = abs(x)
    e = exp32(_F(-2.0) * ax)
    big = (_F(1.0) - e) / (_F(1.0) + e)
    big = big if x >= _F(0.0) else -big
    x2 = x * x
    small = _F(62.0 / 2835.0)
    small = small * x2 - _F(17.0 / 315.0)
    small = small * x2 + _F(2.0 / 15.0)
    small = small * x2 - _F(1.0 / 3.0)
    small = x + x * x2 * small
    res = small if ax < _F(0.25) else big
    return x if x != x else res


@numba.njit(error_model="numpy", cache=True)
def exp64(x):
    return math.exp(x)


@numba.njit(error_model="numpy", cache=True)
def erf64(x):
    return math.erf(x)


@numba.njit(error_model="numpy", cache=True)
def tanh64(x):
    return math.tanh(x)


@intrinsic
def _call_kernel(typingctx, addr, lo, hi, argv):  # noqa: ARG001
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i64])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1], args[2], args[3]])
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(parallel=True, nogil=True, cache=True)
def drive(kernel, units, threads, argv):
    """Run ``kernel`` (a cfunc address) over ``units`` work units on ``threads`` threads; one
    thread runs it directly, with no parallel region (its fixed cost is ~1.5 us)."""
    addr = argv.ctypes.data
    if units <= 0:
        return
    if threads <= 1 or units <= 1:
        _call_kernel(kernel, 0, units, addr)
        return
    per = (units + threads - 1) // threads
    for t in prange(threads):
        lo = t * per
        hi = min(lo + per, units)
        if lo < hi:
            _call_kernel(kernel, lo, hi, addr)


@numba.njit(parallel=True, nogil=True, cache=True)
def drive_chunked(kernel, units, threads, chunk, argv):
    """``drive`` with the units cut into pieces of ``chunk`` dealt to the threads in turn (thread
    t runs pieces t, t + threads, ...): a tuned alternative to one contiguous share per thread
    where units cost unequal time or the shares' memory contends."""
    addr = argv.ctypes.data
    if units <= 0:
        return
    pieces = (units + chunk - 1) // chunk
    for t in prange(threads):
        for piece in range(t, pieces, threads):
            lo = piece * chunk
            _call_kernel(kernel, lo, min(lo + chunk, units), addr)


__all__ = ["KERNEL_SIGNATURE", "PARALLEL_MIN", "SCRATCH", "STACK_BLOCK", "drive", "drive_chunked", "launcher", "threads_for", "erf32", "erf64", "exp32", "exp64", "tanh32", "tanh64",
           "_bf16_to_f32", "_f32_to_bf16", "_fmax", "_fmin", "_i32_as_f32", "_i64_as_f64", "_p_f32", "_p_f64", "_p_i16",
           "_p_i32", "_p_i64", "_p_i8", "_p_u16", "_p_u8", "_round_bf16", "_scratch_f32", "_scratch_f64", "_stack_f32", "_stack_f64", "_stack_i16", "_stack_i32", "_stack_i64", "_stack_i8", "_stack_u8"]


def threads_for(points: int, units: int) -> int:
    """Threads for an iteration space of ``points`` split into ``units`` work units."""
    if points < PARALLEL_MIN or units < 2:
        return 1
    import torch

    return max(1, min(units, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def launcher(address: int, instance: dict):
    """The callable a program uses for one kernel use: ``launch(*tensors)`` (inputs then outputs)
    builds the argument vector (data pointers, then this use's sizes, strides and constants)."""
    static = list(instance["static"])
    units = int(instance["units"])
    # A tuned thread count (ember/tune) wins over the rule.
    threads = int(instance.get("threads") or threads_for(int(instance["points"]), units))
    n_tensors = int(instance["tensors"])
    chunk = int(instance.get("chunk") or 0)  # a tuned parallel chunking (units per piece)

    def launch(*tensors) -> None:
        if len(tensors) != n_tensors:
            raise TypeError(f"CPU kernel takes {n_tensors} tensors, got {len(tensors)}")
        argv = np.array([t.data_ptr() for t in tensors] + static, dtype=np.int64)
        if chunk and threads > 1:
            drive_chunked(address, units, threads, chunk, argv)
        else:
            drive(address, units, threads, argv)

    launch.units, launch.threads = units, threads
    return launch
