"""Scalar integer grids: the 4-line primitives every integer method (rtn, gptq, awq) shares.

A grid maps a row-group of weights to codes q in [0, 2^bits - 1] with a per-row scale and zero:
    w_hat = scale * (q - zero)
Asymmetric grids fit [min(w, 0), max(w, 0)]; symmetric grids fit [-absmax, absmax] with
zero = 2^(bits-1) (GPTQ's convention: scale = 2 * absmax / (2^bits - 1)).

Two details keep checkpoints exact and portable:
- scales are rounded to fp16 here, because the checkpoint stores them as fp16; the method's error
  feedback then sees exactly the weights that a reader will decode. Symmetric scales round down (see fit).
- a symmetric group's scale is the better of two fits (Grid.fit): the max-abs scale above and the range fit,
  which puts the group's dominant extreme exactly on its end code (docs/QUALITY.md, "The 2x is one weight").
- asymmetric zeros are clamped to >= 1, because the GPTQ v1 layout stores zero - 1 and cannot
  represent 0 (it would wrap). Only groups whose weights are all >= 0 are affected.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.options import is_int
from quantkit.schemes.base import register_quantizer

SUPPORTED_BITS = (2, 3, 4, 8)


def check_bits(bits, where="--bits", supported=SUPPORTED_BITS):
    """bits, a whole number among `supported` (the integer grid's widths by default), or a QuantkitError."""
    if not is_int(bits) or bits not in supported:
        raise QuantkitError(f"{where} {bits!r} is not supported: choose one of {', '.join(map(str, supported))}")


def check_group_size(group_size, where="--group-size"):
    if not is_int(group_size) or group_size == 0 or group_size < -1:
        raise QuantkitError(f"{where} {group_size!r} is invalid: use -1 (one group per row) or a positive size such as 128")


@register_quantizer
@dataclass(frozen=True)
class Grid:
    """The scalar integer grid as a quantizer (see quantkit.schemes.base): one column at a time,
    parameters {"scale", "zero"} per row and group, codes q in [0, 2^bits - 1]."""
    bits: int
    sym: bool = True

    name = "int"
    summary = ("a per-group integer grid with scale and zero, the only one GPTQ-layout readers run; "
               f"bits {', '.join(map(str, SUPPORTED_BITS))}")
    width = 1
    rounds_numpy = True  # round() also takes NumPy arrays (GPTQ's column loop on CPU), same arithmetic

    def __post_init__(self):
        check_bits(self.bits, "bits")
        if not isinstance(self.sym, bool):
            raise QuantkitError(f"sym must be true or false, got {self.sym!r}")

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "Grid":
        return cls(bits, sym)

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def code_bits(self) -> int:
        return self.bits

    @property
    def param_bits(self) -> dict:
        return {"scale": 16, "zero": self.bits}  # fp16 scales; zeros packed like the codes

    def settings(self) -> dict:
        return {"bits": self.bits, "sym": self.sym}

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        """{"scale", "zero"} [rows] for one group w [rows, cols]. Symmetric groups take, row by row, whichever of
        the max-abs scale (fit) and the range fit (range_fit_scale) rounds w with the smaller squared error,
        weighted per column by `importance` [cols] when given (GPTQ passes its Hessian diagonal)."""
        scale, zero = fit(w, self)
        if self.sym:
            scale = better_scale(w.float(), scale, range_fit_scale(w, self), zero, self.maxq, importance)
        return {"scale": scale, "zero": zero}

    def round(self, w: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized) of w [rows, cols] with per-row params [rows]."""
        scale, zero = params["scale"][:, None], params["zero"][:, None]
        q = quantize(w, scale, zero, self.maxq)
        return q, dequantize(q, scale, zero)

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        """Weights from codes [rows, cols] and params gathered per column ([rows, cols] each)."""
        return params["scale"] * (codes.float() - params["zero"].float())


def value_range(w: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """The range a grid covers along the last dim: [min(w, 0), max(w, 0)], or [-absmax, absmax]."""
    w = w.float()
    xmin = w.amin(dim=-1).clamp(max=0)
    xmax = w.amax(dim=-1).clamp(min=0)
    if grid.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    return xmin, xmax


def fit(w: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero for `w` [rows, cols]; returns float32 tensors of shape [rows]."""
    xmin, xmax = value_range(w, grid)
    span = xmax - xmin
    scale = torch.where(span > 0, span / grid.maxq, torch.ones_like(span))
    # Stored as fp16 (kept nonzero). Symmetric grids put the group's negative extreme exactly on a tie,
    # -(2^(bits-1) - 1/2) steps: with the scale rounded to the nearest fp16 it went to the shorter code
    # whenever fp16 rounded up (about half the groups), shrinking the group's largest weight by half a step.
    # Rounding the scale down gives it the full code -2^(bits-1) in every group: same weight MSE, but the
    # outliers keep their size (SmolLM2 RTN w4 g64: ppl 42.84 -> 41.56, llm-compressor's fp32 grid 41.57).
    scale = (fp16_at_most(scale) if grid.sym else scale.half().float()).clamp(min=2**-24)
    if grid.sym:
        zero = torch.full_like(scale, float(2 ** (grid.bits - 1)))
    else:
        zero = torch.round(-xmin / scale).clamp(1, grid.maxq)
    return scale, zero


def range_fit_scale(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The symmetric scale that fits the group's range exactly: max(-min / 2^(b-1), max / (2^(b-1) - 1)), rounded up
    to fp16, so the dominant extreme lands on its end code and neither is clamped. The max-abs scale puts the
    negative extreme on the full code but clamps a positive absmax by half a step; GPTQ's error feedback can turn
    that half step on one heavily weighted input into a whole row driven to the grid's ends (SmolLM2's
    layers.28.mlp.down_proj, 91 % of the layer's error at 3 bits)."""
    w = w.float()
    half = 2 ** (grid.bits - 1)
    s = torch.maximum(-w.amin(dim=-1).clamp(max=0) / half, w.amax(dim=-1).clamp(min=0) / (half - 1))
    return fp16_at_least(torch.where(s > 0, s, torch.ones_like(s))).clamp(min=2**-24)


def better_scale(w, scale_a, scale_b, zero, maxq, importance=None) -> torch.Tensor:
    """Per row, scale_b where it rounds w [rows, cols] with a strictly smaller (importance-weighted) squared error.
    The errors are summed in float64: a float32 sum's last bit depends on the CPU's vector width, and a choice that
    flipped with it would make checkpoints differ between machines (the elementwise float32 steps do not)."""
    def error(scale):
        s, z = scale[:, None], zero[:, None]
        e = (w / s).round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s).sub_(w).square_()  # quantize then dequantize, in place
        return (e if importance is None else e.mul_(importance.to(e))).sum(dim=-1, dtype=torch.float64)

    return torch.where(error(scale_b) < error(scale_a), scale_b, scale_a)


def fp16_at_most(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 value not above each (positive) x, as float32."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.zeros_like(h)), h).float()


def fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value not below each (positive) x, as float32."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes (float tensor holding integers) for `w`; scale/zero broadcast against w. Methods, not torch
    functions: the same code rounds NumPy arrays (round half to even in both)."""
    return ((w / scale).round() + zero).clip(0, maxq)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale * (q - zero)

