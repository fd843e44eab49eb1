"""Triton kernel of the codebook dequant-GEMM (kernels/codebook.py): codes -> values -> tl.dot.

Each program takes a [BLOCK_M, BLOCK_N] output tile and one K slice of it (split-K while the tiles alone do not
fill the GPU, reduced inside the launch by triton_decode.store_tile, as in the GPTQ kernel). It walks its slice in
BLOCK_K steps: it loads the x tile, reads each packed word of the K x N weight tile once and shifts its codes out
(triton_decode.tile_codes), decodes them (_decode: a lookup in the codebook, 2^bits cache-resident floats, the E8
lattice point of each 8 codes, or the E8P point of each 8 codes through a 256-entry int32 table), multiplies by the
group scales (one row per tile where g_idx is plain and BLOCK_K divides the group), rounds once to x's dtype (as the
reference does) and accumulates x·Ŵᵀ in fp32 on the tensor cores. Correct for every M, K and group layout.
At M <= 16 with one group per tile, 4-bit levels and 2- and 4-bit E8P points skip the [BLOCK_K, BLOCK_N] decoded
tile: one tl.dot per code position of the words (levels) or per coordinate of the points (E8P), x split to match,
as the GPTQ kernel's tiles by code position do. For the prefill path (dispatch.py) codebook_dequantize decodes the
weight once instead (codebook_dequant_kernel: the same decode and rounding), and cuBLAS multiplies.
Timed once on an H100 before split-K and the word loads, at 0.06-0.13x fp16 (docs/BENCHMARKS.md); not since.
"""
import functools

import torch
import triton
import triton.language as tl

from quantkit.core import bitpack
from quantkit.kernels.device import on_device
from quantkit.kernels.triton_decode import load_words, round_to, store_tile, tile_codes, x_by_code
from quantkit.kernels.triton_gptq import split_k
from quantkit.kernels.triton_gptq_ops import group_layout, num_sms, workspace

TABLE, LATTICE, E8P = 0, 1, 2  # the DECODE variants of _decode
WAVES = 4  # split-K until the programs fill the SMs this many times over (memory-level parallelism at small M)
DEQUANT_BLOCK_K, DEQUANT_BLOCK_N = 64, 64  # the prefill path's decode tile


@triton.jit
def _e8p_fields(c, tab_ptr):
    """What the coordinates of E8P points need from their 16-bit codes c [P, BLOCK_N] (quantkit.schemes.e8p), per
    point: tab[c & 255], which holds 2|a_j| at bits [4j, 4j + 4); the 8 sign bits (bit j: coordinate j negative;
    bits 8-14 of c are those of coordinates 0-6, and coordinate 7 is negative when their count + Σa is odd); and
    the shift, −¼ when bit 15 is set, else +¼. Bit arithmetic on whole words instead of per-coordinate sums."""
    word = tl.load(tab_ptr + (c & 255))
    nibbles = (word & 0x0F0F0F0F) + ((word >> 4) & 0x0F0F0F0F)      # 4 byte sums of 2|a|, each <= 30
    nibbles += nibbles >> 16
    twice_sum = (nibbles + (nibbles >> 8)) & 0xFF                   # Σ 2|a_j|
    signs = (c >> 8) & 0x7F
    parity = signs ^ (signs >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    signs |= ((parity + (twice_sum >> 1)) & 1) << 7
    shift = (0x3E800000 | (((c >> 15) & 1) << 31)).to(tl.float32, bitcast=True)  # ±0.25 by its sign bit
    return word, signs, shift


@triton.jit
def _e8p_coordinate(word, signs, shift, j):
    """Coordinate j (an int, or a tensor that broadcasts) of the points of _e8p_fields: ±|a_j| + shift, in float32,
    without an int -> float conversion: 2^23 + n is the float with n in its low mantissa bits."""
    magnitude = (((word >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) * 0.5 - 4194304.0
    signed = magnitude.to(tl.int32, bitcast=True) ^ (((signs >> j) & 1) << 31)
    return signed.to(tl.float32, bitcast=True) + shift


@triton.jit
def _e8p_point(c, tab_ptr, j):
    """E8P points of 16-bit codes c [P, BLOCK_N] as [P, 8, BLOCK_N] float32; j = the coordinate index as [1, 8, 1]."""
    word, signs, shift = _e8p_fields(c, tab_ptr)
    return _e8p_coordinate(word[:, None, :], signs[:, None, :], shift[:, None, :], j)


@triton.jit
def _e8p_values(c, cb_ptr, RATIO, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unit-scale values [BLOCK_K, BLOCK_N] of the E8P points c [BLOCK_K // 8, BLOCK_N] (each the 8·BITS-bit word of
    a point's 8 codes; _decode says what its bits mean)."""
    j = tl.arange(0, 8)[None, :, None]
    v = _e8p_point(c & 0xFFFF, cb_ptr, j)
    if BITS == 3:
        word = tl.load(cb_ptr + 256 + ((c >> 16) & 255))
        v += ((((word[:, None, :] >> (4 * j)) & 15) - 8).to(tl.float32) * 0.5) / RATIO
    if BITS == 4:
        v += _e8p_point((c >> 16) & 0xFFFF, cb_ptr, j) / RATIO
    return tl.reshape(v, (BLOCK_K, BLOCK_N))


@triton.jit
def _e8p_words(words, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The E8P points [BLOCK_K // 8, BLOCK_N] of packed words [BLOCK_K * BITS // 32, BLOCK_N] at 2 and 4 bits, where
    points never straddle words: a 4-bit word is one point, a 2-bit word two (its low half first)."""
    if BITS == 4:
        points = words
    else:
        halves = tl.join(words & 0xFFFF, (words >> 16) & 0xFFFF)      # [words, N, 2]
        points = tl.reshape(tl.permute(halves, (0, 2, 1)), (BLOCK_K // 8, BLOCK_N))
    return points  # one return (see _decode)


@triton.jit
def _decode(q, cb_ptr, OFFSET, RATIO, BITS: tl.constexpr, DECODE: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Unit-scale values of the codes q [BLOCK_K, BLOCK_N]: the swappable decode step.

    TABLE (turboquant): codebook[q]. LATTICE (e8, box-truncated E8, quantkit.schemes.e8): every 8 consecutive
    codes along K are one point; code 7 carries the coset bit in place of its lowest bit, which the parity
    (Σk even) restores; the value is k − 2^(BITS−1) + OFFSET + coset / 2. E8P (quantkit.schemes.e8p): the 8 codes
    of a point are one 8·BITS-bit word, code j at bits [BITS·j, BITS·j + BITS); bits 0–15 are an E8P code, and at
    3 bits bits 16–23 index the 256 residual points (cb_ptr + 256, 2v + 8 nibbles), at 4 bits bits 16–31 are a
    second E8P code; the residual adds its point / RATIO."""
    # One return: Triton types every return of a function together, constexpr branches included, and the
    # E8P table is int32 where the TABLE branch's load would return it.
    if DECODE == 2:
        q3 = tl.reshape(q, (BLOCK_K // 8, 8, BLOCK_N))
        c = tl.sum(q3 << (BITS * tl.arange(0, 8)[None, :, None]), axis=1)  # disjoint bit fields: the sum is the OR
        values = _e8p_values(c, cb_ptr, RATIO, BITS, BLOCK_K, BLOCK_N)
    elif DECODE == 1:
        q3 = tl.reshape(q, (BLOCK_K // 8, 8, BLOCK_N))
        last = (tl.arange(0, 8) == 7)[None, :, None]
        q7 = tl.sum(tl.where(last, q3, 0), axis=1)
        coset = q7 & 1
        parity = (tl.sum(q3, axis=1) - coset) & 1
        k = tl.where(last, ((q7 - coset) | parity)[:, None, :], q3)
        v = k.to(tl.float32) + (OFFSET - (1 << (BITS - 1))) + 0.5 * coset.to(tl.float32)[:, None, :]
        values = tl.reshape(v, (BLOCK_K, BLOCK_N))
    else:
        values = tl.load(cb_ptr + q)
    return values


@triton.jit
def codebook_kernel(x_ptr, c_ptr, s_ptr, g_ptr, cb_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, KW, GS, SPLIT_K,
                    OFFSET, RATIO, BITS: tl.constexpr, DECODE: tl.constexpr, UNIFORM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BY_CODE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // grid_n, pid % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    # This program's K slice: whole BLOCK_K tiles (triton_gptq's split-K, reduced in store_tile).
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # BY_CODE (the launch's choice, takes_tiles_by_code): one tl.dot per code position of the words (4-bit levels,
    # rows 8j + c), as the GPTQ kernel's mma.sync tiles do, or per coordinate j of the E8P points (rows 8p + j, each
    # coordinate a few bit operations on its point's fields), so no decoded [BLOCK_K, BLOCK_N] tile is reshaped.
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        s = _group_scales(s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, GS, UNIFORM)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if BY_CODE and DECODE == 0:
            words = load_words(c_ptr, k0, offs_n, n_mask, N, KW, BITS, BLOCK_K, False)
            xs = x_by_code(x, BITS, BLOCK_M, BLOCK_K)
            for c in tl.static_range(32 // BITS):
                level = tl.load(cb_ptr + ((words >> (BITS * c)) & ((1 << BITS) - 1)))
                acc = dot_into(xs[c], round_to(level * s, x.dtype, INTERPRETER), acc, IEEE, INTERPRETER)
        elif BY_CODE:
            points = _e8p_words(load_words(c_ptr, k0, offs_n, n_mask, N, KW, BITS, BLOCK_K, False), BITS, BLOCK_K,
                                BLOCK_N)
            xs = x_by_code(x, 4, BLOCK_M, BLOCK_K)  # 8 rows a point, as 4-bit words have 8 codes
            word, signs, shift = _e8p_fields(points & 0xFFFF, cb_ptr)
            if BITS == 4:
                word2, signs2, shift2 = _e8p_fields((points >> 16) & 0xFFFF, cb_ptr)
            for j in tl.static_range(8):
                v = _e8p_coordinate(word, signs, shift, j)
                if BITS == 4:
                    v += _e8p_coordinate(word2, signs2, shift2, j) / RATIO
                acc = dot_into(xs[j], round_to(v * s, x.dtype, INTERPRETER), acc, IEEE, INTERPRETER)
        else:
            v = _tile_values(c_ptr, cb_ptr, k0, offs_k, offs_n, n_mask, N, KW, OFFSET, RATIO, BITS, DECODE, BLOCK_K,
                             BLOCK_N)
            acc = dot_into(x, round_to(v * s, x.dtype, INTERPRETER), acc, IEEE, INTERPRETER)
    store_tile(y_ptr, b_ptr, ws_ptr, lock_ptr, acc, offs_m, offs_n, m_mask, n_mask, M, N, N, pid, pid_k, SPLIT_K,
               HAS_BIAS, INTERPRETER)


@triton.jit
def codebook_dequant_kernel(c_ptr, s_ptr, g_ptr, cb_ptr, w_ptr, N, K, KW, GS, OFFSET, RATIO, BITS: tl.constexpr,
                            DECODE: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            INTERPRETER: tl.constexpr):
    """Ŵᵀ [K, N] in w's dtype, one [BLOCK_K, BLOCK_N] tile a program, rounded once as codebook_kernel rounds."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, n_mask = offs_k < K, offs_n < N
    s = _group_scales(s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, GS, UNIFORM)
    v = _tile_values(c_ptr, cb_ptr, k0, offs_k, offs_n, n_mask, N, KW, OFFSET, RATIO, BITS, DECODE, BLOCK_K, BLOCK_N)
    tl.store(w_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
             round_to(v * s, w_ptr.dtype.element_ty, INTERPRETER), mask=k_mask[:, None] & n_mask[None, :])


@triton.jit
def _group_scales(s_ptr, g_ptr, k0, offs_k, k_mask, offs_n, n_mask, N, GS, UNIFORM: tl.constexpr):
    """The fp32 scales of the K tile at k0: one row [1, BLOCK_N] when the tile lies in one group, else gathered."""
    if UNIFORM:
        s = tl.load(s_ptr + (k0 // GS) * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0).to(tl.float32)
    return s


@triton.jit
def _tile_values(c_ptr, cb_ptr, k0, offs_k, offs_n, n_mask, N, KW, OFFSET, RATIO, BITS: tl.constexpr,
                 DECODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unit-scale values [BLOCK_K, BLOCK_N] of the K tile at k0. Codes past K (zero-padded words) meet x = 0, or are
    never stored; codes past N are 0, a valid index, and never stored."""
    if DECODE == 2 and BITS != 3:  # whole points per word: no codes to take apart and put back together
        words = load_words(c_ptr, k0, offs_n, n_mask, N, KW, BITS, BLOCK_K, False)
        v = _e8p_values(_e8p_words(words, BITS, BLOCK_K, BLOCK_N), cb_ptr, RATIO, BITS, BLOCK_K, BLOCK_N)
    else:
        q = tile_codes(c_ptr, k0, offs_k, offs_n, n_mask, N, KW, BITS, BLOCK_K, BLOCK_N, False)
        v = _decode(q, cb_ptr, OFFSET, RATIO, BITS, DECODE, BLOCK_K, BLOCK_N)
    return v


@triton.jit
def dot_into(x, w, acc, IEEE: tl.constexpr, INTERPRETER: tl.constexpr):
    if INTERPRETER:  # its tl.dot mishandles bf16 (numpy has none); the fp32 upcast is exact
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


VARIANTS = {"table": TABLE, "lattice": LATTICE, "e8p": E8P}


def check_layer(x, codes, scales, g_idx, table, bits, decode, bias=None) -> int:
    """ValueError unless x [M, K] and the layer's tensors fit the kernels; the decode variant's number."""
    k = x.shape[1]
    n = scales.shape[1]
    kw = bitpack.packed_len(k, bits)
    if tuple(codes.shape) != (kw, n) or codes.dtype != torch.int32:
        raise ValueError(f"codes must be int32 [{kw}, {n}] for K={k} at {bits} bits, got {codes.dtype} {tuple(codes.shape)}")
    variant = VARIANTS[decode.variant]
    if variant != TABLE and k % 8:
        raise ValueError(f"E8 layers need K to be a multiple of 8, got {k}")
    e8p_words = 512 if bits == 3 else 256  # _decode reads the abs patterns, and at 3 bits the residual points
    if variant == E8P and (table.dtype != torch.int32 or bits not in (2, 3, 4) or table.numel() != e8p_words):
        raise ValueError(f"a {bits}-bit E8P layer needs {e8p_words} int32 table entries, got {table.dtype} "
                         f"[{table.numel()}]")
    if tuple(g_idx.shape) != (k,) or (variant == TABLE and table.numel() != 1 << bits):
        raise ValueError(f"g_idx must be [{k}] and the codebook hold {1 << bits} levels")
    check_together(x, [codes, scales, g_idx, table], bias)
    return variant


def check_together(x, tensors: list, bias=None) -> None:
    """ValueError unless x's dtype is one the kernels take and x, the layer's tensors and bias share a device."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if len({t.device for t in [x, *tensors] + ([bias] if bias is not None else [])}) != 1:
        raise ValueError("x and the layer's tensors must be on one device")


def codebook_matmul(x, codes, scales, g_idx, table, bits, decode, bias=None):
    """x [M, K] (fp16/bf16/fp32, contiguous) @ Ŵᵀ -> [M, N] in x's dtype, the weight decoded in registers;
    ValueError on a malformed layer. decode: the quantizer's KernelDecode (quantkit.schemes.base); table:
    kernels.codebook.decode_table(decode)."""
    variant = check_layer(x, codes, scales, g_idx, table, bits, decode, bias)
    m, k = x.shape
    n = scales.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    uniform, gs = group_layout(g_idx, scales.shape[0])
    by_code = m <= 16 and uniform and gs % 128 == 0 and takes_tiles_by_code(variant, bits)
    block_m, block_n, block_k, warps = tile_for(m, by_code)
    uniform = uniform and gs % block_k == 0
    splits, partials, counters = split_for(m, n, k, num_sms(x.device), by_code)
    ws, locks = workspace(x.device, partials, counters)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    with on_device(x):
        codebook_kernel[grid](x, codes, scales, g_idx.to(torch.int32), table.contiguous(),
                              bias if bias is not None else scales, y, ws, locks, m, n, k, codes.shape[0],
                              gs if uniform else 1, splits, float(decode.offset), float(decode.ratio), BITS=bits,
                              DECODE=variant, UNIFORM=uniform, HAS_BIAS=bias is not None,
                              IEEE=x.dtype == torch.float32, BY_CODE=by_code, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, INTERPRETER=not x.is_cuda, num_warps=warps)
    return y


def codebook_dequantize(codes, scales, g_idx, table, bits, decode, k, dtype):
    """Ŵᵀ [K, N] in `dtype`, a transient weight for the prefill path (2 bytes a weight), decoded as the GEMM
    kernel decodes it (the caller has run check_layer)."""
    n = scales.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=codes.device)
    uniform, gs = group_layout(g_idx, scales.shape[0])
    uniform = uniform and gs % DEQUANT_BLOCK_K == 0
    grid = (triton.cdiv(k, DEQUANT_BLOCK_K), triton.cdiv(n, DEQUANT_BLOCK_N))
    with on_device(codes):
        codebook_dequant_kernel[grid](codes, scales, g_idx.to(torch.int32), table.contiguous(), w, n, k,
                                      codes.shape[0], gs if uniform else 1, float(decode.offset), float(decode.ratio),
                                      BITS=bits, DECODE=VARIANTS[decode.variant], UNIFORM=uniform,
                                      BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, INTERPRETER=not codes.is_cuda)
    return w


def split_for(m, n, k, sms, by_code=False):
    """(K slices, fp32 partials, tile counters) of an [m, n, k] launch: no workspace without split-K."""
    block_m, block_n, block_k, _ = tile_for(m, by_code)
    splits = split_k(m, n, k, block_m, block_n, block_k, sms, WAVES)
    if splits == 1:
        return 1, 0, 0
    return splits, splits * m * n, triton.cdiv(m, block_m) * triton.cdiv(n, block_n)


@functools.lru_cache(maxsize=256)
def workspace_bound(n, k, sms):
    """(partials, counters): the most any M asks of an [n, k] layer (triton_gptq_ops.workspace_bound's reasoning:
    M = 16 on either small tile, and the multiples of 64 until the tiles fill the SMs WAVES times)."""
    ms = [16] + list(range(64, 64 * sms * WAVES + 1, 64))
    needs = [split_for(16, n, k, sms, by_code=True)] + [split_for(m, n, k, sms) for m in ms]
    return tuple(map(max, zip(*[need[1:] for need in needs])))


def takes_tiles_by_code(variant: int, bits: int) -> bool:
    """Whether a layer's M <= 16 calls split their dots by code position (4-bit levels) or coordinate (E8P whose
    points fill whole words), given groups of 128 or more."""
    return variant == TABLE and bits == 4 or variant == E8P and bits in (2, 4)


def fused_pays(m: int, decode, bits: int) -> bool:
    """Whether the fused kernel beats decode + cuBLAS (the prefill path) at m rows. The second H100 run (2026-11-27,
    docs/BENCHMARKS.md) timed the generic 16-row tile 4-15x slower than the prefill path on TurboQuant 3-bit at
    M = 1 and 16 (197 against 48 us on 4096 x 4096), while the tiles by code position beat it: so rows of 16 or
    fewer take the fused kernel only where those tiles apply."""
    return m > 16 or takes_tiles_by_code(VARIANTS[decode.variant], bits)


def tile_for(m, by_code=False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): 16-row mma.sync tiles while M is small (split-K fills the GPU), 64-row
    tiles above; the tiles by code position (M <= 16, takes_tiles_by_code) take BLOCK_K = 128, so that each code
    position still gives tl.dot 16 rows. Not autotuned: fixed until a GPU run picks (docs/BENCHMARKS.md)."""
    if by_code:
        return 16, 128, 128, 8  # 4 warps spill 4-bit E8P's two points
    return (16, 64, 64, 4) if m <= 16 else (64, 64, 64, 4)
