"""The GPTQ tensor layout's arithmetic, shared by the kernels' reference, the quantized linear and the codecs.

Per quantized linear (K inputs, N outputs, G groups): qweight int32 [packed_len(K, bits), N] (codes packed
along the inputs), qzeros int32 [G, packed_len(N, bits)] (zeros packed along the outputs), scales fp16 [G, N],
g_idx int32 [K]; w = scales[g] * (q - z[g]). quantkit.checkpoint.gptq writes and reads it whole.
"""
import torch

from quantkit.core import bitpack

# What qzeros holds: zero - 1 in the classic "gptq" (v1) format, the true zero in "gptq_v2".
V1_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
CHECKPOINT_FORMATS = tuple(V1_ZERO_OFFSET)


def decode(qweight, qzeros, scales, g_idx, bits: int, in_features: int, zero_offset: int = 1,
           group_size=None) -> torch.Tensor:
    """float32 W^T [in_features, out_features] from GPTQ-layout tensors (zero_offset 1 for v1, 0 for v2).

    w = scales[g] * (q - z[g]) in float32 is exact: an fp16 scale times an integer below 2^8 fits in
    fp32's mantissa; the mask undoes v1's wrap of a stored zero - 1. A caller that knows g_idx[k] == k // group_size
    (no act-order, equal groups) passes group_size: each group's zero and scale then broadcast over its rows instead
    of being gathered per row, 2-3x faster."""
    q = bitpack.unpack(qweight, bits, in_features, dim=0)
    z = (bitpack.unpack(qzeros, bits, scales.shape[1], dim=1) + zero_offset) & (2**bits - 1)
    groups, n = scales.shape
    if group_size is not None and groups * group_size == in_features:
        w = (q.view(groups, group_size, n) - z.unsqueeze(1)).float().mul_(scales.float().unsqueeze(1))
        return w.view(in_features, n)
    g = g_idx.long()
    return (q - z.index_select(0, g)).float().mul_(scales.float().index_select(0, g))
