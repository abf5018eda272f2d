"""Generated-kernel micro-benchmarks: achieved GB/s of each kernel family against the
measured copy bandwidth, Ember vs Inductor vs eager, in one run.

Run on the device (from the repo root):
    PYTHONPATH=src python benchmarks/scripts/kernel_bench.py --json $OUT/kernel_bench.json
    PYTHONPATH=src python benchmarks/scripts/kernel_bench.py --loop-rblock 1024,4096   # sweep a codegen constant
    PYTHONPATH=src python benchmarks/scripts/kernel_bench.py --cases nhwc --tile 64x4096,32x4096 --split 528,264
    PYTHONPATH=src python benchmarks/scripts/kernel_bench.py --cases transpose --transpose-tile 0,32,64

Each case is a small function (batch-norm statistics and normalisation in NCHW and in
channels_last (NHWC), layer norm, softmax, a pointwise bias+activation+residual chain, a column
reduction, transposing copies). ``--tile XBLOCKxTILE`` sweeps the channel-contiguous reduction tile and ``--split N``
the split-reduction program target (block-size settings, ember/config.py). Time per call comes
from CUDA-graph replay (``triton.testing.do_bench_cudagraph``), so host overhead does not
hide microsecond kernels. GB/s counts the minimum traffic: every input read once and every
output written once.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

import ember
from ember import config
from ember.bench.report import git_commit

BLOCKS = config.Settings()  # the default block sizes

BF16 = torch.bfloat16


def _bn_train(x: torch.Tensor) -> torch.Tensor:
    return F.relu(F.batch_norm(x.float(), None, None, training=True).to(x.dtype))


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), w, b).to(x.dtype)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def _bias_gelu_residual(x: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b) + r


def _channel_sum(x: torch.Tensor) -> torch.Tensor:
    return x.float().sum(dim=(0, 2, 3))


def _bn_affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, w, b, training=True)


def _bn_relu_affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.relu(F.batch_norm(x, None, None, w, b, training=True))


def _to_nhwc(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).permute(0, 2, 3, 1).contiguous()


def _to_nchw(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).permute(0, 3, 1, 2).contiguous()


def _transpose_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.transpose(1, 2) + b


def _transpose_2d(x: torch.Tensor) -> torch.Tensor:
    return (x.t() * 2).contiguous()


def cases(device: torch.device) -> list[tuple[str, str, Callable, tuple]]:
    def t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    def nhwc(*shape: int) -> torch.Tensor:
        return t(*shape).contiguous(memory_format=torch.channels_last)

    def wb(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        return t(c, dtype=torch.float32), t(c, dtype=torch.float32)

    return [
        ("bn nhwc", "128x64x56x56", _bn_affine, (nhwc(128, 64, 56, 56), *wb(64))),
        ("bn+relu nhwc", "128x64x56x56", _bn_relu_affine, (nhwc(128, 64, 56, 56), *wb(64))),
        ("bn+relu nhwc", "128x256x56x56", _bn_relu_affine, (nhwc(128, 256, 56, 56), *wb(256))),
        ("bn+relu nhwc", "128x2048x7x7", _bn_relu_affine, (nhwc(128, 2048, 7, 7), *wb(2048))),
        ("channel sum nhwc", "128x64x56x56", _channel_sum, (nhwc(128, 64, 56, 56),)),
        ("bn+relu", "128x64x56x56", _bn_train, (t(128, 64, 56, 56),)),
        ("bn+relu", "128x256x56x56", _bn_train, (t(128, 256, 56, 56),)),
        ("bn+relu", "128x2048x7x7", _bn_train, (t(128, 2048, 7, 7),)),
        ("channel sum", "128x64x56x56", _channel_sum, (t(128, 64, 56, 56),)),
        ("layer norm", "8192x768", _ln, (t(8192, 768), t(768, dtype=torch.float32), t(768, dtype=torch.float32))),
        ("softmax", "98304x128", _softmax, (t(64 * 12 * 128, 128),)),
        ("bias+gelu+residual", "8192x3072", _bias_gelu_residual, (t(8192, 3072), t(3072), t(8192, 3072))),
        ("transpose nchw->nhwc", "128x64x56x56", _to_nhwc, (t(128, 64, 56, 56),)),
        ("transpose nhwc->nchw", "128x56x56x64", _to_nchw, (t(128, 56, 56, 64),)),
        ("transpose add", "768x197x64", _transpose_add, (t(768, 64, 197), t(768, 197, 64))),
        ("transpose 2d", "8192x8192", _transpose_2d, (t(8192, 8192),)),
    ]


def _ember_with(fn: Callable) -> Callable:
    torch._dynamo.reset()
    return ember.compile(fn)


def _ember_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, int]]]:
    """Labels and codegen constants of each Ember configuration to time."""
    out = []
    for rb in args.loop_rblock.split(","):
        for tile in args.tile.split(","):
            xb, _, elems = tile.partition("x")
            for split in args.split.split(","):
                for tt, tw in itertools.product(args.transpose_tile.split(","), args.transpose_warps.split(",")):
                    label = f"ember rb{rb}" + (f" t{tile}" if "," in args.tile else "") + (
                        f" s{split}" if "," in args.split else "") + (
                        f" tt{tt}" if "," in args.transpose_tile else "") + (
                        f" w{tw}" if "," in args.transpose_warps else "")
                    out.append((label, {"loop_rblock": int(rb), "xcontig_xblock": int(xb), "xcontig_tile": int(elems),
                                        "split_target_programs": int(split), "transpose_tile": int(tt),
                                        "transpose_warps": int(tw)}))
    return out


def _nbytes(args: tuple, out: torch.Tensor) -> int:
    return sum(a.numel() * a.element_size() for a in args) + out.numel() * out.element_size()


def _time_ms(fn: Callable, args: tuple) -> float:
    try:
        return triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=50)
    except Exception:  # noqa: BLE001 - not capturable: plain timing instead
        return triton.testing.do_bench(lambda: fn(*args), rep=50)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--loop-rblock", default=str(BLOCKS.loop_rblock),
                        help="comma list of loop_rblock values to sweep for Ember")
    parser.add_argument("--tile", default=f"{BLOCKS.xcontig_xblock}x{BLOCKS.xcontig_tile}",
                        help="comma list of xcontig_xblock x xcontig_tile, e.g. 64x4096 (channel-contiguous reduction tiles)")
    parser.add_argument("--split", default=str(BLOCKS.split_target_programs),
                        help="comma list of split_target_programs (0: no split reductions)")
    parser.add_argument("--transpose-tile", default=str(BLOCKS.transpose_tile),
                        help="comma list of transpose_tile (0: transposed pointwise kernels walk one index)")
    parser.add_argument("--transpose-warps", default=str(BLOCKS.transpose_warps),
                        help="comma list of transpose_warps (0: by tile size)")
    parser.add_argument("--cases", default="",
                        help="comma list: only cases with this word in their name, or named 'NAME SHAPE'")
    parser.add_argument("--backends", default="eager,inductor,ember")
    args = parser.parse_args()
    device = torch.device("cuda")
    buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    copy_ms = triton.testing.do_bench(buf.clone, rep=100)
    copy_gbs = 2 * buf.numel() / copy_ms / 1e6
    print(f"copy bandwidth (256 MiB clone): {copy_gbs:.0f} GB/s")
    buf = None
    rows = []
    backends = args.backends.split(",")
    print(f"{'case':<20}{'shape':<16}{'backend':<18}{'us':>9}{'GB/s':>8}{'% copy':>8}")
    for name, shape, fn, fargs in cases(device):
        if args.cases and not any(f"{c}|" in f"{name} {shape}|" or c in name.split() for c in args.cases.split(",")):
            continue
        want = fn(*fargs)
        variants: list[tuple[str, dict | None]] = [("eager", None)] if "eager" in backends else []
        variants += [("inductor", None)] if "inductor" in backends else []
        variants += _ember_variants(args) if "ember" in backends else []
        for label, constants in variants:
            # Ember's block sizes are read at code generation, on the first call: patched around it.
            with config.patch(**(constants or {})):
                compiled = (fn if label == "eager" else torch.compile(fn) if label == "inductor"
                            else _ember_with(fn))
                try:
                    got = compiled(*fargs)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    ms = _time_ms(compiled, fargs)
                except Exception as exc:  # one failure must not hide the rest
                    print(f"{name:<20}{shape:<16}{label:<18} ERROR {type(exc).__name__}: {str(exc)[:120]}")
                    rows.append({"case": name, "shape": shape, "backend": label, "error": str(exc)})
                    continue
                gbs = _nbytes(fargs, want) / ms / 1e6
                print(f"{name:<20}{shape:<16}{label:<18}{ms * 1e3:>9.1f}{gbs:>8.0f}{100 * gbs / copy_gbs:>7.0f}%"
                      + (f"  rel.err {err:.1e}" if err > 1e-2 else ""), flush=True)
                rows.append({"case": name, "shape": shape, "backend": label, "us": ms * 1e3, "gb_per_s": gbs,
                             "pct_of_copy": 100 * gbs / copy_gbs, "rel_err_vs_eager": err})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": datetime.date.today().isoformat(),
                       "commit": git_commit(), "argv": sys.argv[1:], "copy_gb_per_s": copy_gbs,
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
