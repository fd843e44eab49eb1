"""RTN: round-to-nearest on a per-group grid. The baseline every other method is measured against."""
import time
from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.methods import grid as qgrid
from quantkit.methods.grid import Grid
from quantkit.methods.result import QuantResult


def check_args(grid: Grid, group_size: int) -> None:
    """Shared argument checks for the integer methods (rtn, gptq)."""
    qgrid.check_bits(grid.bits, "bits")
    qgrid.check_group_size(group_size, "group_size")


def rtn(weight: torch.Tensor, grid: Grid, group_size: int = 128,
        bias: Optional[torch.Tensor] = None) -> QuantResult:
    """Quantize `weight` [out, in] group by group along the input dim.

    Groups are columns [g*G, (g+1)*G); the last one is shorter when in % G != 0; group_size -1 is
    one group per row. Every tensor of the result lives on the weight's device.
    """
    check_args(grid, group_size)
    if weight.dim() != 2:
        raise QuantkitError(f"rtn expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    t0 = time.perf_counter()
    w = weight.detach().float()
    rows, cols = w.shape
    size = cols if group_size == -1 else group_size
    ng = qgrid.n_groups(cols, group_size)
    codes = torch.empty(rows, cols, dtype=torch.int32, device=w.device)
    scales = torch.empty(rows, ng, dtype=torch.float32, device=w.device)
    zeros = torch.empty(rows, ng, dtype=torch.int32, device=w.device)
    for g in range(ng):
        c0, c1 = g * size, min((g + 1) * size, cols)
        scale, zero = qgrid.fit(w[:, c0:c1], grid)
        codes[:, c0:c1] = qgrid.quantize(w[:, c0:c1], scale[:, None], zero[:, None], grid.maxq).to(torch.int32)
        scales[:, g] = scale
        zeros[:, g] = zero.to(torch.int32)
    return QuantResult(
        qweight=codes, scales=scales, zeros=zeros,
        g_idx=qgrid.group_index(cols, group_size).to(w.device),
        bits=grid.bits, group_size=group_size, sym=grid.sym, bias=bias,
        stats={"seconds": time.perf_counter() - t0},
    )
