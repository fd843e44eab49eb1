"""--target-bits against every uniform setting at or under the same size, and the sensitivity estimate checked
(issue 59). On one model (SmolLM2-135M in docs/QUALITY.md's protocol):

1. mixed: `quantize --method METHOD --target-bits T` for each T; its bits per weight counted from the files;
2. uniform: the same method at each bits x group size; for each T the best uniform run whose bits per weight do not
   exceed the mixed one's is the baseline (KLD ratio);
3. prediction: N random allocations (a random setting per fused group, rounded by --random-method, by default
   --method: the costs predict what that method makes) measured against the KL divergence the first mixed run's
   report predicts for them (its per-layer costs): Spearman's rho.

    python scripts/bench_target_bits.py /tmp/smollm2 --calib ../shared/assets/text/wikitext2_tok_valid.txt \\
        --eval ../shared/assets/text/wikitext2_raw_test.txt --json /tmp/target_bits.json

Rows are written to --json after every run; a run already in it is not run again (a long benchmark resumes).
"""
import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_quality import true_bits_per_weight
from quantkit.api import quantize
from quantkit.calibration.data import calibration_ids
from quantkit.compare import compare_models
from quantkit.eval import eval_ids
from quantkit.models.hub import load_fp_model
from quantkit.run.config import QuantConfig
from quantkit.run.load import load_quantized
from quantkit.run.report import inspect_checkpoint

UNIFORM = [(b, g) for b in (2, 3, 4) for g in (32, 64, 128)] + [(8, 128)]
FUSED = (r"self_attn\.(q|k|v)_proj", r"mlp\.(gate|up)_proj")  # Llama's fused groups: one setting each


def measure(args, fp_model, eval_tokens, calib, config: QuantConfig, tokens: int) -> dict:
    """Quantize, then bits per weight from the files and KLD / top-1 / ppl against the fp model."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q"
        start = time.perf_counter()
        report = quantize(args.model, out, config, calibration_ids=calib)
        seconds = time.perf_counter() - start
        info = inspect_checkpoint(out)
        model = load_quantized(out, device="cpu", dtype=fp_model.dtype)  # as the fp model it is compared with
        q = compare_models(fp_model, model, eval_tokens[:tokens], args.seqlen, progress=False)
    row = {"kld": q["kld"]["mean"], "top1": q["top1"]["mean"], "ppl": q["ppl"]["quant"], "seconds": seconds,
           "bpw": true_bits_per_weight(info), "mib": info["total_bytes"] / 2**20}
    if "target_bits" in report:
        tb = report["target_bits"]
        row.update(predicted_kld=tb["predicted_kld"], costs=tb["costs"],
                   sensitivity_seconds=float(re.search(r"measured in ([\d.]+) s", tb["summary"][-1]).group(1)))
    return row


def random_recipe(costs: dict, rng: random.Random, bits=None) -> tuple[list, float]:
    """(recipe overrides giving each fused group one random setting, of `bits` widths when given, the KL divergence
    the costs predict)."""
    settings = sorted(s for s in next(iter(costs.values())) if bits is None or int(s.split("-")[0]) in bits)
    chosen, overrides, predicted = {}, [], 0.0
    for name, row in costs.items():
        group = next((re.sub(p, "G", name) for p in FUSED if re.search(p, name)), name)
        setting = chosen.setdefault(group, rng.choice(settings))
        bits, group_size = re.match(r"(\d+)-bit g(-?\d+)", setting).groups()
        overrides.append({"pattern": f"^{re.escape(name)}$", "bits": int(bits), "group_size": int(group_size),
                          "split_fused": True})
        predicted += row[setting]
    return overrides, predicted


def spearman(a: list, b: list) -> float:
    ra, rb = (torch.tensor(x).argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--calib", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--method", default="gptq")
    p.add_argument("--targets", nargs="+", type=float, default=[2.5, 3.0, 3.5, 4.0, 4.5])
    p.add_argument("--uniform", nargs="*", default=[f"{b}:{g}" for b, g in UNIFORM], help="bits:group_size runs")
    p.add_argument("--random", type=int, default=10, help="random allocations that check the prediction")
    p.add_argument("--random-tokens", type=int, default=8192, help="eval tokens of each random allocation")
    p.add_argument("--random-bits", type=int, nargs="+", help="the widths random allocations draw from (default all)")
    p.add_argument("--random-method", help="what rounds the random allocations (default --method; their predicted "
                                          "cost is --method's)")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    fp_model, tokenizer = load_fp_model(args.model, "float32")
    eval_tokens = eval_ids(tokenizer, args.eval, args.max_tokens)
    calib = calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen, seed=0)
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else {}
    base = dict(method=args.method, nsamples=args.nsamples, seqlen=args.seqlen)

    def run(key, config, tokens=args.max_tokens):
        if key not in rows:
            rows[key] = measure(args, fp_model, eval_tokens, calib, config, tokens)
            path.write_text(json.dumps(rows, indent=1))
            r = rows[key]
            print(f"{key}: {r['bpw']:.3f} bpw, KLD {r['kld']:.4f}, top-1 {100 * r['top1']:.1f} %, ppl {r['ppl']:.2f}, "
                  f"{r['seconds']:.0f} s", file=sys.stderr)
        return rows[key]

    for t in args.targets:
        run(f"mixed {t}", QuantConfig(**base, target_bits=t))
    for spec in args.uniform:
        bits, group = map(int, spec.split(":"))
        run(f"uniform {bits}-bit g{group}", QuantConfig(**base, bits=bits, group_size=group))
    costs = rows[f"mixed {args.targets[0]}"]["costs"]
    rng = random.Random(0)
    method = args.random_method or args.method
    tag = "" if args.random_bits is None else f" ({'/'.join(map(str, args.random_bits))}-bit)"
    tag += "" if method == "rtn" else f" {method}"  # the rtn rows keep the keys they had
    for i in range(args.random):
        overrides, predicted = random_recipe(costs, rng, args.random_bits)
        config = QuantConfig(**{**base, "method": method}, modules=overrides)
        row = run(f"random{tag} {i}", config, args.random_tokens)
        row["predicted_kld"] = predicted
    path.write_text(json.dumps(rows, indent=1))
    print(table(rows, args))


def table(rows: dict, args) -> str:
    uniform = {k: r for k, r in rows.items() if k.startswith("uniform")}
    lines = ["| target | bpw (files) | KLD | top-1 % | ppl | best uniform at or under it | its bpw | its KLD | "
             "KLD ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for t in args.targets:
        m = rows[f"mixed {t}"]
        fits = [(r["kld"], k, r) for k, r in uniform.items() if r["bpw"] <= m["bpw"]]
        best = min(fits, default=None, key=lambda x: x[0])
        tail = (f"{best[1]} | {best[2]['bpw']:.3f} | {best[2]['kld']:.4f} | {m['kld'] / best[0]:.2f}x" if best
                else "none | | |")
        lines.append(f"| {t} | {m['bpw']:.3f} | {m['kld']:.4f} | {100 * m['top1']:.1f} | {m['ppl']:.2f} | {tail} |")
    for tag in sorted({k.rpartition(" ")[0] for k in rows if k.startswith("random")}):
        randoms = [r for k, r in rows.items() if k.rpartition(" ")[0] == tag]
        if len(randoms) >= 3:
            rho = spearman([r["predicted_kld"] for r in randoms], [r["kld"] for r in randoms])
            lines.append(f"\nSpearman rho of predicted against measured KLD over {len(randoms)} {tag} "
                         f"allocations: {rho:.3f}")
    passes = sorted(rows[f"mixed {t}"]["sensitivity_seconds"] for t in args.targets)
    gptq = [r["seconds"] for k, r in uniform.items() if k == "uniform 4-bit g128"]
    if gptq:
        median = passes[len(passes) // 2]
        lines.append(f"sensitivity pass {median:.1f} s (median of {len(passes)}; {passes[0]:.1f}-{passes[-1]:.1f}) "
                     f"against one {args.method} run (4-bit g128) {gptq[0]:.1f} s: {median / gptq[0]:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
