#!/usr/bin/env python
"""Per-linear output error of RTN and GPTQ, each with and without the Hadamard rotation, on real inputs.

Each linear of the chosen blocks is quantized alone from the floating-point model's calibration inputs
(no sequential propagation of quantized outputs), and its relative output error ||(W - Ŵ) X||² / ||W X||²
is printed with the outlier ratio of its inputs (largest / median diagonal entry of H = 2 X Xᵀ / n):
what docs/QUALITY.md uses to explain why rotation helps GPTQ and hurts RTN.

    python scripts/rotation_layer_errors.py MODEL --calib FILE --bits 3 --group-size 64 --blocks 0,15,29
"""
import argparse

from quantkit.calibration.data import calibration_ids
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.hessian import output_error
from quantkit.schemes.grid import Grid
from quantkit.schemes.rotation import Rotation
from quantkit.algorithms.rtn import rtn
from quantkit.models.arch import arch_for, get_submodule, get_weight
from quantkit.models.hub import load_fp_model
from quantkit.calibration.runner import BlockRunner
from quantkit.calibration.capture import capture_block_calls


def errors(W, x, bits, group_size, name):
    """(outlier ratio, rtn, rtn+hadamard, gptq, gptq+hadamard) for one linear."""
    grid, rot = Grid(bits), Rotation.for_layer(name, W.shape[1], 0)
    g = GPTQ(W)
    g.add_batch(x)
    H = g.H.clone()
    d = H.diagonal()
    rotated = GPTQ(W)
    rotated.add_batch(x)
    rotated.rotate(rot)
    return (float(d.max() / d.median()),
            output_error(W, rtn(W, grid, group_size).dequantize(), H),
            output_error(W, rot.unrotate_weight(rtn(rot.rotate_weight(W), grid, group_size).dequantize()), H),
            output_error(W, g.quantize(grid, group_size, act_order=True).dequantize(), H),
            output_error(W, rot.unrotate_weight(rotated.quantize(grid, group_size, act_order=True).decoded()), H))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--calib", required=True)
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--blocks", default="0", help="comma-separated block indices, ascending")
    args = p.parse_args(argv)
    model, tokenizer = load_fp_model(args.model, "float32")
    arch = arch_for(model)
    captured = capture_block_calls(model, arch, calibration_ids(tokenizer, args.calib, args.nsamples, args.seqlen, 0),
                                   "cpu")
    inputs = captured.inputs
    blocks = get_submodule(model, arch.blocks)
    names = [n for stage in arch.sequential for n in stage]
    print(f"w{args.bits} g{args.group_size}: relative output error of each linear alone; "
          "outlier = max H_ii / median H_ii\n")
    print("| layer | outlier | rtn | rtn + hadamard | gptq | gptq + hadamard |\n|---|---|---|---|---|---|")
    done = 0
    for i in sorted(int(b) for b in args.blocks.split(",")):
        for j in range(done, i):  # the fp model's inputs of block i
            inputs = BlockRunner(blocks[j], inputs, captured.of_block(j), "cpu").forward_all(keep_outputs=True)
        done = i
        xs = BlockRunner(blocks[i], inputs, captured.of_block(i), "cpu").capture(names)
        for n in names:
            ratio, *errs = errors(get_weight(blocks[i].get_submodule(n)).float(), xs[n], args.bits, args.group_size,
                                  f"{arch.blocks}.{i}.{n}")
            print(f"| {i}.{n} | {ratio:.0f} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


if __name__ == "__main__":
    main()
