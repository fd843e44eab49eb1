/* The trellis decode of quantkit.schemes.trellis_codes in C, for the CPU: codes -> states -> state values.
 *
 * A layer's codes [rows][cols] (one k-bit code per weight, int32) are tiles of tile_rows x width weights, each one
 * tail-biting sequence read row by row: weight p of a tile sits at its row p / width, column p % width, and step t
 * holds weights V·t .. V·t + V - 1 (a tile row holds whole steps), whose codes make the step's symbol (code v at
 * bits [k·v, k·v + k)). The state after step t is the last L bits of the symbols, newest lowest:
 *     s_t = ((s_(t-1) << kV) | b_t) mod 2^L
 * and the sequence wraps: the symbols before b_0 are its last ones. So the walk starts from the last
 * ceil(L / kV) symbols, then shifts one symbol in per step and writes table[s_t][v] for the step's weights: the
 * torch decode's values (states_of_codes, then a lookup in the same table) bit for bit, without its passes over
 * int64 copies of the codes.
 *
 * Layouts: codes [rows][cols] int32 at element strides (row_stride, col_stride) (the caller's transposed view of
 * the packed layout, read in place), table [2^L][V] float, out [rows][cols] float in C order. A call decodes the
 * tiles of tile rows [tile0, tile1): calls on disjoint ranges may run side by side.
 */
#include <stdint.h>

static inline uint32_t symbol(const int32_t *code, int64_t col_stride, int64_t k, int64_t V) {
    uint32_t s = 0;
    for (int64_t v = 0; v < V; v++)
        s |= ((uint32_t)code[v * col_stride] & ((1u << k) - 1)) << (k * v);
    return s;
}

void trellis_decode(int64_t cols, int64_t row_stride, int64_t col_stride, int64_t L, int64_t k, int64_t V,
                    int64_t tile_rows, int64_t width, int64_t tile0, int64_t tile1, const int32_t *codes,
                    const float *table, float *out) {
    const int64_t kv = k * V, steps = tile_rows * width / V, window = (L + kv - 1) / kv;
    const uint32_t mask = (1u << L) - 1;
    for (int64_t ti = tile0; ti < tile1; ti++) {
        for (int64_t c0 = 0; c0 < cols; c0 += width) {
            const int32_t *tile = codes + ti * tile_rows * row_stride + c0 * col_stride;
            float *o = out + ti * tile_rows * cols + c0;
            uint32_t state = 0;
            for (int64_t t = steps - window; t < steps; t++) {  /* the wrap: the last symbols, oldest first */
                int64_t p = t * V;
                state = (state << kv) | symbol(tile + (p / width) * row_stride + (p % width) * col_stride,
                                               col_stride, k, V);
            }
            for (int64_t r = 0; r < tile_rows; r++) {  /* then row by row, a step at a time: no divisions */
                const int32_t *row = tile + r * row_stride;
                float *w = o + r * cols;
                for (int64_t c = 0; c < width; c += V) {
                    state = ((state << kv) | symbol(row + c * col_stride, col_stride, k, V)) & mask;
                    for (int64_t v = 0; v < V; v++)
                        w[c + v] = table[state * V + v];
                }
            }
        }
    }
}
