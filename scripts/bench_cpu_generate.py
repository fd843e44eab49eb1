#!/usr/bin/env python
"""CPU generation: memory and speed of loaded quantized models beside the fp32 and bf16 models, in one run.

Each row is a child process that imports torch, transformers and quantkit and builds the model's skeleton on the
meta device, which imports its modeling code (its resident memory then is the runtime's baseline); then it loads one
model, runs a prefill of --prompt tokens and --new-tokens greedy decode steps with the KV cache (batch 1, inference
mode; the prefill computes the last position's logits only, as generate() does; each run's KV cache is released
before the next, as a second generate() call would), and reports:
  load RSS      resident memory once loaded (VmRSS), minus the baseline
  peak RSS      the highest resident memory of the whole child (VmHWM), minus the baseline
  of it, code   the runtime's machine code the run paged in (resident pages of the shared libraries and the Python
                binary, grown since the baseline: torch's and oneDNN's kernels, first touched by the first forward):
                part of the peak, the same for every model, shown so it can be told from the model's own memory
  peak / bf16   that peak over the bf16 source model's weight bytes (2 bytes per parameter, tied weights once; the
                --lm-head row's untied copy is not counted in its favour), and beside it the same less the code
  prefill, decode tokens/s (the fastest of --repeat runs)
Rows: the source model in float32 and bfloat16, and quantkit checkpoints of it (made in --workdir by `quantize`, reused
when there) from the source stored in --source-dtype: RTN w4 g128 (also with --lm-head: lm_head quantized, the
embedding then only looked up) and w3 g128 (GPTQ layout), TurboQuant w4 and E8P w2 (codebooks, rotated: their strips
decode through lookup tables, quantkit.kernels.codebook), the trellis w2 (data-free `--method trellis`: decode
steps multiplied in C from the packed codes, kernels/cpu_trellis.py, where a C compiler is found; the prefill through
strips), loaded in bfloat16 (the int4 CPU kernel decodes, quantkit.nn.cpu_int4_linear) and in float32 (exact
strip-wise decode), and w4 with
cache_dequantized=True (the decoded weights kept: the memory of the fp32 model).
With --llama-bench (llama.cpp's benchmark binary) and --gguf files of the same model, llama-bench's prefill and
decode (pp and tg of the same lengths) of each file on the same number of threads are the anchor rows.
With --mmap-threshold, every row runs under that glibc setting (the peaks then hold little freed memory).

    python scripts/bench_cpu_generate.py ~/.cache/quantkit-assets/smollm2-135m --workdir /tmp/bench_cpu_generate \\
        --llama-bench /path/to/llama.cpp/build/bin/llama-bench --gguf smollm2-Q4_0.gguf smollm2-Q4_K_M.gguf
    python scripts/bench_cpu_generate.py SMOLLM2 --rows "turboquant w4 g128, bf16" "trellis w2 g128, bf16"
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CHECKPOINTS = {"rtn-w4-g128": dict(method="rtn", bits=4, group_size=128),
               "rtn-w4-g128-lm-head": dict(method="rtn", bits=4, group_size=128, lm_head=True),
               "rtn-w3-g128": dict(method="rtn", bits=3, group_size=128),
               "turboquant-w4-g128": dict(method="turboquant", bits=4, group_size=128),
               "e8p-w2-g128": dict(method="e8", bits=2, group_size=128),
               "trellis-w2-g128": dict(method="trellis", bits=2, group_size=128)}
ROWS = [("fp32", "source", "float32", False), ("bf16", "source", "bfloat16", False),
        ("w4 g128, bf16", "rtn-w4-g128", "bfloat16", False), ("w4 g128, fp32", "rtn-w4-g128", "float32", False),
        ("w4 g128, fp32, cache_dequantized", "rtn-w4-g128", "float32", True),
        ("w4 g128 + lm_head, bf16", "rtn-w4-g128-lm-head", "bfloat16", False),
        ("w3 g128, bf16", "rtn-w3-g128", "bfloat16", False),
        ("turboquant w4 g128, bf16", "turboquant-w4-g128", "bfloat16", False),
        ("e8p w2 g128, bf16", "e8p-w2-g128", "bfloat16", False),
        ("trellis w2 g128, bf16", "trellis-w2-g128", "bfloat16", False)]


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {key} in /proc/self/status (Linux only)")


def code_pages() -> int:
    """Resident bytes of the shared libraries' and the interpreter's file mappings (their machine code and data)."""
    total, code = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode[, path]
            path = fields[5] if len(fields) > 5 else ""
            code = ".so" in Path(path).name or path == sys.executable or Path(path).name.startswith("python")
        elif fields[0] == "Rss:" and code:
            total += int(fields[1]) * 1024
    return total


def child(path: str, dtype: str, cache: bool, args) -> dict:
    import torch
    import transformers  # noqa: F401  (part of the baseline: every row pays it)

    from quantkit.models.hub import load_fp_model
    from quantkit.run.load import load_quantized

    torch.set_num_threads(args.threads)
    meta = skeleton(path)
    params, vocab = sum(p.numel() for p in meta.parameters()), meta.config.vocab_size  # tied weights counted once
    baseline, code = status("VmRSS"), code_pages()
    quantized = (Path(path) / "quantkit_report.json").exists()
    if quantized:
        model = load_quantized(path, device="cpu", dtype=dtype, cache_dequantized=cache)
    else:
        model = load_fp_model(path, dtype)[0].eval()
    loaded = status("VmRSS")
    prompt = torch.randint(min(100, vocab // 2), min(1000, vocab), (1, args.prompt),
                           generator=torch.Generator().manual_seed(0))
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = model(prompt, use_cache=True, logits_to_keep=1)  # as generate() prefills: the last logits only
            t1 = time.perf_counter()
            cache_kv, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(args.new_tokens):
                out = model(token, past_key_values=cache_kv, use_cache=True)
                cache_kv, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t2 = time.perf_counter()
            prefill.append(args.prompt / (t1 - t0))
            decode.append(args.new_tokens / (t2 - t1))
            del out, cache_kv, token  # the next run starts without this one's cache, as a new generate() would
    return dict(baseline=baseline, load=loaded - baseline, peak=status("VmHWM") - baseline,
                code=code_pages() - code, prefill=max(prefill), decode=max(decode), bf16_bytes=2 * params,
                mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_", "default (dynamic)"))


def skeleton(path):
    """The model on the meta device (shapes only, its modeling code imported), weights tied."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    return model


def run_child(path, dtype, cache, args) -> dict:
    argv = [sys.executable, __file__, args.source, "--child", path, dtype, str(int(cache)),
            "--threads", str(args.threads), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
            "--repeat", str(args.repeat)]
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"the row {path} ({dtype}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_checkpoints(args, work: Path, names) -> dict:
    from quantkit.api import quantize
    from quantkit.run.config import QuantConfig

    folders = {}
    for name in names:
        options = CHECKPOINTS[name]
        folders[name] = work / name
        if not (folders[name] / "quantkit_report.json").exists():
            print(f"quantizing {name} into {folders[name]}", flush=True)
            quantize(args.source, folders[name], QuantConfig(**options), device="cpu")
    return folders


def source_in(source: str, dtype: str, work: Path) -> Path:
    """The source model stored in `dtype` (a copy in `work` when it is stored otherwise): the checkpoints then keep
    their float tensors in it, and a bf16 load keeps the input embedding a view of the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    declared = json.loads((Path(source) / "config.json").read_text()).get("dtype")
    if dtype == "as-stored" or declared == dtype:
        return Path(source)
    copy = work / f"source-{dtype}"
    if not (copy / "config.json").exists():
        print(f"writing {source} in {dtype} to {copy}", flush=True)
        AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).save_pretrained(copy)
        AutoTokenizer.from_pretrained(source).save_pretrained(copy)
    return copy


def llama_bench(args) -> list:
    """(row name, {prefill, decode, size}) per --gguf file, from llama-bench's JSON (pp and tg runs)."""
    rows = []
    for gguf in args.gguf:
        out = subprocess.run([args.llama_bench, "-m", gguf, "-t", str(args.threads), "-p", str(args.prompt), "-n",
                              str(args.new_tokens), "-r", str(args.repeat), "-o", "json"],
                             check=True, capture_output=True, text=True).stdout
        runs = json.loads(out)
        speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in runs}
        kind = re.search(r"(Q\d_K_[SML]|Q\d_\d|Q\d_K|F16|BF16|IQ\w+)", Path(gguf).name, re.I)
        rows.append((f"llama.cpp {kind.group(1) if kind else Path(gguf).name}",
                     dict(speed, size=Path(gguf).stat().st_size)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="the floating-point model folder")
    p.add_argument("--workdir", default="/tmp/bench_cpu_generate", help="where the checkpoints are made (and reused)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--source-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "as-stored"],
                   help="the dtype the source is stored in for every row (a copy is made in --workdir when it differs; "
                        "SmolLM2 is bf16 on the hub, the asset builder writes fp16)")
    p.add_argument("--prompt", type=int, default=128, help="prefill length (tokens)")
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps")
    p.add_argument("--repeat", type=int, default=2, help="runs per row (the fastest is kept)")
    p.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                   help="glibc's MALLOC_MMAP_THRESHOLD_ in every row's process: blocks of BYTES and more come from the "
                        "OS and go back to it when freed, so the forward's freed temporaries stop counting in the "
                        "peak (glibc's default threshold rises with the largest block freed, to 32 MB); prefill is "
                        "slower for it")
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary, for the anchor rows")
    p.add_argument("--gguf", nargs="*", default=[], help="GGUF files of the same model for llama-bench")
    p.add_argument("--rows", nargs="+", choices=[name for name, *_ in ROWS], metavar="ROW",
                   help="run only these rows (and bf16, the baseline), by name: " + "; ".join(n for n, *_ in ROWS))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        path, dtype, cache = args.child
        print(json.dumps(child(path, dtype, cache == "1", args)))
        return
    import torch

    args.source = str(source_in(args.source, args.source_dtype, Path(args.workdir)))
    rows = [row for row in ROWS if args.rows is None or row[0] in args.rows or row[0] == "bf16"]
    made = make_checkpoints(args, Path(args.workdir), sorted({src for _, src, *_ in rows} - {"source"}))
    folders = {"source": Path(args.source), **made}
    results = [(name, run_child(str(folders[src]), dtype, cache, args)) for name, src, dtype, cache in rows]
    bf16 = dict(results)["bf16"]
    print(f"\nCPU: {cpu_name()}, {args.threads} threads, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}); batch 1, prompt {args.prompt}, {args.new_tokens} new tokens; "
          f"glibc mmap threshold {bf16['mmap_threshold']}\n")
    print("| model | load RSS (MB) | peak RSS (MB) | of it, code (MB) | peak / bf16 weights | without the code | "
          "prefill tok/s | decode tok/s | decode / bf16 |\n|---|---|---|---|---|---|---|---|---|")
    weights = bf16["bf16_bytes"]
    for name, r in results:
        print(f"| {name} | {r['load'] / 1e6:.0f} | {r['peak'] / 1e6:.0f} | {r['code'] / 1e6:.0f} | "
              f"{r['peak'] / weights:.2f} | {(r['peak'] - r['code']) / weights:.2f} | {r['prefill']:.0f} | "
              f"{r['decode']:.1f} | {r['decode'] / bf16['decode']:.2f}x |")
    print(f"\nbaseline (imports, meta skeleton): {bf16['baseline'] / 1e6:.0f} MB, subtracted above; bf16 weights "
          f"{bf16['bf16_bytes'] / 1e6:.0f} MB")
    if args.llama_bench and args.gguf:
        for name, r in llama_bench(args):
            print(f"| {name} ({r['size'] / 1e6:.0f} MB file) | | | | | | {r.get('prefill', 0):.0f} | "
                  f"{r.get('decode', 0):.1f} | {r.get('decode', 0) / bf16['decode']:.2f}x |")


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    return name + (" with AVX-512" if "avx512f" in info else " without AVX-512")


if __name__ == "__main__":
    main()
