"""Triton kernel of the codebook dequant-GEMM (kernels/codebook.py): codes -> table lookup -> tl.dot.

One program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K steps: it loads the x tile, extracts
the codes of the K x N weight tile from the packed words, looks them up in the codebook (2^bits floats,
cache-resident), multiplies by the group scales, rounds once to x's dtype (as the reference does) and
accumulates x·Ŵᵀ in fp32 on the tensor cores. Correct for every M, K and group layout; its GPU speed is
not measured yet (docs/BENCHMARKS.md).
"""
import torch
import triton
import triton.language as tl

from quantkit.formats import bitpack
from quantkit.kernels.triton_decode import _packed_codes


@triton.jit
def codebook_kernel(x_ptr, c_ptr, s_ptr, g_ptr, cb_ptr, b_ptr, y_ptr, M, N, K, KW,
                    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & n_mask[None, :]
        q = _packed_codes(c_ptr + offs_n[None, :], offs_k[:, None], N, mask, KW, BITS)
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
        w = (tl.load(cb_ptr + q, mask=mask, other=0.0) * s.to(tl.float32)).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def codebook_matmul(x, codes, scales, g_idx, codebook, bits, bias=None):
    """x [M, K] (fp16/bf16/fp32, contiguous) @ Ŵᵀ -> [M, N] in x's dtype; ValueError on a malformed layer."""
    m, k = x.shape
    n = scales.shape[1]
    kw = bitpack.packed_len(k, bits)
    if tuple(codes.shape) != (kw, n) or codes.dtype != torch.int32:
        raise ValueError(f"codes must be int32 [{kw}, {n}] for K={k} at {bits} bits, got {codes.dtype} {tuple(codes.shape)}")
    if tuple(g_idx.shape) != (k,) or codebook.numel() != 1 << bits:
        raise ValueError(f"g_idx must be [{k}] and the codebook hold {1 << bits} levels")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    tensors = [x, codes, scales, g_idx, codebook] + ([bias] if bias is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x and the layer's tensors must be on one device")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    codebook_kernel[grid](x, codes, scales, g_idx.to(torch.int32), codebook.float().contiguous(),
                          bias if bias is not None else scales, y, m, n, k, kw, BITS=bits,
                          HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                          BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
    return y
