#!/usr/bin/env python
"""The quantkit side of scripts/bench_peer.py: one quantization in a Python process of its own.

The counterpart of scripts/peer_llmcompressor.py, timed the same way: after the imports, from the model folder to
the packed checkpoint in OUT (quantkit.api.quantize, which reads the source and writes the checkpoint). A fresh
process per run is what a user of `quantkit quantize` gets, and what llm-compressor gets in its runs; a second
quantize() in the process that ran the first (and the fp evaluation) would start with warm caches and allocator.
Writes the seconds as JSON to --timing.

    python scripts/quantkit_job.py MODEL CALIB.pt OUT --timing T.json --method gptq --bits 4 --group-size 64 --sym
"""
import argparse
import json
import time
from pathlib import Path

import torch

from quantkit.api import quantize
from quantkit.run.config import QuantConfig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("calib", help=".pt file holding the calibration LongTensor [nsamples, seqlen]")
    p.add_argument("out", help="the checkpoint folder to write")
    p.add_argument("--timing", required=True, help="JSON file to write {\"seconds\": ...} to")
    p.add_argument("--method", choices=["gptq", "rtn"], required=True)
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--one-pass", action="store_true", help="every linear's statistics of a block in one forward "
                   "(llm-compressor's pipeline shape) instead of true-sequential stages")
    args = p.parse_args(argv)

    ids = torch.load(args.calib)
    config = QuantConfig(method=args.method, bits=args.bits, group_size=args.group_size, sym=args.sym,
                         nsamples=ids.shape[0], seqlen=ids.shape[1], true_sequential=not args.one_pass)
    t0 = time.perf_counter()
    quantize(args.model, args.out, config, device="cpu", calibration_ids=ids if config.needs_calibration else None)
    Path(args.timing).write_text(json.dumps({"seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
