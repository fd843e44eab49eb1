"""Triton decode of trellis layers (quantkit.schemes.trellis): packed codes -> states -> values -> Ŵᵀ.

A weight's state is the window of the last ceil(L / kV) symbols of its step in its tail-biting sequence (a tile of
TILE_ROWS output columns of Ŵᵀ x WIDTH inputs, read output by output: quantkit.schemes.trellis_codes). Each lane of a
program walks one tile row, WIDTH weights of one output: it builds the state before the row's first step from the
symbols of the rows before it (the tile's last rows for its first: tail-biting), then shifts in one symbol a step. A
row's codes are one field of WIDTH x k bits of the output's bit stream along K (LSB first, triton_decode.packed_codes),
loaded once, its symbols taken by shifts; rows wider than 16 bits (QTIP's 16 x 16 tiles) are read symbol by symbol.
The value comes from the state with 32-bit integer ops as QTIP's kernels do: one or two LCG steps, then 1MAD's byte
sum or 3INST's two fp16 halves, or HYB's table row with its sign bit. Times the group scale in float32, rounded once
to the activation dtype: bit for bit the torch reference's Ŵ (tests/test_trellis_kernel.py). The lanes of a program
are [BLOCK_J tile columns, BLOCK_N outputs], outputs fastest, so each of a row's WIDTH stores is coalesced along N.

The walk replaced (2026-11-28, thirteenth session) a decode that gathered every weight's whole window of codes:
sm_90 SASS per weight (scripts/sass_stats.py --kind trellis) 71.3 -> 17.3 at 2 bits, 187.4 -> 28.9 at 3, 96.8 -> 23.1
at 4 (L = 16 on 64 x 4 tiles). Not yet timed on a GPU.

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

# A program's lanes [BLOCK_J tile columns, BLOCK_N outputs], 4 warps, at every code width: no spills
# (scripts/sass_stats.py --kind trellis, which CI runs with --check); 8 x 64, 32 x 32, 32 x 64 and 16 x 128 compiled
# to within 12 % of its instructions per weight (the gather decode before the walk spilled at 3 and 4 bits on 64 x 64
# blocks).
LANES = (16, 64)
# What the kernel reads of trellis_codes, as constexprs (a jitted function reads no other globals). Codes by their
# index in CODES.
MAD_A, MAD_B, INST_A, INST_B = (tl.constexpr(c) for c in MAD + INST)
INST_AND, INST_XOR_C = tl.constexpr(INST_MASK), tl.constexpr(INST_XOR)
MAD_MEAN, MAD_DIV, INST_GAIN = tl.constexpr(MAD_CENTRE), tl.constexpr(MAD_STD), tl.constexpr(THREE_INST_GAIN)
MAD_RCP = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(MAD_STD)))  # 1 / MAD_STD rounded to float32
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
def _row_field(codes_ptr, row, n0, jj, mask, N, KW, FIELD: tl.constexpr):
    """The FIELD bits (a tile row's codes: WIDTH x k) of tile row `row` of each lane's tile (its first output n0, its
    inputs from jj * WIDTH): consecutive fields of one output's bit stream along K."""
    return packed_codes(codes_ptr + (n0 + row), jj, N, mask, KW, FIELD).to(tl.uint32)


@triton.jit
def _symbol(codes_ptr, step, n0, jj, mask, N, KW, KV: tl.constexpr, V: tl.constexpr, WIDTH: tl.constexpr):
    """The kV-bit symbol of step `step` of each lane's sequence (the tile starting at output n0 and input jj * WIDTH):
    the step's V codes are adjacent along K in one output (a tile row holds whole steps), so one field of kV bits."""
    pos = step * V
    field = packed_codes(codes_ptr + (n0 + pos // WIDTH), (jj * WIDTH + pos % WIDTH) // V, N, mask, KW, KV)
    return field.to(tl.uint32)


@triton.jit
def _value(state, v: tl.constexpr, table_ptr, L: tl.constexpr, CODE: tl.constexpr, Q: tl.constexpr):
    """Coordinate v of the value of each state, float32 (quantkit.schemes.trellis_codes says how)."""
    if CODE == 2:  # HYB: row (h >> (L-1-Q)) mod 2^Q of the table, h = s(s+1) mod 2^32; bit L-1 of h flips x
        h = state * (state + 1)
        row = ((h >> (L - 1 - Q)) & ((1 << Q) - 1)).to(tl.int32)
        value = tl.load(table_ptr + row * 2 + v)
        if v == 0:
            value = tl.where(((h >> (L - 1)) & 1) == 1, -value, value)
    elif CODE == 0:  # 1MAD: the byte sum of the v+1-th LCG iterate
        x = _lcg(state, MAD_A, MAD_B)
        for _ in tl.static_range(v):
            x = _lcg(x, MAD_A, MAD_B)
        total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        # total - 510 as a float without an int -> float conversion: 2^23 + total has total in its low mantissa bits
        n = (total | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + MAD_MEAN)
        # n / 147.8...: one FMA-refined reciprocal product, the correctly rounded quotient (what torch's division
        # gives) for every n in -510..510 (checked exhaustively), where div_rn compiles to a slow-path subroutine
        q = n * MAD_RCP
        value = tl.fma(tl.fma(-q, MAD_DIV, n), MAD_RCP, q)
    else:  # 3INST: two fp16 bit patterns of the v+1-th LCG iterate, summed in fp16
        x = _lcg(state, INST_A, INST_B)
        for _ in tl.static_range(v):
            x = _lcg(x, INST_A, INST_B)
        y = (x & _u32(INST_AND)) ^ _u32(INST_XOR_C)
        hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        value = (hi + lo).to(tl.float32) * INST_GAIN  # the fp16 sum, as an fp16 decoder computes it
    return value


@triton.jit
def trellis_dequant_kernel(codes_ptr, scales_ptr, g_idx_ptr, table_ptr, out_ptr, N, K, KW,
                           BITS: tl.constexpr, L: tl.constexpr, V: tl.constexpr, CODE: tl.constexpr,
                           Q: tl.constexpr, TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr,
                           BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETER: tl.constexpr):
    """Each lane walks one tile row (WIDTH inputs of one output): the state of the row's first step from the window
    of symbols before it (the tile's last rows for its first row: tail-biting), then one symbol shifted in a step."""
    S: tl.constexpr = WIDTH // V                      # steps per tile row
    KV: tl.constexpr = BITS * V
    WINDOW: tl.constexpr = (L + KV - 1) // KV         # symbols that make up a state
    STEPS: tl.constexpr = TILE_ROWS * S
    jj = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)[:, None]   # tile columns: inputs jj * WIDTH + ...
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]   # outputs
    j_mask = jj < K // WIDTH
    mask = j_mask & (nn < N)
    r = nn % TILE_ROWS
    n0, t0 = nn - r, r * S
    state = tl.zeros((BLOCK_J, BLOCK_N), tl.uint32)
    if S * KV <= 16:  # a tile row's codes are one field: load each row once, take its symbols by shifts
        ROWS_BEFORE: tl.constexpr = (WINDOW + S - 1) // S
        for q in tl.static_range(ROWS_BEFORE, 0, -1):  # the rows before, oldest first (circularly: tail-biting)
            field = _row_field(codes_ptr, (r + (TILE_ROWS - q)) % TILE_ROWS, n0, jj, mask, N, KW, S * KV)
            for u in tl.static_range(S):
                if q * S - u <= WINDOW:  # one of the WINDOW symbols before the row
                    state = (state << KV) | ((field >> (u * KV)) & ((1 << KV) - 1))
        field = _row_field(codes_ptr, r, n0, jj, mask, N, KW, S * KV)
    else:  # wide rows (QTIP's 16 x 16 tiles): symbol by symbol
        for i in tl.static_range(WINDOW):  # the symbols before the row's first step, oldest first, circularly
            state = (state << KV) | _symbol(codes_ptr, (t0 + (STEPS - WINDOW + i)) % STEPS, n0, jj, mask, N, KW, KV,
                                            V, WIDTH)
    for u in tl.static_range(S):
        if S * KV <= 16:
            symbol = (field >> (u * KV)) & ((1 << KV) - 1)
        else:
            symbol = _symbol(codes_ptr, t0 + u, n0, jj, mask, N, KW, KV, V, WIDTH)
        state = (state << KV) | symbol
        for v in tl.static_range(V):
            value = _value(state & ((1 << L) - 1), v, table_ptr, L, CODE, Q)
            k = jj * WIDTH + (u * V + v)
            g = tl.load(g_idx_ptr + k, mask=j_mask, other=0)
            s = tl.load(scales_ptr + g * N + nn, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + k.to(tl.int64) * N + nn, round_to(value * s, out_ptr.dtype.element_ty, INTERPRETER),
                     mask=mask)


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
    width = length // tile_rows
    block_j, block_n = LANES
    grid = (triton.cdiv(k // width, block_j), triton.cdiv(n, block_n))
    with on_device(codes):
        trellis_dequant_kernel[grid](codes, scales, g_idx.to(torch.int32), table.contiguous(), w, n, k,
                                     codes.shape[0], BITS=bits, L=state_bits, V=step, CODE=CODES.index(code), Q=q,
                                     TILE_ROWS=tile_rows, WIDTH=width, BLOCK_J=block_j,
                                     BLOCK_N=block_n, INTERPRETER=not codes.is_cuda)
    return w
