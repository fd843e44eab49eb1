"""llama.cpp's k-quants as a quantizer: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, super-blocks of 256 weights of a row.

A super-block is cut into sub-blocks of 16 or 32 weights, each with its own small integer scale (and minimum), and
the super-block stores one fp16 step for the scales (and one for the minimums):
    with a minimum (Q2_K, Q4_K, Q5_K)  w = (d sc) q - (dmin m)      q in 0 .. 2^bits - 1, sc and m in 0 .. 2^k - 1
    symmetric (Q3_K, Q6_K)             w = (d sc) (q - 2^(bits-1))  sc signed (6 bits in Q3_K, 8 in Q6_K)
(quantkit.gguf.kquants_blocks lays them out byte for byte). To the methods a sub-block is a group (--group-size
16 or 32, the type's sub-block) and a super-block is `span` groups fitted together: fit() sees all 256 columns,
because the sub-blocks' scales share the super-block's step; round() then rounds column by column with the
quantized scales, so inside GPTQ the codes get the error feedback llama.cpp's quantizer lacks.

The fit follows llama.cpp's (ggml-quants.c: make_qkx3_quants, make_qx_quants, make_qp_quants) with its importance
weights, importance * sqrt(sigma^2 + w^2) where an importance is given (GPTQ's Hessian diagonal standing where
llama.cpp's imatrix stands), its own weights otherwise. Two things are done better: every search is over more
candidate steps, and the sub-scales are rounded against the fp16 step the reader will use, not the unrounded one.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.schemes.base import register_quantizer
from quantkit.schemes.grid import is_int

SUPER = 256


@dataclass(frozen=True)
class KType:
    name: str
    sub: int          # weights per sub-block: the methods' group size
    scale_bits: int   # bits of each sub-block's scale (and minimum)
    has_min: bool
    block_bytes: int  # bytes per super-block of 256


KTYPES = {2: KType("Q2_K", 16, 4, True, 84), 3: KType("Q3_K", 16, 6, False, 110), 4: KType("Q4_K", 32, 6, True, 144),
          5: KType("Q5_K", 32, 6, True, 176), 6: KType("Q6_K", 16, 8, False, 210)}


@register_quantizer
@dataclass(frozen=True)
class KQuants:
    """Per row and sub-block: {"d", "sc"} (and {"dmin", "m"}), d and dmin repeated over their super-block."""
    bits: int

    name = "kquant"
    summary = ("llama.cpp's GGUF k-quants, super-blocks of 256: --bits 2..6 for Q2_K..Q6_K with --group-size the "
               "sub-block (16 for Q2_K, Q3_K, Q6_K; 32 for Q4_K, Q5_K); each type fixes its own symmetry")
    width = 1
    rounds_numpy = True  # round() also takes NumPy arrays (GPTQ's column loop on CPU)

    def __post_init__(self):
        if not is_int(self.bits) or self.bits not in KTYPES:
            raise QuantkitError(f"the kquant quantizer has no {self.bits!r}-bit type: use --bits 2, 3, 4, 5 or 6 "
                                "(Q2_K .. Q6_K)")

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "KQuants":
        q = cls(bits)
        if group_size != q.kind.sub:
            raise QuantkitError(f"{q.ggml_type}'s sub-blocks are {q.kind.sub} weights wide: use --group-size "
                                f"{q.kind.sub} with --quantizer kquant --bits {bits} (got {group_size})")
        return q

    @property
    def kind(self) -> KType:
        return KTYPES[self.bits]

    @property
    def ggml_type(self) -> str:
        return self.kind.name

    @property
    def span(self) -> int:
        """Groups (sub-blocks) fitted together: one super-block."""
        return SUPER // self.kind.sub

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def offset(self) -> int:
        """The code of zero: 0 with a minimum, else 2^(bits-1) (llama.cpp's 4 and 32)."""
        return 0 if self.kind.has_min else 2 ** (self.bits - 1)

    @property
    def code_bits(self) -> int:
        return self.bits

    @property
    def bits_per_weight(self) -> float:
        """What a super-block really costs (d and dmin are stored once per 256 weights, not per group)."""
        return self.kind.block_bytes * 8 / SUPER

    @property
    def param_bits(self) -> dict:
        k = self.kind.scale_bits
        return {"d": 16, "sc": k, "dmin": 16, "m": k} if self.kind.has_min else {"d": 16, "sc": k}

    def settings(self) -> dict:
        return {"bits": self.bits}

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        """{key: [rows, span]} for one super-block w [rows, 256]; importance [256], if given, weighs each column."""
        kind = self.kind
        x = w.float().reshape(w.shape[0], self.span, kind.sub)
        weights = _weights(x, kind, importance)
        if kind.has_min:
            scale, low = fit_with_min(x, weights, self.maxq)
            sw = weights.sum(dim=-1)
            d, sc = quantize_scales(scale, sw, 2**kind.scale_bits - 1)
            dmin, m = quantize_scales(-low, sw, 2**kind.scale_bits - 1)
            return {"d": d, "sc": sc, "dmin": dmin, "m": m}
        scale, _ = fit_signed(x, weights, self.offset)
        half = 2 ** (kind.scale_bits - 1)
        step, sc = fit_signed(scale, weights.sum(dim=-1), half, fp16_step=True)
        return {"d": step[:, None].expand_as(sc).contiguous(), "sc": sc}

    def round(self, w, params: dict):
        """(codes, dequantized) of w [rows, cols] with per-row params [rows] (torch tensors or NumPy arrays)."""
        step = params["d"][:, None] * params["sc"][:, None]
        safe = step + (step == 0)  # a zero scale rounds every weight to code 0 (its value is 0 or -min anyway)
        if self.kind.has_min:
            low = params["dmin"][:, None] * params["m"][:, None]
            q = ((w + low) / safe).round().clip(0, self.maxq)
            return q, step * q - low
        q = (w / safe).round().clip(-self.offset, self.offset - 1) + self.offset
        return q, step * (q - self.offset)

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        """Weights from codes [rows, cols] and params gathered per column ([rows, cols] each)."""
        w = params["d"] * params["sc"] * (codes.float() - self.offset)
        return w - params["dmin"] * params["m"] if self.kind.has_min else w


def _weights(x: torch.Tensor, kind: KType, importance: Optional[torch.Tensor]) -> torch.Tensor:
    """Each weight's share in the fits' squared errors [rows, span, sub]: llama.cpp's with and without imatrix."""
    x2 = x.square()
    if importance is not None:
        sigma2 = x2.sum(dim=(1, 2), keepdim=True) / SUPER * (1 if kind.name == "Q2_K" else 2)
        return importance.float().to(x.device).reshape(1, *x.shape[1:]) * (sigma2 + x2).sqrt()
    if kind.name in ("Q4_K", "Q5_K"):
        return x2.mean(dim=-1, keepdim=True).sqrt() + x.abs()
    return x.abs() if kind.name == "Q2_K" else x2


def fit_with_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, steps: int = 36):
    """(scale, low) [...] fitting w = scale q + low (low <= 0, q in 0..nmax) to x [..., n] under `weights`: the
    range's own grid and `steps` wider or narrower ones (llama.cpp's make_qkx3_quants, rmin -0.9 by 0.05), each with
    scale and low refitted by weighted least squares on its codes; the one with the least weighted error wins."""
    low = x.amin(dim=-1).clamp(max=0)
    span = x.amax(dim=-1) - low
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    sw, swx = weights.sum(dim=-1), (weights * x).sum(dim=-1)
    best_scale, best_low = span / nmax, low
    best_err = _error(x, weights, best_scale, best_low, nmax)
    for i in range(steps + 1):
        q = ((x - low[..., None]) * ((nmax - 0.9 + 0.05 * i) / span)[..., None]).round().clamp(0, nmax)
        sl, sl2, sxl = (weights * q).sum(-1), (weights * q * q).sum(-1), (weights * q * x).sum(-1)
        det = sw * sl2 - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        scale, this_low = (sw * sxl - swx * sl) / det, (sl2 * swx - sl * sxl) / det
        positive = this_low > 0  # the minimum may not pass zero: refit the scale alone
        scale = torch.where(positive, sxl / sl2.clamp(min=1e-30), scale)
        this_low = torch.where(positive, torch.zeros_like(this_low), this_low)
        err = _error(x, weights, scale, this_low, nmax, q)
        better = ok & (err < best_err)
        best_scale, best_low = torch.where(better, scale, best_scale), torch.where(better, this_low, best_low)
        best_err = torch.where(better, err, best_err)
    zero = torch.zeros_like(best_scale)
    return torch.where(flat, zero, best_scale), torch.where(flat, low, best_low)


def _error(x, weights, scale, low, nmax, q=None):
    if q is None:
        q = ((x - low[..., None]) / scale[..., None]).round().clamp(0, nmax)
    return (weights * (scale[..., None] * q + low[..., None] - x).square()).sum(-1)


def fit_signed(x: torch.Tensor, weights: torch.Tensor, nmax: int, steps: int = 9, fp16_step: bool = False):
    """(scale [...], L [..., n]) with x ~ scale L, L in -nmax .. nmax - 1 (llama.cpp's make_qx_quants): the value of
    largest magnitude lands on -nmax, so the scale takes its sign, and 2 `steps` + 1 grids around it are tried, each
    scale refitted by weighted least squares, the best kept. With fp16_step the scale is rounded to fp16 and L
    rounded against it (what the reader will multiply by)."""
    at = x.abs().argmax(dim=-1, keepdim=True)
    peak = x.gather(-1, at).squeeze(-1)
    zero = peak.abs() < 1e-15
    peak = torch.where(zero, torch.ones_like(peak), peak)
    best_scale, best_gain = torch.zeros_like(peak), torch.full_like(peak, -1.0)
    for i in range(-steps, steps + 1):
        q = (x * (-(nmax + 0.1 * i) / peak)[..., None]).round().clamp(-nmax, nmax - 1)
        sxl, sl2 = (weights * x * q).sum(-1), (weights * q * q).sum(-1)
        gain = torch.where(sl2 > 0, sxl * sxl / sl2.clamp(min=1e-30), torch.full_like(sl2, -1.0))
        better = gain > best_gain
        best_scale = torch.where(better, sxl / sl2.clamp(min=1e-30), best_scale)
        best_gain = torch.where(better, gain, best_gain)
    best_scale = torch.where(zero, torch.zeros_like(best_scale), best_scale)
    if fp16_step:
        best_scale = best_scale.half().float()
    safe = best_scale + (best_scale == 0)
    return best_scale, (x / safe[..., None]).round().clamp(-nmax, nmax - 1)


class BestRefit:
    """Per block, the best of several candidate codings of x: each candidate's values q [..., n] refitted to x by
    least squares under weights h (scale = sum h q x / sum h q^2), the one whose refit removes the most weighted
    error (gain (sum h q x)^2 / sum h q^2) kept; positive: only positive scales may win. `scale` starts at `start`
    and `q2` (the winner's sum h q^2) at 0."""

    def __init__(self, start: torch.Tensor, positive: bool = False):
        self.scale, self.positive = start, positive
        self.gain, self.q2 = torch.full_like(start, -1.0), torch.zeros_like(start)

    def offer(self, x: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> None:
        sqx, sq2 = (h * q * x).sum(-1), (h * q * q).sum(-1)
        gain = torch.where(sq2 > 0, sqx * sqx / sq2.clamp(min=1e-30), torch.full_like(sq2, -1.0))
        better = (gain > self.gain) & (sqx > 0) if self.positive else gain > self.gain
        self.scale = torch.where(better, sqx / sq2.clamp(min=1e-30), self.scale)
        self.gain, self.q2 = torch.where(better, gain, self.gain), torch.where(better, sq2, self.q2)


def quantize_scales(s: torch.Tensor, weights: torch.Tensor, nmax: int, steps: int = 8):
    """(d [..., n] repeated, L [..., n]) with s [..., n] >= 0 ~ d L, L in 0..nmax, d fp16 (llama.cpp's
    make_qp_quants): the largest value's grid and `steps` around it, each step refitted by weighted least squares
    on its codes, then rounded to fp16 and the codes rounded against that."""
    peak = s.amax(dim=-1)
    zero = peak <= 1e-15
    peak = torch.where(zero, torch.ones_like(peak), peak)
    best_d, best_err = torch.zeros_like(peak), torch.full_like(peak, float("inf"))
    for i in range(-steps, steps + 1):
        q = (s * ((nmax + 0.1 * i) / peak)[..., None]).round().clamp(0, nmax)
        sl2 = (weights * q * q).sum(-1)
        d = torch.where(sl2 > 0, (weights * s * q).sum(-1) / sl2.clamp(min=1e-30), peak / nmax)
        d = d.half().float()
        safe = d + (d == 0)
        q = (s / safe[..., None]).round().clamp(0, nmax)
        err = (weights * (d[..., None] * q - s).square()).sum(-1)
        better = err < best_err
        best_d, best_err = torch.where(better, d, best_d), torch.where(better, err, best_err)
    best_d = torch.where(zero, torch.zeros_like(best_d), best_d)
    safe = best_d + (best_d == 0)
    q = (s / safe[..., None]).round().clamp(0, nmax)
    return best_d[..., None].expand_as(q).contiguous(), q
