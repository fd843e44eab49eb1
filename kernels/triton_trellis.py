"""Triton kernels of trellis layers (quantkit.schemes.trellis): packed codes -> states -> values -> Ŵᵀ or x Ŵᵀ.

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

Two kernels run the walk (kernels/codebook.py picks): up to FUSED_MAX_M rows trellis_matmul_kernel multiplies each
weight as it is made and writes only y; from there trellis_dequant_kernel writes the weight to a transient fp16/bf16
matrix and cuBLAS multiplies. Offline sm_90 counts per weight at L 16 (docs/BENCHMARKS.md): the fused loop 17.5 / 29.8
/ 23.6 at 2 / 3 / 4 bits at M = 1, about the decode's; neither timed on a GPU yet.
"""
import torch
import triton
import triton.language as tl

from quantkit.kernels.device import on_device
from quantkit.kernels import triton_codebook
from quantkit.kernels.triton_codebook import check_together, dot_into
from quantkit.kernels.triton_decode import packed_codes, round_to, store_tile
from quantkit.kernels.triton_gptq_ops import group_layout, num_sms, workspace
from quantkit.schemes.trellis_codes import CODES, INST, INST_MASK, INST_XOR, MAD, MAD_CENTRE, MAD_STD, \
    THREE_INST_GAIN

# A program's lanes [BLOCK_J tile columns, BLOCK_N outputs], 4 warps, at every code width: no spills
# (scripts/sass_stats.py --kind trellis, which CI runs with --check); 8 x 64, 32 x 32, 32 x 64 and 16 x 128 compiled
# to within 12 % of its instructions per weight (the gather decode before the walk spilled at 3 and 4 bits on 64 x 64
# blocks).
LANES = (16, 64)
# The fused kernel for M <= FUSED_MAX_M rows (decode-time batches): lanes [BLOCK_J tile columns, BLOCK_N outputs],
# BLOCK_J also tl.dot's K (at least 16). Above, the weight is decoded once and cuBLAS multiplies (kernels/codebook.py).
FUSED_MAX_M = 16
FUSED_LANES = (16, 64)
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
def _walk_start(codes_ptr, r, n0, t0, jj, mask, N, KW, KV: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the state before each lane's tile row, the row's codes as one field): the state from the window of symbols
    before the row (the tile's last rows for its first row: tail-biting), oldest first. For rows wider than 16 bits
    the field is unused (_walk_symbol reads symbol by symbol)."""
    S: tl.constexpr = WIDTH // V                      # steps per tile row
    WINDOW: tl.constexpr = (L + KV - 1) // KV         # symbols that make up a state
    STEPS: tl.constexpr = TILE_ROWS * S
    state = tl.zeros((BLOCK_J, BLOCK_N), tl.uint32)
    if S * KV <= 16:  # a tile row's codes are one field: load each row once, take its symbols by shifts
        ROWS_BEFORE: tl.constexpr = (WINDOW + S - 1) // S
        for q in tl.static_range(ROWS_BEFORE, 0, -1):  # the rows before, oldest first (circularly: tail-biting)
            before = _row_field(codes_ptr, (r + (TILE_ROWS - q)) % TILE_ROWS, n0, jj, mask, N, KW, S * KV)
            for u in tl.static_range(S):
                if q * S - u <= WINDOW:  # one of the WINDOW symbols before the row
                    state = (state << KV) | ((before >> (u * KV)) & ((1 << KV) - 1))
        field = _row_field(codes_ptr, r, n0, jj, mask, N, KW, S * KV)
    else:  # wide rows (QTIP's 16 x 16 tiles): symbol by symbol
        for i in tl.static_range(WINDOW):
            state = (state << KV) | _symbol(codes_ptr, (t0 + (STEPS - WINDOW + i)) % STEPS, n0, jj, mask, N, KW, KV,
                                            V, WIDTH)
        field = state
    return state, field


@triton.jit
def _walk_symbol(field, u: tl.constexpr, codes_ptr, t0, n0, jj, mask, N, KW, KV: tl.constexpr, V: tl.constexpr,
                 WIDTH: tl.constexpr):
    """The symbol of step u of each lane's tile row."""
    if (WIDTH // V) * KV <= 16:
        symbol = (field >> (u * KV)) & ((1 << KV) - 1)
    else:
        symbol = _symbol(codes_ptr, t0 + u, n0, jj, mask, N, KW, KV, V, WIDTH)
    return symbol


@triton.jit
def trellis_dequant_kernel(codes_ptr, scales_ptr, g_idx_ptr, table_ptr, out_ptr, N, K, KW,
                           BITS: tl.constexpr, L: tl.constexpr, V: tl.constexpr, CODE: tl.constexpr,
                           Q: tl.constexpr, TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr,
                           BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETER: tl.constexpr):
    """Ŵᵀ [K, N]: each lane walks one tile row (WIDTH inputs of one output) and stores its weights."""
    S: tl.constexpr = WIDTH // V
    KV: tl.constexpr = BITS * V
    jj = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)[:, None]   # tile columns: inputs jj * WIDTH + ...
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]   # outputs
    j_mask = jj < K // WIDTH
    mask = j_mask & (nn < N)
    r = nn % TILE_ROWS
    n0, t0 = nn - r, r * S
    state, field = _walk_start(codes_ptr, r, n0, t0, jj, mask, N, KW, KV, V, L, TILE_ROWS, WIDTH, BLOCK_J, BLOCK_N)
    for u in tl.static_range(S):
        state = (state << KV) | _walk_symbol(field, u, codes_ptr, t0, n0, jj, mask, N, KW, KV, V, WIDTH)
        for v in tl.static_range(V):
            value = _value(state & ((1 << L) - 1), v, table_ptr, L, CODE, Q)
            k = jj * WIDTH + (u * V + v)
            g = tl.load(g_idx_ptr + k, mask=j_mask, other=0)
            s = tl.load(scales_ptr + g * N + nn, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + k.to(tl.int64) * N + nn, round_to(value * s, out_ptr.dtype.element_ty, INTERPRETER),
                     mask=mask)


@triton.jit
def trellis_matmul_kernel(x_ptr, codes_ptr, scales_ptr, g_idx_ptr, table_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, M, N,
                          K, KW, GROUP_SHIFT, SPLIT_K, BITS: tl.constexpr, L: tl.constexpr, V: tl.constexpr,
                          CODE: tl.constexpr, Q: tl.constexpr, TILE_ROWS: tl.constexpr, WIDTH: tl.constexpr,
                          UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETER: tl.constexpr):
    """y [M, N] = x Ŵᵀ for M <= BLOCK_M, the weights never written out: each program takes BLOCK_N outputs and one K
    slice (whole blocks of BLOCK_J tile columns; split-K reduced by store_tile), walks its lanes' tile rows as the
    decode does, and multiplies each weight as it is made, rounded to x's dtype as the reference rounds it. M = 1
    (BLOCK_M 1) accumulates x_k · w per lane and sums the lanes at the end; more rows take one tl.dot per position in
    the tile row ([BLOCK_M, BLOCK_J] x [BLOCK_J, BLOCK_N])."""
    S: tl.constexpr = WIDTH // V
    KV: tl.constexpr = BITS * V
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nn, n_mask = offs_n[None, :], offs_n < N
    r = nn % TILE_ROWS
    n0, t0 = nn - r, r * S
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    per_split = tl.cdiv(tl.cdiv(K // WIDTH, BLOCK_J), SPLIT_K) * BLOCK_J
    j_begin = pid_k * per_split
    j_end = tl.minimum(K // WIDTH, j_begin + per_split)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_J, BLOCK_N), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for j0 in range(j_begin, j_end, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jj, j_mask = j[:, None], (j < j_end)[:, None]
        mask = j_mask & n_mask[None, :]
        state, field = _walk_start(codes_ptr, r, n0, t0, jj, mask, N, KW, KV, V, L, TILE_ROWS, WIDTH, BLOCK_J,
                                   BLOCK_N)
        if UNIFORM:  # the block's BLOCK_J x WIDTH inputs lie in one group of 2^GROUP_SHIFT tile columns
            s = tl.load(scales_ptr + (j0 >> GROUP_SHIFT) * N + nn, mask=n_mask[None, :], other=0.0).to(tl.float32)
        for u in tl.static_range(S):
            state = (state << KV) | _walk_symbol(field, u, codes_ptr, t0, n0, jj, mask, N, KW, KV, V, WIDTH)
            for v in tl.static_range(V):
                k = j * WIDTH + (u * V + v)
                if not UNIFORM:
                    g = tl.load(g_idx_ptr + k[:, None], mask=j_mask, other=0)
                    s = tl.load(scales_ptr + g * N + nn, mask=mask, other=0.0).to(tl.float32)
                value = _value(state & ((1 << L) - 1), v, table_ptr, L, CODE, Q)
                w = round_to(value * s, x_ptr.dtype.element_ty, INTERPRETER)
                if BLOCK_M == 1:
                    xk = tl.load(x_ptr + k[:, None], mask=j_mask, other=0.0).to(tl.float32)
                    acc += xk * w.to(tl.float32)
                else:
                    xk = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + k[None, :],
                                 mask=m_mask[:, None] & (j < j_end)[None, :], other=0.0)
                    acc = dot_into(xk, w, acc, IEEE, INTERPRETER)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=0)[None, :]
    else:
        out = acc
    store_tile(y_ptr, b_ptr, ws_ptr, lock_ptr, out, offs_m, offs_n, m_mask, n_mask, M, N, N, pid_n, pid_k, SPLIT_K,
               HAS_BIAS, INTERPRETER)


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


def trellis_matmul(x, codes, scales, g_idx, table, bits, state_bits, step, code, tile_rows, length, bias=None):
    """x [M, K] (M <= FUSED_MAX_M; fp16/bf16/fp32, contiguous) @ Ŵᵀ -> [M, N] in x's dtype, the weights made in
    registers (trellis_matmul_kernel); ValueError on a malformed layer."""
    check_layer(x, codes, scales, g_idx, table, bits, state_bits, step, code, tile_rows, length, bias)
    m, k = x.shape
    n = scales.shape[1]
    if m > FUSED_MAX_M:
        raise ValueError(f"the fused trellis kernel takes at most {FUSED_MAX_M} rows, got {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    width = length // tile_rows
    uniform, gs = group_layout(g_idx, scales.shape[0])
    block_j, block_n = FUSED_LANES
    group_columns = gs // width if gs % width == 0 else 0  # tile columns a group: a power of two, whole blocks
    uniform = uniform and group_columns % block_j == 0 and group_columns & (group_columns - 1) == 0
    # the codebook kernel's K slices at this shape: its workspace bound (reserved for CUDA graphs) covers them
    splits, partials, counters = triton_codebook.split_for(m, n, k, num_sms(x.device))
    ws, locks = workspace(x.device, partials, counters)
    q = max(int(table.numel() // 2).bit_length() - 1, 0)
    group_shift = group_columns.bit_length() - 1 if uniform else 0
    with on_device(x):
        trellis_matmul_kernel[(triton.cdiv(n, block_n), splits)](
            x, codes, scales, g_idx.to(torch.int32), table.contiguous(), bias if bias is not None else scales, y, ws,
            locks, m, n, k, codes.shape[0], group_shift, splits, BITS=bits, L=state_bits, V=step,
            CODE=CODES.index(code), Q=q, TILE_ROWS=tile_rows, WIDTH=width, UNIFORM=uniform,
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=1 if m == 1 else FUSED_MAX_M,
            BLOCK_J=block_j, BLOCK_N=block_n, INTERPRETER=not x.is_cuda)
    return y
