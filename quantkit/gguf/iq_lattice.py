"""llama.cpp's 2- and 3-bit lattice types as quantizers: IQ2_XXS and IQ3_XXS, super-blocks of 256 weights of a row.

Eight consecutive weights are rounded together, to a signed point of a fixed list (quantkit.gguf.iq_grids):
    IQ2_XXS  one point of 8 magnitudes in {8, 25, 43}        8-bit index + 7 sign bits       2.0625 bits per weight
    IQ3_XXS  two points of 4 magnitudes in {4, 12, ..., 62}  2 x 8-bit index + 7 sign bits   3.0625 bits per weight
The eighth sign is implied: the number of minus signs is even, the parity rule of the E8 lattice whose points the
lists are drawn from. w = step * sign * magnitude, step = d (2 l + 1) / 8 (IQ2_XXS) or d (2 l + 1) / 4 (IQ3_XXS), l a
4-bit scale per sub-block of 32, d one fp16 per super-block (quantkit.gguf.iq_lattice_blocks lays them out).

Rounding is an exact nearest-point search: every point of the list with the weights' own signs and, where an odd
number of them is negative, the one flip that costs least (llama.cpp rounds each coordinate and, off the list,
searches that point's neighbours). Distances weigh each column by its importance where the method has one (GPTQ:
the diagonal of its error metric for the unit): a unit is not rounded column by column, so the weights change
its point. The fit, per sub-block: 19 steps from 0.37x to 1.63x the one that puts the largest weight on the largest
magnitude, each refitted by weighted least squares on its points, the best kept; then d and the 4-bit scales
fitted to those steps by least squares against the fp16 d the reader uses. Weights: the importance where one is
given (GPTQ's Hessian diagonal, where llama.cpp weighs by its imatrix), w^2 otherwise.

A weight's code is its level index with a sign bit above it (3 bits for IQ2_XXS, 4 for IQ3_XXS), so dequantize needs
no list; the layout turns each 8 codes back into point indices and 7 sign bits.
"""
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch

from quantkit.gguf.iq_grids import DIMS, MAGNITUDES, WORDS
from quantkit.gguf.kquants import SUPER, BestRefit
from quantkit.schemes.base import OneType, register_quantizer

UNIT = 8          # weights rounded together: one sign word
BLOCK = 32        # a sub-block: one 4-bit scale
TRIES = 9         # steps tried on each side of the peak's
SPACING = 0.07    # their spacing: 0.37x to 1.63x the peak's step. Outliers of little importance want the small
                  # ones (SmolLM2's last ffn_down, IQ3_XXS: weighted error 0.61 -> 0.55 of llama.cpp's from 0.03)
CHUNK = 2048      # units searched at once: the search holds [CHUNK, 256, 8] floats
SCALE_CODES = 16  # l in 0..15
STEP_UNIT = {"IQ2_XXS": 1 / 8, "IQ3_XXS": 1 / 4}  # step = d (2 l + 1) unit


@cache
def tables(kind: str, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(magnitudes [levels], points [256, dims] float, level indices [256, dims] int64) on `device`. Never written."""
    dims, bits = DIMS[kind], level_bits(kind)
    words = torch.tensor(WORDS[kind], dtype=torch.int64, device=device)
    levels = (words[:, None] >> (bits * torch.arange(dims, device=device))) & ((1 << bits) - 1)
    magnitudes = torch.tensor(MAGNITUDES[kind], dtype=torch.float32, device=device)
    return magnitudes, magnitudes[levels], levels


def level_bits(kind: str) -> int:
    return (len(MAGNITUDES[kind]) - 1).bit_length()


def nearest_points(x: torch.Tensor, kind: str, h: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(point index [n, 8 / dims], negative [n, 8] bool): the signed point of least h-weighted squared distance to
    each unit x [n, 8] (in steps), with an even number of minus signs. h [n, 8], if given, weighs each coordinate."""
    _, points, _ = tables(kind, x.device)
    n, dims = x.shape[0], points.shape[1]
    a, negative = x.abs(), x < 0
    ha = (a if h is None else h * a).view(n, UNIT // dims, dims)
    squares = points.square()
    norm = squares.sum(dim=-1) if h is None else h.view(n, -1, dims) @ squares.t()
    cost = norm - 2 * (ha @ points.t())                       # [n, parts, 256], up to the unit's constant
    plain, index = cost.min(dim=-1)
    odd = (negative.sum(dim=-1) % 2 == 1).nonzero().squeeze(1)
    if len(odd):
        index[odd], turned = _turn_one(cost[odd], plain[odd], index[odd], ha[odd], points)
        negative[odd] ^= turned
    return index, negative


def _turn_one(cost, plain, index, ha, points) -> tuple[torch.Tensor, torch.Tensor]:
    """(point index [m, parts], turned [m, 8] bool) for units with an odd count of minus signs: the points, and the
    one coordinate whose sign turns, of least cost together. cost [m, parts, 256]; plain, index: its minima."""
    parts = cost.shape[1]
    flipped, flip_index = (cost + _cheapest_flip(ha, points)).min(dim=-1)
    host = (flipped - plain).argmin(dim=-1)                   # the part that takes the turn (IQ3_XXS has two)
    takes = torch.arange(parts, device=cost.device) == host[:, None]
    index = torch.where(takes, flip_index, index)
    score = torch.where(takes[..., None], ha * points[index], torch.full_like(ha, float("inf"))).flatten(1)
    return index, torch.arange(UNIT, device=cost.device) == score.argmin(dim=-1, keepdim=True)


def _cheapest_flip(ha: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """[n, parts, 256]: what turning the cheapest coordinate negative adds, min_j 4 h_j |x_j| point_j (a coordinate at
    a time: the [n, parts, 256, dims] product would cost 2-3x the time)."""
    columns = points.t()
    out = ha[..., :1] * columns[0]
    for j in range(1, columns.shape[0]):
        torch.minimum(out, ha[..., j:j + 1] * columns[j], out=out)
    return 4 * out


def codes_of(index: torch.Tensor, negative: torch.Tensor, kind: str) -> torch.Tensor:
    """Codes [n, 8] int64 (level | sign << level bits) of the points `index` [n, parts] with signs `negative`."""
    _, _, levels = tables(kind, index.device)
    return levels[index].reshape(index.shape[0], UNIT) | negative.long() << level_bits(kind)


def values(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """Signed magnitudes (float32) of codes of any shape."""
    magnitudes, _, _ = tables(kind, codes.device)
    codes = codes.long()
    bits = level_bits(kind)
    return magnitudes[codes & ((1 << bits) - 1)] * (1 - 2 * (codes >> bits & 1)).float()


def step_of(params: dict, kind: str) -> torch.Tensor:
    """The sub-blocks' steps d (2 l + 1) unit from their params {"d", "sc"}."""
    return params["d"] * (2 * params["sc"] + 1) * STEP_UNIT[kind]


def _round_units(x: torch.Tensor, kind: str, h: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes [n, 8] of units x [n, 8], CHUNK units at a time."""
    out = torch.empty(x.shape, dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], CHUNK):
        part = slice(i, i + CHUNK)
        out[part] = codes_of(*nearest_points(x[part], kind, None if h is None else h[part]), kind)
    return out


def fit_scales(step: torch.Tensor, weight: torch.Tensor, unit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [rows, n] repeated, l [rows, n]) with step [rows, n] >= 0 ~ d unit (2 l + 1), l in 0..15, d fp16: each
    candidate d (the largest step on an odd multiple between 27 and 31.5) refitted by least squares weighted by
    `weight` [rows, n], rounded to fp16, the l's rounded against it; the least weighted error wins."""
    peak = step.amax(dim=-1)
    zero = peak <= 0
    peak = torch.where(zero, torch.ones_like(peak), peak)
    top = 2 * SCALE_CODES - 1
    best_d, best_err = torch.zeros_like(peak), torch.full_like(peak, float("inf"))
    for target in torch.arange(27.0, 31.75, 0.25).tolist():
        d = peak / (unit * target)
        m = _odd(step / (unit * d[:, None]), top)
        sm2 = (weight * m * m).sum(dim=-1)
        d = torch.where(sm2 > 0, (weight * step * m).sum(dim=-1) / (unit * sm2.clamp(min=1e-30)), d).half().float()
        m = _odd(step / (unit * (d + (d == 0))[:, None]), top)
        err = (weight * (unit * d[:, None] * m - step).square()).sum(dim=-1)
        better = err < best_err
        best_d, best_err = torch.where(better, d, best_d), torch.where(better, err, best_err)
    best_d = torch.where(zero, torch.zeros_like(best_d), best_d)
    m = _odd(step / (unit * (best_d + (best_d == 0))[:, None]), top)
    return best_d[:, None].expand_as(m).contiguous(), (m - 1) / 2


def _odd(v: torch.Tensor, top: int) -> torch.Tensor:
    """The odd integer in 1..top nearest each value."""
    return 2 * ((v - 1) / 2).round().clamp(0, (top - 1) // 2) + 1


@dataclass(frozen=True)
class _Lattice(OneType):
    """The shared rounding: codes are signed levels, times the sub-block's step d (2 l + 1) unit."""
    type_group = BLOCK
    width = UNIT
    span = SUPER // BLOCK
    rounds_numpy = False
    weighted_round = True

    @property
    def code_bits(self) -> int:
        return level_bits(self.ggml_type) + 1

    @property
    def param_bits(self) -> dict:
        return {"d": 16, "sc": 4}

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / SUPER

    @property
    def unit(self) -> float:
        return STEP_UNIT[self.ggml_type]

    def round(self, w: torch.Tensor, params: dict, importance: Optional[torch.Tensor] = None):
        """(codes, dequantized) of w [rows, 8 k] with per-row params [rows]; importance [8 k], if given, weighs
        each column's error in the search (without it a column with 1000x the importance of its neighbours, as
        SmolLM2's last ffn_down has, is rounded as if it mattered as much as they do)."""
        step = step_of(params, self.ggml_type)[:, None].float()
        x = w.float() / (step + (step == 0))
        h = None if importance is None else importance.float().to(w.device).expand(w.shape).reshape(-1, UNIT)
        codes = _round_units(x.reshape(-1, UNIT), self.ggml_type, h).reshape(w.shape)
        return codes, step * values(codes, self.ggml_type)

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        return step_of(params, self.ggml_type) * values(codes, self.ggml_type)

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        """{"d", "sc"}: [rows, 8] each, for one super-block w [rows, 256]; importance [256], if given, weighs each
        column."""
        rows = w.shape[0]
        x = w.float().reshape(rows * self.span, BLOCK)
        if importance is None:
            h = x.square()
        else:
            h = importance.float().to(x.device).reshape(self.span, BLOCK).repeat(rows, 1)
        step, weight = self._sub_steps(x, h)
        d, sc = fit_scales(step.view(rows, self.span), weight.view(rows, self.span), self.unit)
        return {"d": d, "sc": sc}

    def _sub_steps(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(step [n], sum h q^2 [n]) for sub-blocks x [n, 32] under weights h [n, 32]: the search of the docstring."""
        top = MAGNITUDES[self.ggml_type][-1]
        peak = x.abs().amax(dim=-1)
        zero = peak <= 1e-30
        peak = torch.where(zero, torch.ones_like(peak), peak)
        best = BestRefit(peak / top, positive=True)
        for i in range(-TRIES, TRIES + 1):
            s = peak / (top * (1 + SPACING * i))
            codes = _round_units((x / s[:, None]).reshape(-1, UNIT), self.ggml_type, h.reshape(-1, UNIT))
            best.offer(x, values(codes, self.ggml_type).view_as(x), h)
        return torch.where(zero, torch.zeros_like(best.scale), best.scale), best.q2


@register_quantizer
@dataclass(frozen=True)
class IQ2XXS(_Lattice):
    """{"d", "sc"} per row and sub-block of 32, d (fp16) repeated over its super-block of 256, sc in 0..15."""
    name = "iq2xxs"
    ggml_type = "IQ2_XXS"
    type_bits = 2
    block_bytes = 66  # per super-block of 256
    summary = ("llama.cpp's IQ2_XXS: 8 weights a signed point of an E8-lattice list, 4-bit scales per 32, an fp16 "
               "step per 256 (--bits 2 --group-size 32; rows of whole super-blocks)")


@register_quantizer
@dataclass(frozen=True)
class IQ3XXS(_Lattice):
    """{"d", "sc"} per row and sub-block of 32, d (fp16) repeated over its super-block of 256, sc in 0..15."""
    name = "iq3xxs"
    ggml_type = "IQ3_XXS"
    type_bits = 3
    block_bytes = 98
    summary = ("llama.cpp's IQ3_XXS: 4 weights a point of an E8-lattice list, signs per 8, 4-bit scales per 32, an "
               "fp16 step per 256 (--bits 3 --group-size 32; rows of whole super-blocks)")
