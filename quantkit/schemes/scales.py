"""Per-group scales as checkpoints store them, and the least-squared-error scale search that the codebook
quantizers (turboquant, e8) share.

A scale is one fp16 number per row and group: what the method's error feedback uses must be what a
reader decodes, so every candidate is rounded to fp16 before it is tried. The search tries multiples of a
starting scale s0 (the quantizer's natural one: the block's rms over the codebook's) and then one
least-squares step: with the codes of the best candidate fixed, s = <w, p> / <p, p> for the decoded unit-scale
points p. It keeps whichever gives the least squared error, row by row, so it never does worse than s0.
"""
import math

import torch

SEARCH = torch.linspace(0.7, 1.3, 31).tolist()  # multipliers of s0; 1.0 is among them


def fp16_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales as the checkpoint stores them (fp16) and nonzero (an all-zero block decodes to ~0)."""
    return s.half().float().clamp(min=2**-24)


def squared_error(quantizer, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per row of w [rows, cols], ||w - round(w)||² with scale s [rows] (the quantizer's own shortcut if it has one)."""
    if hasattr(quantizer, "squared_error"):
        return quantizer.squared_error(w, s)
    return (w - quantizer.round(w, {"scale": s})[1]).pow(2).sum(dim=1)


def searched_scale(quantizer, w: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """The scale [rows] with the least squared error among fp16(s0 * SEARCH) and a least-squares refit."""
    w = w.float()
    best_s, best_err = fp16_scale(s0), torch.full_like(s0, math.inf)
    for m in SEARCH:
        s = fp16_scale(s0 * m)
        err = squared_error(quantizer, w, s)
        better = err < best_err
        best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    points = quantizer.round(w, {"scale": best_s})[1] / best_s[:, None]
    refit = fp16_scale((w * points).sum(dim=1) / (points * points).sum(dim=1).clamp(min=1e-30))
    return torch.where(squared_error(quantizer, w, refit) < best_err, refit, best_s)


class OneScalePerGroup:
    """What the codebook quantizers (turboquant, e8, trellis) share: b-bit codes and one fp16 "scale" per row and group.

    `spread_by_bits` (a class attribute, bits -> the codebook's rms per unit scale) gives the default `fit`: the
    scale search starts from the group's rms over that spread (trellis fits its own)."""
    bits: int
    spread_by_bits = {}  # set by each quantizer

    def fit(self, w: torch.Tensor, importance=None) -> dict:
        """{"scale": [rows]} for one group w [rows, cols]; the search is unweighted (`importance` unused)."""
        rms = w.float().pow(2).mean(dim=1).sqrt()
        return {"scale": searched_scale(self, w, rms / self.spread_by_bits[self.bits])}

    @property
    def code_bits(self) -> int:
        return self.bits

    @property
    def param_bits(self) -> dict:
        return {"scale": 16}
