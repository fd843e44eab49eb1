#!/usr/bin/env python
"""A codebook layer's CPU strip decode, side by side in one run: through the quantizer's dequantize, and through the
lookup tables (quantkit.kernels.codebook.lookup_of) that DecodedLinear's strips now take; for a trellis (no lookup),
its dequantize as torch ops against its C walk (quantkit/schemes/trellis_decode.c), which the dequantize takes
where a C compiler is found; and then a trellis layer's whole product x Ŵᵀ at a few rows of bf16 x (--rows):
the strips (C walk, then torch's GEMM) against the C product straight from the codes (kernels/cpu_trellis.py, what
DecodedLinear runs for up to 8 rows); their outputs must agree to the order of the sums.

For each quantizer and layer shape (K inputs x N outputs, random codes, fp16 scales, groups of --group-size), the
milliseconds (the fastest of --repeat) to decode the whole layer to float32 Wᵀ [K, N] each way, and their ratio.
The two must agree bit for bit: the script exits 1 where they do not.

    python scripts/bench_cpu_codebook.py                        # SmolLM2's MLP shapes
    python scripts/bench_cpu_codebook.py --shapes 4096x4096 --quantizers turboquant4 e8p2
    python scripts/bench_cpu_codebook.py --quantizers trellis2 trellis3 trellis4
"""
import argparse
import sys
from contextlib import contextmanager
from functools import partial

import torch

from bench_cpu_int4 import add_cpu_options, start, timed

QUANTIZERS = ("turboquant2", "turboquant3", "turboquant4", "e8p2", "e8p3", "e8p4", "e8box2", "e8box3", "trellis2",
              "trellis3", "trellis4")


def quantizer(spec: str, group_size: int):
    from quantkit.schemes.e8 import E8Box
    from quantkit.schemes.e8p import E8P
    from quantkit.schemes.trellis import Trellis
    from quantkit.schemes.turboquant import TurboQuant

    name, bits = spec.rstrip("0123456789"), int(spec[len(spec.rstrip("0123456789")):])
    return {"turboquant": lambda: TurboQuant(bits, group_size), "e8p": lambda: E8P(bits),
            "e8box": lambda: E8Box(bits), "trellis": lambda: Trellis(bits)}[name]()


@contextmanager
def torch_ops_only():
    """The trellis decode without its C walk, as on a machine with no C compiler."""
    from quantkit.schemes import trellis_codes

    saved = trellis_codes.native_decode
    trellis_codes.native_decode = lambda: None
    try:
        yield
    finally:
        trellis_codes.native_decode = saved


def layer(q, k: int, n: int, group_size: int):
    """(codes int32 [packed, N], scales fp16 [G, N], g_idx) of random codes."""
    from quantkit.core import bitpack
    from quantkit.core.groups import group_index, n_groups

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**q.code_bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n_groups(k, group_size), n, generator=gen) * 0.01 + 1e-3).half()
    return bitpack.pack(codes, q.code_bits, dim=0), scales, group_index(k, group_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576"], help="KxN per layer")
    p.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows of x in the trellis product table")
    add_cpu_options(p)
    args = p.parse_args(argv)
    from quantkit.core.groups import group_width
    from quantkit.kernels.codebook import decode_codebook, lookup_columns, lookup_of

    start(args, f"group size {args.group_size}")
    print("| quantizer | K x N | dequantize (ms) | lookup or C walk (ms) | speed-up |\n|---|---|---|---|---|")
    wrong = []
    for spec in args.quantizers:
        q = quantizer(spec, args.group_size)
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            codes, scales, g_idx = layer(q, k, n, args.group_size)
            lookup = lookup_of(q, k)
            decode = partial(decode_codebook, codes, scales, g_idx, q, k)
            if q.name == "trellis":
                with torch_ops_only():
                    slow, reference = timed(decode, args.repeat), decode()
                fast = timed(decode, args.repeat)
                if not torch.equal(decode(), reference):
                    wrong.append(f"{spec} {shape}")
                print(f"| {spec} | {k} x {n} | {slow:.2f} | {fast:.2f} | {slow / fast:.1f}x |")
                continue
            slow = timed(decode, args.repeat)
            if lookup is None:
                print(f"| {spec} | {k} x {n} | {slow:.2f} | (none) | |")
                continue
            by_lookup = partial(lookup_columns, codes, scales, lookup, q.code_bits, k, group_width(k, args.group_size))
            fast = timed(by_lookup, args.repeat)
            if not torch.equal(by_lookup(), decode()):
                wrong.append(f"{spec} {shape}")
            print(f"| {spec} | {k} x {n} | {slow:.2f} | {fast:.2f} | {slow / fast:.1f}x |")
    trellises = [spec for spec in args.quantizers if spec.startswith("trellis")]
    if trellises:
        wrong += products(trellises, args)
    if wrong:
        print(f"\nthe lookup or C walk decoded differently from the dequantize: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


def products(specs, args) -> list:
    """The second table: a trellis layer's product at --rows rows of bf16 x, strips against the C product; the
    layers whose two outputs differ by more than bf16's rounding."""
    from quantkit.core import strips
    from quantkit.kernels import cpu_trellis
    from quantkit.kernels.codebook import decode_codebook

    if cpu_trellis.native_gemv() is None:
        print("\n(no C product: it could not be built here)")
        return []
    print("\n| quantizer | K x N | rows | strips: C walk + GEMM (ms) | C product (ms) | speed-up |\n|---|---|---|---|---|---|")
    wrong = []
    for spec in specs:
        q = quantizer(spec, args.group_size)
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            codes, scales, g_idx = layer(q, k, n, args.group_size)
            decode = partial(lambda a, b: decode_codebook(codes[:, a:b], scales[:, a:b], g_idx, q, k))
            for rows in args.rows:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
                by_strips = partial(strips.strip_linear, x, decode, strips.ranges(n, k, q.row_multiple))
                by_c = partial(cpu_trellis.trellis_linear, x, codes, scales, g_idx, q)
                slow, fast = timed(by_strips, args.repeat), timed(by_c, args.repeat)
                if not torch.allclose(by_c().float(), by_strips().float(), rtol=1e-2, atol=1e-2 * float(
                        by_strips().float().abs().max())):
                    wrong.append(f"{spec} {shape} at {rows} rows")
                print(f"| {spec} | {k} x {n} | {rows} | {slow:.2f} | {fast:.2f} | {slow / fast:.1f}x |")
    return wrong


if __name__ == "__main__":
    sys.exit(main())
