#!/usr/bin/env python
"""One CPU linear layer's paths, side by side in one run: where torch's int4 GEMM stops paying (INT4_MM_MAX_M).

For each layer shape (K inputs x N outputs, 4-bit g128 random codes) and each row count M, the milliseconds per call
(the fastest of --repeat) of
  int4 op      CpuInt4Linear through aten._weight_int4pack_mm_for_cpu (what bf16 calls of <= INT4_MM_MAX_M rows take)
  strip        CpuInt4Linear's exact strip-wise decode + GEMM (every other call), bf16 activations
  bf16 dense   F.linear with the decoded bf16 weight (the unquantized model's layer)
  fp32 dense   F.linear in float32
and op / strip: below 1 the op is the faster path. The crossover moves with the CPU: the op's cost grows with M
at the speed of its bf16 dot products, the strip's is one decode per call plus a GEMM at the speed of torch's.

    python scripts/bench_cpu_int4.py                      # Llama-3-8B's shapes
    python scripts/bench_cpu_int4.py --shapes 576x1536 1536x576 --rows 1 64 128 512
"""
import argparse
import time

import torch
import torch.nn.functional as F


def layer(k: int, n: int):
    """A CpuInt4Linear of random 4-bit g128 codes and its decoded bf16 weight [N, K]."""
    from quantkit.core import bitpack
    from quantkit.kernels.reference import dequantize_weight
    from quantkit.nn.cpu_int4_linear import CpuInt4Linear
    from quantkit.nn.quant_linear import QuantLinear

    gen = torch.Generator().manual_seed(0)
    m = QuantLinear(k, n, 4, 128, bias=False, dtype=torch.bfloat16)
    m.qweight.copy_(bitpack.pack(torch.randint(0, 16, (k, n), generator=gen), 4, dim=0))
    m.qzeros.copy_(bitpack.pack(torch.full((m.scales.shape[0], n), 7), 4, dim=1))
    m.scales.copy_((torch.rand(m.scales.shape, generator=gen) * 0.01 + 1e-3).half())
    m.g_idx.copy_(torch.arange(k, dtype=torch.int32) // 128)
    weight = dequantize_weight(m.qweight, m.qzeros, m.scales, m.g_idx, 4, k, m.zero_offset(), torch.bfloat16)
    return CpuInt4Linear.from_quant_linear(m), weight.t().contiguous()


def add_cpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)


def start(args, setting: str) -> None:
    """Threads set, and the line naming the CPU path and the setting the table ran under."""
    torch.set_num_threads(args.threads)
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, torch {torch.__version__}; {setting}\n")


def timed(fn, repeat: int) -> float:
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x14336", "14336x4096"], help="KxN per layer")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 128, 256, 512], help="M, the rows per call")
    add_cpu_options(p)
    args = p.parse_args(argv)
    from quantkit.kernels import cpu_int4

    start(args, f"INT4_MM_MAX_M = {cpu_int4.INT4_MM_MAX_M}")
    print("| K x N | M | int4 op (ms) | strip (ms) | bf16 dense (ms) | fp32 dense (ms) | op / strip |")
    print("|---|---|---|---|---|---|---|")
    default_max_m = cpu_int4.INT4_MM_MAX_M
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        packed, weight = layer(k, n)
        weight32 = weight.float()
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            x32 = x.float()
            times = {}
            for path, max_m in (("op", m), ("strip", 0)):
                cpu_int4.INT4_MM_MAX_M = max_m
                times[path] = timed(lambda: packed(x), args.repeat)
            cpu_int4.INT4_MM_MAX_M = default_max_m
            bf16 = timed(lambda: F.linear(x, weight), args.repeat)
            fp32 = timed(lambda: F.linear(x32, weight32), args.repeat)
            print(f"| {k} x {n} | {m} | {times['op']:.2f} | {times['strip']:.2f} | {bf16:.2f} | {fp32:.2f} | "
                  f"{times['op'] / times['strip']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
