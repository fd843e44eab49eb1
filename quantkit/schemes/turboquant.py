"""TurboQuant_mse as a quantizer: one fp16 scale per block of d weights and a b-bit Lloyd–Max code per weight.

TurboQuant (Zandieh et al., 2025, arXiv 2504.19874) quantizes a vector by a random rotation followed by
the MSE-optimal scalar codebook of the coordinate density on the sphere (quantkit.schemes.lloyd_max),
with the vector's norm stored beside the codes. As a weight quantizer: the rotation is the layer's
Hadamard rotation Π (config rotate="hadamard", the default of --method turboquant and turboquant+gptq),
a block is a group of d = group_size consecutive inputs of one output row, and a weight decodes as

    w_hat = scale * codebook[code]        codebook: 2^bits levels in the variance-1 scale

How the per-block scale is chosen (`scale`; rate 16 / d bits per weight whichever is used):
  norm   the paper's: ||w|| / sqrt(L) for a block of L weights (so the unit-sphere codebook applies)
  ratio  the norm, then corrected so the decoded block has the block's norm, ||w_hat|| = ||w||
  mse    the scale minimising ||w - w_hat||² for this block: a search around the norm scale plus a
         least-squares step (quantkit.schemes.scales; side information bought with the same 16 bits)
The codebook is stored in the checkpoint's settings (float32 values), so a reader never recomputes it.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.options import is_int
from quantkit.schemes.base import KernelDecode, offer_method, register_quantizer
from quantkit.schemes.grid import check_bits
from quantkit.schemes.lloyd_max import lloyd_max, nearest
from quantkit.schemes.scales import OneScalePerGroup, fp16_scale, searched_scale

SUPPORTED_BITS = (1, 2, 3, 4, 5)
SCALES = ("norm", "ratio", "mse")


@register_quantizer
@dataclass(frozen=True)
class TurboQuant(OneScalePerGroup):
    bits: int
    dim: int
    scale: str = "mse"
    codebook: Optional[tuple] = None

    name = "turboquant"
    summary = (f"a 2^bits-level Lloyd-Max codebook times one fp16 scale per block (--group-size, a power of two "
               f">= 8); bits {SUPPORTED_BITS[0]}-{SUPPORTED_BITS[-1]}")
    width = 1

    def __post_init__(self):
        check_bits(self.bits, "turboquant bits", SUPPORTED_BITS)
        if not is_int(self.dim) or self.dim < 8 or self.dim & (self.dim - 1):
            raise QuantkitError(f"turboquant needs its block size (--group-size) to be a power of two >= 8, such "
                                f"as 64 or 128; got {self.dim!r}")
        if self.scale not in SCALES:
            raise QuantkitError(f"turboquant scale {self.scale!r} is unknown: use {', '.join(SCALES)}")
        levels = lloyd_max(self.bits, self.dim) if self.codebook is None else self.codebook
        object.__setattr__(self, "codebook", _check_codebook(levels, self.bits))

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "TurboQuant":
        if group_size == -1:
            raise QuantkitError("turboquant quantizes blocks of --group-size weights: give a power of two such as 128, "
                                "not -1")
        return cls(bits, group_size)

    def settings(self) -> dict:
        return {"bits": self.bits, "dim": self.dim, "scale": self.scale, "codebook": list(self.codebook)}

    @property
    def kernel_decode(self) -> KernelDecode:
        """How the dequant-GEMM decodes a code (quantkit.kernels.codebook): a lookup in the levels."""
        return KernelDecode("table", table=self.codebook)

    def levels(self, like: torch.Tensor) -> torch.Tensor:
        """The codebook as a tensor on like's device and dtype (cached: GPTQ asks once per column)."""
        key = ("_levels", like.device, like.dtype)
        if key not in self.__dict__:
            self.__dict__[key] = torch.tensor(self.codebook, dtype=like.dtype, device=like.device)
        return self.__dict__[key]

    def fit(self, w: torch.Tensor, importance=None) -> dict:
        """{"scale": [rows]} for the block(s) w [rows, L], fp16-representable and positive (`importance` unused)."""
        w = w.float()
        s = w.norm(dim=1) / math.sqrt(w.shape[1])
        if self.scale == "ratio":
            decoded = self.levels(w)[nearest(w / fp16_scale(s)[:, None], self.levels(w))]
            s = w.norm(dim=1) / decoded.norm(dim=1).clamp(min=1e-30)
        elif self.scale == "mse":
            s = searched_scale(self, w, s)
        return {"scale": fp16_scale(s)}

    def round(self, w: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized) of w [rows, cols] with per-row params [rows]: the nearest level of w / scale."""
        levels = self.levels(w)
        s = params["scale"][:, None].to(w.dtype)
        q = nearest(w / s, levels)
        return q, s * levels[q]

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        s = params["scale"].float()
        return s * self.levels(s)[codes.long()]


def _check_codebook(levels, bits) -> tuple:
    """2^bits finite ascending levels, rounded to float32 (what the decoder computes with)."""
    if not isinstance(levels, (list, tuple)) or len(levels) != 1 << bits or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in levels):
        raise QuantkitError(f"a {bits}-bit turboquant codebook needs {1 << bits} numbers, got {levels!r}")
    t = torch.tensor(levels, dtype=torch.float32)
    if not bool(torch.isfinite(t).all()) or not bool((t[1:] > t[:-1]).all()):
        raise QuantkitError("a turboquant codebook must hold finite, strictly ascending levels")
    return tuple(t.tolist())


offer_method("turboquant", "a Lloyd-Max codebook per block")
