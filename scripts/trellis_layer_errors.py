#!/usr/bin/env python
"""One linear's output error under each codebook quantizer, rounded to nearest and inside GPTQ: why a trellis's unit
shape matters (GPTQ feeds the error back once per unit of `width` columns).

The layer's Hessian comes from the fp model's forward over calibration windows; the layer is rotated as quantkit
rotates it (seeded Hadamard); each quantizer rounds it data-free and with GPTQ (act-order), and the relative output
error tr(E H Eᵀ) / tr(W H Wᵀ) of each is printed, with the seconds.

    python scripts/trellis_layer_errors.py ~/.cache/quantkit-assets/smollm2-135m model.layers.15.self_attn.o_proj \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --nsamples 16 --bits 3

docs/QUALITY.md ("Trellis") has what it showed on SmolLM2.
"""
import argparse
import copy
import time

from quantkit.algorithms.hessian import output_error
from quantkit.algorithms.rtn import rtn
from quantkit.calibration.data import calibration_ids
from quantkit.models.hub import load_fp_model
from quantkit.schemes.base import quantizer_for
from quantkit.schemes.rotation import Rotation
from quantkit.schemes.trellis import Trellis

from gptq_error_sources import layer_hessian  # the sibling script, as a module: a layer's Hessian from the fp model


def quantizers(bits: int, group: int) -> dict:
    l12 = dict(state_bits=12, length=64)  # --quantizer trellis-l12's trellis, in each tile shape
    return {"turboquant": quantizer_for("turboquant", bits, True, group), "e8p": quantizer_for("e8", bits, True, group),
            "trellis L 12, 64 columns of a row": Trellis(bits, tile_rows=1, **l12),
            "trellis L 12, tiles of 4 x 16": Trellis(bits, tile_rows=4, **l12),
            "trellis L 12, tiles of 8 x 8": Trellis(bits, tile_rows=8, **l12),
            "trellis L 12, tiles of 32 x 2 (trellis-l12)": Trellis(bits, tile_rows=32, **l12),
            "trellis L 16, tiles of 16 x 16 (trellis-l16, QTIP's)": Trellis(bits, tile_rows=16),
            "trellis L 16, tiles of 64 x 4 (the default)": Trellis(bits)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("layer")
    p.add_argument("--calib", required=True)
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=128)
    args = p.parse_args(argv)
    model, tokenizer = load_fp_model(args.model, "float32")
    ids = calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen, seed=0)
    base = layer_hessian(model, args.layer, ids)
    base.rotate(Rotation.for_layer(args.layer, base.weight.shape[1], 0))
    W, H = base.weight.float().clone(), base.H.clone()
    print(f"| {args.layer}, {args.bits} bits, g{args.group_size} | round to nearest | GPTQ, act-order | seconds |")
    print("|---|---|---|---|")
    for label, q in quantizers(args.bits, args.group_size).items():
        start = time.perf_counter()
        nearest = output_error(W, rtn(W, q, args.group_size).dequantize(), H)
        fed_back = copy.deepcopy(base).quantize(q, args.group_size, block_size=128, damp=0.01, act_order=True)
        print(f"| {label} | {nearest:.5f} | {output_error(W, fed_back.dequantize(), H):.5f} | "
              f"{time.perf_counter() - start:.1f} |")


if __name__ == "__main__":
    main()
