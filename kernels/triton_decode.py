"""Device helpers shared by the Triton kernels: packed codes -> integers -> weights, and the output tile.

Layout (see quantkit.checkpoint.gptq): qweight int32 [KW = packed_len(K, bits), N], codes along K, LSB
first; qzeros int32 [G, packed_len(N, bits)] packed along N (stores zero - zero_offset); scales fp16
[G, N]; g_idx int32 [K]. W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]. Bits 2, 4, 8
hold 32/bits whole codes per word; 3-bit packs 32 codes into 3 words, two of them straddling a word
boundary (packed_codes gathers those).
"""
import triton
import triton.language as tl


@triton.jit
def load_words(qw_ptr, k0, offs_n, n_mask, N, KW, BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed words of K tile [k0, k0 + BLOCK_K): [BLOCK_K // (32 // BITS), BLOCK_N] int32."""
    offs_kw = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
    return tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :],
                   mask=in_range(offs_kw, KW, EVEN_K)[:, None] & n_mask[None, :], other=0)


@triton.jit
def tile_codes(qw_ptr, k0, offs_k, offs_n, n_mask, N, KW, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Codes of the K tile [k0, k0 + BLOCK_K) as [BLOCK_K, BLOCK_N] int32, row i = k0 + i (= offs_k)."""
    if 32 % BITS != 0:  # 3 (5, ...) bits: codes straddle words, gather each row's word(s)
        q = packed_codes(qw_ptr + offs_n[None, :], offs_k[:, None], N, n_mask[None, :], KW, BITS)
    else:          # one load per word, its codes shifted out in registers: row = word * PW + code
        PW: tl.constexpr = 32 // BITS
        words = load_words(qw_ptr, k0, offs_n, n_mask, N, KW, BITS, BLOCK_K, EVEN_K)
        shifts = tl.arange(0, PW) * BITS
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
    return q


@triton.jit
def x_by_code(x, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] as one tensor [BLOCK_M, BLOCK_K // PW] per code position c of a packed word
    (PW = 32 // BITS codes, word j = rows PW j .. PW j + PW - 1), number c holding columns PW j + c: the
    rows that code c of the tile's words multiplies. 4- and 8-bit.

    tl.split halves the last axis, so c is peeled off bit by bit, lowest first (c = 4a + 2b + e: e, b, a)."""
    if BITS == 8:
        x = tl.reshape(x, (BLOCK_M, BLOCK_K // 4, 2, 2))
        e0, e1 = tl.split(x)
        c0, c2 = tl.split(e0)
        c1, c3 = tl.split(e1)
        return c0, c1, c2, c3
    else:
        tl.static_assert(BITS == 4, "by-code tiles take 4- and 8-bit words")
        x = tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))
        e0, e1 = tl.split(x)
        e0b0, e0b1 = tl.split(e0)
        e1b0, e1b1 = tl.split(e1)
        c0, c4 = tl.split(e0b0)
        c2, c6 = tl.split(e0b1)
        c1, c5 = tl.split(e1b0)
        c3, c7 = tl.split(e1b1)
        return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def in_range(offs, limit, ALWAYS: tl.constexpr):
    """offs < limit, or a constant-true mask (folded away) when the shapes are known to divide."""
    if ALWAYS:
        return tl.full(offs.shape, 1, tl.int1)
    return offs < limit


@triton.jit
def packed_codes(ptr, idx, stride, mask, n_words, BITS: tl.constexpr):
    """Code number idx of a packed bit stream whose word w is at ptr + w * stride (LSB first).

    Used along K for qweight (stride N) and along N for qzeros (stride 1); ptr, idx and mask
    broadcast together. 2/4/8 bits: one word per code. 3 (or 5) bits: code i occupies bits
    [b i, b i + b), which spill into the next word when b i % 32 > 32 - b; logical (uint32) shifts keep
    the sign bit out, and the next word is loaded only where a code spills (elsewhere it reads as 0)."""
    if 32 % BITS != 0:
        bit = idx * BITS
        word, off = bit // 32, bit % 32
        spill = off > 32 - BITS
        lo = tl.load(ptr + word * stride, mask=mask & (word < n_words), other=0).to(tl.uint32, bitcast=True)
        hi = tl.load(ptr + (word + 1) * stride, mask=mask & spill & (word + 1 < n_words),
                     other=0).to(tl.uint32, bitcast=True)
        codes = ((lo >> off.to(tl.uint32)) | (hi << tl.where(spill, 32 - off, 0).to(tl.uint32))) & ((1 << BITS) - 1)
        codes = codes.to(tl.int32, bitcast=True)
    else:
        PW: tl.constexpr = 32 // BITS
        word = tl.load(ptr + (idx // PW) * stride, mask=mask, other=0)
        codes = (word >> ((idx % PW) * BITS)) & ((1 << BITS) - 1)
    return codes


@triton.jit
def group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """Scales and true zeros of group(s) g (a scalar, or [R, 1] for per-row groups) x columns."""
    cols = offs_n[None, :]
    s = tl.load(s_ptr + g * N + cols, mask=n_mask[None, :], other=0.0)
    z = (packed_codes(qz_ptr + g * NW, cols, 1, n_mask[None, :], NW, BITS) + ZERO_OFFSET) & ((1 << BITS) - 1)
    return s, z


@triton.jit
def group_row(s_ptr, qz_ptr, g, offs_n, n_mask, N, NW, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """Scales and true zeros of one group g as [1, BLOCK_N] rows, for tiles that lie in one group.

    Loaded as 1-D vectors and expanded afterwards: a [1, BLOCK_N] load would get a layout of its own
    that Triton then imposes on the tile (a layout conversion of every decoded slab, seen in SASS)."""
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0)
    z = (packed_codes(qz_ptr + g * NW, offs_n, 1, n_mask, NW, BITS) + ZERO_OFFSET) & ((1 << BITS) - 1)
    return s[None, :], z[None, :]


@triton.jit
def dequant(q, z, s, IS_FP16: tl.constexpr, INTERPRETER: tl.constexpr):
    """w = s * (q - z) rounded once to the activation dtype, exactly as the torch reference.

    Integers become floats by the exponent trick instead of I2F (a quarter-rate conversion that
    otherwise bounds the whole kernel): OR-ing a code c < 2^10 into the mantissa of 1024.0 (fp16
    0x6400) gives the fp16 number 1024 + c, and (1024 + q) - (1024 + z) = q - z exactly. bf16
    activations use the fp32 version (2^23 = 0x4B000000) so the product is rounded only once."""
    if IS_FP16:
        qf = f16_bits(q | 0x6400)
        zf = f16_bits(z | 0x6400)
        w = (qf - zf) * s                           # exact difference, one fp16 rounding
    else:
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
        zf = (z | 0x4B000000).to(tl.float32, bitcast=True)
        w = round_to((qf - zf) * s.to(tl.float32), tl.bfloat16, INTERPRETER)
    return w


@triton.jit
def round_to(v, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 -> dtype, round to nearest even. The interpreter's fp32 -> bf16 cast truncates instead,
    so there we round by hand (finite inputs only), to agree bit for bit with the GPU."""
    if INTERPRETER and dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def f16_bits(v):
    """int32 holding an fp16 bit pattern in its low half -> that fp16 value."""
    return v.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def store_tile(y_ptr, b_ptr, ws_ptr, lock_ptr, acc, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, tile, pid_k,
               SPLIT_K, HAS_BIAS: tl.constexpr, INTERPRETER: tl.constexpr):
    """Write an output tile's fp32 sum acc (+ bias) as y's dtype; under split-K (SPLIT_K > 1, this program's
    K slice pid_k) reduce the slices inside the launch: each program stores its partial in ws, bumps the
    tile's counter, and the last to arrive sums the partials in slice order (deterministic), writes the
    tile and resets the counter for the next launch (no memset)."""
    out_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        _store_output(y_ptr, b_ptr, acc, out_offs, offs_n, n_mask, out_mask, HAS_BIAS, INTERPRETER)
    else:
        part = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + part, acc, mask=out_mask)
        tl.debug_barrier()                                  # every thread's partial is stored ...
        arrived = tl.atomic_add(lock_ptr + tile, 1)         # ... before the (acq_rel) count
        if arrived == SPLIT_K - 1:                          # last slice of this tile to finish
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):                        # fixed order: deterministic result
                total += tl.load(ws_ptr + s * M * N + part, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_output(y_ptr, b_ptr, total, out_offs, offs_n, n_mask, out_mask, HAS_BIAS, INTERPRETER)
            tl.atomic_xchg(lock_ptr + tile, 0)              # ready for the next launch


@triton.jit
def _store_output(y_ptr, b_ptr, acc, out_offs, offs_n, n_mask, out_mask, HAS_BIAS: tl.constexpr,
                  INTERPRETER: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + out_offs, round_to(acc, y_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)
