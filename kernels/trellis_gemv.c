/* y = x Ŵᵀ of a trellis layer on the CPU for a few rows of x (decode-time batches), straight from the packed codes.
 *
 * The CPU's other path (quantkit.core.strips) decodes the weight a strip at a time to float32, rounds it to x's
 * dtype and hands it to a GEMM: at one row of x that is several passes over 4-byte weights for one multiply-add
 * each. Here each weight is made and used at once: the walk of quantkit/schemes/trellis_decode.c (a tile's state
 * carried row by row, one symbol shifted in a step, the sequence wrapping at its end), the state's value from the
 * same table, times its group's scale, rounded to bf16 where x is bf16 (the strips' one rounding), times x.
 * The weights are the reference's bit for bit; y differs from the strips' only by the order of the float32 sums.
 *
 * Two loops. With AVX-512, tile16 walks 16 rows of a tile at once, one per vector lane: each lane builds its row's
 * first state from the codes of the rows before it, as the GPU walk does, so the lanes do not wait on each other, and
 * gathers its values (3.5x the scalar loop at one row of x). Elsewhere (no AVX-512, rows wider than 32 bits of codes)
 * tile walks one row after the other, the state carried from row to row.
 *
 * Layouts (C order): codes [KW][N] int32, each output's k-bit codes one LSB-first bit stream along K (3-bit codes
 * straddle words); scales [G][N] float; g_idx [K] int32; table [2^L][V] float; x [M][K] float; y [M][N] float,
 * written for the outputs of tiles [tile0, tile1) (tile_rows outputs each): calls on disjoint tiles may run side by
 * side. Built with OpenMP, one call shares its tiles among the OpenMP threads (trellis_gemv_openmp).
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 64       /* rows of x a call of the 16-lane loop takes (trellis_gemv_rows) */
#define MAX_ROWS_SCALAR 8  /* ... of the scalar loop: beyond, the strips' GEMM is faster */

/* bits [i·k, i·k + count) of output n's stream, count <= 32 */
static inline uint64_t field(const int32_t *codes, int64_t N, int64_t KW, int64_t n, int64_t i, int64_t k,
                             int64_t count) {
    const int64_t bit = i * k, w = bit >> 5, off = bit & 31;
    uint64_t word = (uint32_t)codes[w * N + n];
    if (off + count > 32 && w + 1 < KW)
        word |= (uint64_t)(uint32_t)codes[(w + 1) * N + n] << 32;
    return (word >> off) & ((1ull << count) - 1);
}

/* round to nearest even bf16, held in a float (finite values) */
static inline float to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}

/* whether the inputs c0 .. c0 + width share a group (always, unless act-order scattered the groups) */
static inline int same_group(const int32_t *g_idx, int64_t c0, int64_t width) {
    int same = 1;
    for (int64_t c = 1; c < width; c++)
        same &= g_idx[c0 + c] == g_idx[c0];
    return same;
}

/* One tile's outputs. Always inlined with V, M and width as constants where the caller knows them, so that the
 * compiler unrolls the step, weight and row loops (3-4x faster than the same loops with run-time bounds). */
static inline __attribute__((always_inline)) void tile(
        const int64_t V, const int64_t M, const int64_t width, int64_t N, int64_t K, int64_t KW, int64_t L,
        int64_t k, int64_t tile_rows, int64_t bf16, int64_t n0, const int32_t *codes, const float *scales,
        const int32_t *g_idx, const float *table, const float *x, float *y) {
    const int64_t kv = k * V, per_row = width / V, steps = tile_rows * per_row, window = (L + kv - 1) / kv;
    const uint32_t mask = (1u << L) - 1, symbol_mask = (1u << kv) - 1;
    const int whole_row = width * k <= 32;  /* a tile row's codes are one field */
    for (int64_t m = 0; m < M; m++)
        memset(y + m * N + n0, 0, tile_rows * sizeof(float));
    for (int64_t c0 = 0; c0 < K; c0 += width) {
        uint32_t state = 0;
        for (int64_t t = steps - window; t < steps; t++)  /* the wrap: the tile's last symbols, oldest first */
            state = (state << kv) | (uint32_t)field(codes, N, KW, n0 + t / per_row, c0 + (t % per_row) * V, k, kv);
        const int one_group = same_group(g_idx, c0, width);
        const float *group_scales = scales + (int64_t)g_idx[c0] * N;
        for (int64_t r = 0; r < tile_rows; r++) {
            const int64_t n = n0 + r;
            const uint64_t row = whole_row ? field(codes, N, KW, n, c0, k, width * k) : 0;
            const float s = group_scales[n];
            float acc[MAX_ROWS_SCALAR] = {0};
            for (int64_t c = 0; c < width; c += V) {
                const uint32_t symbol = whole_row ? (uint32_t)(row >> (c * k)) & symbol_mask
                                                  : (uint32_t)field(codes, N, KW, n, c0 + c, k, kv);
                state = ((state << kv) | symbol) & mask;
                for (int64_t v = 0; v < V; v++) {
                    const int64_t i = c0 + c + v;
                    float w = table[state * V + v] * (one_group ? s : scales[(int64_t)g_idx[i] * N + n]);
                    if (bf16)
                        w = to_bf16(w);
                    for (int64_t m = 0; m < M; m++)
                        acc[m] += x[m * K + i] * w;
                }
            }
            for (int64_t m = 0; m < M; m++)
                y[m * N + n] += acc[m];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The codes fields (count bits from `bit` on) of outputs n .. n + 15, one a lane. */
static inline __attribute__((always_inline)) __m512i fields16(const int32_t *codes, int64_t N, int64_t KW,
                                                              int64_t n, int64_t bit, int64_t count) {
    const int64_t w = bit >> 5, off = bit & 31;
    __m512i word = _mm512_srl_epi32(_mm512_loadu_si512(codes + w * N + n), _mm_cvtsi64_si128(off));
    if (off + count > 32 && w + 1 < KW)
        word = _mm512_or_si512(word, _mm512_sll_epi32(_mm512_loadu_si512(codes + (w + 1) * N + n),
                                                      _mm_cvtsi64_si128(32 - off)));
    return _mm512_and_si512(word, _mm512_set1_epi32(count >= 32 ? -1 : (int32_t)((1u << count) - 1)));
}

/* 16 consecutive rows of a tile as the 16 lanes of AVX-512 registers: each lane builds its row's first state from the
 * rows before it (the walk's window, the tile's last rows for its first: tail-biting), as the GPU walk does, so the
 * lanes need not wait for each other; values by gather from the table. Takes tiles whose rows are a multiple of 16,
 * whose row's codes fit one 32-bit field and whose window lies within the 16 rows before. */
static inline __attribute__((always_inline)) void tile16(
        const int64_t V, const int64_t M, const int64_t width, int64_t N, int64_t K, int64_t KW, int64_t L, int64_t k,
        int64_t tile_rows, int64_t bf16, int64_t n0, const int32_t *codes, const float *scales,
        const int32_t *g_idx, const float *table, const float *x, float *y) {
    const int64_t kv = k * V, per_row = width / V, window = (L + kv - 1) / kv;
    const int64_t before = (window + per_row - 1) / per_row;  /* rows whose symbols make a row's first state */
    const __m512i mask = _mm512_set1_epi32((int32_t)((1u << L) - 1)), symbol_mask = _mm512_set1_epi32((1 << kv) - 1);
    const __m512i round_bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    const __m512i high = _mm512_set1_epi32((int32_t)0xFFFF0000u);
    for (int64_t r0 = 0; r0 < tile_rows; r0 += 16) {
        const int64_t p0 = (r0 + tile_rows - 16) % tile_rows;  /* the 16 rows before, circularly */
        __m512 acc[MAX_ROWS];
        for (int64_t m = 0; m < M; m++)
            acc[m] = _mm512_setzero_ps();
        for (int64_t c0 = 0; c0 < K; c0 += width) {
            const __m512i cur = fields16(codes, N, KW, n0 + r0, c0 * k, width * k);
            const __m512i prev = fields16(codes, N, KW, n0 + p0, c0 * k, width * k);
            __m512i state = _mm512_setzero_si512();
            for (int64_t q = before; q > 0; q--) {  /* rows r - q: prev's last q lanes, then cur's first 16 - q */
                __m512i rows;
                switch (q) {  /* alignr takes its shift as an immediate */
#define ALIGN(Q) case Q: rows = _mm512_alignr_epi32(cur, prev, 16 - Q); break;
                    ALIGN(1) ALIGN(2) ALIGN(3) ALIGN(4) ALIGN(5) ALIGN(6) ALIGN(7) ALIGN(8)
                    ALIGN(9) ALIGN(10) ALIGN(11) ALIGN(12) ALIGN(13) ALIGN(14) ALIGN(15)
#undef ALIGN
                    default: rows = prev;
                }
                for (int64_t u = 0; u < per_row; u++)
                    if (q * per_row - u <= window)
                        state = _mm512_or_si512(_mm512_slli_epi32(state, kv),
                                                _mm512_and_si512(_mm512_srli_epi32(rows, u * kv), symbol_mask));
            }
            const int one_group = same_group(g_idx, c0, width);
            __m512 s = _mm512_loadu_ps(scales + (int64_t)g_idx[c0] * N + n0 + r0);
            for (int64_t u = 0; u < per_row; u++) {
                state = _mm512_and_si512(_mm512_or_si512(_mm512_slli_epi32(state, kv),
                                         _mm512_and_si512(_mm512_srli_epi32(cur, u * kv), symbol_mask)), mask);
                for (int64_t v = 0; v < V; v++) {
                    const int64_t i = c0 + u * V + v;
                    const __m512i index = V == 1 ? state : _mm512_add_epi32(_mm512_slli_epi32(state, 1),
                                                                            _mm512_set1_epi32((int32_t)v));
                    if (!one_group)
                        s = _mm512_loadu_ps(scales + (int64_t)g_idx[i] * N + n0 + r0);
                    __m512 w = _mm512_mul_ps(_mm512_i32gather_ps(index, table, 4), s);
                    if (bf16) {
                        __m512i bits = _mm512_castps_si512(w);
                        bits = _mm512_add_epi32(bits, _mm512_add_epi32(round_bias,
                                                _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
                        w = _mm512_castsi512_ps(_mm512_and_si512(bits, high));
                    }
                    for (int64_t m = 0; m < M; m++)
                        acc[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * K + i]), acc[m]);
                }
            }
        }
        for (int64_t m = 0; m < M; m++)
            _mm512_storeu_ps(y + m * N + n0 + r0, acc[m]);
    }
}
#define HAVE_TILE16 1
#else
#define HAVE_TILE16 0
#endif

/* whether tile16 takes a layer of these settings: AVX-512, whole groups of 16 rows a tile, a row's codes in one
 * 32-bit field, a window within the 16 rows before */
static int lanes_take(int64_t L, int64_t k, int64_t V, int64_t tile_rows, int64_t width) {
    const int64_t per_row = width / V, window = (L + k * V - 1) / (k * V);
    return HAVE_TILE16 && tile_rows % 16 == 0 && width * k <= 32 && (window + per_row - 1) / per_row <= 16;
}

/* The most rows of x trellis_gemv takes for a layer of these settings. Against the strips (decode, then a GEMM), one
 * thread: the 16-lane loop 3-8x at 32 rows, and at 128 from a tie (2 bits, 1536 inputs) to 2x; the scalar loop 2-3x
 * at 4 rows (scripts/bench_cpu_codebook.py --rows) */
int64_t trellis_gemv_rows(int64_t L, int64_t k, int64_t V, int64_t tile_rows, int64_t width) {
    return lanes_take(L, k, V, tile_rows, width) ? MAX_ROWS : MAX_ROWS_SCALAR;
}

/* Whether trellis_gemv shares its tiles among OpenMP threads itself (built with OpenMP: torch's own threads, see
 * quantkit.core.native), or runs the tiles it is given on the caller's thread. */
int64_t trellis_gemv_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void trellis_gemv(int64_t M, int64_t N, int64_t K, int64_t KW, int64_t L, int64_t k, int64_t V, int64_t tile_rows,
                  int64_t width, int64_t bf16, int64_t tile0, int64_t tile1, const int32_t *codes,
                  const float *scales, const int32_t *g_idx, const float *table, const float *x, float *y) {
#define TILE(V_, M_, W_) tile(V_, M_, W_, N, K, KW, L, k, tile_rows, bf16, ti * tile_rows, codes, scales, g_idx, \
                              table, x, y)
#define TILE16(V_, M_, W_) tile16(V_, M_, W_, N, K, KW, L, k, tile_rows, bf16, ti * tile_rows, codes, scales, \
                                  g_idx, table, x, y)
    if (M < 1 || M > trellis_gemv_rows(L, k, V, tile_rows, width))  /* the caller checks: nothing is written */
        return;
#if HAVE_TILE16
    const int lanes = lanes_take(L, k, V, tile_rows, width);
#endif
#pragma omp parallel for schedule(static) if (tile1 - tile0 > 1)
    for (int64_t ti = tile0; ti < tile1; ti++) {
#if HAVE_TILE16
        if (lanes && M == 1 && width == 4)  /* the default tiles (64 x 4) at one row: V 2 at 1-2 bits, V 1 at 3-4 */
            V == 2 ? TILE16(2, 1, 4) : TILE16(1, 1, 4);
        else if (lanes && M == 1)
            V == 2 ? TILE16(2, 1, width) : TILE16(1, 1, width);
        else if (lanes)
            V == 2 ? TILE16(2, M, width) : TILE16(1, M, width);
        else
#endif
        if (M == 1 && width == 4)
            V == 2 ? TILE(2, 1, 4) : TILE(1, 1, 4);
        else if (M == 1)
            V == 2 ? TILE(2, 1, width) : TILE(1, 1, width);
        else
            V == 2 ? TILE(2, M, width) : TILE(1, M, width);
    }
#undef TILE
#undef TILE16
}
