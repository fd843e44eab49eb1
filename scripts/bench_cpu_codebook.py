#!/usr/bin/env python
"""A codebook layer's CPU strip decode, side by side in one run: through the quantizer's dequantize, and through the
lookup tables (quantkit.kernels.codebook.lookup_of) that DecodedLinear's strips now take.

For each quantizer and layer shape (K inputs x N outputs, random codes, fp16 scales, groups of --group-size), the
milliseconds (the fastest of --repeat) to decode the whole layer to float32 Wᵀ [K, N] each way, and their ratio.
The two must agree bit for bit: the script exits 1 where they do not.

    python scripts/bench_cpu_codebook.py                        # SmolLM2's MLP shapes
    python scripts/bench_cpu_codebook.py --shapes 4096x4096 --quantizers turboquant4 e8p2
"""
import argparse
import sys
import time

import torch

QUANTIZERS = ("turboquant2", "turboquant3", "turboquant4", "e8p2", "e8p3", "e8p4", "e8box2", "e8box3")


def quantizer(spec: str, group_size: int):
    from quantkit.schemes.e8 import E8Box
    from quantkit.schemes.e8p import E8P
    from quantkit.schemes.turboquant import TurboQuant

    name, bits = spec.rstrip("0123456789"), int(spec[len(spec.rstrip("0123456789")):])
    return {"turboquant": lambda: TurboQuant(bits, group_size), "e8p": lambda: E8P(bits),
            "e8box": lambda: E8Box(bits)}[name]()


def layer(q, k: int, n: int, group_size: int):
    """(codes int32 [packed, N], scales fp16 [G, N], g_idx) of random codes."""
    from quantkit.core import bitpack
    from quantkit.core.groups import group_index, n_groups

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2**q.code_bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n_groups(k, group_size), n, generator=gen) * 0.01 + 1e-3).half()
    return bitpack.pack(codes, q.code_bits, dim=0), scales, group_index(k, group_size)


def timed(fn, repeat: int):
    fn()
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["576x1536", "1536x576"], help="KxN per layer")
    p.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    from quantkit.kernels.codebook import decode_codebook, lookup_columns, lookup_of

    torch.set_num_threads(args.threads)
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, torch {torch.__version__}; "
          f"group size {args.group_size}\n")
    print("| quantizer | K x N | dequantize (ms) | lookup (ms) | speed-up |\n|---|---|---|---|---|")
    wrong = []
    for spec in args.quantizers:
        q = quantizer(spec, args.group_size)
        for shape in args.shapes:
            k, n = map(int, shape.split("x"))
            codes, scales, g_idx = layer(q, k, n, args.group_size)
            lookup = lookup_of(q, k)
            slow, want = timed(lambda: decode_codebook(codes, scales, g_idx, q, k), args.repeat)
            if lookup is None:
                print(f"| {spec} | {k} x {n} | {slow:.2f} | (none) | |")
                continue
            fast, got = timed(lambda: lookup_columns(codes, scales, g_idx, lookup, q.code_bits, k, args.group_size),
                              args.repeat)
            if not torch.equal(got, want):
                wrong.append(f"{spec} {shape}")
            print(f"| {spec} | {k} x {n} | {slow:.2f} | {fast:.2f} | {slow / fast:.1f}x |")
    if wrong:
        print(f"\nthe lookup decoded differently from the dequantize: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
