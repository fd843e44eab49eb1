"""bench_quality with the symmetric grid's scale fitted another way (docs/QUALITY.md, "The scales' rounding direction"
and "The 2x is one weight").

quantkit's symmetric grid takes, per row and group, the better of two scales (quantkit.schemes.grid.Grid.fit): the
max-abs scale rounded down to fp16 (a group's negative extreme, exactly on the -(2^(bits-1) - 1/2) tie, then takes
the full code) and the range fit (the dominant extreme exactly on its end code), by the squared rounding error,
weighted by H's diagonal under GPTQ. This runs scripts/bench_quality.py's runs with the integer grid's fit replaced
by one scale alone, to measure what each part is worth:

    python scripts/scale_rounding.py max-abs ~/.cache/quantkit-assets/smollm2-135m \\
        --calib ../shared/assets/text/wikitext2_tok_valid.txt --eval ../shared/assets/text/wikitext2_raw_test.txt \\
        --max-tokens 32768 --seqlen 512 --nsamples 32 --runs gptq:3:128

First argument: choice (quantkit's default), max-abs (the max-abs scale only, rounded down: the default before the
choice), nearest (max-abs rounded to the nearest fp16: before commit 5c411bc), up (max-abs rounded up) or range (the
range fit only); the rest is bench_quality's options, and its table comes out. Each mode is a Grid subclass (MODES)
that the run gets as `--quantizer int-maxabs` (int-nearest, int-up, int-range): a quantizer name that builds the
subclass and is recorded as "int", so the checkpoint is the same GPTQ layout that plain int codes make and is read
back as such (only the fit differs). Asymmetric grids, and runs whose method rounds with another quantizer
(turboquant, e8), are the same in every mode. scripts/gptq_error_sources.py compares the fits on one layer.
"""
import dataclasses
import sys
from dataclasses import dataclass

import torch

from quantkit.api import QuantConfig
from quantkit.schemes.base import quantizer_names, register_spec_name
from quantkit.schemes.grid import Grid, fp16_at_least, range_fit_scale
from quantkit.schemes.grid import fit as grid_fit

import bench_quality  # the sibling script, as a module: its run specs, sizes and table


def max_abs_scale(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The max-abs scale 2 absmax / (2^bits - 1) of each row of w, not yet rounded to fp16 (1 for a zero row)."""
    absmax = w.float().abs().amax(dim=-1)
    return torch.where(absmax > 0, 2 * absmax / grid.maxq, torch.ones_like(absmax))


@dataclass(frozen=True)
class SingleScaleGrid(Grid):
    """The integer grid with one scale per symmetric row-group, scale(w), instead of the better of two; asymmetric
    groups are fitted as Grid fits them. Its name stays "int": the codes decode as the integer grid's."""
    quantizer = None  # the --quantizer name that builds it (register_quantizers)

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fit(self, w: torch.Tensor, importance=None) -> dict:
        if not self.sym:
            return super().fit(w, importance)
        scale = self.scale(w)
        return {"scale": scale, "zero": torch.full_like(scale, float(2 ** (self.bits - 1)))}


@dataclass(frozen=True)
class MaxAbsGrid(SingleScaleGrid):
    quantizer = "int-maxabs"
    summary = "the int grid with the max-abs scale only, rounded down to fp16 (scripts/scale_rounding.py)"

    def scale(self, w):
        return grid_fit(w, self)[0]  # Grid.fit's first candidate: the max-abs scale rounded down to fp16


@dataclass(frozen=True)
class NearestGrid(SingleScaleGrid):
    quantizer = "int-nearest"
    summary = "the int grid with the max-abs scale only, rounded to the nearest fp16 (scripts/scale_rounding.py)"

    def scale(self, w):
        return max_abs_scale(w, self).half().float().clamp(min=2**-24)


@dataclass(frozen=True)
class UpGrid(SingleScaleGrid):
    quantizer = "int-up"
    summary = "the int grid with the max-abs scale only, rounded up to fp16 (scripts/scale_rounding.py)"

    def scale(self, w):
        return fp16_at_least(max_abs_scale(w, self)).clamp(min=2**-24)


@dataclass(frozen=True)
class RangeFitGrid(SingleScaleGrid):
    quantizer = "int-range"
    summary = "the int grid with the range-fit scale only (scripts/scale_rounding.py)"

    def scale(self, w):
        return range_fit_scale(w, self)


MODES = {"choice": Grid, "max-abs": MaxAbsGrid, "nearest": NearestGrid, "up": UpGrid, "range": RangeFitGrid}


def register_quantizers() -> None:
    """Make each mode's grid a --quantizer name (QuantConfig(quantizer=...)); done once per process."""
    for cls in MODES.values():
        if cls is not Grid and cls.quantizer not in quantizer_names():
            register_spec_name(cls.quantizer, cls.from_spec, cls.summary)


def mode_config(grid: type):
    """bench_quality's config of a run, its integer grid built as `grid` (a run with another quantizer as is)."""
    def config_of(fields: dict, args) -> QuantConfig:
        config = bench_quality.default_config(fields, args)
        if grid is Grid or config.quantizer != Grid.name:
            return config
        return dataclasses.replace(config, quantizer=grid.quantizer)
    return config_of


def main(argv=None):
    """bench_quality.main, each run's integer grid fitted the mode's way."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in MODES:
        sys.exit(f"usage: scale_rounding.py {{{','.join(MODES)}}} MODEL [bench_quality options]")
    register_quantizers()
    bench_quality.main(argv[1:], config_of=mode_config(MODES[argv[0]]), prog="scale_rounding.py MODE")


if __name__ == "__main__":
    main()
