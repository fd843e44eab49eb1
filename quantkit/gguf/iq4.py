"""llama.cpp's non-linear 4-bit types as quantizers: IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256).

Each code indexes a fixed table of 16 levels (kvalues_iq4nl, denser near zero, as weights are) times a scale:
    IQ4_NL  w = d kvalue[q]                          d fp16 per block of 32              4.5 bits per weight
    IQ4_XS  w = (d (ls - 32)) kvalue[q]              ls 6 bits per sub-block of 32,       4.25 bits per weight
                                                     d fp16 per super-block of 256
(quantkit.gguf.iq4_blocks lays them out byte for byte). The fit follows llama.cpp's quantize_row_iq4_nl_impl:
per block of 32, the scales that put the largest-magnitude weight on either end of the table (+127, clipped to
113, and -127) and 2 x 7 more around the second, each refitted by weighted least squares on its codes, the best
kept; IQ4_XS then quantizes the sub-block scales to 6 bits against one fp16 step (searched the same way, not only
max / 32). The fits weigh each weight by its
importance where one is given (GPTQ's Hessian diagonal, where llama.cpp weighs by imatrix * sqrt(sigma^2 + w^2):
on SmolLM2 IQ4_XS the plain diagonal gave mean KLD 0.0772 against 0.0789), by w^2 otherwise, as llama.cpp does.
"""
from dataclasses import dataclass
from functools import cache
from typing import Optional

import torch

from quantkit.gguf.kquants import SUPER, BestRefit, fit_signed
from quantkit.schemes.base import OneType, register_quantizer

LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
BLOCK = 32
TRIES = 7


@cache
def _table(device=None) -> torch.Tensor:
    """The levels as float32 on `device`, made once: GPTQ's column loop rounds a column at a time. Never written."""
    return torch.tensor(LEVELS, dtype=torch.float32, device=device)


@cache
def _midpoints(device=None) -> torch.Tensor:
    table = _table(device)
    return (table[1:] + table[:-1]) / 2


def nearest_level(v: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest each value of v (in units of the scale)."""
    return torch.bucketize(v.contiguous(), _midpoints(v.device))


@dataclass(frozen=True)
class _IQ4(OneType):
    """The shared rounding of both types: codes index LEVELS, times the block's step."""
    bits: int = 4
    type_bits = 4
    type_group = BLOCK
    width = 1
    code_bits = 4

    def _step(self, params: dict):
        return params["d"] * params["sc"] if "sc" in params else params["d"]

    def round(self, w: torch.Tensor, params: dict):
        """(codes, dequantized) of w [rows, cols] with per-row params [rows]."""
        step = self._step(params)[:, None]
        q = nearest_level(w / (step + (step == 0)))
        return q, step * _table(w.device)[q]

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        return self._step(params) * _table(codes.device)[codes.long()]


def _block_scales(x: torch.Tensor, importance: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [..., blocks], weights) of x [rows, blocks, 32]: llama.cpp's search per block of 32."""
    x2 = x.square()
    if importance is None:
        weights = x2
    else:
        weights = importance.float().to(x.device).reshape(1, *x.shape[1:]).expand_as(x)
    peak = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    zero = peak.abs() < 1e-15
    peak = torch.where(zero, torch.ones_like(peak), peak)
    table = _table(x.device)
    best = BestRefit(torch.zeros_like(peak))
    # llama.cpp's first candidate puts the peak on +127 (a positive step, the peak clipped to 113), then the peak on
    # -127 + i (a negative step): without the first, RTN's IQ4_NL rounded 1.3 % further in its own w^2-weighted error
    for multiplier in [-LEVELS[0]] + [i + LEVELS[0] for i in range(-TRIES, TRIES + 1)]:
        best.offer(x, table[nearest_level(x * (multiplier / peak)[..., None])], weights)
    return torch.where(zero, torch.zeros_like(best.scale), best.scale), weights


@register_quantizer
@dataclass(frozen=True)
class IQ4NL(_IQ4):
    """{"d"} per row and block of 32: fp16."""
    name = "iq4nl"
    ggml_type = "IQ4_NL"
    summary = "llama.cpp's IQ4_NL: 16 non-uniform levels times an fp16 scale per block of 32 (--bits 4 --group-size 32)"
    rounds_numpy = False
    bits_per_weight = 4.5

    @property
    def param_bits(self) -> dict:
        return {"d": 16}

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        scale, _ = _block_scales(w.float()[:, None], importance)
        return {"d": scale[:, 0].half().float()}


@register_quantizer
@dataclass(frozen=True)
class IQ4XS(_IQ4):
    """{"d", "sc"} per row and sub-block of 32, d (fp16) repeated over its super-block of 256, sc in -32..31."""
    name = "iq4xs"
    ggml_type = "IQ4_XS"
    summary = ("llama.cpp's IQ4_XS: IQ4_NL's levels with 6-bit scales per block of 32 under an fp16 step per 256 "
               "(--bits 4 --group-size 32; rows of whole super-blocks)")
    rounds_numpy = False
    bits_per_weight = 4.25
    span = SUPER // BLOCK

    @property
    def param_bits(self) -> dict:
        return {"d": 16, "sc": 6}

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        """{key: [rows, 8]} for one super-block w [rows, 256]."""
        scale, weights = _block_scales(w.float().reshape(w.shape[0], self.span, BLOCK), importance)
        step, sc = fit_signed(scale, weights.sum(dim=-1), 32, fp16_step=True)
        return {"d": step[:, None].expand_as(sc).contiguous(), "sc": sc}
