#!/usr/bin/env python
"""Calibration on a device: `quantize`'s calibrated methods timed on a real model and on Llama-3-8B-shaped blocks,
and the real model's perplexity on that device against the CPU's, one table.

For each --methods entry (w4 g128; the methods' own quantizers) and each model:
  seconds, s / block   the whole `quantize` call (model streamed from disk, calibration forwards, the method, packing,
                       the files), and that over the decoder blocks
  peak GiB             torch.cuda.max_memory_allocated over the call (GPU runs)
  ppl                  the real model only: perplexity of the checkpoint loaded on --device, on held-out text sampled
                       from the fp model (`quantkit demo`'s protocol: offline, no dataset on disk)
  CPU ppl              with --cpu-reference, the same method quantized and evaluated on the CPU. GPU and CPU sum in
                       other orders, so GPTQ's codes may differ in a few places; the two ppl must agree within
                       --ppl-tolerance (relative), or the script exits 1 (with --device cpu, a second CPU run:
                       the dry run of that comparison)
The real model is --model (default: the bundled stories260k, a 292,800-parameter Llama trained on TinyStories;
SmolLM2 where it is on disk); layers a method cannot take (E8's 8-column units against stories260k's 172-input
down_proj) stay in floating point, as `quantkit demo` keeps them. The random model is --preset's shape
(scripts/bench_generate.py) cut to --blocks decoder blocks, calibrated on random token ids.

    python scripts/bench_calibration.py --device cuda --cpu-reference --json /tmp/calibration.json
    python scripts/bench_calibration.py --device cpu --preset tiny --nsamples 4 --seqlen 32   (a dry run)
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import PRESETS  # noqa: E402

METHODS = ("gptq", "awq", "turboquant+gptq", "e8+gptq")


def quantize_timed(source: Path, out: Path, config, device: str, calibration_ids) -> dict:
    """seconds, s / block and peak GiB of one `quantize` call."""
    from quantkit.api import quantize

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    quantize(str(source), out, config, device=device, calibration_ids=calibration_ids, resumable=False)
    seconds = time.perf_counter() - start
    blocks = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return dict(seconds=seconds, s_per_block=seconds / blocks, peak_gib=peak)


def guarded(row: dict, measure) -> dict:
    """row updated by measure(row); an exception is recorded in it (and fails the run at the end) instead of
    stopping the other methods."""
    try:
        measure(row)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
    print(row, flush=True)
    return row


def real_model_rows(args, work: Path) -> list:
    from quantkit.demo import bundled_model_path, sample_text_ids, skip_misfits
    from quantkit.eval import perplexity
    from quantkit.models.hub import load_fp_model
    from quantkit.run.config import QuantConfig
    from quantkit.run.load import load_quantized

    source = Path(args.model) if args.model else bundled_model_path()
    fp_model, _ = load_fp_model(str(source), "float32")
    seqlen = min(args.seqlen, fp_model.config.max_position_embeddings)
    eval_ids = sample_text_ids(fp_model, args.eval_tokens, seed=0, seqlen=seqlen).reshape(1, -1)
    calibration = sample_text_ids(fp_model, args.nsamples * seqlen, seed=1, seqlen=seqlen)

    def measure(row):
        config = QuantConfig(method=row["method"], bits=4, group_size=128, nsamples=args.nsamples, seqlen=seqlen)
        config, row["kept"] = skip_misfits(config, fp_model)
        for device, role in [(args.device, "run")] + ([("cpu", "reference")] if args.cpu_reference else []):
            out = work / f"{source.name}-{row['method']}-{device}-{role}"
            timing = quantize_timed(source, out, config, device, calibration)
            with torch.inference_mode():
                model = load_quantized(out, device=device, dtype=torch.float32)
                ppl = perplexity(model, eval_ids.to(device), seqlen, progress=False)["ppl"]
            if role == "run":
                row.update(timing, ppl=ppl)
            else:
                row["cpu_ppl"] = ppl
            del model
        if "cpu_ppl" in row:
            row["agrees"] = abs(row["ppl"] - row["cpu_ppl"]) <= args.ppl_tolerance * row["cpu_ppl"]
    return [guarded(dict(model=source.name, method=method), measure) for method in args.methods]


def random_model_rows(args, work: Path) -> list:
    from bench_scale import build_model

    from quantkit.run.config import QuantConfig

    _, hidden, inter, heads, kv, vocab = PRESETS[args.preset]
    source = work / f"{args.preset}-{args.blocks}blocks-fp16"
    shape = argparse.Namespace(layers=args.blocks, hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv,
                               vocab=vocab, shard_bytes=2 * 10**9, experts=0, source_dtype="float16")
    build_model(source, shape)
    ids = torch.randint(0, vocab, (args.nsamples, args.seqlen), generator=torch.Generator().manual_seed(0))

    def measure(row):
        config = QuantConfig(method=row["method"], bits=4, group_size=128, nsamples=args.nsamples, seqlen=args.seqlen)
        row.update(quantize_timed(source, work / f"random-{row['method']}", config, args.device, ids))
    return [guarded(dict(model=f"{args.preset}, {args.blocks} blocks", method=method), measure)
            for method in args.methods]


def table(rows) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)
    lines = ["| model | method | seconds | s / block | peak GiB | ppl | CPU ppl | agrees |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['error']} | | | | | |")
            continue
        agrees = "-" if "agrees" not in r else ("yes" if r["agrees"] else "**NO**")
        lines.append(f"| {r['model']} | {r['method']} | {r['seconds']:.1f} | {r['s_per_block']:.2f} | "
                     f"{cell(r['peak_gib'], '.2f')} | {cell(r.get('ppl'), '.3f')} | {cell(r.get('cpu_ppl'), '.3f')} | "
                     f"{agrees} |")
    kept = [f"{r['model']}, {r['method']}: {note}" for r in rows for note in r.get("kept", [])]
    return "\n".join(lines + ([""] + kept if kept else []))  # what each run left in floating point


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--model", help="the real model's folder (default: the bundled stories260k)")
    p.add_argument("--cpu-reference", action="store_true", help="also quantize and evaluate the real model on the CPU")
    p.add_argument("--ppl-tolerance", type=float, default=0.02, help="relative ppl gap allowed (default 0.02)")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens of the real model's ppl")
    p.add_argument("--preset", choices=list(PRESETS), default="llama3-8b", help="the random model's shape")
    p.add_argument("--blocks", type=int, default=2, help="the random model's decoder blocks (0: none)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows")
    p.add_argument("--seqlen", type=int, default=2048,
                   help="calibration window (the real model's: at most its context)")
    p.add_argument("--parts", nargs="+", choices=("real", "random"), default=["real", "random"],
                   help="which models, in this order: the real one (GPU against CPU ppl), the random one (s / block)")
    p.add_argument("--workdir", help="where the models and checkpoints go (default: a temporary folder)")
    p.add_argument("--json", help="also write the rows here (rewritten after each part)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: use --device cpu for a dry run")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        rows = []
        for part in args.parts:
            if part == "real" or args.blocks:
                rows += (real_model_rows if part == "real" else random_model_rows)(args, work)
                save(args, device_name, rows)
    print(f"\n{device_name}, w4 g128, {args.nsamples} x {args.seqlen} calibration tokens, torch {torch.__version__}\n")
    print(table(rows))
    if any(r.get("agrees") is False or "error" in r for r in rows):
        sys.exit(f"failed: a method's error, or {args.device} and CPU perplexities apart by more than "
                 f"{args.ppl_tolerance:.0%} (the table)")


def save(args, device_name, rows):
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device_name, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
