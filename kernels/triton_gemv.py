"""M = 1 inner loops of the fused GPTQ kernel (triton_gptq.py): one row of x against a tile of words.

The GEMV is memory-bound in principle but, on an H100, issue-bound in practice: every weight costs a
few instructions and the SM issues 128 per clock (docs/BENCHMARKS.md). These tiles therefore work in
the packed words' own register layout, with no reshape and no cross-thread reduction in the loop.
"""
import triton
import triton.language as tl

from quantkit.kernels.triton_decode import f16_bits, group_params, in_range


@triton.jit
def gemv_tile(acc, words, x_row, k0, K, s, z, g_ptr, s_ptr, qz_ptr, offs_n, n_mask, N, NW,
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
    k_mask = in_range(offs_k, K, EVEN_K)
    x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[:, None] * (1.0 / (1 << SH))
    if not UNIFORM:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)[:, None]
        s, z = group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS, ZERO_OFFSET)
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


@triton.jit
def gemv_tile_half2(acc, words, x_row, k0, K, s, z, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     INTERPRETER: tl.constexpr):
    """M = 1, 4-bit, one group per tile, fp16 x: two weights per instruction in packed fp16 math.

    Codes j and j + 4 of a word sit 16 bits apart, so a shift and one LOP3 put both into the two
    halves under the fp16 exponent of 1024: ((w >> 4j) & 0x000F000F) | 0x64006400 is the fp16 pair
    (1024 + q_j, 1024 + q_j+4). One HADD2 removes 1024 + z exactly and one HFMA2 multiplies by the
    x pair (x_k, x_k+4) and accumulates: 4 instructions per 2 weights, about 4 per weight with x,
    zeros and the fp32 widening, against 5.4-6.2 for the fp32 FMA path (gemv_tile; sm_90 SASS,
    docs/BENCHMARKS.md). The pairs travel as int32 (Triton has no packed-half type); only
    _fma_f16x2 reads them as numbers.
    Range and rounding: x is scaled by 2^-6 first, so a word's partial sum, at most
    4 * 15 * 65504 / 64 < 65504 in magnitude, cannot overflow for any finite fp16 x. Each product
    and sum rounds to fp16 (relative u = 2^-11; 2^-25 absolute where x * 2^-6 is subnormal), so
    the four-term partial of each half is within about 4u of exact; partials are widened to fp32
    per word, summed and scaled in fp32."""
    offs_k = k0 + tl.arange(0, BLOCK_K // 8) * 8             # first k of each row of words
    minus_z = -f16_bits(z | 0x6400)                         # [1, C]: removes 1024 + z
    part = tl.zeros(words.shape, dtype=tl.int32)             # the fp16 pair (0, 0)
    for j in tl.static_range(4):
        codes = ((words >> (4 * j)) & 0x000F000F) | 0x64006400
        part = _fma_f16x2(codes, minus_z, _x_pair(x_row, offs_k + j, K, EVEN_K), part, INTERPRETER)
    lo, hi = _unpack_f16x2(part)
    return acc + (lo.to(tl.float32) + hi.to(tl.float32)) * (s.to(tl.float32) * 64.0)


@triton.jit
def _x_pair(x_row, k, K, EVEN_K: tl.constexpr):
    """[rows, 1] int32 holding the fp16 pair (x_k, x_k+4) * 2^-6 (exact unless subnormal)."""
    lo = tl.load(x_row + k, mask=in_range(k, K, EVEN_K), other=0.0) * 0.015625
    hi = tl.load(x_row + k + 4, mask=in_range(k + 4, K, EVEN_K), other=0.0) * 0.015625
    return _pack_f16x2(lo, hi)[:, None]


@triton.jit
def _fma_f16x2(codes, offset, x2, acc, INTERPRETER: tl.constexpr):
    """(codes + offset) * x2 + acc per fp16 half: codes, x2 and acc are fp16 pairs carried in int32,
    offset an fp16 tensor (the same in both halves). On the GPU PTX add.f16x2 + fma.rn.f16x2. The
    interpreter cannot run inline PTX, so it computes the same formula per half in fp16 (rounding
    the product before the add where the GPU's fma rounds once; both within the stated bound)."""
    offset2 = _pack_f16x2(offset, offset)
    if INTERPRETER:
        c_lo, c_hi = _unpack_f16x2(codes)
        x_lo, x_hi = _unpack_f16x2(x2)
        a_lo, a_hi = _unpack_f16x2(acc)
        return _pack_f16x2((c_lo + offset) * x_lo + a_lo, (c_hi + offset) * x_hi + a_hi)
    args = [tl.broadcast_to(v, acc.shape) for v in (codes, offset2, x2)]
    return tl.inline_asm_elementwise("{ .reg .b32 d; add.f16x2 d, $1, $2; fma.rn.f16x2 $0, d, $3, $4; }",
                                     "=r,r,r,r,r", args + [acc], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pack_f16x2(lo, hi):
    """Two fp16 tensors -> int32 with lo in bits 0-15 and hi in bits 16-31 (PTX's f16x2 order)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _unpack_f16x2(v):
    return f16_bits(v), f16_bits(v >> 16)
