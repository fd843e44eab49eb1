#!/usr/bin/env python
"""One layer through both GPTQs: quantkit's GPTQ.quantize and llm-compressor's quantize_weight, given the same
weight and Hessian — do they agree?

A random layer with correlated inputs and a few loud channels (like a real one); static act-order, damping 0.01,
block 128 in both. Prints the largest weight difference with each tool's own group scales (quantkit rounds its
scales to fp16, what the checkpoint stores), the same with quantkit's scales handed to llm-compressor (0.0 when
the algorithms are the same; symmetric grids only), and both layers' output errors ||(W - Ŵ)X||² / ||WX||².
Needs a Python with both installed, e.g. the peer environment of scripts/bench_peer.py plus
`pip install --no-deps -e .` of this repository.

    python scripts/peer_gptq_layer.py --bits 3 --group-size 64
"""
import argparse

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import output_error
from quantkit.schemes.grid import Grid


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--asym", action="store_true")
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    sym, gs = not args.asym, args.group_size

    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.cols) @ (0.2 * torch.randn(args.cols, args.cols) + torch.eye(args.cols))
    x[:, :4] *= 20
    w = 0.05 * torch.randn(args.rows, args.cols)
    ours = GPTQ(w)
    ours.add_batch(x)
    res = ours.quantize(Grid(args.bits, sym), group_size=gs, act_order=True, static_groups=True)
    w_ours = res.dequantize()

    qargs = QuantizationArgs(num_bits=args.bits, type="int", symmetric=sym, strategy="group", group_size=gs,
                             actorder="static")
    groups = w.reshape(args.rows, -1, gs)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), qargs)

    def peer(scales):
        out, _, _ = quantize_weight(w[None].clone(), ours.H[None].clone(), scales[None], zero[None], None, qargs,
                                    128, 0.01)
        return out[0]

    w_peer = peer(scale)
    print(f"w{args.bits} g{gs} {'sym' if sym else 'asym'}, layer {args.rows} x {args.cols}")
    print(f"  own scales: max |Ŵ_quantkit - Ŵ_llmcompressor| = {float((w_ours - w_peer).abs().max()):.4g} "
          f"(scales differ by at most {float((res.params['scale'] - scale).abs().max()):.3g}: fp16 rounding)")
    if sym:
        same = peer(res.params["scale"].clone())
        print(f"  quantkit's scales in both: max difference = {float((w_ours - same).abs().max()):.4g}")
    print(f"  output error: quantkit {output_error(w, w_ours, ours.H):.5f}, "
          f"llm-compressor {output_error(w, w_peer, ours.H):.5f}")


if __name__ == "__main__":
    main()
