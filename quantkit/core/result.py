"""QuantResult: what every method hands to the codecs. No bit layouts here."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from quantkit.core.groups import per_column


@dataclass
class QuantResult:
    """One quantized nn.Linear of shape [out, in], in whatever quantizer produced it.

    codes:     int32 [out, in], the quantizer's code of each weight (for the integer grid q in [0, 2^b - 1])
    params:    {key: [out, n_groups]} the quantizer's per-group parameters (integer grid: "scale" float32,
               fp16-representable, and "zero", the true zero point)
    g_idx:     int32 [in], group of each input column
    quantizer: the object that rounded (its name, width and settings decode the codes)
    rotation:  None, or the quantkit.schemes.rotation.Rotation Π the codes live behind: the stored weight is
               W Πᵀ and the layer computes Ŵ (Π x)
    """

    codes: torch.Tensor
    params: dict
    g_idx: torch.Tensor
    quantizer: object
    group_size: int
    bias: Optional[torch.Tensor] = None
    rotation: Optional[object] = None
    stats: dict = field(default_factory=dict)  # the report of this layer: error, damp, seconds (see Method)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def decoded(self) -> torch.Tensor:
        """The stored weight as the codes say, float32 [out, in] (in the rotated basis when rotated)."""
        return self.quantizer.dequantize(self.codes, per_column(self.params, self.g_idx))

    def dequantize(self) -> torch.Tensor:
        """The weight the layer really applies to x, float32 [out, in]: decoded() Π when rotated."""
        w = self.decoded()
        return w if self.rotation is None else self.rotation.unrotate_weight(w)

    def bits_per_weight(self) -> float:
        """Code bits plus the per-group parameters at the width the quantizer stores them (or what the quantizer says
        its blocks cost, where parameters are shared across groups)."""
        if hasattr(self.quantizer, "bits_per_weight"):
            return self.quantizer.bits_per_weight
        rows, cols = self.shape
        param_bits = sum(self.quantizer.param_bits[k] * v.numel() for k, v in self.params.items())
        return self.quantizer.code_bits + param_bits / (rows * cols)
