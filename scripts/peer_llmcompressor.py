#!/usr/bin/env python
"""The llm-compressor side of scripts/bench_peer.py: run inside a Python that has llmcompressor installed.

Reads calibration token windows saved by bench_peer.py (a LongTensor [nsamples, seqlen] in a .pt file),
runs llm-compressor's oneshot with its defaults for the scheme (GPTQModifier: static act-order, min-max
observer, dampening 0.01, block 128; QuantizationModifier for RTN), then writes the model with every
quantized weight replaced by its dequantized value (compressed-tensors' own fake_quantize with the
scales and zero points llm-compressor chose) as a plain floating-point checkpoint, so both tools'
models are evaluated by the same code. Also writes timing.json: {"seconds": the wall time of the whole job
`quantkit quantize` does — loading the model, oneshot, saving the compressed checkpoint (in OUT/compressed) —,
"oneshot_seconds": oneshot alone}.

    python scripts/peer_llmcompressor.py MODEL CALIB.pt OUT --method gptq --bits 4 --group-size 64 --sym
"""
import argparse
import json
import time
from pathlib import Path

import torch


def scheme(bits: int, group_size: int, sym: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def recipe(method: str, bits: int, group_size: int, sym: bool):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    groups = scheme(bits, group_size, sym)
    if method == "gptq":
        return GPTQModifier(config_groups=groups, ignore=["lm_head"])
    return QuantizationModifier(config_groups=groups, ignore=["lm_head"])


def calibration_dataset(ids: torch.Tensor):
    from datasets import Dataset

    rows = ids.tolist()
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def dequantized_weights(model) -> dict:
    """name -> dequantized weight of every module llm-compressor quantized (its own fake_quantize)."""
    from compressed_tensors.quantization import fake_quantize

    out = {}
    for name, module in model.named_modules():
        qscheme = getattr(module, "quantization_scheme", None)
        if qscheme is None or qscheme.weights is None or not hasattr(module, "weight_scale"):
            continue
        zero = getattr(module, "weight_zero_point", None)
        # static act-order keeps the groups in column order: no g_idx to pass
        with torch.no_grad():
            out[name + ".weight"] = fake_quantize(module.weight, module.weight_scale, zero,
                                                  qscheme.weights).detach().clone()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("calib", help=".pt file holding the calibration LongTensor [nsamples, seqlen]")
    p.add_argument("out")
    p.add_argument("--method", choices=["gptq", "rtn"], required=True)
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()

    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    ids = torch.load(args.calib)
    t0 = time.perf_counter()
    # fp32 on CPU, as quantkit calibrates there (fp16 matmuls on CPU are slow and less exact)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    t1 = time.perf_counter()
    oneshot(model=model, dataset=calibration_dataset(ids), recipe=recipe(args.method, args.bits, args.group_size,
            args.sym), num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1],
            shuffle_calibration_samples=False)
    t2 = time.perf_counter()
    weights = dequantized_weights(model)  # before saving, which may compress the model's weights in place
    t3 = time.perf_counter()
    model.save_pretrained(Path(args.out, "compressed"), save_compressed=True)
    seconds = (t2 - t0) + (time.perf_counter() - t3)

    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    state = plain.state_dict()
    missing = [n for n in weights if n not in state]
    if missing or not weights:
        raise SystemExit(f"peer: no quantized weights to copy back ({missing[:3] or 'none found'})")
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    plain.save_pretrained(args.out)
    Path(args.out, "timing.json").write_text(json.dumps({"seconds": seconds, "oneshot_seconds": t2 - t1,
                                                                "layers": len(weights)}))


if __name__ == "__main__":
    main()
