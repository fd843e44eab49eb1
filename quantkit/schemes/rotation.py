"""Rotations, their own axis of the config: a seeded randomized Hadamard transform Π along a linear's input dim.

Π = blockdiag(H_b / sqrt(b)) · diag(signs): random ±1 signs, then a normalized Walsh–Hadamard transform
of every block of b consecutive inputs (fast, O(n log b); quantkit.kernels.rotation). b is the largest
power of two dividing in_features: the whole row when it is a power of two, 64 for SmolLM2's 576 =
9 × 64, and only 4 for stories260k's down_proj (172 = 43 × 4), where the rotation mixes little.

A rotated layer stores W' = W Πᵀ quantized (its rows are Π applied to W's rows) and computes
Ŵ' (Π x) = Ŵ x: the forward rotates x (quantkit.nn.quant_linear), the weight is never unrotated.
GPTQ sees the Hessian of the rotated inputs, Π H Πᵀ, so its rounding is Hessian-aware in that basis.
"""
import zlib
from dataclasses import dataclass

import torch

from quantkit.schemes import hadamard as kr

KINDS = ("none", "hadamard")


@dataclass(frozen=True)
class Rotation:
    signs: torch.Tensor   # int8 [in], ±1
    block: int
    seed: int

    kind = "hadamard"

    @classmethod
    def hadamard(cls, in_features: int, seed: int) -> "Rotation":
        return cls(kr.random_signs(in_features, seed), kr.hadamard_block(in_features), seed)

    @classmethod
    def for_layer(cls, name: str, in_features: int, seed: int) -> "Rotation":
        """Each layer its own signs, reproducible from the run's seed and the layer's name."""
        return cls.hadamard(in_features, (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31)

    def settings(self) -> dict:
        return {"type": self.kind, "block": self.block, "seed": self.seed}

    def rotate_weight(self, w: torch.Tensor) -> torch.Tensor:
        """W Πᵀ: Π applied to every row of w [out, in]."""
        return kr.rotate(w, self.signs, self.block)

    def unrotate_weight(self, w: torch.Tensor) -> torch.Tensor:
        """W' Π: back to the original basis (Πᵀ applied to every row)."""
        return kr.unrotate(w, self.signs, self.block)

    def rotate_diagonal(self, d: torch.Tensor) -> torch.Tensor:
        """The diagonal of Π diag(d) Πᵀ for each row of d [rows, in]: Π mixes the inputs of each Hadamard block with
        entries ±1/√B, so it is each block's mean, exactly (a weight's Fisher diagonal in the rotated basis)."""
        rows, cols = d.shape
        means = d.reshape(rows, cols // self.block, self.block).mean(-1, keepdim=True)
        return means.expand(-1, -1, self.block).reshape(rows, cols)

    def rotate_hessian(self, h: torch.Tensor) -> torch.Tensor:
        """Π H Πᵀ, the second moment of the rotated inputs Π x."""
        return kr.rotate(kr.rotate(h, self.signs, self.block).t(), self.signs, self.block).t().contiguous()
