"""--target-bits for the codebook methods (turboquant, e8, trellis; with or without +gptq): their rates as candidates.

A codebook layer stores a b-bit code per weight (packed along the inputs), one fp16 scale per row and group, g_idx
and, behind the rotation, the rotation's signs (quantkit.checkpoint.quantkit_format): `layer_bits` counts them as the
codec writes them. Its cost at a rate is the integer proxy's (quantkit.run.allocate: round to nearest on the b-bit
grid with the same groups, weighted by the layer's Fisher diagonal and GPTQ's feedback gains) times one factor per
rate: what the codebook itself makes of sample rows, over what the proxy makes of the same rows, both in the basis
the method rounds in (behind the rotation, where the proxy is costed too). It is pooled over the layers, as the GGUF
types' factors are (quantkit.gguf.auto.TypeFactors): a codebook's search costs seconds per million weights (E8P's,
the trellis's Viterbi).
"""
from functools import cache

import torch

from quantkit.algorithms.rtn import rtn
from quantkit.core import bitpack
from quantkit.core.errors import QuantkitError
from quantkit.core.groups import check_shape, n_groups
from quantkit.gguf.auto import SAMPLE_ROWS, SAMPLE_WEIGHTS, evenly
from quantkit.schemes.base import quantizer_for

CODEBOOK_BITS = (2, 3, 4)


def codebook_quantizer(config, bits: int, group_size: int):
    """The run's quantizer at `bits` and `group_size`, or None where it does not take them."""
    return _quantizer(config.quantizer, bits, config.sym, group_size)


@cache
def _quantizer(name: str, bits: int, sym: bool, group_size: int):
    # built once per rate: every layer's size and the summary ask (TurboQuant's levels take ~1 ms to make)
    try:
        return quantizer_for(name, bits, sym, group_size)
    except (QuantkitError, ValueError):
        return None


def misfit(quantizer, group_size: int, in_features: int, out_features: int) -> str | None:
    """Why the quantizer cannot cut a layer [out, in] into its units and tiles at this group size, or None."""
    try:
        check_shape(quantizer, in_features, group_size, rows=out_features)
    except QuantkitError as e:
        return str(e)
    return None


def layer_bits(quantizer, group_size: int, rotated: bool, in_features: int, out_features: int) -> int | None:
    """The bits a codebook layer [out, in] stores: packed codes, each parameter per row and group at its dtype, g_idx
    as int32, the rotation's int8 signs; None where the quantizer cannot take the layer (misfit)."""
    if misfit(quantizer, group_size, in_features, out_features) is not None:
        return None
    codes = 32 * bitpack.packed_len(in_features, quantizer.code_bits) * out_features  # a code per weight
    params = sum(quantizer.param_bits.values()) * n_groups(in_features, group_size) * out_features
    return codes + params + 32 * in_features + (8 * in_features if rotated else 0)


class RateFactors:
    """Each rate's squared error over its integer proxy's, on the same sample rows: rows of every layer (in the basis
    the method rounds in: rotated, as allocate.predicted_costs hands them), pooled by input width."""

    def __init__(self, config, proxy_error):
        self.config = config
        self.proxy_error = proxy_error  # (w [rows, in], setting) -> (w − ŵ)² of the proxy grid
        self.pools = {}
        self.factors = {}

    def add(self, w: torch.Tensor) -> None:
        self.pools.setdefault(w.shape[1], []).append(evenly(w, SAMPLE_ROWS))

    def factor(self, setting) -> float:
        if setting not in self.factors:
            self.factors[setting] = self._measure(setting)
        return self.factors[setting]

    def _measure(self, setting) -> float:
        quantizer = codebook_quantizer(self.config, setting.bits, setting.group_size)
        multiple = getattr(quantizer, "row_multiple", 1)
        real = proxy = 0.0
        for width, pool in self.pools.items():
            rows = torch.cat(pool)
            take = min(len(rows), max(1, SAMPLE_WEIGHTS // width)) // multiple * multiple  # whole tiles of rows
            if take == 0 or misfit(quantizer, setting.group_size, width, take) is not None:
                continue
            rows = evenly(rows, take)
            real += float((rtn(rows, quantizer, setting.group_size).dequantize() - rows).square().sum())
            proxy += float(self.proxy_error(rows, setting).sum())
        return real / proxy if proxy > 0 else 1.0
