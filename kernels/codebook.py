"""Codebook dequant-GEMM (TurboQuant and E8 layers): y = x Ŵᵀ + bias with Ŵ[n, k] = scales[g, n] * value(code).

How a code becomes a value is the quantizer's KernelDecode (quantkit.schemes.base): a lookup in a table of
levels (turboquant), the coordinate of a box-truncated E8 point (e8: 8 codes along K per point) or of an E8P point
(e8p: the 8 codes of a point are one 8b-bit word, decoded through int32 tables). This module never names a scheme.

Layout (quantkit.checkpoint.quantkit_format, generic layers): codes int32 [packed_len(K, bits), N], the
b-bit codes of each output column packed along K as one LSB-first bit stream (quantkit.core.bitpack:
5-bit codes straddle words, as 3-bit ones do in the GPTQ layout); scales fp16 [G, N]; g_idx int32 [K].
The decode step is the GPTQ kernels' code extraction (triton_decode.packed_codes) followed by the variant's
decode where the integer grid does scale * (q - zero).

Backends as in dispatch.py: Triton on CUDA fp16/bf16 (kernels/triton_codebook.py: in-register decode
feeding tl.dot, fp32 accumulation), the torch reference elsewhere (the quantizer's own dequantize in float32,
rounded once to x's dtype, one GEMM), "triton" on CPU under TRITON_INTERPRET=1 for the tests.
"""
import torch

from quantkit.core import bitpack
from quantkit.core.groups import per_column
from quantkit.kernels.dispatch import choose_backend
from quantkit.kernels.reference import linear_dequantized


def decode_table(decode, device=None) -> torch.Tensor:
    """The tensor the kernel reads for a KernelDecode: float32 levels ("table"), int32 words ("e8p"), or one
    unused zero ("lattice", whose points need no table)."""
    if decode.variant == "e8p":
        return torch.tensor(decode.table, dtype=torch.int32, device=device)
    return torch.tensor(decode.table or (0.0,), dtype=torch.float32, device=device)


def decode_weight(codes, params: dict, g_idx, quantizer, in_features) -> torch.Tensor:
    """Ŵ [out_features, in_features], float32, exactly as the checkpoint says: the packed codes and the per-group
    parameters {key: [G, N]} decoded by the quantizer's own dequantize."""
    q = bitpack.unpack(codes, quantizer.code_bits, in_features, dim=0)
    return quantizer.dequantize(q.t(), per_column({k: v.t().float() for k, v in params.items()}, g_idx))


def decode_codebook(codes, scales, g_idx, quantizer, in_features) -> torch.Tensor:
    """Ŵᵀ [in_features, out_features] of a layer whose only parameter is its scale (what the kernel decodes)."""
    return decode_weight(codes, {"scale": scales}, g_idx, quantizer, in_features).t()


def codebook_linear_torch(x, codes, scales, g_idx, quantizer, in_features, bias=None):
    w = decode_codebook(codes, scales, g_idx, quantizer, in_features).to(x.dtype)
    return linear_dequantized(x, w, bias)


def codebook_linear(x, codes, scales, g_idx, table, quantizer, in_features, bias=None, *, backend=None):
    """y = x @ Ŵᵀ (+ bias), x [..., in_features]; table: decode_table(quantizer.kernel_decode) on x's device;
    backend "auto" | "triton" | "torch" (see dispatch.py)."""
    if choose_backend(x, quantizer.code_bits, backend) == "torch":
        return codebook_linear_torch(x, codes, scales, g_idx, quantizer, in_features, bias)
    from quantkit.kernels.triton_codebook import codebook_matmul  # triton imports only where it runs

    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    y = codebook_matmul(x.reshape(-1, in_features).contiguous(), codes, scales, g_idx, table, quantizer.code_bits,
                        quantizer.kernel_decode, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
