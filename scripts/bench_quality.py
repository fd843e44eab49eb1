#!/usr/bin/env python
"""Quality benchmark: method x bits x group -> perplexity, KL divergence and top-1 agreement against the
floating-point model, quantization time, size, true bits/weight.

The floating-point baseline is evaluated in the same run and stays in memory: every quantized model is
compared with it window by window (quantkit.compare, the figures of `quantkit eval compare`). Markdown
table to stdout (and --out), optionally a PNG of perplexity and KLD against bits per weight (matplotlib).

Example (the protocol of the GPTQ/AWQ issues, on SmolLM2-135M built by the developers' asset script
../shared/assets/get-smollm2.sh):
    python scripts/bench_quality.py ~/.cache/quantkit-assets/smollm2-135m \
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt \
        --max-tokens 32768 --seqlen 512 --nsamples 128 \
        --runs rtn:4:128 gptq:4:128 rtn:3:128 gptq:3:128 rtn:4:-1 gptq:4:-1
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantkit.api import quantize
from quantkit.compare import compare_models
from quantkit.run.config import QuantConfig
from quantkit.calibration.data import calibration_ids
from quantkit.eval import eval_ids, perplexity
from quantkit.run.load import load_quantized
from quantkit.models.hub import load_fp_model
from quantkit.run.report import inspect_checkpoint


def parse_run(text):
    """method:bits:group[:asym][:hadamard][:no-act-order] -> dict of QuantConfig fields."""
    parts = text.split(":")
    run = {"method": parts[0], "bits": int(parts[1]), "group_size": int(parts[2])}
    for flag in parts[3:]:
        if flag in ("sym", "asym"):
            run["sym"] = flag == "sym"
        elif flag == "hadamard":
            run["rotate"] = flag
        elif flag == "no-act-order":
            run["act_order"] = False
        else:
            raise SystemExit(f"run {text!r}: unknown flag {flag!r} (asym, sym, hadamard or no-act-order)")
    return run


def true_bits_per_weight(info) -> float:
    total = sum(l["shape"][0] * l["shape"][1] for l in info["layers"].values())
    return sum(l["bits_per_weight"] * l["shape"][0] * l["shape"][1] for l in info["layers"].values()) / total


def default_config(fields: dict, args) -> QuantConfig:
    """A run's QuantConfig: its spec's fields (parse_run) and the calibration options."""
    return QuantConfig(**fields, nsamples=args.nsamples, seqlen=args.seqlen)


def main(argv=None, config_of=default_config, prog=None):
    """config_of(fields, args) -> QuantConfig builds each run's config (scripts/scale_rounding.py swaps the grid)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--calib", required=True, help="calibration dataset (name or file)")
    p.add_argument("--eval", required=True, help="evaluation dataset (name or file)")
    p.add_argument("--runs", nargs="+", required=True,
                   help="method:bits:group[:asym][:hadamard][:no-act-order], e.g. gptq:4:128 or gptq:3:64:hadamard")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration windows")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="source model dtype for quantization")
    p.add_argument("--eval-dtype", default=None, help="dtype for evaluation (default fp32 CPU / fp16 GPU)")
    p.add_argument("--out", help="also write the markdown table here")
    p.add_argument("--json", help="write the raw rows as JSON here")
    p.add_argument("--png", help="plot perplexity against bits per weight here")
    args = p.parse_args(argv)

    from quantkit.models.hub import resolve_device

    device = resolve_device(args.device)
    fp_model, tokenizer = load_fp_model(args.model, args.eval_dtype or ("float32" if device == "cpu" else "auto"))
    ids = eval_ids(tokenizer, args.eval, args.max_tokens)
    calib = calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen, seed=args.seed)
    fp = perplexity(fp_model.to(device), ids, args.seqlen, progress=False)
    fp_bytes = sum(p.numel() * 2 for n, p in fp_model.named_parameters())
    rows = [{"run": "fp (baseline)", "ppl": fp["ppl"], "kld": 0.0, "top1": 1.0, "seconds": 0.0, "bpw": 16.0,
             "mib": fp_bytes / 2**20}]
    print(f"fp: ppl {fp['ppl']:.3f} on {fp['tokens']} tokens", file=sys.stderr)
    for spec in args.runs:
        config = config_of(parse_run(spec), args)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "q"
            t0 = time.perf_counter()
            quantize(args.model, out, config, device=device, dtype=args.dtype,
                     calibration_ids=calib if config.needs_calibration else None)
            seconds = time.perf_counter() - t0
            info = inspect_checkpoint(out)
            model = load_quantized(out, device=device, dtype=args.eval_dtype or fp_model.dtype)
            q = compare_models(fp_model, model, ids, args.seqlen, progress=False)
            del model
        row = {"run": spec, "ppl": q["ppl"]["quant"], "kld": q["kld"]["mean"], "top1": q["top1"]["mean"],
               "seconds": seconds, "bpw": true_bits_per_weight(info), "mib": info["total_bytes"] / 2**20}
        rows.append(row)
        print(f"{spec}: ppl {row['ppl']:.3f}, KLD {row['kld']:.4f}, top-1 {100 * row['top1']:.1f} %, "
              f"{seconds:.1f} s", file=sys.stderr)
        save(rows, args, fp["tokens"], device)  # after every run: a long benchmark cut short keeps its rows
        if device == "cuda":
            torch.cuda.empty_cache()

    print(markdown(rows, args, fp["tokens"], device))
    if args.png:
        plot(rows, args.png)


def save(rows, args, tokens, device) -> None:
    if args.out:
        Path(args.out).write_text(markdown(rows, args, tokens, device) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def markdown(rows, args, tokens, device) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [f"model {args.model}; calibration {Path(args.calib).name} ({args.nsamples} x {args.seqlen}); "
             f"eval {Path(args.eval).name}, {tokens} predicted tokens, seqlen {args.seqlen}; device {name}",
             "", "| run (method:bits:group) | ppl | vs fp | KLD (nats/token) | top-1 % | quant. time (s) | "
             "checkpoint MiB | bits/weight (linears) |", "|---|---|---|---|---|---|---|---|"]
    base = rows[0]["ppl"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['ppl']:.3f} | {r['ppl'] / base:.3f}x | {r['kld']:.4f} | "
                     f"{100 * r['top1']:.2f} | {r['seconds']:.1f} | {r['mib']:.1f} | {r['bpw']:.3f} |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping --png", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ppl", "perplexity"), (axes[1], "kld", "KL divergence from fp (nats/token)")):
        for r in rows[1:]:
            ax.scatter(r["bpw"], r[key])
            ax.annotate(r["run"], (r["bpw"], r[key]), fontsize=7)
        if key == "ppl":  # the fp model's KLD is 0: no line on a log scale
            ax.axhline(rows[0][key], linestyle="--", label="fp")
            ax.legend()
        ax.set_xlabel("bits per weight (linears, scales and zeros counted)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
