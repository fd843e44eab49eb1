"""E8P as a quantizer (--quantizer e8p; "e8", the e8 methods' default, picks it at 2-4 bits): 8 columns at a time,
one fp16 scale per row and group, w_hat = scale * point. The codebook, its 16-bit codes, the exact nearest-point
search and the residual stages are quantkit.schemes.e8p_codebook.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.schemes.base import KernelDecode, offer_method, register_quantizer, register_spec_name
from quantkit.schemes.e8 import E8Box
from quantkit.schemes.e8p_codebook import (ABS_TABLE, E8_1BIT_TABLE, NATURAL_SPREAD, RATIO, SUPPORTED_BITS, decode,
                                           e8_1bit_decode, e8_1bit_error, e8p_decode, e8p_nearest, encode, join_word,
                                           split_word)
from quantkit.schemes.grid import check_bits
from quantkit.schemes.scales import OneScalePerGroup


def _check_table(table, default, what):
    if table is None:
        return default
    if not isinstance(table, (list, tuple)) or tuple(table) != default:
        raise QuantkitError(f"this version decodes {what} with its own table only (docs/FORMAT.md): the layer "
                            "stores a different one")
    return default


@register_quantizer
@dataclass(frozen=True)
class E8P(OneScalePerGroup):
    """E8P as a quantizer: 8 columns at a time, one fp16 scale per row and group, w_hat = scale * point, at 2 bits
    (E8P), 3 (E8P + the 256-point E8 residual) or 4 (E8P + E8P). `ratio`: the residual stage's magnification."""
    bits: int
    ratio: Optional[float] = None
    abs_table: Optional[tuple] = None
    residual_table: Optional[tuple] = None

    name = "e8p"
    summary = "QuIP#'s E8P ball codebook (+ a residual stage at 3 and 4 bits), one fp16 scale per group; bits 2-4"
    width = 8
    spread_by_bits = NATURAL_SPREAD

    def __post_init__(self):
        check_bits(self.bits, "e8p bits", SUPPORTED_BITS)
        if self.bits == 2:
            if self.ratio is not None or self.residual_table is not None:
                raise QuantkitError("2-bit e8p has no residual stage: it takes no ratio or residual_table")
        else:
            ratio = RATIO[self.bits] if self.ratio is None else self.ratio
            if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < float("inf"):
                raise QuantkitError(f"e8p ratio must be a positive number, got {self.ratio!r}")
            object.__setattr__(self, "ratio", float(ratio))
        if self.bits != 3 and self.residual_table is not None:
            raise QuantkitError(f"{self.bits}-bit e8p has no residual_table (only 3 bits uses the E8 1-bit codebook)")
        object.__setattr__(self, "abs_table", _check_table(self.abs_table, ABS_TABLE, "E8P"))
        if self.bits == 3:
            object.__setattr__(self, "residual_table",
                               _check_table(self.residual_table, E8_1BIT_TABLE, "the 3-bit residual"))

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "E8P":
        if group_size != -1 and group_size % 8:
            raise QuantkitError(f"e8p rounds 8 weights at a time: --group-size must be a multiple of 8, got {group_size}")
        return cls(bits)

    def settings(self) -> dict:
        out = {"bits": self.bits, "abs_table": list(self.abs_table)}
        if self.bits > 2:
            out["ratio"] = self.ratio
        if self.bits == 3:
            out["residual_table"] = list(self.residual_table)
        return out

    @property
    def kernel_decode(self) -> KernelDecode:
        """How the dequant-GEMM decodes codes (quantkit.kernels.codebook): int32 tables (ABS, then for 3 bits the
        residual points) and the stage-2 ratio (1.0 at 2 bits, unused)."""
        tables = list(self.abs_table) + list(self.residual_table or ())
        as_int32 = tuple(v - (1 << 32) if v >= 1 << 31 else v for v in tables)  # two's complement
        return KernelDecode("e8p", table=as_int32, ratio=self.ratio or 1.0)

    def lookup_stages(self) -> tuple:
        """The point of a code word as table lookups summed in order (quantkit.kernels.codebook.Lookup), float32, as
        `decode` computes it: E8P's point of the low 16 bits, then the residual stage's point of the bits above
        divided by the ratio. Tables of 2^16 (and 2^8) points where the whole word would need 2^24 or 2^32."""
        first = e8p_decode(torch.arange(1 << 16), torch.float32, self.abs_table)
        if self.bits == 2:
            return ((0, first),)
        if self.bits == 3:
            second = e8_1bit_decode(torch.arange(1 << 8), torch.float32, self.residual_table)
        else:
            second = e8p_decode(torch.arange(1 << 16), torch.float32, self.abs_table)
        return (0, first), (16, second / self.ratio)

    def round(self, w: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized) of w [rows, 8 k] with per-row scales [rows]."""
        s = params["scale"][:, None].to(w.dtype)
        y = (w / s).reshape(w.shape[0], -1, 8)
        word, _ = encode(y, self.bits, self.ratio)
        point = decode(word, self.bits, self.ratio).to(w.dtype)      # bit for bit what a reader decodes
        return split_word(word, self.bits).reshape(w.shape), s * point.reshape(w.shape)

    def squared_error(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Per row, ||w - round(w)||² at scales s [rows] (the scale search's inner step)."""
        y = (w / s[:, None]).reshape(w.shape[0], -1, 8)
        if self.bits == 2:
            err = e8p_nearest(y, "err")[2]
        else:
            r = (y - e8p_nearest(y, "point")[1]) * self.ratio
            err = (e8_1bit_error(r) if self.bits == 3 else e8p_nearest(r, "err")[2]) / (self.ratio * self.ratio)
        return err.sum(dim=1) * s * s

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        rows, cols = codes.shape
        word = join_word(codes.reshape(rows, cols // 8, 8), self.bits)
        return params["scale"].float() * decode(word, self.bits, self.ratio).reshape(rows, cols)


def best_e8(bits: int, sym: bool, group_size: int):
    """What `--quantizer e8` (the e8 methods' default) means: the E8 codebook with the least MSE at this width,
    measured on unit Gaussians and rotated SmolLM2 rows (docs/QUALITY.md): E8P at 2, 3 and 4 bits, the
    box-truncated E8 at 1 bit (E8P has no 1-bit form)."""
    return (E8P if bits in (2, 3, 4) else E8Box).from_spec(bits, sym, group_size)


register_spec_name("e8", best_e8, "the E8 codebook with the least MSE at the width: e8p at 2-4 bits, e8box at 1")
offer_method("e8", "an E8 lattice codebook (8 weights per point: QuIP#'s E8P ball at 2 bits, E8P + a "
             "residual stage at 3 and 4, the box-truncated E8 at 1)")
