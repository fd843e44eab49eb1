"""Benchmark the GPTQ dequant-GEMM Triton kernels against torch fp16 F.linear (cuBLAS).

    python scripts/bench_kernels.py --check --out docs/bench.md

Shapes are the linears of Llama-3-8B / 70B (N = out_features, K = in_features), INT4 with
group size 128, symmetric, v1 zeros; M = tokens per call. Each op is captured in a CUDA graph
(so Python launch overhead is not counted: that is how decode loops run in practice) and timed
with triton.testing.do_bench: L2 flushed before every replay, median of many. The fp16 baseline
is measured in the same run on the same activations. Bytes counted for the kernel: packed
weights + scales + zeros + g_idx + activations in + outputs; for fp16: weight + in + out.

`tinygemm` is torch's own INT4 kernel (`torch.ops.aten._weight_int4pack_mm`, what gpt-fast and torchao use;
scripts/tinygemm.py) on the same codes and scales, bf16 activations (the only dtype it takes), timed the same
way in the same run; its column is omitted for other bit widths.

`int4` times the real entry point, quantkit.kernels.gptq_linear, so its dispatch decides the path:
the fused kernel for M < PREFILL_MIN_M, dequantize-to-a-transient-fp16-weight + cuBLAS above
(kernels/dispatch.py). `--path fused|prefill` forces one path (for finding the crossover), and
`--dequant` also times the dequantize kernel alone per shape (GB/s = packed bytes read + fp16 written).
"""
import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F

import tinygemm  # scripts/tinygemm.py, beside this file

SHAPES = {  # name: (N, K)
    "4096x4096": (4096, 4096),        # 8B q/o proj
    "14336x4096": (14336, 4096),      # 8B gate/up
    "4096x14336": (4096, 14336),      # 8B down
    "28672x8192": (28672, 8192),      # 70B gate/up
    "8192x28672": (8192, 28672),      # 70B down
}
MS = [1, 4, 16, 64, 256, 1024, 4096]
PEAK_GBS = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
            ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0)]


def detect_peak_gbs(name):
    for key, gbs in PEAK_GBS:
        if key in name:
            return gbs
    return None


def make_layer(n, k, bits, group_size, device):
    """Random INT4 GPTQ tensors (sym: every zero 2^(b-1), stored as v1 zero - 1)."""
    from quantkit.core import bitpack

    groups = -(-k // group_size)
    qweight = torch.randint(-2**31, 2**31 - 1, (bitpack.packed_len(k, bits), n), dtype=torch.int32, device=device)
    zeros = torch.full((groups, n), 2 ** (bits - 1) - 1, dtype=torch.int32)
    layer = dict(qweight=qweight, qzeros=bitpack.pack(zeros, bits, dim=1).to(device),
                 scales=(torch.rand(groups, n, device=device) * 0.01 + 0.001).half(),
                 g_idx=(torch.arange(k, device=device) // group_size).to(torch.int32), group_size=group_size)
    if bits == 4 and k % (tinygemm.INNER_K_TILES * 16) == 0 and n % 8 == 0:
        layer["tinygemm"] = tinygemm.from_gptq(layer["qweight"], layer["qzeros"], layer["scales"], bits, k)
    return layer


def fp16_weight(layer, bits, k):
    from quantkit.kernels.reference import dequantize_weight

    return dequantize_weight(layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k,
                             1, dtype=torch.float16).t().contiguous()


def graph_time_us(fn, rep_ms):
    """Median time of one op replayed from a CUDA graph, L2 flushed before each replay."""
    import triton

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up on the capture stream: its split-K workspace exists
        for _ in range(3):           # before capture, and autotuning / compiles / cuBLAS handles too
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def eager_time_us(fn, iters=200):
    """Back-to-back eager calls, warm L2: max(Python launch overhead, GPU time) per call."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def check(layers, bits, args, args_path=None, half2=False):
    """Kernel vs the fp16 reference on this GPU: relative Frobenius error per shape and M.

    M = 1, 7, 118 take the fused kernel's three launch shapes, M = 300 the prefill path. With the
    packed-fp16 M = 1 tiles offered (`half2`), M = 1 fp16 may sum in fp16: allowed 6u (its
    worst-case bound is about 5u, tests/test_kernels.py)."""
    from quantkit.kernels import gptq_linear

    ok = True
    for i, (name, (n, k)) in enumerate(layers.items()):
        layer, w16 = args[name]
        for m in (1, 7, 118, 300):
            for dtype in (torch.float16, torch.bfloat16) if i == 0 else (torch.float16,):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                y = gptq_linear(x, layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k,
                                path=args_path)
                ref = x.double() @ w16.to(dtype).double().t()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                if m == 300:  # the prefill path: its decoded weight must equal the reference's bit for bit
                    from quantkit.kernels.reference import dequantize_weight
                    from quantkit.kernels.triton_dequant import dequantize_triton

                    tensors = (layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"], bits, k, 1)
                    same = torch.equal(dequantize_triton(*tensors, dtype), dequantize_weight(*tensors, dtype=dtype))
                    ok &= same
                    print(f"check {name} dequantize {str(dtype)[6:]}: {'bit-exact' if same else 'MISMATCH'}")
                # fp16 / bf16 output rounding: ~u/sqrt(3) relative rms (u = 2^-11 / 2^-8); allow 2u.
                bound = 2 * (2.0**-11 if dtype == torch.float16 else 2.0**-8)
                if half2 and m == 1 and dtype == torch.float16:
                    bound = 6 * 2.0**-11
                good = err <= bound and torch.isfinite(y).all().item()
                ok &= good
                print(f"check {name} M={m} {str(dtype)[6:]}: rel err {err:.2e} (bound {bound:.1e}) "
                      f"{'ok' if good else 'FAIL'}", flush=True)
            if "tinygemm" in layer:
                ok &= check_tinygemm(name, layer, w16, m, k)
    return ok


def check_tinygemm(name, layer, w16, m, k):
    """The baseline computes the same layer: bf16 output and bf16 scales (tinygemm stores them so), 4u."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = tinygemm.matmul(x, *layer["tinygemm"], layer["group_size"])
    ref = x.double() @ w16.double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    good = err <= 4 * 2.0**-8
    print(f"check {name} M={m} tinygemm: rel err {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return good


def bench_shape(name, n, k, layer, w16, bits, group_size, ms, args, peak):
    from quantkit.kernels import gptq_linear
    from quantkit.kernels.dispatch import choose_path

    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        quant = lambda: gptq_linear(x, layer["qweight"], layer["qzeros"], layer["scales"],  # noqa: E731
                                    layer["g_idx"], bits, k, path=args.path)
        dense = lambda: F.linear(x, w16)  # noqa: E731
        t_q = graph_time_us(quant, args.rep)
        t_d = graph_time_us(dense, args.rep)
        t_eager = eager_time_us(quant) if args.eager else None
        t_tiny = None
        if "tinygemm" in layer:
            xb = x.to(torch.bfloat16)
            t_tiny = graph_time_us(lambda: tinygemm.matmul(xb, *layer["tinygemm"], group_size), args.rep)
        groups = layer["scales"].shape[0]
        act = (m * k + m * n) * 2
        q_bytes = layer["qweight"].numel() * 4 + groups * n * 2 + layer["qzeros"].numel() * 4 + k * 4 + act
        d_bytes = n * k * 2 + act
        flops = 2 * m * n * k
        row = dict(shape=name, N=n, K=k, M=m, int4_us=t_q, fp16_us=t_d, speedup=t_d / t_q,
                   int4_gbs=q_bytes / t_q / 1e3, fp16_gbs=d_bytes / t_d / 1e3,
                   int4_tflops=flops / t_q / 1e6, fp16_tflops=flops / t_d / 1e6, int4_eager_us=t_eager,
                   tinygemm_us=t_tiny, vs_tinygemm=t_tiny / t_q if t_tiny else None, path=choose_path(m, args.path))
        row["int4_peak_pct"] = 100 * row["int4_gbs"] / peak if peak else None
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def bench_dequant(name, layer, bits, k, rep_ms, peak):
    """The prefill path's dequantize kernel alone: W^T [K, N] fp16 from the packed tensors."""
    from quantkit.kernels.triton_dequant import dequantize_triton

    fn = lambda: dequantize_triton(layer["qweight"], layer["qzeros"], layer["scales"], layer["g_idx"],  # noqa: E731
                                   bits, k, 1, torch.float16)
    t = graph_time_us(fn, rep_ms)
    n = layer["scales"].shape[1]
    nbytes = (layer["qweight"].numel() + layer["qzeros"].numel() + k) * 4 + layer["scales"].numel() * 2 + k * n * 2
    gbs = nbytes / t / 1e3
    pct = f"{100 * gbs / peak:.0f}%" if peak else "n/a"
    print(f"dequant {name}: {t:.1f} us, {gbs:.0f} GB/s ({pct} of peak)", flush=True)
    return dict(shape=name, us=t, gbs=gbs)


HEADER = ("| N x K | M | int4 us | fp16 us | speedup | tinygemm us | vs tinygemm | int4 GB/s | % peak BW | fp16 GB/s "
          "| int4 TFLOP/s | fp16 TFLOP/s | int4 eager us |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r):
    pct = f"{r['int4_peak_pct']:.0f}%" if r["int4_peak_pct"] is not None else "n/a"
    eager = f"{r['int4_eager_us']:.1f}" if r["int4_eager_us"] is not None else "-"
    tiny = (f"{r['tinygemm_us']:.1f} | {r['vs_tinygemm']:.2f}x" if r.get("tinygemm_us") is not None else "- | -")
    return (f"| {r['shape']} | {r['M']} | {r['int4_us']:.1f} | {r['fp16_us']:.1f} | {r['speedup']:.2f}x | {tiny} "
            f"| {r['int4_gbs']:.0f} | {pct} | {r['fp16_gbs']:.0f} | {r['int4_tflops']:.1f} "
            f"| {r['fp16_tflops']:.1f} | {eager} |")


def chosen_configs():
    """Autotuner picks, for the record (key -> config)."""
    from quantkit.kernels import triton_gptq

    out = {}
    from quantkit.kernels import triton_dequant

    for label, mod in [("m1_kernel", triton_gptq), ("decode_kernel", triton_gptq), ("gemm_kernel", triton_gptq),
                       ("dequant_kernel", triton_dequant)]:
        tuner = getattr(mod, label)
        for key, cfg in tuner.cache.items():
            out[f"{label} {key}"] = str(cfg)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=MS)
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: by GPU name)")
    p.add_argument("--rep", type=int, default=200, help="ms of timed replays per measurement")
    p.add_argument("--check", action="store_true", help="verify kernels against the reference before timing")
    p.add_argument("--eager", action="store_true",
                   help="also time back-to-back eager calls (shows Python launch overhead)")
    p.add_argument("--path", choices=["auto", "fused", "prefill"], default="auto",
                   help="gptq_linear path: auto (dispatch by M), or force the fused kernel / dequant + cuBLAS")
    p.add_argument("--dequant", action="store_true", help="also time the dequantize kernel alone per shape")
    p.add_argument("--m1-half2", choices=["add", "only"],
                   help="offer the packed-fp16 M = 1 tiles (triton_gptq.M1_HALF2_CONFIGS, not yet in the default "
                        "autotune list) to the autotuner: with the FMA tiles (add) or alone (only)")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--json", help="write raw numbers and autotuner picks here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    peak = args.peak_gbs or detect_peak_gbs(gpu)
    torch.manual_seed(0)
    layers = {name: SHAPES[name] for name in args.shapes}
    tensors = {}
    for name, (n, k) in layers.items():
        layer = make_layer(n, k, args.bits, args.group_size, "cuda")
        tensors[name] = (layer, fp16_weight(layer, args.bits, k))
    if args.m1_half2:
        from quantkit.kernels import triton_gptq, triton_gptq_ops

        half2 = triton_gptq.M1_HALF2_CONFIGS
        triton_gptq_ops.use_m1_configs(half2 if args.m1_half2 == "only" else triton_gptq.M1_CONFIGS + half2)
    if args.check and not check(layers, args.bits, tensors, args.path, half2=bool(args.m1_half2)):
        sys.exit("kernel check FAILED")
    dequant = [bench_dequant(name, tensors[name][0], args.bits, SHAPES[name][1], args.rep, peak)
               for name in layers] if args.dequant else []
    print(HEADER, flush=True)
    rows = []
    for name, (n, k) in layers.items():
        rows += bench_shape(name, n, k, *tensors[name], args.bits, args.group_size, args.ms, args, peak)
    title = (f"INT{args.bits} g{args.group_size} sym, {gpu}, peak {peak or 'unknown'} GB/s, "
             f"torch {torch.__version__}, {datetime.date.today().isoformat()}, gptq_linear path={args.path}")
    table = "\n".join([title, "", HEADER] + [format_row(r) for r in rows])
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, peak_gbs=peak, rows=rows, dequant=dequant, configs=chosen_configs(),
                           argv=sys.argv), f, indent=1)


if __name__ == "__main__":
    main()
