"""Peak memory of quantizing and loading a model much larger than one block (issue 17).

Builds a synthetic random Llama (fp16, or --source-dtype bfloat16; multi-shard safetensors, shapes from the flags)
one tensor at a time, quantizes it in a child process, loads the output and runs one forward in another child, and
reports each child's peak resident memory against the fp model's size on disk. A third child that only imports
torch, transformers and quantkit gives the fixed cost every run pays whatever the model size.

Peak RSS is VmHWM from /proc/self/status, read by the child at its end: everything resident, including
file-backed pages (the shared libraries' code, pages of memory-mapped safetensors files), which the kernel
can drop and re-read under memory pressure. A thread in the child also samples RssAnon (memory only the
process holds: tensors, heap) and RssFile every 10 ms; their peaks are reported too.

    python scripts/bench_scale.py --layers 12 --hidden 2048 --intermediate 5632 --workdir /tmp/bench_scale
    python scripts/bench_scale.py ... --method gptq --nsamples 8 --seqlen 128
    python scripts/bench_scale.py --source /tmp/bench_scale/fp --method gptq --workdir /tmp/other   (reuse a model)
    python scripts/bench_scale.py --layers 8 --experts 16 --expert-intermediate 1536 ...   (a Qwen3-MoE: ~90 % of the
                                                                                      block weights in experts)
    python scripts/bench_scale.py ... --eval-dataset ../shared/assets/text/wikitext2_raw_test.txt --dtype bfloat16
        (adds a row: `quantkit eval perplexity` of the quantized model, whole in memory, over --eval-tokens tokens)
The model and the output are deleted afterwards unless --keep is given (a --source model is never deleted).
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

IMPORTS = "import torch, transformers, quantkit.api, quantkit.run.load"


def build_model(folder: Path, args) -> int:
    """Writes the model shard by shard (never more than one shard in memory); returns its size in bytes."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3MoeConfig

    from quantkit.demo import bundled_model_path
    from quantkit.models.moe import split_experts

    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, vocab_size=args.vocab, tie_word_embeddings=False,
                 dtype=args.source_dtype)
    if args.experts:  # written per expert, as Qwen-MoE releases are (and the streamed reader reads them)
        config = Qwen3MoeConfig(**shape, moe_intermediate_size=args.expert_intermediate, num_experts=args.experts,
                                num_experts_per_tok=2, head_dim=args.hidden // args.heads)
    else:
        config = LlamaConfig(**shape, intermediate_size=args.intermediate)
    with init_empty_weights():
        skeleton = split_experts(AutoModelForCausalLM.from_config(config))
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    gen, dtype = torch.Generator().manual_seed(0), getattr(torch, args.source_dtype)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, folder / name, metadata={"format": "pt"})
        shards.append((name, list(current)))

    for name, p in skeleton.state_dict().items():
        std = 1.0 if "norm" not in name else 0.0
        t = (torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if std == 0.0 else 0.0)).to(dtype)
        if current and size + t.numel() * 2 > args.shard_bytes:
            flush()
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    weight_map = {n: f for f, names in shards for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def child_quantize(src, out, args):
    import torch

    from quantkit.api import quantize
    from quantkit.run.config import QuantConfig

    calib = torch.randint(0, 512, (args.nsamples, args.seqlen), generator=torch.Generator().manual_seed(1))
    config = QuantConfig(method=args.method, bits=args.bits, group_size=args.group_size, nsamples=args.nsamples,
                         seqlen=args.seqlen)
    quantize(src, out, config, device="cpu", calibration_ids=calib if config.needs_calibration else None)


def child_load(out, args, stream=False):
    import torch

    from quantkit.run.load import load_quantized

    model = load_quantized(out, device="cpu", stream=stream, dtype=args.dtype or "auto")
    with torch.inference_mode():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()


def child_eval(out, args):
    """`quantkit eval perplexity OUT --dtype D --max-tokens T` (no --stream): the whole model in memory."""
    from quantkit.eval import evaluate_path

    result = evaluate_path(out, args.eval_dataset, args.seqlen_eval, args.eval_tokens, "cpu", args.dtype,
                           progress=False)
    print(f"perplexity {result['ppl']:.3f} over {result['tokens']} tokens", flush=True)


def child_fp_stream(src, args):
    """The fp model as `quantkit eval perplexity --stream` runs it: one forward with the blocks read as they run."""
    import torch

    from quantkit.eval import load_any

    model, _ = load_any(src, "cpu", stream=True)
    with torch.inference_mode():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()


def _status() -> dict:
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in
            Path("/proc/self/status").read_text().splitlines()) if k in ("VmHWM", "RssAnon", "RssFile")}


def sample_peaks(peaks: dict) -> None:
    """Keep the highest RssAnon and RssFile seen, every 10 ms (runs in a daemon thread of the child)."""
    while True:
        for k, v in _status().items():
            peaks[k] = max(peaks.get(k, 0), v)
        time.sleep(0.01)


def peak_rss() -> int:
    """This process's peak resident memory in bytes, from the OS (VmHWM). Not getrusage's ru_maxrss: Linux
    carries that across exec, so a child forked from this (large) parent would report the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def run_child(argv, work: Path) -> tuple[dict, float]:
    """({VmHWM, RssAnon, RssFile} peaks in bytes, seconds) of `python this_script --child argv`, as the child
    measured itself."""
    t0 = time.perf_counter()
    result = work / "peak.txt"
    subprocess.run([sys.executable, __file__, "--child", str(result), *argv], check=True)
    return json.loads(result.read_text()), time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=0, help="build a Qwen3-MoE with this many experts a layer (0: Llama)")
    ap.add_argument("--expert-intermediate", type=int, default=1536, help="each expert's intermediate size")
    ap.add_argument("--source-dtype", choices=["float16", "bfloat16"], default="float16",
                    help="the built model's dtype (Llama-3's own is bfloat16; default float16)")
    ap.add_argument("--shard-bytes", type=int, default=500 * 10**6, help="source shard size (default 500 MB)")
    ap.add_argument("--method", default="rtn", help="rtn (default) or gptq (calibrated on random token ids)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--workdir", default="/tmp/quantkit_bench_scale")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic model and the output")
    ap.add_argument("--source", help="an existing model folder (e.g. a kept fp/ of an earlier run) instead of building")
    ap.add_argument("--quantized", help="an existing quantized output of --source (a kept q/): measure the loads only")
    ap.add_argument("--dtype", help="activation dtype of the loads (default: load_quantized's, the checkpoint's own)")
    ap.add_argument("--eval-dataset", help="also run `eval perplexity` of the quantized model on this dataset")
    ap.add_argument("--eval-tokens", type=int, default=1024, help="tokens that evaluation reads (default 1024)")
    ap.add_argument("--seqlen-eval", type=int, default=512, help="evaluation window (default 512)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import threading

        peaks = {}
        threading.Thread(target=sample_peaks, args=(peaks,), daemon=True).start()
        result, kind, *paths = args.child
        {"quantize": lambda: child_quantize(*paths, args), "load": lambda: child_load(*paths, args),
         "load-stream": lambda: child_load(*paths, args, stream=True), "fp-stream": lambda: child_fp_stream(*paths, args),
         "eval": lambda: child_eval(*paths, args),
         "imports": lambda: exec(IMPORTS)}[kind]()
        peaks.update({k: max(peaks.get(k, 0), v) for k, v in _status().items()})
        Path(result).write_text(json.dumps({**peaks, "VmHWM": peak_rss()}))
        return
    work = Path(args.workdir)
    if work.exists():
        raise SystemExit(f"{work} exists: pass another --workdir or delete it")
    src, out = (Path(args.source) if args.source else work / "fp"), Path(args.quantized or work / "q")
    if args.quantized and not args.source:
        raise SystemExit("--quantized needs the --source it was made from")
    work.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        if args.source:
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        else:
            size = build_model(src, args)
            print(f"built {src}: {size / 1e9:.2f} GB {args.source_dtype} in {time.perf_counter() - t0:.0f} s", flush=True)
        flags = [f"--{k}={v}" for k, v in (("method", args.method), ("bits", args.bits), ("group-size",
                 args.group_size), ("nsamples", args.nsamples), ("seqlen", args.seqlen), ("dtype", args.dtype),
                 ("eval-dataset", args.eval_dataset), ("eval-tokens", args.eval_tokens),
                 ("seqlen-eval", args.seqlen_eval)) if v is not None]
        rows = [("imports only (torch, transformers, quantkit)", *run_child(["imports"], work))]
        if not args.quantized:
            rows.append((f"quantize {args.method} w{args.bits} g{args.group_size}",
                         *run_child(["quantize", str(src), str(out), *flags], work)))
        out_size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        rows += [("load_quantized + one forward (16 tokens)", *run_child(["load", str(out), *flags], work)),
                 ("load_quantized(stream=True) + one forward", *run_child(["load-stream", str(out), *flags], work)),
                 ("fp model streamed (eval --stream) + one forward", *run_child(["fp-stream", str(src)], work))]
        if args.eval_dataset:
            rows.append((f"eval perplexity ({args.eval_tokens} tokens, {args.dtype or 'float32'}, not streamed)",
                         *run_child(["eval", str(out), *flags], work)))
        print(f"\nfp model {size / 1e9:.3f} GB, quantized checkpoint {out_size / 1e9:.3f} GB; bound = model / 4 = "
              f"{size / 4e9:.3f} GB\n")
        base = rows[0][1]["VmHWM"]  # the imports-only child: the runtime's fixed cost
        print("| step | peak RSS (GB) | peak / model | (peak - imports) / model | peak RssAnon (GB) | RssAnon / model | "
              "peak RssFile (GB) | seconds |\n|---|---|---|---|---|---|---|---|")
        for what, peak, secs in rows:
            print(f"| {what} | {peak['VmHWM'] / 1e9:.3f} | {peak['VmHWM'] / size:.3f} | "
                  f"{(peak['VmHWM'] - base) / size:.3f} | {peak['RssAnon'] / 1e9:.3f} | {peak['RssAnon'] / size:.3f} | "
                  f"{peak['RssFile'] / 1e9:.3f} | {secs:.0f} |")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
