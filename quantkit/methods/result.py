"""QuantResult: what an integer method hands to the packer. No bit layouts here."""
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class QuantResult:
    """Integer codes and the grid that decodes them, for one nn.Linear of shape [out, in].

    qweight: int32 [out, in], codes in [0, 2^bits - 1]
    scales:  float32 [out, n_groups] (fp16-representable)
    zeros:   int32 [out, n_groups]  (the true zero point, not zero - 1)
    g_idx:   int32 [in], group of each input column
    Decoding: w[o, i] = scales[o, g_idx[i]] * (qweight[o, i] - zeros[o, g_idx[i]])
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    bias: Optional[torch.Tensor] = None
    stats: dict = field(default_factory=dict)  # method-specific report: error, damp, alpha, seconds

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return self.scales[:, g] * (self.qweight.float() - self.zeros[:, g].float())
