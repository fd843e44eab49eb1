#!/usr/bin/env python
"""Every decoder family transformers ships, quantized by quantkit: which ones it handles, and how well.

For each family (a model_type of transformers' causal-LM or image-text-to-text table, encoder-decoders and
masked-LM encoders aside) a tiny random model is built from the family's own config class, its defaults shrunk
by one table of field names (no entry per family), with the fewest layers that still hold every kind of layer
the full default config has. Each method then runs in a child process of its own, so a crash or a hang costs
one row: `quantkit quantize` (the CLI, calibrating on a local text file), load_quantized of the output and a
forward on held-out text (two windows of 64 tokens of WikiText-2's test split, tokenized with the model's tokenizer
as the calibration text is), compared with the fp model's logits on the same ids. The quantized share is counted
again here from the output's safetensors files, independently of the share quantkit prints.

The stages live in scripts/sweep/ (see its __init__). Some families' vision towers are timm models (fast_vlm,
gemma3n, perception_lm): they build only where `timm` and the torchvision it imports can be imported, else they are
rows "not built". PyPI's torchvision wheels are CUDA builds that do not import beside a CPU-only torch; timm needs
only torchvision's Python side, which 0.16 imports without its C ops, so for the sweep alone:
    pip install --no-deps --target /tmp/timm timm pillow torchvision==0.16.2
    PYTHONPATH=/tmp/timm python scripts/family_sweep.py --families gemma3n fast_vlm ...

    python scripts/family_sweep.py --families llama qwen3_next gemma4 --workdir /tmp/sweep
    python scripts/family_sweep.py --timeout 240 --out docs/MODELS.md   (every family, rtn and gptq)
The children run the quantkit that `python -c "import quantkit"` finds: an editable install's finder takes
precedence over PYTHONPATH, so to sweep a fixed revision while the working tree changes, install that revision into a
venv of its own.
"""
import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from sweep.children import ANSWER, child_build, child_check, child_json, error_line, run_child
from sweep.coverage import quantized_share
from sweep.heldout import HELD_OUT
from sweep.tiny_build import build_tiny, tiny_config

# what other code imports from here (tests/test_family_sample.py: build_tiny)
__all__ = ["build_tiny", "tiny_config", "decoder_families", "quantized_share", "main"]

REPO = Path(__file__).resolve().parents[1]
CALIB = REPO.parent / "shared" / "assets" / "text" / "wikitext2_tok_valid.txt"
ROW = "row: "  # the prefix of a finished family's row (JSON) on stdout
MARKER = ".family_sweep"  # marks a workdir/<family> folder this script made (and may delete)


def decoder_families() -> list:
    """model_types transformers builds a text-generating head for, less encoder-decoders and the BERT-style encoders
    that also register a causal-LM head (their masked-LM head is what they are); a family that is still not causal
    is caught by build_tiny's causality check."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    keys = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(t for t in keys - set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)
                  if not _encoder_decoder(CONFIG_MAPPING[t]))


def _encoder_decoder(config_class) -> bool:
    """The class's default is_encoder_decoder, or an encoder/decoder pair of sub-configs (T5Gemma2, Musicgen)."""
    default = next((f.default for f in dataclasses.fields(config_class) if f.name == "is_encoder_decoder"), False)
    return bool(default) or {"encoder", "decoder"} <= set(config_class.sub_configs) or (
        "text_encoder" in config_class.sub_configs)


def quantize_argv(src: Path, out: Path, method: str, dataset: str) -> list:
    """The command line under test, as a user types it (--device cpu: no GPU probing)."""
    return ["quantkit", "quantize", str(src), "-o", str(out), "--method", method, "--bits", "4", "--group-size", "32",
            "--nsamples", "8", "--seqlen", "64", "--dataset", dataset, "--device", "cpu"]


def run_method(src: Path, reference: Path, out: Path, method: str, args) -> dict:
    """quantize, then load + forward, within args.timeout seconds in all: {status, rel, share, float, summary,
    why}."""
    t0 = time.perf_counter()
    rc, stdout, stderr = run_child(quantize_argv(src, out, method, args.dataset), args.timeout, args.env)
    summary = next((line.strip() for line in reversed(stdout.splitlines()) if line.startswith("quantized ")), "")
    if rc is None:
        return {"status": "timeout", "why": f"quantize ran past {args.timeout:.0f} s", "summary": summary}
    if rc != 0:
        return {"status": "quantize failed", "why": error_line(stderr) or f"exit code {rc}", "summary": summary}
    share, floats = quantized_share(out, 4)
    row = {"share": share, "float": floats, "summary": summary}
    left = max(10.0, args.timeout - (time.perf_counter() - t0))
    answer, why = child_json(["check", str(out), str(reference)], left, args.env)
    if answer is None:
        return {**row, "status": "timeout" if why == "timeout" else "load failed", "why": why}
    if answer["stage"] != "ok":
        return {**row, "status": f"{answer['stage']} failed", "why": answer["error"]}
    return {**row, "status": "ok", "rel": answer["rel"]}


def run_family(model_type: str, args) -> dict:
    """One row: build, then every method (each in child processes of its own)."""
    t0 = time.perf_counter()
    work = Path(args.workdir) / model_type
    if (work / MARKER).exists():
        shutil.rmtree(work)  # a folder of an earlier sweep (nothing else is ever deleted)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).touch()
    src, reference = work / "fp", work / "fp_reference.pt"
    built, why = child_json(["build", model_type, str(src), str(reference), *args.heldout], args.timeout, args.env)
    row = {"family": model_type, "methods": {}}
    if built is None or "error" in built:
        why = built["error"] if built else "build ran past the timeout" if why == "timeout" else why
        return {**row, "status": "not built", "why": why, "seconds": time.perf_counter() - t0}
    row["built"] = built
    for method in args.methods:
        row["methods"][method] = run_method(src, reference, work / method, method, args)
    failed = [(m, r) for m, r in row["methods"].items() if r["status"] != "ok"]
    row["status"] = failed[0][1]["status"] if failed else "ok"
    row["why"] = "; ".join(f"{m}: {r['why']}" for m, r in failed) if failed else (
        f"built with {built['repair']}" if built.get("repair") else "")
    row["seconds"] = time.perf_counter() - t0
    return row


def markdown(rows: list, methods: list) -> str:
    """The results as one markdown table, a row per family."""
    head = ["family", "status", "quantized share", *[f"{m} rel err" for m in methods], "stayed in float", "why",
            "quantkit's summary"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        results = row["methods"]
        done = [r for r in results.values() if "share" in r]
        share = " / ".join(sorted({f"{100 * r['share']:.1f} %" for r in done})) or "-"
        errors = [f"{results[m]['rel']:.4f}" if "rel" in results.get(m, {}) else "-" for m in methods]
        floats = done[0]["float"] if done else "-"
        why = row.get("why", "").replace("|", "\\|")
        said = next((r["summary"] for r in results.values() if r.get("summary")), "-")
        lines.append(f"| {row['family']} | {row['status']} | {share} | {' | '.join(errors)} | {floats} | {why} | "
                     f"{said} |")
    return "\n".join(lines)


def header(argv: list, seconds: float, heldout: list) -> str:
    """The paragraph above the table: what ran, when, against which versions, how long, what the columns mean."""
    import transformers

    text, part = heldout
    tokens = f"the {'first' if part == 'head' else 'last'} 2 x 64 tokens of {Path(text).name}"
    return (f"# quantkit across transformers' decoder families\n\n"
            f"`python scripts/family_sweep.py {' '.join(argv)}` on {date.today().isoformat()}: transformers "
            f"{transformers.__version__}, quantkit from {quantkit_tree()}, {seconds / 60:.1f} min in all. Each "
            "family: a tiny random model from its config class's defaults, `quantkit quantize --bits 4 --group-size "
            "32 --nsamples 8 --seqlen 64` (calibration: --dataset), load_quantized and a forward. rel err = "
            f"||q - fp|| / ||fp|| of the logits on held-out text the calibration never saw ({tokens}, tokenized "
            "with the model's tokenizer as the calibration text is): how closely each method keeps the model on "
            "text of the kind it was calibrated for. Quantized share: counted from the checkpoint's files (decoder "
            "blocks only: embeddings, lm_head and vision/audio towers aside). The families whose vision tower is a "
            "timm model (fast_vlm, gemma3n, perception_lm) build only where `timm` is installed.\n\n")


def held_out_text(args) -> list:
    """[text file, "head" or "tail"]: the --heldout file's first tokens; without one, WikiText-2's test text, or where
    shared/ lacks it, the last tokens of the calibration file itself (the calibration reads only its start)."""
    text = Path(args.heldout) if args.heldout else HELD_OUT if HELD_OUT.exists() else Path(args.dataset)
    return [str(text), "tail" if text.resolve() == Path(args.dataset).resolve() else "head"]


def quantkit_tree() -> str:
    """Where the children's quantkit comes from (PYTHONPATH may point elsewhere), with its git commit if any."""
    from importlib.util import find_spec

    folder = Path(find_spec("quantkit").origin).parent
    commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return f"{folder}" + (f" (git {commit}, with any uncommitted changes)" if commit else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", help="model_types (default: every decoder family)")
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq"])
    ap.add_argument("--workdir", default="/tmp/quantkit_family_sweep")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per family and method (and for the build)")
    ap.add_argument("--out", help="write the markdown table here (default: print only)")
    ap.add_argument("--jobs", type=int, default=1, help="families swept at once")
    ap.add_argument("--json", help="also write the rows (every method's result) as JSON here")
    ap.add_argument("--dataset", default=str(CALIB if CALIB.exists() else REPO / "README.md"),
                    help="calibration text file (default: ../shared's WikiText-2 validation text, else README.md)")
    ap.add_argument("--heldout", help="text file whose first tokens the fp and quantized logits are compared on "
                    "(default: ../shared's WikiText-2 test text, else the end of --dataset's file)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        answer = {"build": child_build, "check": child_check}[kind](*rest)
        print(ANSWER + json.dumps(answer), flush=True)
        return
    families = args.families or decoder_families()
    args.env = _child_env(args.jobs)
    args.heldout = held_out_text(args)
    t0 = time.perf_counter()
    rows = sweep(families, args)
    seconds = time.perf_counter() - t0
    table = markdown(rows, args.methods)
    print(f"\n{table}\n\n{len(rows)} families in {seconds / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "rows": rows}, indent=1))
    if args.out:
        Path(args.out).write_text(header(sys.argv[1:] if argv is None else argv, seconds, args.heldout) + table + "\n")


def sweep(families: list, args) -> list:
    """run_family over the families, args.jobs at a time, in the given order; a line of progress per family."""
    from concurrent.futures import ThreadPoolExecutor

    done = []

    def one(model_type):
        row = run_family(model_type, args)
        done.append(model_type)
        print(f"[{len(done)}/{len(families)}] {model_type}: {row['status']} ({row['seconds']:.0f} s) "
              f"{row.get('why', '')}"[:200], flush=True)
        print(ROW + json.dumps(row), flush=True)  # each finished row whole: a sweep cut short still has them
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(one, families))


def _child_env(jobs: int):
    """The children's environment: the cores shared between the jobs running at once."""
    import os

    if jobs <= 1:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}


if __name__ == "__main__":
    main()
