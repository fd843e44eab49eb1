#!/usr/bin/env python
"""Distortion benchmark: normalized MSE E||x - x̂||² / E||x||² per bit width, scalar RTN against TurboQuant,
on i.i.d. Gaussian vectors and on real SmolLM2-135M weight rows (rotated and not), next to theory.

Every method quantizes blocks of d consecutive weights of a row (d = --dim, 128 by default) with one fp16
scale per block, so all of them spend b + 16/d bits per weight (turboquant_prod: b + 32/d, two norms):
  rtn             symmetric uniform grid (2^b levels), scale from the block's absmax (GPTQ's sym grid)
  rtn_mse         the same grid, scale searched per block for the least squared error (a clipping search)
  turboquant_norm TurboQuant_mse as the paper has it: Lloyd–Max codebook of the sphere density, scale = the
                  block's norm (quantkit.schemes.turboquant, scale="norm")
  turboquant_ratio the same with the norm-ratio correction: the scale makes ||x̂|| = ||x|| per block
  turboquant      quantkit's default: the same codebook, scale searched per block for the least squared error
  turboquant_prod TurboQuant_prod: (b-1)-bit turboquant_norm + 1-bit QJL of the residual (sign(S r), S
                  i.i.d. N(0, 1) d x d, and ||r||), decoded as x̂_mse + sqrt(pi/2)/d ||r|| Sᵀ sign(S r)
  e8_box          box-truncated E8 lattice, 8 weights per point at exactly b bits per weight, scale searched
                  per block (quantkit.schemes.e8; b = 1..4)
  e8_relaxed      the seed's relaxed-parity variant of the same box (half-integer coset without the parity
                  rule): 1.5x the points, so b + 0.073 bits per weight; compare it with e8_box at that rate
  e8p             QuIP#'s E8P ball (2^16 points of E8 + ¼, 16 bits per 8 weights) at b = 2; at b = 3 and 4 E8P
                  plus a residual stage (the 256-point E8 codebook / E8P again, on the residual times a fixed
                  ratio), scale searched per block (quantkit.schemes.e8p)
  e8              what --method e8 rounds with: the E8 codebook that measured best at each b (e8p at 2..4,
                  e8_box at 1; quantkit.schemes.base.best_e8), the same numbers as that row
  trellis         QTIP's trellis-coded quantizer as --quantizer trellis makes it (quantkit.schemes.trellis: L = 16
                  state bits, 3INST with 2 weights per step at 1-2 bits, 1MAD with 1 at 3-4, tail-biting sequences
                  of 256 weights: --dim a multiple of 256), scale from the block's rms; b = 1..4. Each sequence is
                  a row's consecutive weights (the tile's shape does not change i.i.d. data's distortion).
                  --trellis L:V:code[:length[:scale]] adds a row per variant
                  (trellis_L16_V1_1mad; scale "refit": the least-squares refit, "unit": one fixed scale for unit
                  Gaussians, rate exactly b, as QTIP measures)
Seconds per million weights of every row are printed too (torch threads: --threads; the CPU: lscpu's model name).
Theory: Lloyd–Max MSE of the unit Gaussian (the d -> inf codebook with the exact norm), the lower bound
4^-b and TurboQuant's upper bound sqrt(3) pi / 2 * 4^-b ≈ 2.72 * 4^-b.
Rotated rows use quantkit's randomized Hadamard rotation (block = largest power of two dividing the width).

    python scripts/bench_distortion.py --model ~/.cache/quantkit-assets/smollm2-135m          # markdown
    python scripts/bench_distortion.py --model ~/.cache/quantkit-assets/smollm2-135m --json   # one JSON object
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.core.errors import QuantkitError
from quantkit.schemes.lloyd_max import codebook_mse, lloyd_max
from quantkit.schemes.e8 import NATURAL_SPREAD, E8Box, box_point, nearest_box_coset
from quantkit.schemes.e8p import E8P
from quantkit.schemes.e8p_codebook import RATIO, SUPPORTED_BITS as E8P_BITS
from quantkit.schemes.base import quantizer_for
from quantkit.schemes.rotation import Rotation
from quantkit.algorithms.rtn import rtn
from quantkit.schemes.scales import SEARCH, fp16_scale
from quantkit.schemes.trellis import GAIN as TRELLIS_GAIN, Trellis
from quantkit.schemes.turboquant import TurboQuant

BITS = (1, 2, 3, 4, 5)
SOURCES = ("gaussian", "smollm2", "smollm2_rotated")
CLIP = torch.linspace(0.3, 1.0, 36).tolist()  # rtn_mse: fractions of the absmax scale tried


RELAXED_EXTRA_BITS = math.log2(1.5) / 8  # per weight: the relaxed set has 1.5 x 2^(8b) points


def nearest_relaxed(y: torch.Tensor, bits: int, offset: float) -> torch.Tensor:
    """The seed's "relaxed parity" variant, for measurement: the integer coset keeps Σk even, the half-integer
    coset drops the parity rule (all of (Z + ½)⁸ in the box). 2^(8b-1) + 2^(8b) points: b + RELAXED_EXTRA_BITS
    bits per weight at an exact (entropy-coded) rate. Returns the nearest point [..., 8] (float64)."""
    k0, e0 = nearest_box_coset(y, bits, offset)
    t = y - (offset + 0.5 - 2 ** (bits - 1))
    k1 = torch.round(t).clamp_(0, (1 << bits) - 1)
    e1 = ((t - k1) ** 2).sum(dim=-1)
    second = (e1 < e0)[..., None]
    point0 = box_point(k0, torch.zeros_like(e0, dtype=torch.long), bits, offset)
    point1 = box_point(k1, torch.ones_like(e0, dtype=torch.long), bits, offset)
    return torch.where(second, point1, point0)


def least_error(x, candidates):
    """Per row of x, the reconstruction with the least squared error among candidates(s) for each scale s."""
    best, best_err = None, None
    for xq in candidates:
        err = (x - xq).pow(2).sum(dim=1, keepdim=True)
        if best is None:
            best, best_err = xq, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, xq, best), torch.where(better, err, best_err)
    return best


def uniform(x, bits, search):
    """Symmetric uniform grid per row of x [rows, d] (GPTQ's: scale 2 absmax / (2^b - 1), zero 2^(b-1))."""
    maxq, zero = 2**bits - 1, 2 ** (bits - 1)
    base = 2 * x.abs().amax(dim=1, keepdim=True) / maxq

    def rounded(f):
        s = fp16_scale(base * f)
        return s * (torch.clamp(torch.round(x / s) + zero, 0, maxq) - zero)

    return least_error(x, (rounded(f) for f in (CLIP if search else [1.0])))


def turbo(x, bits, scale):
    d = x.shape[1]
    return rtn(x, TurboQuant(bits, d, scale), d).decoded()


def turbo_prod(x, bits, seed=0):
    """TurboQuant_prod at b bits: (b-1)-bit TurboQuant_mse (paper's norm) + 1-bit QJL of the residual."""
    d = x.shape[1]
    base = turbo(x, bits - 1, "norm") if bits > 1 else torch.zeros_like(x)
    r = x - base
    S = torch.randn(d, d, generator=torch.Generator().manual_seed(seed))
    norm = r.norm(dim=1, keepdim=True).half().float()
    return base + math.sqrt(math.pi / 2) / d * norm * (torch.sign(r @ S.t()) @ S)


_DECODED = {}


def rtn_decoded(x, quantizer):
    """rtn's decoded blocks, computed once per (quantizer, x): the e8 row repeats e8p's or e8_box's."""
    key = (quantizer, x.data_ptr(), tuple(x.shape))
    if key not in _DECODED:
        _DECODED[key] = rtn(x, quantizer, x.shape[1]).decoded()
    return _DECODED[key]


def e8_box(x, bits):
    return rtn_decoded(x, E8Box(bits)) if bits in NATURAL_SPREAD else None


def e8p(x, bits, ratio=None):
    return rtn_decoded(x, E8P(bits, ratio=ratio)) if bits in E8P_BITS and (ratio is None or bits > 2) else None


def e8(x, bits):
    try:
        return rtn_decoded(x, quantizer_for("e8", bits, True, x.shape[1]))
    except QuantkitError:
        return None


def e8_relaxed(x, bits):
    """Relaxed-parity box E8 with the same per-block scale search as e8 (without its least-squares step)."""
    if bits not in NATURAL_SPREAD:
        return None
    s0 = x.pow(2).mean(dim=1, keepdim=True).sqrt() / NATURAL_SPREAD[bits]

    def rounded(m):
        s = fp16_scale(s0 * m)
        return nearest_relaxed((x / s).reshape(x.shape[0], -1, 8), bits, 0.25).float().reshape(x.shape) * s

    return least_error(x, (rounded(m) for m in SEARCH))


def trellis(x, bits, variant=None, unit=False):
    """The trellis quantizer's blocks decoded: the default, or variant (state_bits, step, code, length, scale).
    unit: every block at the one scale that fits unit Gaussians (GAIN / the table's rms; rate exactly b, what QTIP
    measures) instead of a scale per block."""
    if bits not in range(1, 5):
        return None
    try:
        q = Trellis(bits, tile_rows=1) if variant is None else Trellis(bits, *variant, tile_rows=1)
        if unit:
            s = torch.full((x.shape[0],), TRELLIS_GAIN[bits] / q.spread)
            return q.round(x, {"scale": fp16_scale(s)})[1]
        return rtn(x, q, x.shape[1]).decoded()
    except QuantkitError:  # 4 bits x 2 weights per step need more than 8 state bits; --dim no multiple of length
        return None


def trellis_variant(spec: str):
    """(row name, variant, unit) of a --trellis "L:V:code[:length[:scale]]" (scale: rms, refit or unit)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4, 5) or (len(parts) == 5 and parts[4] not in ("rms", "refit", "unit")):
        raise argparse.ArgumentTypeError(f"--trellis {spec!r}: use L:V:code[:length[:scale]], e.g. 16:1:1mad or "
                                         "12:2:3inst:64:refit (scale rms, refit or unit)")
    L, V, code = int(parts[0]), int(parts[1]), parts[2]
    length = int(parts[3]) if len(parts) > 3 else 64
    scale = parts[4] if len(parts) > 4 else "rms"
    name = f"trellis_L{L}_V{V}_{code}" + (f"_T{length}" if len(parts) > 3 else "") + (f"_{scale}" if len(parts) > 4
                                                                                       else "")
    return name, (L, V, code, length, "rms" if scale == "unit" else scale), scale == "unit"


METHODS = {
    "rtn": lambda x, b: uniform(x, b, search=False),
    "rtn_mse": lambda x, b: uniform(x, b, search=True),
    "turboquant_norm": lambda x, b: turbo(x, b, "norm"),
    "turboquant_ratio": lambda x, b: turbo(x, b, "ratio"),
    "turboquant": lambda x, b: turbo(x, b, "mse"),
    "turboquant_prod": turbo_prod,
    "e8_box": e8_box,
    "e8_relaxed": e8_relaxed,
    "e8p": e8p,
    "e8": e8,
    "trellis": trellis,
}


def nmse(x, xq):
    return None if xq is None else round(float((x - xq).pow(2).sum() / x.pow(2).sum()), 6)


def blocks(w, d):
    """Rows of w [out, in] cut into blocks of d weights: [out * in / d, d] (in must be a multiple of d)."""
    return w.reshape(-1, d)


def smollm2_rows(model_dir, d, rotate, layers=(0, 15, 29), seed=0):
    """Blocks of the 7 linears of a few SmolLM2 decoder layers, as stored or rotated as quantkit rotates."""
    out = []
    path = Path(model_dir).expanduser() / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            if not name.endswith("proj.weight") or int(name.split(".")[2]) not in layers:
                continue
            w = f.get_tensor(name).float()
            if rotate:
                w = Rotation.for_layer(name, w.shape[1], seed).rotate_weight(w)
            out.append(blocks(w, d))
    return torch.cat(out)


def measure(x, bits, methods=None, ratios=(), variants=()) -> tuple[dict, dict]:
    """({method: {bits: normalized MSE}}, {method: {bits: seconds per million weights}}) of x's blocks."""
    fns = {m: fn for m, fn in METHODS.items() if methods is None or m in methods}
    fns.update({f"e8p_ratio{r:g}": (lambda x, b, r=r: e8p(x, b, r)) for r in ratios})
    fns.update({name: (lambda x, b, v=v, u=u: trellis(x, b, v, u)) for name, v, u in variants})
    mse, seconds = {}, {}
    for m, fn in fns.items():
        for b in bits:
            t0 = time.perf_counter()
            mse.setdefault(m, {})[str(b)] = nmse(x, fn(x, b))
            took = (time.perf_counter() - t0) * 1e6 / x.numel()
            seconds.setdefault(m, {})[str(b)] = None if mse[m][str(b)] is None else round(took, 3)
    return mse, seconds


def theory(bits, d) -> dict:
    return {
        "lloyd_max_gaussian": {str(b): round(codebook_mse(lloyd_max(b)), 6) for b in bits},
        f"lloyd_max_sphere_d{d}": {str(b): round(codebook_mse(lloyd_max(b, d), d), 6) for b in bits},
        "lower_bound_4^-b": {str(b): round(4.0**-b, 6) for b in bits},
        "upper_bound_2.72*4^-b": {str(b): round(math.sqrt(3) * math.pi / 2 * 4.0**-b, 6) for b in bits},
    }


def markdown(results: dict, bits) -> str:
    lines = []
    for source, table in results.items():
        what = "seconds per million weights" if source.endswith("_seconds") else "normalized MSE; lower is better"
        lines += [f"\n**{source}** ({what})\n",
                  "| method | " + " | ".join(f"b = {b}" for b in bits) + " |",
                  "|---|" + "---|" * len(bits)]
        lines += [f"| {m} | " + " | ".join("–" if v[str(b)] is None else f"{v[str(b)]:.5f}" for b in bits) + " |"
                  for m, v in table.items()]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="folder of SmolLM2-135M (model.safetensors); without it, Gaussian only")
    p.add_argument("--dim", type=int, default=128, help="block size d (a power of two)")
    p.add_argument("--vectors", type=int, default=100_000, help="Gaussian vectors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, nargs="+", default=list(BITS))
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES,
                   help="what to measure (the smollm2 ones need --model)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), help="only these rows (default: all)")
    p.add_argument("--e8p-ratios", type=float, nargs="*", default=(),
                   help=f"extra e8p rows at 3 and 4 bits with this stage-2 ratio (default ratios: {RATIO})")
    p.add_argument("--trellis", type=trellis_variant, nargs="*", default=(), metavar="L:V:CODE[:LENGTH]",
                   help="extra trellis rows: state bits, weights per step, code (1mad, 3inst, hyb), sequence length")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"theory": theory(args.bits, args.dim)}
    for source in args.sources:
        if source == "gaussian":
            x = torch.randn(args.vectors, args.dim, generator=torch.Generator().manual_seed(args.seed))
        elif args.model:
            x = smollm2_rows(args.model, args.dim, rotate=source == "smollm2_rotated", seed=args.seed)
        else:
            continue
        results[source], results[f"{source}_seconds"] = measure(x, args.bits, args.methods, args.e8p_ratios,
                                                                args.trellis)
    print(json.dumps(results, indent=1) if args.json else markdown(results, args.bits))


if __name__ == "__main__":
    main()
