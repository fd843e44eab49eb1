"""Peak memory of `load_quantized` + one forward on the CPU, with its defaults and with each dtype (issue 61).

Builds a random Llama from a config (default: hidden 2048, 32 blocks, intermediate 7168, 32 heads, no GQA, vocab 32000,
lm_head untied: 2.077 B parameters, 4.154 GB in float16, the issue's "4.15 GB fp16 Llama"), written shard by shard in
float16 (scripts/bench_scale.py's build_model); quantizes it with RTN w4 g128 (data-free, on the CPU); then, in a fresh
process per row, loads the output with `load_quantized(path, device="cpu", **row)` (device="cpu" is the default on a
machine without a GPU; it is named so that a GPU machine measures the same thing), runs one forward of 16 tokens and
reports the process's peak resident memory (VmHWM, and getrusage's ru_maxrss, which agree here because no process in
the chain is large before its exec) in GiB and against the float16 weights' bytes. Every child is started from a parent
that never imports torch, and a first child that only imports torch, transformers (its Llama modeling code) and quantkit
gives the runtime's fixed cost.

    python scripts/bench_load_memory.py                      (the full size: ~5 GB of disk, minutes of RTN on 2 cores)
    python scripts/bench_load_memory.py --small              (a 4-block model of hidden 512: seconds)
    python scripts/bench_load_memory.py --keep --workdir /tmp/m      (then --reuse --workdir /tmp/m: the loads again)
"""
import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROWS = {"defaults": {}, "dtype=bfloat16": {"dtype": "bfloat16"}, "dtype=float32": {"dtype": "float32"}}
GiB = 1 << 30
IMPORTS = "imports only (torch, transformers' Llama, quantkit)"


def shape(args) -> argparse.Namespace:
    """The model bench_scale.build_model writes: the issue's Llama, or --small's."""
    big = dict(hidden=2048, layers=32, intermediate=7168, heads=32)
    small = dict(hidden=512, layers=4, intermediate=1792, heads=8)
    dims = {k: getattr(args, k) or v for k, v in (small if args.small else big).items()}
    return argparse.Namespace(**dims, kv_heads=dims["heads"], vocab=args.vocab, experts=0, source_dtype="float16",
                              shard_bytes=500 * 10**6)


def child(kind: str, paths: list, args) -> dict:
    """One measured step in this (fresh) process; returns what it reports besides the peak."""
    if kind == "build":
        from bench_scale import build_model

        return {"bytes": build_model(Path(paths[0]), shape(args))}
    if kind == "quantize":
        from quantkit.api import QuantConfig, quantize

        quantize(paths[0], paths[1], QuantConfig(method="rtn", bits=4, group_size=128), device="cpu")
        return {}
    import importlib

    import torch

    import quantkit.run.load
    importlib.import_module("transformers.models.llama.modeling_llama")  # ~110 MB of the runtime: fixed cost
    if kind == "imports":
        return {}
    model = quantkit.run.load.load_quantized(paths[0], device="cpu", **json.loads(paths[1]))
    with torch.inference_mode():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()
    return {"dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def peaks() -> dict:
    """VmHWM (the kernel's high-water mark of resident memory) and ru_maxrss, in bytes."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"VmHWM": int(status["VmHWM"].split()[0]) * 1024,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_child(kind: str, paths: list, args, work: Path) -> dict:
    result = work / "child.json"
    t0 = time.perf_counter()
    flags = ["--small"] if args.small else []
    flags += [f"--{k}={v}" for k in ("hidden", "layers", "intermediate", "heads", "vocab")
              if (v := getattr(args, k)) is not None]
    subprocess.run([sys.executable, __file__, *flags, "--child", str(result), kind, *map(str, paths)], check=True)
    return {**json.loads(result.read_text()), "seconds": time.perf_counter() - t0}


def table(rows: list, fp16_bytes: int, base: int) -> str:
    lines = ["| load (device='cpu') | dtype | peak RSS (GiB) | peak / fp16 weights | (peak - imports) / fp16 weights "
             "| seconds |", "|---|---|---|---|---|---|"]
    for what, r in rows:
        lines.append(f"| {what} | {r.get('dtype', '-')} | {r['VmHWM'] / GiB:.3f} | {r['VmHWM'] / fp16_bytes:.3f} | "
                     f"{(r['VmHWM'] - base) / fp16_bytes:.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="hidden 512, 4 blocks, intermediate 1792 (a quick run)")
    for name in ("hidden", "layers", "intermediate", "heads"):
        ap.add_argument(f"--{name}", type=int, help="override the model's shape")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", default="/tmp/quantkit_bench_load_memory")
    ap.add_argument("--keep", action="store_true", help="keep the models (fp/ and q/ under --workdir)")
    ap.add_argument("--reuse", action="store_true", help="measure the loads of a kept --workdir again")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result, kind, *paths = args.child
        out = child(kind, paths, args)
        Path(result).write_text(json.dumps({**out, **peaks()}))
        return
    work = Path(args.workdir)
    if work.exists() and not args.reuse:
        raise SystemExit(f"{work} exists: pass --reuse to measure its models again, or another --workdir")
    fp, q = work / "fp", work / "q"
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not args.reuse:
            built = run_child("build", [fp], args, work)
            print(f"built {fp}: {built['bytes'] / 1e9:.3f} GB float16 in {built['seconds']:.0f} s", flush=True)
            done = run_child("quantize", [fp, q], args, work)
            print(f"quantized RTN w4 g128 in {done['seconds']:.0f} s, peak {done['VmHWM'] / GiB:.2f} GiB", flush=True)
        fp16_bytes = sum(f.stat().st_size for f in fp.glob("*.safetensors"))  # the weights, plus small headers
        rows = [(IMPORTS, run_child("imports", [], args, work))]
        rows += [(what, run_child("load", [q, json.dumps(kwargs)], args, work)) for what, kwargs in ROWS.items()]
        q_bytes = sum(f.stat().st_size for f in q.glob("*.safetensors"))
        print(f"\nfloat16 model {fp16_bytes / 1e9:.3f} GB ({fp16_bytes / GiB:.3f} GiB), checkpoint "
              f"{q_bytes / 1e9:.3f} GB; one forward of 16 tokens\n\n{table(rows, fp16_bytes, rows[0][1]['VmHWM'])}")
        if args.json:
            Path(args.json).write_text(json.dumps({"fp16_bytes": fp16_bytes, "checkpoint_bytes": q_bytes,
                                                   "rows": dict(rows)}, indent=1))
    finally:
        if not args.keep and not args.reuse:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
