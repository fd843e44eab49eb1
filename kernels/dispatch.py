"""Entry point used by QuantLinear: Triton on CUDA, pure torch on CPU."""
import torch

from quantkit.kernels.reference import gptq_linear_torch


def gptq_linear(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1):
    """y = x @ W^T + bias where W is decoded from GPTQ-layout tensors. x: [..., in_features]."""
    return gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias, zero_offset)
