/* y = x Ŵᵀ of a trellis layer on the CPU for a few rows of x (decode-time batches), straight from the packed codes.
 *
 * The CPU's other path (quantkit.core.strips) decodes the weight a strip at a time to float32, rounds it to x's
 * dtype and hands it to a GEMM: at one row of x that is several passes over 4-byte weights for one multiply-add
 * each. Here each weight is made and used at once: the walk of quantkit/schemes/trellis_decode.c (a tile's state
 * carried row by row, one symbol shifted in a step, the sequence wrapping at its end), the state's value from the
 * same table, times its group's scale, rounded to bf16 where x is bf16 (the strips' one rounding), times x.
 * The weights are the reference's bit for bit; y differs from the strips' only by the order of the float32 sums.
 *
 * Layouts (C order): codes [KW][N] int32, each output's k-bit codes one LSB-first bit stream along K (3-bit codes
 * straddle words); scales [G][N] float; g_idx [K] int32; table [2^L][V] float; x [M][K] float; y [M][N] float,
 * written for the outputs of tiles [tile0, tile1) (tile_rows outputs each): calls on disjoint tiles may run side by
 * side.
 */
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8 /* rows of x a call takes (quantkit.kernels.cpu_trellis.MAX_ROWS) */

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
        int one_group = 1;  /* the tile column's inputs share a group (always, unless act-order scattered them) */
        for (int64_t c = 1; c < width; c++)
            one_group &= g_idx[c0 + c] == g_idx[c0];
        const float *group_scales = scales + (int64_t)g_idx[c0] * N;
        for (int64_t r = 0; r < tile_rows; r++) {
            const int64_t n = n0 + r;
            const uint64_t row = whole_row ? field(codes, N, KW, n, c0, k, width * k) : 0;
            const float s = group_scales[n];
            float acc[MAX_ROWS] = {0};
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

void trellis_gemv(int64_t M, int64_t N, int64_t K, int64_t KW, int64_t L, int64_t k, int64_t V, int64_t tile_rows,
                  int64_t width, int64_t bf16, int64_t tile0, int64_t tile1, const int32_t *codes,
                  const float *scales, const int32_t *g_idx, const float *table, const float *x, float *y) {
#define TILE(V_, M_, W_) tile(V_, M_, W_, N, K, KW, L, k, tile_rows, bf16, ti * tile_rows, codes, scales, g_idx, \
                              table, x, y)
    for (int64_t ti = tile0; ti < tile1; ti++) {
        if (M == 1 && width == 4)  /* the default tiles (64 x 4) at one row: V 2 at 1-2 bits, V 1 at 3-4 */
            V == 2 ? TILE(2, 1, 4) : TILE(1, 1, 4);
        else if (M == 1)
            V == 2 ? TILE(2, 1, width) : TILE(1, 1, width);
        else
            V == 2 ? TILE(2, M, width) : TILE(1, M, width);
    }
#undef TILE
}
