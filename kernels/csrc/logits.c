/* The output projection for a few rows (decode steps, a prefill's sampled rows): out[r][v] = dot(h[r], w[v])
 * for r < R, float32. A BLAS GEMM with a handful of rows packs the weight before it multiplies, and reads
 * the 262K x 640 embedding of Gemma 3 several times at 8 rows (94 ms here against 25 ms for one row). This
 * streams each weight row once and threads over vocabulary rows: tiles of 4 weight rows x 4 h rows, 8 lanes
 * each, held in registers, fused multiply-adds the compiler vectorizes; the tile's weight rows stay in L1
 * while every group of h rows passes over them. Each lane sums in order, then the lanes are summed in order:
 * the result does not depend on the thread count. */

#include <stdint.h>

#define LANES 8
#define WROWS 4
#define HROWS 4
#define MAX_ROWS 64

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* 8 lanes, any alignment */

/* Rows v0..v0+NW of w against rows r0..r0+NH of h. */
static inline __attribute__((always_inline)) void tile(const float *w, const float *h, float *out, int64_t K,
                                                       int64_t V, int64_t v0, int64_t r0, const int NW,
                                                       const int NH) {
    v8 acc[WROWS][HROWS];
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < NH; b++) acc[a][b] = (v8){0};
    for (int64_t k = 0; k < K; k += LANES) {
        v8 wv[WROWS], hv[HROWS];
        for (int a = 0; a < NW; a++) wv[a] = *(const v8 *)(w + (v0 + a) * K + k);
        for (int b = 0; b < NH; b++) hv[b] = *(const v8 *)(h + (r0 + b) * K + k);
        for (int a = 0; a < NW; a++)
            for (int b = 0; b < NH; b++) acc[a][b] += wv[a] * hv[b];
    }
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < NH; b++) {
            float s = 0.0f;
            for (int j = 0; j < LANES; j++) s += acc[a][b][j];
            out[(r0 + b) * V + v0 + a] = s;
        }
}

#define H_CASES(NW)                                                             \
    switch (nh) {                                                               \
        case 4: tile(w, h, out, K, V, v0, r0, NW, 4); break;                    \
        case 3: tile(w, h, out, K, V, v0, r0, NW, 3); break;                    \
        case 2: tile(w, h, out, K, V, v0, r0, NW, 2); break;                    \
        default: tile(w, h, out, K, V, v0, r0, NW, 1); break;                   \
    }

/* w [V, K] and h [R, K] row-major, out [R, V]. K a multiple of 8, 1 <= R <= 64. Returns 0, or -1 for shapes
 * it does not take. */
int moorage_logits_f32(const float *w, const float *h, float *out, int64_t V, int64_t K, int64_t R,
                       int nthreads) {
    if (V < 0 || K <= 0 || K % LANES || R < 1 || R > MAX_ROWS || nthreads < 1) return -1;
    (void)nthreads;
    int64_t tiles = (V + WROWS - 1) / WROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static, 128)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t v0 = t * WROWS;
        int nw = V - v0 >= WROWS ? WROWS : (int)(V - v0);
        for (int64_t r0 = 0; r0 < R; r0 += HROWS) {
            int nh = R - r0 >= HROWS ? HROWS : (int)(R - r0);
            if (nw == WROWS) {
                H_CASES(4)
            } else if (nw == 3) {
                H_CASES(3)
            } else if (nw == 2) {
                H_CASES(2)
            } else {
                H_CASES(1)
            }
        }
    }
    return 0;
}
