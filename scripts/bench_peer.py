#!/usr/bin/env python
"""quantkit against llm-compressor on the same calibration samples and the same evaluation, one table.

The calibration windows are drawn once (quantkit.calibration.data.calibration_ids) and handed to both tools, each of which
quantizes in a Python process of its own: quantkit through scripts/quantkit_job.py into a checkpoint that
load_quantized reads back; llm-compressor in its own Python (--peer-python, a virtual environment with
`pip install llmcompressor`: it pins other transformers versions than quantkit's) through
scripts/peer_llmcompressor.py, which writes its dequantized weights as a plain checkpoint. Both models are then
evaluated here by quantkit.eval.perplexity in fp32 on the same tokens (and on --heldout text when given). Seconds
are each tool's wall time for the same job, timed inside its process after the imports: a model folder in, a
packed checkpoint out (quantkit: quantize(), reading the source and writing the checkpoint; llm-compressor: loading
the model, oneshot() and save_pretrained(save_compressed=True); its oneshot() alone in a column of its own),
measured one after the other on the same machine — read them as a ratio. With --repeat N each tool runs N times
per scheme, the two alternating: the table gives the fastest run of each and their ratio, and the ratio of each
pair of runs that ran side by side, with the median of those (the machine's drift moves both runs of a pair alike).

Runs are method:bits:group[:asym][:one-pass], method gptq or rtn (llm-compressor's RTN is its
QuantizationModifier). one-pass: quantkit collects every linear's statistics of a block in one forward, as
llm-compressor does, instead of stage by stage (true-sequential, its default); runs that differ only in it
share one llm-compressor run.

    python -m venv /tmp/peer && /tmp/peer/bin/pip install llmcompressor torch   # CPU torch: see README
    python scripts/bench_peer.py ~/.cache/quantkit-assets/smollm2-135m --peer-python /tmp/peer/bin/python \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt \\
        --nsamples 64 --runs gptq:4:64 gptq:4:64:asym gptq:3:64 rtn:4:64
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from quantkit.calibration.data import calibration_ids
from quantkit.eval import eval_ids, perplexity
from quantkit.run.load import load_quantized
from quantkit.models.hub import load_fp_model

PEER_SCRIPT = Path(__file__).with_name("peer_llmcompressor.py")
JOB_SCRIPT = Path(__file__).with_name("quantkit_job.py")


def parse_run(text: str) -> tuple[dict, dict]:
    """method:bits:group[:asym][:one-pass] -> (the scheme both tools run, quantkit-only options)."""
    method, *rest = text.split(":")
    flags = rest[2:]
    if method not in ("gptq", "rtn") or len(rest) < 2 or not set(flags) <= {"sym", "asym", "one-pass"}:
        raise SystemExit(f"run {text!r}: use method:bits:group[:asym][:one-pass] with method gptq or rtn")
    scheme = {"method": method, "bits": int(rest[0]), "group_size": int(rest[1]), "sym": "asym" not in flags}
    return scheme, ({"true_sequential": False} if "one-pass" in flags else {})


def evaluate(model, texts: dict, seqlen: int) -> dict:
    return {name: perplexity(model, ids, seqlen, progress=False)["ppl"] for name, ids in texts.items()}


def run_quantkit(model_path, run, calib_file, texts, seqlen, extra, evaluated=True) -> dict:
    """{"times": [seconds]} and, if evaluated, the model's perplexity per text. The quantization runs in a fresh
    Python (scripts/quantkit_job.py), as llm-compressor's does: neither tool's later runs start warm."""
    with tempfile.TemporaryDirectory() as tmp:
        out, timing = Path(tmp) / "q", Path(tmp) / "timing.json"
        cmd = [sys.executable, str(JOB_SCRIPT), str(model_path), str(calib_file), str(out), "--timing", str(timing),
               *_scheme_args(run)] + (["--one-pass"] if extra.get("true_sequential") is False else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"quantkit run failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
        times = {"times": [json.loads(timing.read_text())["seconds"]]}
        if not evaluated:
            return times
        model = load_quantized(out, device="cpu", dtype="float32")
        return {**times, **evaluate(model, texts, seqlen)}


def _scheme_args(run) -> list[str]:
    """The command-line options both tools' job scripts take for a scheme."""
    return ["--method", run["method"], "--bits", str(run["bits"]), "--group-size", str(run["group_size"]),
            "--sym" if run["sym"] else "--no-sym"]


def run_peer(peer_python, model_path, run, calib_file, texts, seqlen, evaluated=True) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer"
        cmd = [peer_python, str(PEER_SCRIPT), str(model_path), str(calib_file), str(out), *_scheme_args(run)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"llm-compressor run failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
        timing = json.loads((out / "timing.json").read_text())
        times = {"times": [timing["seconds"]], "oneshot": [timing["oneshot_seconds"]]}
        if not evaluated:
            return times
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # weights only, no tokenizer
        return {**times, **evaluate(model, texts, seqlen)}


def with_run(so_far, run) -> dict:
    """A tool's result for a scheme after one more run: its times so far plus the new one, the rest as first
    measured; seconds is the fastest run (what the code costs with the least interference from the machine)."""
    merged = {**run, **(so_far or {})}
    for key in ("times", "oneshot"):  # every run's seconds (whole job; llm-compressor's oneshot() alone)
        if key in run:
            merged[key] = (so_far or {}).get(key, []) + run[key]
    return {**merged, "seconds": min(merged["times"])}


def pair_ratios(mine, peer) -> list[float]:
    """quantkit's seconds over llm-compressor's, run by run: the i-th runs of the two ran one after the other (for a
    scheme that shares another's llm-compressor runs, the i-th run of that scheme's)."""
    return [q / p for q, p in zip(mine.get("times", []), peer.get("times", [])) if p]


def markdown(rows, text_names) -> str:
    head = ["run"] + [f"quantkit {t} ppl" for t in text_names] + ["quantkit s"]
    head += [f"llm-compressor {t} ppl" for t in text_names] + ["llm-compressor s", "time ratio", "pair ratios (median)",
                                                                "its oneshot() s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        q, p = r["quantkit"], r["peer"]
        cells = [r["run"]] + [f"{q[t]:.2f}" for t in text_names] + [f"{q['seconds']:.0f}"]
        cells += [f"{p[t]:.2f}" for t in text_names] + [f"{p['seconds']:.0f}" if p["seconds"] else "—"]
        cells.append(f"{q['seconds'] / p['seconds']:.2f}x" if p["seconds"] else "—")
        pairs = pair_ratios(q, p)
        cells.append(f"{', '.join(f'{x:.2f}' for x in pairs)} ({statistics.median(pairs):.2f}x)" if pairs else "—")
        cells.append(f"{min(p['oneshot']):.0f}" if p.get("oneshot") else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model folder (safetensors)")
    p.add_argument("--peer-python", required=True, help="a Python with llmcompressor installed")
    p.add_argument("--calib", required=True, help="calibration text file or dataset")
    p.add_argument("--eval", required=True, help="evaluation text (the first --max-tokens tokens)")
    p.add_argument("--heldout", help="a second evaluation text, reported in its own column")
    p.add_argument("--runs", nargs="+", required=True,
                   help="method:bits:group[:asym][:one-pass], method gptq or rtn")
    p.add_argument("--nsamples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration windows (the spread over seeds "
                   "says how much of a difference between the tools is the choice of samples)")
    p.add_argument("--repeat", type=int, default=1, help="time each tool this many times per scheme, alternating, "
                   "and report the fastest (this machine's speed drifts by up to 20%% between minutes)")
    p.add_argument("--json", help="write the rows here (after every run)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: use 1 or more runs per tool")

    torch.manual_seed(0)
    fp_model, tokenizer = load_fp_model(args.model, "float32")
    texts = {"eval": eval_ids(tokenizer, args.eval, args.max_tokens)}
    if args.heldout:
        texts["heldout"] = eval_ids(tokenizer, args.heldout, args.max_tokens)
    calib = calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen, seed=args.seed)
    rows = [{"run": "fp", "quantkit": {"seconds": 0.0, **evaluate(fp_model, texts, args.seqlen)}}]
    rows[0]["peer"] = rows[0]["quantkit"]
    del fp_model
    with tempfile.TemporaryDirectory() as tmp:
        calib_file = Path(tmp) / "calib.pt"
        torch.save(calib, calib_file)
        peer = {}  # llm-compressor's runs per scheme, shared by the quantkit runs of that scheme
        for spec in args.runs:
            scheme, extra = parse_run(spec)
            key = json.dumps(scheme, sort_keys=True)
            mine = None
            for rep in range(args.repeat):  # the tools alternate: a slow spell of the machine hits both
                if len(peer.get(key, {}).get("times", [])) <= rep:
                    peer[key] = with_run(peer.get(key), run_peer(args.peer_python, args.model, scheme, calib_file,
                                                                 texts, args.seqlen, evaluated=key not in peer))
                mine = with_run(mine, run_quantkit(args.model, scheme, calib_file, texts, args.seqlen, extra,
                                                   evaluated=mine is None))
            row = {"run": spec, "quantkit": mine, "peer": peer[key]}
            rows.append(row)
            print(f"{spec}: {json.dumps(row)}", file=sys.stderr)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(markdown(rows, list(texts)))


if __name__ == "__main__":
    main()
