"""RTN: round-to-nearest per group, with any quantizer. The baseline every other method is measured against."""
from typing import Optional

import torch

from quantkit.algorithms.registry import MethodSpec, Rounding, register_algorithm, register_method
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import check_shape, group_index, group_width
from quantkit.core.result import QuantResult
from quantkit.schemes.base import fit_all
from quantkit.schemes.grid import check_group_size


def check_args(quantizer, group_size: int, weight: torch.Tensor) -> None:
    """Shared argument checks of the methods (rtn, gptq)."""
    if weight.dim() != 2:
        raise QuantkitError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    check_group_size(group_size, "group_size")
    check_shape(quantizer, weight.shape[1], group_size, rows=weight.shape[0])


def rtn(weight: torch.Tensor, quantizer, group_size: int = 128,
        bias: Optional[torch.Tensor] = None) -> QuantResult:
    """Quantize `weight` [out, in] group by group along the input dim: fit, then round every unit.

    Groups are columns [g*G, (g+1)*G); the last one is shorter when in % G != 0; group_size -1 is
    one group per row. Every tensor of the result lives on the weight's device.
    """
    check_args(quantizer, group_size, weight)
    w = weight.detach().float()
    rows, cols = w.shape
    size = group_width(cols, group_size)
    codes = torch.empty(rows, cols, dtype=torch.int32, device=w.device)
    params = fit_all(quantizer, w, group_size)
    for g, c0 in enumerate(range(0, cols, size)):
        c1 = min(c0 + size, cols)
        codes[:, c0:c1] = quantizer.round(w[:, c0:c1], {k: v[:, g] for k, v in params.items()})[0].to(torch.int32)
    return QuantResult(codes=codes, params=params, g_idx=group_index(cols, group_size).to(w.device),
                       quantizer=quantizer, group_size=group_size, bias=bias)


class RoundToNearest(Rounding):
    """Each group's parameters fit to its weights, each weight rounded to the nearest point: no data needed."""
    name = "rtn"

    def round(self, weight, observer, quantizer, group_size, config, bias):
        return rtn(weight, quantizer, group_size, bias=bias)


register_algorithm(RoundToNearest())
register_method(MethodSpec("rtn", "rtn", summary="round to nearest"))
