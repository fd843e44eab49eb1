"""Pure-torch reference for the GPTQ-layout dequant-GEMM (also the CPU forward path)."""
import torch

from quantkit.formats import bitpack


def dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset=1, dtype=None):
    """W^T [in_features, out_features] decoded from packed tensors, in `dtype` (default: scales')."""
    n = scales.shape[1]
    q = bitpack.unpack(qweight, bits, in_features, dim=0)
    z = (bitpack.unpack(qzeros, bits, n, dim=1) + zero_offset) & (2**bits - 1)
    g = g_idx.long()
    w = scales.float()[g] * (q - z[g]).float()
    return w.to(dtype or scales.dtype)


def gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1):
    w = dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset, dtype=x.dtype)
    y = x @ w
    return y + bias.to(y.dtype) if bias is not None else y
