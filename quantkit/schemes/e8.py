"""The E8 lattice: nearest points (Conway–Sloane) and the box-truncated E8 codebook at exactly b bits per weight.

E8 = D8 ∪ (D8 + ½·1), D8 = {z ∈ Z⁸ : Σz even}. The nearest point of D8 to y (Conway & Sloane, "Fast
quantizing and decoding algorithms for lattice quantizers", 1982): round every coordinate; when the sum is
odd, re-round the one coordinate whose rounding cost least (largest |y_i − round(y_i)|) the other way. For
E8, the closer of the nearest points of D8 and of D8 + ½. Both are exact and vectorised over [..., 8].

A codebook needs finitely many points. The box-truncated E8 at b bits keeps, in each coset c ∈ {0, 1},
the points whose coordinates are lo + k + c/2 + offset with k ∈ {0, …, 2^b − 1} (lo = −2^(b−1)) and Σk even:
2 · 2^(8b − 1) = 2^(8b) points, exactly b bits per weight. The code of an 8-vector is its eight k with the
lowest bit of the last one replaced by the coset bit: that bit is implied by the parity (Σk even), so
nothing is lost and every column keeps a b-bit code (quantkit.schemes.base's one code per column).
Nearest point within the box is exact too: per coordinate the nearest level in range, and when the parity
is wrong the cheapest single change to a neighbouring level in range (changing one coordinate by ±1 is
the only way to flip the parity that can be optimal, since every change costs ≥ 0).
"""
import math
from dataclasses import dataclass

import torch

from quantkit.core.errors import QuantkitError
from quantkit.schemes.base import KernelDecode, register_quantizer, register_spec_name
from quantkit.schemes.grid import check_bits
from quantkit.schemes.scales import OneScalePerGroup


def nearest_box_coset(y: torch.Tensor, bits: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, squared error) of the nearest point of one box-truncated coset to y [..., 8].

    The coset's coordinates are lo + k + shift (k in 0 .. 2^bits − 1) with Σk even. Per coordinate the
    nearest level k (residual r = t − k) and the neighbour k + dir: toward t (dir = sign r, extra cost
    1 − 2|r|), or away from it where the box ends (extra cost 1 + 2|r|); both are 1 − 2·dir·r."""
    top = (1 << bits) - 1
    t = y - (shift - 2 ** (bits - 1))                  # the coordinate in units of k
    k = torch.round(t).clamp_(0, top)
    r = t - k
    dir = torch.where(r >= 0, 1.0, -1.0).to(y.dtype)
    blocked = torch.where(dir > 0, k == top, k == 0)
    dir = torch.where(blocked, -dir, dir)
    extra, i = (1 - 2 * dir * r).min(dim=-1, keepdim=True)
    odd = (k.sum(dim=-1, keepdim=True) % 2) != 0
    k = k.scatter_add(-1, i, dir.gather(-1, i) * odd)
    err = (r * r).sum(dim=-1) + (extra * odd).squeeze(-1)
    return k, err


def nearest_box(y: torch.Tensor, bits: int, offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k [..., 8] int64, coset [...] int64, squared error [...]) of the nearest box-truncated E8 point to y [..., 8]."""
    k0, e0 = nearest_box_coset(y, bits, offset)
    k1, e1 = nearest_box_coset(y, bits, offset + 0.5)
    second = e1 < e0
    return torch.where(second[..., None], k1, k0).long(), second.long(), torch.minimum(e0, e1)


def box_point(k: torch.Tensor, coset: torch.Tensor, bits: int, offset: float) -> torch.Tensor:
    """The lattice point of codes k [..., 8] in coset [...]: lo + k + offset + coset / 2."""
    return k.to(torch.float64) - 2 ** (bits - 1) + offset + 0.5 * coset[..., None].to(torch.float64)


def pack_codes(k: torch.Tensor, coset: torch.Tensor) -> torch.Tensor:
    """One b-bit code per coordinate: k, with the last coordinate's lowest bit (implied by Σk even) replaced
    by the coset bit."""
    return torch.cat([k[..., :7], (k[..., 7:] & ~1) | coset[..., None]], dim=-1)


def unpack_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_codes: (k [..., 8], coset [...])."""
    codes = codes.long()
    coset = codes[..., 7] & 1
    high = codes[..., 7] & ~1
    low = (codes[..., :7].sum(-1) + high) & 1      # the bit that makes Σk even
    return torch.cat([codes[..., :7], (high | low)[..., None]], dim=-1), coset


# Block rms over the scale at which the box fits a unit Gaussian best (the median optimum measured on unit
# Gaussian blocks of 128 with offset ¼); the scale search then looks ±30 % around it.
NATURAL_SPREAD = {1: 0.625, 2: 1.0, 3: 1.7, 4: 3.0}


@register_quantizer
@dataclass(frozen=True)
class E8Box(OneScalePerGroup):
    """The box-truncated E8 lattice as a quantizer: 8 columns at a time, one fp16 scale per row and group,
    w_hat = scale * point. `offset` shifts the lattice: with ¼ the two cosets' boxes are mirror images of each
    other (the codebook is symmetric under negation), and it measured lower MSE than 0 at 1–4 bits."""
    bits: int
    offset: float = 0.25

    name = "e8"
    summary = "the box-truncated E8 lattice, 8 weights per point, one fp16 scale per group; bits 1-4"
    width = 8
    spread_by_bits = NATURAL_SPREAD

    def __post_init__(self):
        check_bits(self.bits, "e8 bits", tuple(NATURAL_SPREAD))
        if not isinstance(self.offset, (int, float)) or isinstance(self.offset, bool) or not math.isfinite(self.offset):
            raise QuantkitError(f"e8 offset must be a number, got {self.offset!r}")

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "E8Box":
        if group_size != -1 and group_size % 8:
            raise QuantkitError(f"e8 rounds 8 weights at a time: --group-size must be a multiple of 8, got {group_size}")
        return cls(bits)

    def settings(self) -> dict:
        return {"bits": self.bits, "offset": self.offset}

    @property
    def kernel_decode(self) -> KernelDecode:
        """How the dequant-GEMM decodes codes (quantkit.kernels.codebook): as lattice points with this offset."""
        return KernelDecode("lattice", offset=self.offset)

    def round(self, w: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized) of w [rows, 8 k] with per-row scales [rows]."""
        s = params["scale"][:, None].to(w.dtype)
        y = (w / s).reshape(w.shape[0], -1, 8)
        k, coset, _ = nearest_box(y, self.bits, self.offset)
        point = box_point(k, coset, self.bits, self.offset).to(w.dtype).reshape(w.shape)
        return pack_codes(k, coset).reshape(w.shape), s * point

    def squared_error(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Per row, ||w - round(w)||² at scales s [rows], without building codes (the scale search's inner step)."""
        y = (w / s[:, None]).reshape(w.shape[0], -1, 8)
        return nearest_box(y, self.bits, self.offset)[2].sum(dim=1) * s * s

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        rows, cols = codes.shape
        k, coset = unpack_codes(codes.reshape(rows, cols // 8, 8))
        return params["scale"].float() * box_point(k, coset, self.bits, self.offset).float().reshape(rows, cols)


# --quantizer e8box: the box-truncated E8 at any width (a checkpoint records its class name, "e8", as before E8P)
register_spec_name("e8box", E8Box.from_spec, "the box-truncated E8 lattice at any width (recorded as e8)")
