"""Triton decode of trellis layers (quantkit.schemes.trellis): packed codes -> states -> values -> Ŵᵀ.

A weight's state is the window of the last ceil(L / kV) symbols of its step in its tail-biting sequence (a tile of
TILE_ROWS output columns of Ŵᵀ x WIDTH inputs, read output by output: quantkit.schemes.trellis_codes). Each program
decodes a [BLOCK_K, BLOCK_N] block of Ŵᵀ: it gathers every weight's window from the packed columns (LSB-first bit
streams along K, triton_decode.packed_codes; the codes are a few bits of L1-resident words), ORs them into the state,
and computes the value from the state with 32-bit integer ops as QTIP's kernels do: one or two LCG steps, then 1MAD's
byte sum or 3INST's two fp16 halves, or HYB's table row with its sign bit. Times the group scale in float32, rounded
once to the activation dtype: bit for bit the torch reference's Ŵ (tests/test_trellis_kernel.py).

The GEMM is the prefill path's for every M (kernels/codebook.py): the weight decoded to a transient fp16/bf16 matrix,
then cuBLAS. A fused kernel (the state built in registers per tile, as QTIP's are) is not written yet.
"""
import torch
import triton
import triton.language as tl

from quantkit.kernels.device import on_device
from quantkit.kernels.triton_codebook import check_together
from quantkit.kernels.triton_decode import packed_codes, round_to
from quantkit.schemes.trellis_codes import CODES, INST, INST_MASK, INST_XOR, MAD, MAD_CENTRE, MAD_STD, \
    THREE_INST_GAIN

# The decode tile [BLOCK_K, BLOCK_N] per code width: the largest none of whose sm_90 compiles spills registers
# (scripts/sass_stats.py --kind trellis; at 3 bits the 64 x 64 tile spilled, 22 and 95 spills at L = 12 and 16, and
# took 11x L = 12's time at L = 16 on an H200; at 4 bits it spills 6 on the default 64 x 4 trellis tiles).
TILES = {1: (64, 64), 2: (64, 64), 3: (64, 32), 4: (64, 32)}
# What the kernel reads of trellis_codes, as constexprs (a jitted function reads no other globals). Codes by their
# index in CODES.
MAD_A, MAD_B, INST_A, INST_B = (tl.constexpr(c) for c in MAD + INST)
INST_AND, INST_XOR_C = tl.constexpr(INST_MASK), tl.constexpr(INST_XOR)
MAD_MEAN, MAD_DIV, INST_GAIN = tl.constexpr(MAD_CENTRE), tl.constexpr(MAD_STD), tl.constexpr(THREE_INST_GAIN)
assert CODES == ("1mad", "3inst", "hyb")


@triton.jit
def _u32(c: tl.constexpr):
    """The constant c as a uint32 scalar: kept unsigned 32-bit (a literal over 2^31 would widen the words to int64)."""
    return tl.full((), c, tl.uint32)


@triton.jit
def _lcg(x, A: tl.constexpr, B: tl.constexpr):
    """(A·x + B) mod 2^32 on uint32 words (the product wraps)."""
    return x * _u32(A) + _u32(B)


@triton.jit
def _state(codes_ptr, kk, nn, mask, N, KW, BITS: tl.constexpr, L: tl.constexpr, V: tl.constexpr,
           TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """(state, v) of the weights at inputs kk [BLOCK_K, 1] x outputs nn [1, BLOCK_N]: the uint32 state of the step
    holding each weight and the weight's coordinate v in that step."""
    STEPS: tl.constexpr = TILE_ROWS * WIDTH // V
    WINDOW: tl.constexpr = (L + BITS * V - 1) // (BITS * V)
    c, r = kk % WIDTH, nn % TILE_ROWS
    p = r * WIDTH + c                      # the weight's position in its sequence
    t, v = p // V, p % V
    state = tl.zeros(p.shape, tl.uint32)
    for j in tl.static_range(WINDOW):      # symbol t - j, circularly, at bits [kVj, kVj + kV)
        step = (t - j + STEPS) % STEPS
        if WIDTH % V == 0:  # the symbol's V codes are adjacent along K in one output: one field of kV bits
            pos = step * V
            symbol = packed_codes(codes_ptr + (nn - r + pos // WIDTH), (kk - c + pos % WIDTH) // V, N, mask, KW,
                                  BITS * V)
            state |= symbol.to(tl.uint32) << (BITS * V * j)
        else:
            for u in tl.static_range(V):
                pos = step * V + u
                code = packed_codes(codes_ptr + (nn - r + pos // WIDTH), kk - c + pos % WIDTH, N, mask, KW, BITS)
                state |= code.to(tl.uint32) << (BITS * (V * j + u))
    return state & ((1 << L) - 1), v


@triton.jit
def _value(state, v, table_ptr, L: tl.constexpr, V: tl.constexpr, CODE: tl.constexpr, Q: tl.constexpr):
    """Coordinate v of the value of each state, float32 (quantkit.schemes.trellis_codes says how)."""
    if CODE == 2:  # HYB: row (h >> (L-1-Q)) mod 2^Q of the table, h = s(s+1) mod 2^32; bit L-1 of h flips x
        h = state * (state + 1)
        row = ((h >> (L - 1 - Q)) & ((1 << Q) - 1)).to(tl.int32)
        value = tl.load(table_ptr + row * 2 + v)
        value = tl.where((v == 0) & (((h >> (L - 1)) & 1) == 1), -value, value)
    else:
        if CODE == 0:
            x = _lcg(state, MAD_A, MAD_B)
            if V == 2:
                x = tl.where(v == 1, _lcg(x, MAD_A, MAD_B), x)
            total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
            value = tl.div_rn((total.to(tl.int32) - MAD_MEAN).to(tl.float32), tl.full((), MAD_DIV, tl.float32))
        else:
            x = _lcg(state, INST_A, INST_B)
            if V == 2:
                x = tl.where(v == 1, _lcg(x, INST_A, INST_B), x)
            y = (x & _u32(INST_AND)) ^ _u32(INST_XOR_C)
            hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            value = (hi + lo).to(tl.float32) * INST_GAIN  # the fp16 sum, as an fp16 decoder computes it
    return value


@triton.jit
def trellis_dequant_kernel(codes_ptr, scales_ptr, g_idx_ptr, table_ptr, out_ptr, N, K, KW,
                           BITS: tl.constexpr, L: tl.constexpr, V: tl.constexpr, CODE: tl.constexpr,
                           Q: tl.constexpr, TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETER: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = offs_k < K, offs_n < N
    mask = k_mask[:, None] & n_mask[None, :]
    state, v = _state(codes_ptr, offs_k[:, None], offs_n[None, :], mask, N, KW, BITS, L, V, TILE_ROWS, WIDTH)
    value = _value(state, v, table_ptr, L, V, CODE, Q)
    g = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
    s = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    out = offs_k.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + out, round_to(value * s, out_ptr.dtype.element_ty, INTERPRETER), mask=mask)


def check_layer(x, codes, scales, g_idx, table, bits, state_bits, step, code, tile_rows, length, bias=None):
    """ValueError unless x [M, K] and the layer's tensors are a trellis layer these kernels decode."""
    k, n = x.shape[1], scales.shape[1]
    kw = -(-k * bits // 32)
    if tuple(codes.shape) != (kw, n) or codes.dtype != torch.int32:
        raise ValueError(f"codes must be int32 [{kw}, {n}] for K={k} at {bits} bits, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    width = length // tile_rows
    if k % width or n % tile_rows:
        raise ValueError(f"a trellis layer is tiles of {tile_rows} outputs x {width} inputs, not [{n}, {k}]")
    if code not in CODES or (code == "hyb") != (table.numel() > 1) or tuple(g_idx.shape) != (k,):
        raise ValueError(f"code {code!r} with a table of {table.numel()} values and g_idx {tuple(g_idx.shape)}")
    check_together(x, [codes, scales, g_idx, table], bias)


def trellis_dequantize(codes, scales, g_idx, table, bits, state_bits, step, code, tile_rows, length, k, dtype):
    """Ŵᵀ [K, N] in `dtype` (a transient weight: 2 bytes a weight at fp16) of a checked trellis layer: codes int32
    [packed_len(K, bits), N], scales [G, N], g_idx int32 [K], table the hyb table's 2^9 (x, y) float32 pairs
    flattened (one unused zero for the computed codes)."""
    n = scales.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=codes.device)
    q = max(int(table.numel() // 2).bit_length() - 1, 0)
    block_k, block_n = TILES[bits]
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    with on_device(codes):
        trellis_dequant_kernel[grid](codes, scales, g_idx.to(torch.int32), table.contiguous(), w, n, k,
                                     codes.shape[0], BITS=bits, L=state_bits, V=step, CODE=CODES.index(code), Q=q,
                                     TILE_ROWS=tile_rows, WIDTH=length // tile_rows, BLOCK_K=block_k,
                                     BLOCK_N=block_n, INTERPRETER=not codes.is_cuda)
    return w
