#!/usr/bin/env python
"""CPU evaluation speed: `quantkit eval perplexity` of each model with torch's own float32 products against
quantkit.core.matmul's oneDNN ones, the two alternating in one process on the same windows (read the ratio).

Each path is a floating-point model folder or a quantized checkpoint, loaded as the CLI loads it
(quantkit.eval.load_any, float32 on the CPU). The perplexities of both product paths are printed too: they agree to
float32 rounding.

    python scripts/bench_cpu_eval.py ~/.cache/quantkit-assets/smollm2-135m /tmp/q-gptq-w4 \\
        --eval ../shared/assets/text/wikitext2_raw_test.txt --max-tokens 8192 --repeat 3
"""
import argparse
import time

import torch

from quantkit.core import matmul
from quantkit.eval import eval_ids, load_any, perplexity


def timed(model, ids, seqlen, onednn: bool) -> tuple[float, float]:
    matmul.ENABLED = onednn
    t0 = time.perf_counter()
    ppl = perplexity(model, ids, seqlen, progress=False)["ppl"]
    return time.perf_counter() - t0, ppl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="floating-point model folders or quantized checkpoints")
    p.add_argument("--eval", required=True, help="evaluation dataset (name or file)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per product path (fastest kept)")
    args = p.parse_args(argv)
    if not matmul.onednn_available():
        raise SystemExit("oneDNN is not used on this CPU (it needs AVX-512): nothing to compare")

    print(f"CPU eval, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}\n")
    print("| model | windows | torch s (fastest) | oneDNN s (fastest) | speed-up | ppl torch | ppl oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for path in args.paths:
        model, tokenizer = load_any(path, device="cpu")
        ids = eval_ids(tokenizer, args.eval, args.max_tokens)
        timed(model, ids[:, : args.seqlen], args.seqlen, True)  # warm-up: caches, decoded weights, allocator
        runs = {True: [], False: []}
        for _ in range(args.repeat):
            for onednn in (False, True):
                runs[onednn].append(timed(model, ids, args.seqlen, onednn))
        torch_s, onednn_s = min(s for s, _ in runs[False]), min(s for s, _ in runs[True])
        print(f"| {path} | {ids.shape[1] // args.seqlen} | {torch_s:.2f} | {onednn_s:.2f} | "
              f"{torch_s / onednn_s:.2f}x | {runs[False][0][1]:.4f} | {runs[True][0][1]:.4f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
