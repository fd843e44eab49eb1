"""Benchmark quantkit's GPU kernels against torch fp16 F.linear (cuBLAS), one format after another.

    python scripts/bench_kernels.py --check --out docs/bench.md
    python scripts/bench_kernels.py --check --formats int4 int4-asym int3 int8 int4-rotated turboquant4 turboquant3 e8p2
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --device cpu --shapes 64x128 --ms 1 3 --check   (a dry run)

Shapes are the linears of Llama-3-8B / 70B (N = out_features, K = in_features), or any NxK; group size 128;
M = tokens per call. The formats (scripts/kernel_formats.py): the GPTQ layout at 4 bits (symmetric, v1 zeros; or with
random zeros), 3 and 8 bits, the rotated 4-bit layer (the input's Hadamard transform, then the GEMM), and the
codebook layers (TurboQuant 4/3-bit, E8P 2-bit). Each op is captured in a CUDA graph
(so Python launch overhead is not counted: that is how decode loops run in practice) and timed
with triton.testing.do_bench: L2 flushed before every replay, median of many. The fp16 baseline
is measured in the same run on the same activations. Bytes counted for the kernel: packed
weights + scales + zeros + g_idx + activations in + outputs; for fp16: weight + in + out.

`tinygemm` is torch's own INT4 kernel (`torch.ops.aten._weight_int4pack_mm`, what gpt-fast and torchao use;
scripts/tinygemm.py) on the same codes and scales, bf16 activations (the only dtype it takes), timed the same
way in the same run; its column is omitted for other bit widths.

`--device cpu` is the dry run of the whole script on a machine without a GPU: the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set by the script when triton was not imported yet), each op is timed by one wall-clock call,
and tinygemm is torch's CPU variant; the numbers mean nothing, the checks and the tables' plumbing do.

The GPTQ formats time the real entry point, quantkit.kernels.gptq_linear, so its dispatch decides the path:
the fused kernel for M < PREFILL_MIN_M, dequantize-to-a-transient-fp16-weight + cuBLAS above
(kernels/dispatch.py). `--path fused|prefill` forces one path (for finding the crossover), and
`--dequant` also times the dequantize kernel alone per shape (GB/s = packed bytes read + fp16 written).
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernel_formats  # scripts/kernel_formats.py, beside this file

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


def shape_of(name: str) -> tuple:
    """(N, K) of a named Llama shape or of any "NxK"."""
    n, k = SHAPES.get(name) or map(int, name.split("x"))
    return n, k


def time_us(fn, rep_ms):
    """The op's time on its device: a CUDA graph's replays, or on the CPU (the dry run) one wall-clock call."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return graph_time_us(fn, rep_ms)


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
    fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def check(fmt, name, layer, device, ms, half2=False, dtypes=(torch.float16,)):
    """The op against its float64 reference on this device: relative Frobenius error per M and dtype.

    M = 1, 7, 118 take the fused GPTQ kernel's three launch shapes, M = 300 the prefill path (whose decoded weight
    must equal the reference's bit for bit). fp16 / bf16 output rounding is ~u/sqrt(3) relative rms (u = 2^-11 /
    2^-8): allowed 2u, 3u behind a rotation (x is rotated in x's dtype first); with the packed-fp16 M = 1 tiles
    offered (`half2`), M = 1 fp16 may sum in fp16: 6u (its worst-case bound is about 5u, tests/test_kernels.py)."""
    ok = True
    for m in ms:
        for dtype in dtypes:
            x = torch.randn(m, layer.weight.shape[1], device=device, dtype=dtype)
            y, ref = layer.op(x), layer.reference(x)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            u = 2.0**-11 if dtype == torch.float16 else 2.0**-8
            bound = (3 if layer.rotate is not None else 2) * u
            if half2 and fmt == "int4" and m == 1 and dtype == torch.float16:
                bound = 6 * 2.0**-11
            good = err <= bound and torch.isfinite(y).all().item()
            ok &= good
            print(f"check {fmt} {name} M={m} {str(dtype)[6:]}: rel err {err:.2e} (bound {bound:.1e}) "
                  f"{'ok' if good else 'FAIL'}", flush=True)
            if m >= 256 and layer.dequantize is not None:
                same = torch.equal(*layer.dequantize(dtype))
                ok &= same
                print(f"check {fmt} {name} dequantize {str(dtype)[6:]}: {'bit-exact' if same else 'MISMATCH'}")
        if layer.tinygemm is not None:
            ok &= check_tinygemm(fmt, name, layer, m, device)
    return ok


def check_tinygemm(fmt, name, layer, m, device):
    """The baseline computes the same layer: bf16 output and bf16 scales (tinygemm stores them so), 4u."""
    x = torch.randn(m, layer.weight.shape[1], device=device, dtype=torch.bfloat16)
    y = layer.tinygemm(x)
    ref = x.double() @ layer.weight.double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    good = err <= 4 * 2.0**-8
    print(f"check {fmt} {name} M={m} tinygemm: rel err {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return good


def bench_shape(fmt, name, layer, ms, args, peak, device):
    from quantkit.kernels.dispatch import choose_path

    rows = []
    n, k = layer.weight.shape
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.float16)
        t_q = time_us(lambda: layer.op(x), args.rep)
        t_d = time_us(lambda: F.linear(x, layer.weight), args.rep)
        t_eager = eager_time_us(lambda: layer.op(x)) if args.eager else None
        t_tiny = None
        if layer.tinygemm is not None:
            xb = x.to(torch.bfloat16)
            t_tiny = time_us(lambda: layer.tinygemm(xb), args.rep)
        act = (m * k + m * n) * 2
        q_bytes, d_bytes = layer.nbytes + act, n * k * 2 + act
        flops = 2 * m * n * k
        row = dict(format=fmt, shape=name, N=n, K=k, M=m, quant_us=t_q, fp16_us=t_d, speedup=t_d / t_q,
                   quant_gbs=q_bytes / t_q / 1e3, fp16_gbs=d_bytes / t_d / 1e3,
                   quant_tflops=flops / t_q / 1e6, fp16_tflops=flops / t_d / 1e6, quant_eager_us=t_eager,
                   tinygemm_us=t_tiny, vs_tinygemm=t_tiny / t_q if t_tiny else None,
                   path=choose_path(m, args.path) if fmt.startswith("int") else "codebook")
        row["quant_peak_pct"] = 100 * row["quant_gbs"] / peak if peak else None
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def bench_dequant(name, layer, rep_ms, peak):
    """The prefill path's dequantize kernel alone: W^T [K, N] fp16 from the packed tensors."""
    t = time_us(lambda: layer.dequantize(torch.float16), rep_ms)
    n, k = layer.weight.shape
    gbs = (layer.nbytes + k * n * 2) / t / 1e3
    pct = f"{100 * gbs / peak:.0f}%" if peak else "n/a"
    print(f"dequant {name}: {t:.1f} us, {gbs:.0f} GB/s ({pct} of peak)", flush=True)
    return dict(shape=name, us=t, gbs=gbs)


HEADER = ("| format | N x K | M | quant us | fp16 us | speedup | tinygemm us | vs tinygemm | quant GB/s | % peak BW "
          "| fp16 GB/s | quant TFLOP/s | fp16 TFLOP/s | quant eager us |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r):
    pct = f"{r['quant_peak_pct']:.0f}%" if r["quant_peak_pct"] is not None else "n/a"
    eager = f"{r['quant_eager_us']:.1f}" if r["quant_eager_us"] is not None else "-"
    tiny = (f"{r['tinygemm_us']:.1f} | {r['vs_tinygemm']:.2f}x" if r.get("tinygemm_us") is not None else "- | -")
    return (f"| {r['format']} | {r['shape']} | {r['M']} | {r['quant_us']:.1f} | {r['fp16_us']:.1f} | "
            f"{r['speedup']:.2f}x | {tiny} | {r['quant_gbs']:.0f} | {pct} | {r['fp16_gbs']:.0f} | "
            f"{r['quant_tflops']:.1f} | {r['fp16_tflops']:.1f} | {eager} |")


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
    p.add_argument("--formats", nargs="+", choices=kernel_formats.FORMATS,
                   help="layouts to time (default: int{--bits}); scripts/kernel_formats.py says what each is")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help=f"NxK: {', '.join(SHAPES)} or any")
    p.add_argument("--ms", nargs="+", type=int, default=MS)
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8], help="the default format's bits")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the dry run (the kernels in Triton's interpreter; timings meaningless)")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: by GPU name)")
    p.add_argument("--rep", type=int, default=200, help="ms of timed replays per measurement")
    p.add_argument("--check", action="store_true",
                   help="verify each format against its reference before timing it (a format that fails is not "
                        "timed, and the script exits 1 at the end)")
    p.add_argument("--check-ms", nargs="+", type=int, default=[1, 7, 118, 300], help="rows of the check's calls")
    p.add_argument("--eager", action="store_true",
                   help="also time back-to-back eager calls (shows Python launch overhead)")
    p.add_argument("--path", choices=["auto", "fused", "prefill"], default="auto",
                   help="gptq_linear path: auto (dispatch by M), or force the fused kernel / dequant + cuBLAS")
    p.add_argument("--dequant", action="store_true", help="also time the dequantize kernel alone per GPTQ shape")
    p.add_argument("--m1-half2", choices=["add", "only"],
                   help="offer the packed-fp16 M = 1 tiles (triton_gptq.M1_HALF2_CONFIGS, not yet in the default "
                        "autotune list) to the autotuner: with the FMA tiles (add) or alone (only)")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--json", help="write raw numbers and autotuner picks here (rewritten after every format)")
    args = p.parse_args(argv)
    formats = args.formats or [f"int{args.bits}"]
    if args.device == "cpu":
        dry_run_on_cpu()
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --device cpu for the dry run)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run, Triton interpreter)"
    peak = args.peak_gbs or detect_peak_gbs(gpu)
    torch.manual_seed(0)
    if args.m1_half2:
        from quantkit.kernels import triton_gptq, triton_gptq_ops

        half2 = triton_gptq.M1_HALF2_CONFIGS
        triton_gptq_ops.use_m1_configs(half2 if args.m1_half2 == "only" else triton_gptq.M1_CONFIGS + half2)
    rows, dequant, failed = [], [], []

    def save():
        title = (f"{', '.join(formats)}, g{args.group_size}, {gpu}, peak {peak or 'unknown'} GB/s, "
                 f"torch {torch.__version__}, {datetime.date.today().isoformat()}, gptq_linear path={args.path}")
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join([title, "", HEADER] + [format_row(r) for r in rows]) + "\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(gpu=gpu, peak_gbs=peak, rows=rows, dequant=dequant, failed=failed,
                               configs=chosen_configs(), argv=sys.argv), f, indent=1)
        return title

    print(HEADER, flush=True)
    for fmt in formats:
        for name in args.shapes:
            try:  # one format's failure (a check, a launch) is recorded and the others still run
                layer = kernel_formats.build(fmt, *shape_of(name), args.group_size, args.device, args.path)
                dtypes = (torch.float16, torch.bfloat16) if name == args.shapes[0] else (torch.float16,)
                if args.check and not check(fmt, name, layer, args.device, args.check_ms, bool(args.m1_half2),
                                            dtypes):
                    failed.append(f"{fmt} {name}")
                    continue
                if args.dequant and layer.dequantize is not None:
                    dequant.append(dict(format=fmt, **bench_dequant(name, layer, args.rep, peak)))
                rows += bench_shape(fmt, name, layer, args.ms, args, peak, args.device)
            except Exception as e:  # noqa: BLE001 (reported, and the exit status says so)
                print(f"{fmt} {name}: {type(e).__name__}: {e}", flush=True)
                failed.append(f"{fmt} {name} ({type(e).__name__})")
            layer = None
        save()
    print("\n" + "\n".join([save(), "", HEADER] + [format_row(r) for r in rows]))
    if failed:
        sys.exit(f"kernel check FAILED: {', '.join(failed)}")


def dry_run_on_cpu():
    """The kernels on CPU tensors: Triton's interpreter, chosen before triton is imported, and the Triton backend
    asked for by name (its automatic choice on the CPU is the torch reference)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu needs TRITON_INTERPRET=1 before triton is imported: run the script in a fresh process")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["QUANTKIT_BACKEND"] = "triton"


if __name__ == "__main__":
    main()
