"""`quantkit demo`: the whole job on a fresh offline machine.

Quantizes the bundled stories260k model (a real 292,800-parameter Llama trained on TinyStories, MIT
licence, karpathy/llama2.c) and prints floating-point vs quantized perplexity. With no dataset on
disk, the text is sampled from the fp model itself (seeded): a quantized model that matches the fp
model's distribution scores close to it, so the gap measures the damage quantization does.
"""
import dataclasses
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from quantkit.api import quantize
from quantkit.eval import perplexity
from quantkit.models.arch import arch_for, context_length
from quantkit.models.hub import load_fp_model
from quantkit.run.config import QuantConfig
from quantkit.run.load import load_quantized
from quantkit.run.output import claim_output
from quantkit.run.precheck import layer_specs, quantizable_linears, skip_override, unit_misfits

SEQLEN = 512  # windows for a model whose config names no context (stories260k's is 512)


def bundled_model_path() -> Path:
    return Path(str(resources.files("quantkit") / "assets" / "stories260k"))


def sample_text_ids(model, n_tokens: int, seed: int, seqlen: int) -> torch.Tensor:
    """[rows, seqlen] token ids sampled from `model` (temperature 1), starting at BOS."""
    rows = max(1, n_tokens // seqlen)
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 1
    start = torch.full((rows, 1), bos, dtype=torch.long)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(start, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_length=seqlen,
                             min_length=seqlen, pad_token_id=model.config.pad_token_id or 0)
    return out[:, :seqlen]


def run_demo(out, bits, group_size, method, n_tokens, overwrite=False) -> str:
    src = bundled_model_path()
    if out is not None:
        claim_output(out, overwrite, sources=[src])  # before the sampling: refuse a bad -o at once
    fp_model, _ = load_fp_model(str(src), "float32")
    seqlen = context_length(fp_model.config) or SEQLEN  # windows as long as the model's context
    eval_rows = sample_text_ids(fp_model, n_tokens, seed=0, seqlen=seqlen)
    config = QuantConfig(method=method, bits=bits, group_size=group_size, nsamples=32, seqlen=seqlen)
    config, kept = skip_misfits(config, fp_model)
    calib_rows = None
    if config.needs_calibration:
        calib_rows = sample_text_ids(fp_model, config.nsamples * seqlen, seed=1, seqlen=seqlen)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(out) if out else Path(tmp) / "stories260k-quantized"
        t0 = time.perf_counter()
        quantize(str(src), target, config, device="cpu", overwrite=overwrite, calibration_ids=calib_rows,
                 resumable=False)
        seconds = time.perf_counter() - t0
        q_model = load_quantized(target, device="cpu")  # where the fp model runs, in its float32
        stream = eval_rows.reshape(1, -1)
        fp = perplexity(fp_model, stream, seqlen, progress=False)
        q = perplexity(q_model, stream, seqlen, progress=False)
        size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    return "\n".join([
        f"stories260k, {method} w{bits} g{group_size}: quantized in {seconds:.1f} s, checkpoint {size / 1024:.0f} KiB"
        + (f", written to {out}" if out else " (deleted afterwards; keep it with -o DIR)"),
        *kept,
        f"perplexity on {fp['tokens']} self-generated tokens (seqlen {seqlen}):",
        "| model | perplexity |", "|---|---|",
        f"| fp32 | {fp['ppl']:.3f} |",
        f"| {method} w{bits} g{group_size} | {q['ppl']:.3f} |",
    ])


def skip_misfits(config, fp_model):
    """(config, note lines): the bundled model's down_proj has 172 inputs, which E8's 8-column units do not
    divide; the demo keeps such layers in floating point, as the error of `quantize` tells a user to, and says so."""
    misfits = unit_misfits(*layer_specs(fp_model, quantizable_linears(fp_model, arch_for(fp_model)), config))
    if not misfits:
        return config, []
    override = skip_override(misfits)
    reason = next(iter(misfits.values()))
    note = f"kept in floating point: {len(misfits)} layers matching {override['pattern']} ({reason})"
    return dataclasses.replace(config, modules=[override]), [note]
