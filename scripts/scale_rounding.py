"""bench_quality with the symmetric fp16 scales rounded another way (docs/QUALITY.md, "The scales' rounding direction").

quantkit rounds a symmetric grid's fp16 scale down (quantkit.methods.grid._fp16_at_most), so a group's negative
extreme, exactly on the -(2^(bits-1) - 1/2) tie, takes the full code. This runs scripts/bench_quality.py unchanged
except for that one rounding, to measure how much the direction moves a method:

    python scripts/scale_rounding.py up ~/.cache/quantkit-assets/smollm2-135m \
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt \
        --max-tokens 32768 --seqlen 512 --nsamples 32 --runs gptq:3:128

First argument: down (quantkit's default), nearest (before commit 5c411bc), up, range (not a rounding: the
range-fitting scale of scripts/layer_error.py) or choose (GPTQ's static groups pick the better of the default and
the range fit per row and group, by the Hessian-diagonal-weighted rounding error); the rest is bench_quality's.
"""
import runpy
import sys
from pathlib import Path

import torch

import quantkit.methods.grid as grid
from layer_error import RangeFitGrid, fp16_at_least


def to_nearest(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


ROUNDINGS = {"down": grid._fp16_at_most, "nearest": to_nearest, "up": fp16_at_least}
PLAIN_FIT = grid.fit


def range_fit(w: torch.Tensor, g) -> tuple:
    """Symmetric grids: scripts/layer_error.py's range fit (the dominant extreme exactly on its end code)."""
    if not g.sym:
        return PLAIN_FIT(w, g)
    params = RangeFitGrid(g.bits, True).fit(w)
    return params["scale"], params["zero"]


def choose_per_group():
    """GPTQ's static symmetric groups (act-order's default) take, per row and group, whichever of quantkit's scale and
    the range fit rounds the original weights with the smaller Hessian-diagonal-weighted error (an experiment: the
    layer's H diagonal reaches the fit through a wrapped GPTQ.quantize)."""
    import quantkit.methods.gptq as gptq

    plain_quantize, plain_fit_static, diag = gptq.GPTQ.quantize, gptq._fit_static, {}

    def quantize(self, quantizer, *args, **kwargs):
        diag["H"] = self.H.diagonal().clone()
        return plain_quantize(self, quantizer, *args, **kwargs)

    def fit_static(Wt, quantizer, group_size):
        ours = plain_fit_static(Wt, quantizer, group_size)
        if type(quantizer) is not grid.Grid or not quantizer.sym:
            return ours
        ranged = plain_fit_static(Wt, RangeFitGrid(quantizer.bits, True), group_size)
        W = Wt.t()
        g_idx = torch.arange(W.shape[1]) // (W.shape[1] if group_size == -1 else group_size)

        def weighted_error(p):
            e = (W - grid.fake_quantize(W, p["scale"][:, g_idx], p["zero"][:, g_idx], quantizer.maxq)) ** 2
            return torch.zeros_like(p["scale"]).index_add_(1, g_idx, e * diag["H"].to(W.dtype))

        take = weighted_error(ranged) < weighted_error(ours)
        return {k: torch.where(take, ranged[k], ours[k]) for k in ours}

    gptq.GPTQ.quantize, gptq._fit_static = quantize, fit_static


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in (*ROUNDINGS, "range", "choose"):
        sys.exit(f"usage: scale_rounding.py {{{','.join(ROUNDINGS)},range,choose}} MODEL [bench_quality options]")
    choice = sys.argv.pop(1)
    if choice == "range":
        grid.fit = range_fit
    elif choice == "choose":
        choose_per_group()
    else:
        grid._fp16_at_most = ROUNDINGS[choice]
    bench = Path(__file__).with_name("bench_quality.py")
    sys.argv[0] = str(bench)
    runpy.run_path(str(bench), run_name="__main__")
