"""M = 1 inner loops of the fused GPTQ kernel (triton_gptq.py): one row of x against a tile of words.

The GEMV is memory-bound in principle but, on an H100, issue-bound in practice: every weight costs a
few instructions and the SM issues 128 per clock (docs/BENCHMARKS.md). These tiles therefore work in
the packed words' own register layout, with no reshape and no cross-thread reduction in the loop.
"""
import triton
import triton.language as tl

from quantkit.kernels.triton_decode import _group_params, _in_range


@triton.jit
def _gemv_tile(acc, words, x_row, k0, K, s, z, g_ptr, s_ptr, qz_ptr, offs_n, n_mask, N, NW,
               BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):
    """M = 1: acc[word, n] += sum over the codes j of each word of (q - z) * s * x, fp32 FMAs.

    Everything stays in the words' own layout (no reshape, no cross-thread reduction in the loop),
    and each weight costs three instructions: (1) a LOP3 masks code j *in place* and ORs in the
    exponent of 2^23, giving the fp32 number 2^23 + q * 2^sh (exact while sh + BITS <= 23; the top
    codes are taken from the word shifted right by 12 once); (2) an FADD of 2^23 + z * 2^sh leaves
    (q - z) * 2^sh exactly; (3) an FFMA with x * 2^-sh (exact power-of-two rescale, once per row).
    In uniform mode the scale is applied once per tile and column. W is thus used exactly, not
    rounded to the activation dtype as the reference does: at most u * sum|x * w| apart."""
    hi = words >> 12
    part = tl.zeros(acc.shape, dtype=tl.float32)
    for j in tl.static_range(32 // BITS):
        part = _gemv_code(part, j, words, hi, x_row, k0, K, s, z, g_ptr, s_ptr, qz_ptr, offs_n, n_mask, N, NW,
                          BITS, ZERO_OFFSET, UNIFORM, BLOCK_K, EVEN_K)
    if UNIFORM:
        return acc + part * s.to(tl.float32)
    return acc + part


@triton.jit
def _gemv_code(part, j: tl.constexpr, words, hi, x_row, k0, K, s, z, g_ptr, s_ptr, qz_ptr, offs_n, n_mask, N, NW,
               BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Code j of every word of the tile (a function, so its constexprs are fresh per j)."""
    PW: tl.constexpr = 32 // BITS
    LOW: tl.constexpr = j * BITS + BITS <= 23
    SH: tl.constexpr = j * BITS if LOW else j * BITS - 12
    FIELD: tl.constexpr = ((1 << BITS) - 1) << SH
    offs_k = k0 + tl.arange(0, BLOCK_K // PW) * PW + j
    k_mask = _in_range(offs_k, K, EVEN_K)
    x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[:, None] * (1.0 / (1 << SH))
    if not UNIFORM:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
        s, z = _group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
    if LOW:
        qf = ((words & FIELD) | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        qf = ((hi & FIELD) | 0x4B000000).to(tl.float32, bitcast=True)
    zf = ((z << SH) | 0x4B000000).to(tl.float32, bitcast=True)
    if UNIFORM:
        part += (qf - zf) * x
    else:
        part += (qf - zf) * (x * s.to(tl.float32))
    return part
