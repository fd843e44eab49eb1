"""llama.cpp's legacy block types as a quantizer: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, blocks of 32 weights of a row.

    symmetric ("_0")    w = d (q - 2^(bits-1))    q in 0 .. 2^bits - 1, d fp16
    with a minimum ("_1")  w = d q + m            q in 0 .. 2^bits - 1, d and m fp16
(quantkit.gguf.legacy_blocks lays the codes out byte for byte). A symmetric block is the integer grid with a
group of 32 and 5 bits allowed: its scale is the best of the grid's two fits (max-abs and range, quantkit.schemes.grid)
and llama.cpp's two (its plain signed one, which may be negative, and, with an importance, its imatrix search). A
block with a minimum stores m itself, not a zero point, so it is fitted here: the better of the range fit (m the
block's minimum rounded down to fp16, d the step that reaches the maximum from there, rounded up, so every weight
lies inside the grid) and, with an importance, llama.cpp's weighted search. Inside GPTQ the codes then get the error
feedback llama.cpp's own quantizer lacks.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.core.errors import QuantkitError
from quantkit.gguf.kquants import fit_signed, fit_with_min
from quantkit.schemes import grid
from quantkit.schemes.base import register_quantizer

BLOCK = 32
TYPES = {(4, True): "Q4_0", (4, False): "Q4_1", (5, True): "Q5_0", (5, False): "Q5_1", (8, True): "Q8_0"}


@register_quantizer
@dataclass(frozen=True)
class GGMLBlocks:
    """{"d"} (and {"m"} for the "_1" types) per row and block of 32; codes q in [0, 2^bits - 1]."""
    bits: int
    sym: bool = True

    name = "ggml"
    summary = ("llama.cpp's legacy GGUF blocks of 32 (--group-size 32): --bits 4/5 with --sym for Q4_0/Q5_0, "
               "without for Q4_1/Q5_1, --bits 8 --sym for Q8_0")
    width = 1
    rounds_numpy = True  # round() also takes NumPy arrays (GPTQ's column loop on CPU)

    def __post_init__(self):
        if (self.bits, self.sym) not in TYPES:
            raise QuantkitError(f"the ggml quantizer has no {self.bits}-bit {'symmetric' if self.sym else 'asymmetric'} "
                                "type: use --bits 4 or 5 (symmetric: Q4_0, Q5_0; --no-sym: Q4_1, Q5_1) or --bits 8 "
                                "--sym (Q8_0)")

    @classmethod
    def from_spec(cls, bits: int, sym: bool, group_size: int) -> "GGMLBlocks":
        if group_size != BLOCK:
            raise QuantkitError(f"the ggml quantizer rounds llama.cpp's blocks of {BLOCK} weights: use --group-size "
                                f"{BLOCK} (got {group_size})")
        return cls(bits, sym)

    @property
    def ggml_type(self) -> str:
        return TYPES[(self.bits, self.sym)]

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def offset(self) -> int:
        """The code of zero of a symmetric type (llama.cpp's 8, 16, 128); 0 with a minimum."""
        return 2 ** (self.bits - 1) if self.sym else 0

    @property
    def code_bits(self) -> int:
        return self.bits

    @property
    def param_bits(self) -> dict:
        return {"d": 16} if self.sym else {"d": 16, "m": 16}

    def settings(self) -> dict:
        return {"bits": self.bits, "sym": self.sym}

    def fit(self, w: torch.Tensor, importance: Optional[torch.Tensor] = None) -> dict:
        """{"d"} (and {"m"}) [rows] for one block w [rows, 32]."""
        if self.sym:
            return {"d": self._signed_fit(w.float(), grid.Grid.fit(self, w, importance)["scale"], importance)}
        ranged = self.range_fit(w)
        return ranged if importance is None else self._searched_min_fit(w.float(), ranged, importance)

    def range_fit(self, w: torch.Tensor) -> dict:
        """{"d", "m"} that cover each row's range exactly: m its minimum rounded down to fp16, d the step that reaches
        its maximum from there, rounded up (nothing is clamped)."""
        w = w.float()
        low = grid.fp16_at_most(w.amin(dim=-1))
        span = w.amax(dim=-1) - low
        d = grid.fp16_at_least(torch.where(span > 0, span / self.maxq, torch.ones_like(span))).clamp(min=2**-24)
        return {"d": d, "m": low}

    def _signed_fit(self, w, d, importance):
        """Per row, the best of d and llama.cpp's choices, whichever rounds w with the smallest (weighted) squared
        error. Its plain choice puts the block's largest-magnitude weight on code 0 whatever its sign (d = peak /
        -2^(bits-1), so d may be negative and the step is absmax / 2^(bits-1), where the grid's positive d steps
        absmax / (2^(bits-1) - 1/2) when the positive extreme dominates); its imatrix choice, a weighted least-squares
        search around it, is tried only with an importance: without one the search's least squared error clips the
        blocks' extreme weights, which the outputs feel more than the squared error says (SmolLM2 RTN Q4_0, mean KLD
        from llama.cpp's llama-perplexity: 0.299 with the search, 0.276 without, llama.cpp's own 0.288)."""
        offset = torch.full_like(d, float(self.offset))
        peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        candidates = [(peak / -self.offset).half().float()]
        if importance is not None:
            weights = importance.float().to(w.device).expand_as(w)
            candidates.append(fit_signed(w, weights, self.offset, fp16_step=True)[0])
        for candidate in candidates:
            candidate = torch.where(candidate == 0, d, candidate)
            d = grid.better_scale(w, d, candidate, offset, self.maxq, importance)
        return d

    def _searched_min_fit(self, w, ranged: dict, importance) -> dict:
        """Per row, the range fit or llama.cpp's imatrix search (a weighted least-squares fit of d and m <= 0 around
        wider and narrower grids, make_qkx3_quants), whichever rounds w with the smaller importance-weighted squared
        error (only with an importance, as for the symmetric types)."""
        weights = importance.float().to(w.device).expand_as(w)
        scale, low = fit_with_min(w[:, None], weights[:, None], self.maxq)
        searched = {"d": scale[:, 0].half().float(), "m": low[:, 0].half().float()}
        usable = searched["d"] > 0

        def error(p):
            e = (self.round(w, p)[1] - w).square()
            return (e * weights).sum(dim=-1, dtype=torch.float64)

        safe = {"d": torch.where(usable, searched["d"], ranged["d"]), "m": searched["m"]}
        better = usable & (error(safe) < error(ranged))
        return {k: torch.where(better, safe[k], ranged[k]) for k in ranged}

    def round(self, w, params: dict):
        """(codes, dequantized) of w [rows, cols] with per-row params [rows] (torch tensors or NumPy arrays)."""
        d = params["d"][:, None]
        if self.sym:
            q = grid.quantize(w, d, self.offset, self.maxq)
            return q, d * (q - self.offset)
        m = params["m"][:, None]
        q = ((w - m) / d).round().clip(0, self.maxq)
        return q, d * q + m

    def dequantize(self, codes: torch.Tensor, params: dict) -> torch.Tensor:
        """Weights from codes [rows, cols] and params gathered per column ([rows, cols] each)."""
        w = params["d"] * (codes.float() - self.offset)
        return w if self.sym else w + params["m"]
