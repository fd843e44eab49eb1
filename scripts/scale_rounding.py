"""bench_quality with the symmetric grid's scale fitted another way (docs/QUALITY.md, "The scales' rounding direction"
and "The 2x is one weight").

quantkit's symmetric grid takes, per row and group, the better of two scales (quantkit.schemes.grid.Grid.fit): the
max-abs scale rounded down to fp16 (a group's negative extreme, exactly on the -(2^(bits-1) - 1/2) tie, then takes
the full code) and the range fit (the dominant extreme exactly on its end code), by the squared rounding error,
weighted by H's diagonal under GPTQ. This runs scripts/bench_quality.py unchanged except for that fit, to measure
what each part is worth:

    python scripts/scale_rounding.py max-abs ~/.cache/quantkit-assets/smollm2-135m \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt \\
        --max-tokens 32768 --seqlen 512 --nsamples 32 --runs gptq:3:128

First argument: choice (quantkit's default), max-abs (the max-abs scale only, rounded down: the default before the
choice), nearest (max-abs rounded to the nearest fp16: before commit 5c411bc), up (max-abs rounded up) or range (the
range fit only); the rest is bench_quality's. Asymmetric grids are the same in every mode.
"""
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import quantkit.schemes.grid as grid

PLAIN_FIT = grid.Grid.fit


def only(scale_of):
    """A Grid.fit whose symmetric scale is scale_of(w, grid) alone."""
    def fit(self, w, importance=None):
        if not self.sym:
            return PLAIN_FIT(self, w, importance)
        scale = scale_of(w, self)
        return {"scale": scale, "zero": torch.full_like(scale, float(2 ** (self.bits - 1)))}
    return fit


def single_scale_grid(scale_of, name: str) -> type:
    """A Grid subclass whose symmetric scale is scale_of(w, grid) alone (scripts/layer_error.py compares them)."""
    return dataclass(frozen=True)(type(name, (grid.Grid,), {"fit": only(scale_of)}))


def max_abs(rounding):
    """The max-abs scale 2 absmax / (2^bits - 1), rounded to fp16 by `rounding`."""
    def scale_of(w, g):
        absmax = w.float().abs().amax(dim=-1)
        return rounding(torch.where(absmax > 0, 2 * absmax / g.maxq, torch.ones_like(absmax))).clamp(min=2**-24)
    return scale_of


MODES = {
    "choice": None,
    "max-abs": max_abs(grid._fp16_at_most),
    "nearest": max_abs(lambda x: x.half().float()),
    "up": max_abs(grid.fp16_at_least),
    "range": grid.range_fit_scale,
}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: scale_rounding.py {{{','.join(MODES)}}} MODEL [bench_quality options]")
    mode = MODES[sys.argv.pop(1)]
    if mode is not None:
        grid.Grid.fit = only(mode)
    bench = Path(__file__).with_name("bench_quality.py")
    sys.argv[0] = str(bench)
    runpy.run_path(str(bench), run_name="__main__")
