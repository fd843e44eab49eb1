"""Pure-torch reference for the GPTQ-layout dequant-GEMM (also the CPU forward path)."""
import torch

from quantkit.formats import bitpack


def unpack_rows(qweight, bits, in_features):
    """int32 codes [in_features, N] from qweight [packed K, N] (same result as bitpack.unpack).

    For 2/4/8 bits no code straddles a word, so one broadcast shift + mask over int32 does it,
    several times faster than the general int64 path that 3-bit needs."""
    if 32 % bits:
        return bitpack.unpack(qweight, bits, in_features, dim=0)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    codes = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & (2**bits - 1)
    return codes.reshape(-1, qweight.shape[1])[:in_features]


def _unpack(words, bits, k, dim):
    """bitpack.unpack that also runs on CUDA tensors (bitpack builds its index tensors on the CPU)."""
    if 32 % bits == 0:
        return unpack_rows(words.movedim(dim, 0), bits, k).movedim(0, dim)
    return bitpack.unpack(words.cpu(), bits, k, dim=dim).to(words.device)


def dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset=1, dtype=None):
    """W^T [in_features, out_features] decoded from packed tensors, in `dtype` (default: scales').

    w = scales[g] * (q - z[g]) computed in float32 (exact: an fp16 scale times an integer below
    2^8 fits in fp32's mantissa) and rounded once to `dtype`."""
    n = scales.shape[1]
    q = _unpack(qweight, bits, in_features, dim=0)
    z = (_unpack(qzeros, bits, n, dim=1) + zero_offset) & (2**bits - 1)
    g = g_idx.long()
    w = (q - z.index_select(0, g)).float().mul_(scales.float().index_select(0, g))
    return w.to(dtype or scales.dtype)


def linear_dequantized(x, w_t, bias=None):
    """x @ w_t (+ bias) for a decoded W^T; on CPU, float16 runs as float32 and is rounded back.

    PyTorch's CPU float16 GEMM is an order of magnitude slower than float32 and accumulates in
    float32 anyway, so the upcast changes only the summation order (last-bit differences)."""
    if x.device.type == "cpu" and x.dtype == torch.float16:
        y = (x.float() @ w_t.float()).to(x.dtype)
    else:
        y = x @ w_t.to(x.dtype)
    return y + bias.to(y.dtype) if bias is not None else y


def gptq_linear_torch(x, qweight, qzeros, scales, g_idx, bits, in_features, bias=None, zero_offset=1):
    """The reference: decode W^T in x.dtype, then x @ W^T (+ bias) in x.dtype."""
    w = dequantize_weight(qweight, qzeros, scales, g_idx, bits, in_features, zero_offset, dtype=x.dtype)
    y = x @ w
    return y + bias.to(y.dtype) if bias is not None else y
