#!/usr/bin/env python
"""Where one linear's GPTQ error comes from: its inputs' largest Hessian entries and the rows that carry the error.

The layer's Hessian is accumulated from the fp model on calibration windows (the inputs it would see if every
earlier layer were exact), then GPTQ runs with act-order on and off and with three fits of the symmetric grid's
scale: max-abs (the group's absmax at ±(2^(b-1) - 1/2) steps, so the extreme sits half a step off every code:
quantkit's only fit before the choice), range fit (the smallest scale whose codes -2^(b-1) .. 2^(b-1)-1 hold the
group: the dominant extreme lands exactly on its end code) and quantkit's (per row and group, whichever of the two
rounds the group with the smaller Hessian-diagonal-weighted error). For each it prints the relative output error and
the share of the worst row.

    python scripts/gptq_error_sources.py ~/.cache/quantkit-assets/smollm2-135m model.layers.28.mlp.down_proj \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --nsamples 32 --bits 3 --group-size 128

docs/notes/quality-log.md ("The 2x is one weight") has what it showed on SmolLM2.
"""
import argparse

import torch

from quantkit.algorithms.gptq import GPTQ
from quantkit.calibration.data import calibration_ids
from quantkit.calibration.runner import input_hooks
from quantkit.models.hub import load_fp_model
from quantkit.schemes.grid import Grid

from scale_rounding import MaxAbsGrid, RangeFitGrid  # the sibling script, as a module: its single-scale grids


def layer_hessian(model, name: str, ids: torch.Tensor) -> GPTQ:
    """GPTQ of `name` with its Hessian from the fp model's forward over ids [n, seqlen]."""
    g = GPTQ(model.get_submodule(name).weight)
    with torch.inference_mode(), input_hooks(model, [name], lambda _, x: g.add_batch(x)):
        for row in ids:
            model(row[None], use_cache=False)
    return g


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model folder (safetensors)")
    p.add_argument("layer", help="the linear's full name, e.g. model.layers.28.mlp.down_proj")
    p.add_argument("--calib", required=True, help="calibration text file or dataset")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args(argv)

    model, tokenizer = load_fp_model(args.model, "float32")
    g = layer_hessian(model, args.layer, calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen,
                                                         seed=args.seed))
    H, W = g.H, g.weight
    diag = H.diagonal()
    top = torch.argsort(diag, descending=True)[:4].tolist()
    print(f"{args.layer}: H diagonal median {float(diag.median()):.4g}; largest: "
          + ", ".join(f"input {i} {float(diag[i]):.4g}" for i in top))
    signal = float(((W @ H) * W).sum())
    print("| scale fit | act-order | rel. output error | worst row | its share of the error | its codes at the ends |")
    print("|---|---|---|---|---|---|")
    fits = (("max-abs", MaxAbsGrid), ("range fit", RangeFitGrid), ("quantkit (choice)", Grid))
    for label, grid in ((label, cls(args.bits, True)) for label, cls in fits):
        for act_order in (True, False):
            res = g.quantize(grid, args.group_size, act_order=act_order)
            D = W - res.dequantize()
            per_row = ((D @ H) * D).sum(dim=1)  # each row's ||(W - Ŵ) X||², summing to the layer's (fidelity's noise)
            worst = int(per_row.argmax())
            ends = int(((res.codes[worst] == 0) | (res.codes[worst] == grid.maxq)).sum())
            print(f"| {label} | {'on' if act_order else 'off'} | {float(per_row.sum()) / signal:.5f} | {worst} | "
                  f"{float(per_row[worst] / per_row.sum()):.0%} | {ends} of {W.shape[1]} |")


if __name__ == "__main__":
    main()
