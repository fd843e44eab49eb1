#!/usr/bin/env python
"""End-to-end prefill and decode tokens/s of a quantized model against the same model in fp16, one table.

Builds a random Llama of the chosen shape (scripts/bench_scale.py's builder: fp16 safetensors shards, weights
N(0, 0.02)), quantizes it into each --models checkpoint (data-free methods: random weights make every method
equally fast to serve): "int4 g128" RTN INT4 g128 sym, the GPTQ kernels' target format; "turboquant w4" TurboQuant
4-bit (rotated codebook layers); "e8p w2" E8P 2-bit (rotated lattice layers); and for the fp16 model (transformers)
and each quantized one (load_quantized) measures, per batch size:
  prefill tok/s   B·P / the time of one forward over B prompts of P tokens (logits of the last position only)
  decode tok/s    B·(N − 1) / (t(N new tokens) − t(1 new token)), greedy generate(): the prefill and the first
                  token cancel, what is left is the per-token loop
  peak GiB        torch.cuda.max_memory_allocated over that model's measurements (weights included)
(on CPU the baseline is the fp32 model: CPU fp16 matmuls are not what anyone serves with)
--static decodes with a static KV cache, which transformers' generate() compiles (torch.compile
mode="reduce-overhead": CUDA graphs) — the one line a user writes is
    model.generate(input_ids, max_new_tokens=..., cache_implementation="static")
and QuantLinear's custom op (torch.ops.quantkit.gptq_linear) lets the whole decode step be captured.

    python scripts/bench_generate.py --preset llama3-8b --workdir /tmp/bench_generate --static
    python scripts/bench_generate.py --preset llama3-8b-4layers --models "int4 g128" "turboquant w4" "e8p w2"
    python scripts/bench_generate.py --preset tiny --device cpu     (smoke run: seconds, no GPU)
The models are kept in --workdir and reused by later runs of the same preset.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import build_model  # noqa: E402

PRESETS = {  # name: (layers, hidden, intermediate, heads, kv_heads, vocab)
    "llama3-8b": (32, 4096, 14336, 32, 8, 128256),
    "llama3-8b-8layers": (8, 4096, 14336, 32, 8, 128256),  # same linears, a quarter of the depth: quicker
    "llama3-8b-4layers": (4, 4096, 14336, 32, 8, 128256),  # an eighth: what a GPU slot's few minutes quantize
    "tiny": (2, 256, 512, 4, 2, 1024),
}


QUANTIZED = {  # --models name: how its checkpoint is made
    "int4 g128": dict(method="rtn", bits=4, group_size=128, sym=True),
    "turboquant w4": dict(method="turboquant", bits=4, group_size=128),
    "e8p w2": dict(method="e8", bits=2, group_size=128),
}


def source_model(workdir: Path, preset: str) -> Path:
    """The fp16 folder of the preset's random model, built on first use."""
    fp = workdir / f"{preset}-fp16"
    if not (fp / "config.json").exists():
        layers, hidden, inter, heads, kv, vocab = PRESETS[preset]
        shape = argparse.Namespace(layers=layers, hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv,
                                   vocab=vocab, shard_bytes=2 * 10**9, experts=0, source_dtype="float16")
        print(f"building {fp} ...", flush=True)
        build_model(fp, shape)
    return fp


def quantized_model(fp: Path, model: str, device: str) -> Path:
    """The checkpoint of `model` (a QUANTIZED name) made from fp, on first use; the seconds it took are printed."""
    from quantkit.api import quantize
    from quantkit.run.config import QuantConfig

    q = fp.parent / f"{fp.name.removesuffix('-fp16')}-{model.replace(' ', '-')}"
    if not (q / "config.json").exists():
        print(f"quantizing {q} ({QUANTIZED[model]}) ...", flush=True)
        start = time.perf_counter()
        quantize(str(fp), q, QuantConfig(**QUANTIZED[model]), device=device)
        print(f"quantized {model} in {time.perf_counter() - start:.0f} s", flush=True)
    return q


def load(kind: str, folder: Path, device: str, dtype: torch.dtype):
    if kind not in QUANTIZED:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    from quantkit.run.load import load_quantized

    return load_quantized(folder, device=device, dtype=dtype).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call (compiles, autotunes, allocates)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(model, batch: int, args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, args.prompt), generator=gen).to(args.device)
    short = prompts[:, :16]

    def prefill():
        model(prompts, use_cache=False, logits_to_keep=1)

    def generate(n):
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if args.static:
            kwargs["cache_implementation"] = "static"
        return lambda: model.generate(short, **kwargs)

    with torch.inference_mode():
        t_prefill = timed(prefill, args.device, args.repeats)
        t_one = timed(generate(1), args.device, args.repeats)
        t_all = timed(generate(args.new), args.device, args.repeats)
    return dict(prefill_tok_s=batch * args.prompt / t_prefill,
                decode_tok_s=batch * (args.new - 1) / max(t_all - t_one, 1e-9),
                decode_ms_per_step=1e3 * (t_all - t_one) / (args.new - 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--preset", choices=list(PRESETS), default="llama3-8b", help="model shape (default llama3-8b)")
    p.add_argument("--workdir", default="/tmp/quantkit_bench_generate", help="where the models are built and kept")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke runs)")
    p.add_argument("--models", nargs="+", choices=list(QUANTIZED), default=["int4 g128"],
                   help="quantized checkpoints beside the fp16 model (default: int4 g128)")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="batch sizes (default 1 16)")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt length (default 512)")
    p.add_argument("--new", type=int, default=128, help="tokens generated in the decode measurement (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per figure, median kept (default 3)")
    p.add_argument("--static", action="store_true",
                   help="static KV cache: generate() compiles the decode step (CUDA graphs on a GPU)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: use --device cpu for a smoke run")
    if args.new < 2:
        sys.exit("--new must be at least 2 (decode is timed as N new tokens minus 1)")
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    fp = source_model(Path(args.workdir), args.preset)
    vocab = PRESETS[args.preset][5]
    rows = []
    errors = []
    for kind in [str(dtype)[6:].replace("float", "fp")] + args.models:
        try:  # each checkpoint made when its turn comes, and one model's failure leaves the others their rows
            measure_model(kind, fp, args, dtype, vocab, rows)
        except Exception as e:  # noqa: BLE001 (reported, and the exit status says so)
            print(f"{kind}: {type(e).__name__}: {e}", flush=True)
            errors.append(f"{kind}: {type(e).__name__}: {e}")
        if args.json:  # after every model: a run stopped at its time limit keeps what it measured
            Path(args.json).write_text(json.dumps(dict(argv=sys.argv, rows=rows, errors=errors), indent=1))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\n{args.preset}, {device_name}, prompt {args.prompt}, {args.new} new tokens, "
          f"{'static cache (compiled)' if args.static else 'dynamic cache (eager)'}, torch {torch.__version__}\n")
    print(table(rows) if rows else "no rows")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device_name, argv=sys.argv, rows=rows, errors=errors),
                                              indent=1))
    if errors:
        sys.exit("failed: " + "; ".join(errors))


def measure_model(kind: str, fp: Path, args, dtype, vocab: int, rows: list) -> None:
    """One model's rows (kind: the fp model's dtype name or a QUANTIZED name), one per batch size, appended to rows
    as each is measured."""
    folder = quantized_model(fp, kind, args.device) if kind in QUANTIZED else fp
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = load(kind, folder, args.device, dtype)
    for batch in args.batch:
        row = dict(model=kind, batch=batch, **measure(model, batch, args, vocab))
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
        rows.append(row)
        print(row, flush=True)


def table(rows) -> str:
    """The first model's rows (fp16; fp32 on CPU) are the baseline of each batch size."""
    base = {r["batch"]: r for r in rows if r["model"] == rows[0]["model"]}
    lines = ["| model | batch | prefill tok/s | vs fp | decode tok/s | vs fp | ms/step | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[r["batch"]]
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['prefill_tok_s']:.0f} | "
                     f"{r['prefill_tok_s'] / b['prefill_tok_s']:.2f}x | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}x | {r['decode_ms_per_step']:.2f} | {peak} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
