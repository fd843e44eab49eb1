"""Pure-torch reference for the GPTQ-layout dequant-GEMM (also the CPU forward path)."""
import torch

from quantkit.core import gptq_layout, matmul


def dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset=1, dtype=None):
    """W^T [in_features, out_features] decoded from packed tensors (exactly, in float32) and rounded
    once to `dtype` (default: scales')."""
    w = gptq_layout.decode(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset)
    return w.to(dtype or scales.dtype)


def linear_dequantized(x, w_t, bias=None):
    """x @ w_t (+ bias) for a decoded W^T; on CPU, float16 runs as float32 and is rounded back.

    PyTorch's CPU float16 GEMM is an order of magnitude slower than float32 and accumulates in
    float32 anyway, so the upcast changes only the summation order (last-bit differences)."""
    if x.device.type == "cpu" and x.dtype == torch.float16:
        y = _product(x.float(), w_t.float()).to(x.dtype)
    else:
        y = _product(x, w_t.to(x.dtype))
    return y + bias.to(y.dtype) if bias is not None else y


def _product(x, w_t):
    # oneDNN reads the weight as [out, in] rows: a W^T laid out that way (QuantLinear's CPU cache) takes it where
    # quantkit.core.matmul would; any other layout keeps torch's product rather than copying the weight on every call
    if w_t.t().is_contiguous() and matmul.uses_onednn(x, w_t):
        return matmul.linear(x, w_t.t())
    return x @ w_t


def gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1):
    """The reference: decode W^T in x.dtype, then x @ W^T (+ bias) in x.dtype."""
    w = dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset, dtype=x.dtype)
    y = x @ w
    return y + bias.to(y.dtype) if bias is not None else y
