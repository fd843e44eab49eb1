"""Codebook dequant-GEMM (TurboQuant and E8 layers): y = x Ŵᵀ + bias with Ŵ[n, k] = scales[g, n] * value(code),
value = codebook[code[k, n]] (turboquant) or the coordinate of an E8 lattice point (e8: 8 codes along K per point;
e8p: the 8 codes of a point are one 8b-bit word, decoded through int32 tables, quantkit.schemes.e8p).

Layout (quantkit.checkpoint.quantkit_format, generic layers): codes int32 [packed_len(K, bits), N], the
b-bit codes of each output column packed along K as one LSB-first bit stream (quantkit.core.bitpack:
5-bit codes straddle words, as 3-bit ones do in the GPTQ layout); scales fp16 [G, N]; g_idx int32 [K];
codebook float32 [2^bits]. The decode step is the GPTQ kernels' code extraction (triton_decode.
_packed_codes) followed by a table lookup where the integer grid does scale * (q - zero).

Backends as in dispatch.py: Triton on CUDA fp16/bf16 (kernels/triton_codebook.py: in-register decode
feeding tl.dot, fp32 accumulation), the torch reference elsewhere (decode W in float32, round it once
to x's dtype, one GEMM), "triton" on CPU under TRITON_INTERPRET=1 for the tests.
"""
import torch

from quantkit.core import bitpack
from quantkit.kernels.dispatch import _choose_backend
from quantkit.kernels.reference import linear_dequantized


def decode_codebook(codes, scales, g_idx, codebook, bits, in_features, lattice_offset=None,
                    e8p_ratio=None) -> torch.Tensor:
    """Ŵᵀ [in_features, out_features], float32, exactly as the checkpoint says. e8p_ratio not None: an E8P layer,
    `codebook` its int32 tables (256 abs patterns, then for 3 bits the 256 residual points)."""
    q = bitpack.unpack(codes, bits, in_features, dim=0).long()
    if e8p_ratio is not None:
        values = _e8p_values(q, bits, codebook, e8p_ratio)
    elif lattice_offset is None:
        values = codebook.float().to(q.device)[q]
    else:
        values = _lattice_values(q, bits, lattice_offset)
    return scales.float()[g_idx.long()] * values


def _lattice_values(q, bits, offset):
    """Box-truncated E8 points of codes q [K, N] (8 consecutive codes along K per point), float32."""
    from quantkit.schemes.e8 import box_point, unpack_codes

    k, coset = unpack_codes(q.t().reshape(q.shape[1], -1, 8))
    return box_point(k, coset, bits, offset).float().reshape(q.shape[1], -1).t()


def _e8p_values(q, bits, tables, ratio):
    """E8P points of codes q [K, N] (8 consecutive codes along K per point, one 8·bits-bit word), float32."""
    from quantkit.schemes.e8p import decode, join_word, table_len

    if tables.numel() != table_len(bits):
        raise ValueError(f"a {bits}-bit E8P layer needs {table_len(bits)} table entries, got {tables.numel()}")
    word = join_word(q.t().reshape(q.shape[1], -1, 8), bits)
    return decode(word, bits, ratio, tables=tables.to(q.device)).reshape(q.shape[1], -1).t()


def codebook_linear_torch(x, codes, scales, g_idx, codebook, bits, in_features, bias=None, lattice_offset=None,
                          e8p_ratio=None):
    w = decode_codebook(codes, scales, g_idx, codebook, bits, in_features, lattice_offset, e8p_ratio).to(x.dtype)
    return linear_dequantized(x, w, bias)


def codebook_linear(x, codes, scales, g_idx, codebook, bits, in_features, bias=None, *, lattice_offset=None,
                    e8p_ratio=None, backend=None):
    """y = x @ Ŵᵀ (+ bias), x [..., in_features]; backend "auto" | "triton" | "torch" (see dispatch.py).
    lattice_offset: the layer is E8 (its codes decode to lattice points with this offset; codebook unused).
    e8p_ratio: the layer is E8P (codebook: its int32 tables; the ratio divides the residual stage)."""
    if _choose_backend(x, bits, backend) == "torch":
        return codebook_linear_torch(x, codes, scales, g_idx, codebook, bits, in_features, bias, lattice_offset,
                                     e8p_ratio)
    from quantkit.kernels.triton_codebook import codebook_matmul

    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x must be [..., in_features={in_features}], got {tuple(x.shape)}")
    y = codebook_matmul(x.reshape(-1, in_features).contiguous(), codes, scales, g_idx, codebook, bits, bias,
                        lattice_offset, e8p_ratio)
    return y.reshape(*x.shape[:-1], y.shape[-1])
