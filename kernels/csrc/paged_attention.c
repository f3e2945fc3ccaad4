/* Paged decode attention (one query token per sequence) straight from block-major KV pages:
 * online softmax across blocks, split-K over the context (flash-decoding), GQA without copies. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 64   /* query heads per kv head */
#define MAX_D 256  /* head dim */
#define MAX_BS 128 /* tokens per block (a multiple of 8) */
#ifndef CB
#define CB 4       /* blocks per softmax rescale */
#endif
#ifndef PF_STEP
#define PF_STEP 64 /* bytes between software prefetches of the next blocks */
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 ld8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void st8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline v8 sel(v8i m, v8 a, v8 b) { return (v8)((m & (v8i)a) | (~m & (v8i)b)); } /* m ? a : b */
static inline v8 vmax(v8 a, v8 b) { return sel(a > b, a, b); }

/* exp(x) for x <= 0, 8 lanes (Cephes polynomial, ~1 ulp); x below -87 gives ~1e-38. */
static inline v8 exp_neg(v8 x) {
    x = vmax(x, splat(-87.0f));
    v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    v8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8 p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}

/* [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (x86 vhaddps) */
static inline v8 hadd(v8 a, v8 b) {
    return SHUF2(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF2(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
/* out[j] = sum of the 8 lanes of a[j] */
static inline v8 reduce8(const v8 *a) {
    v8 s0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3])), s1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
    return SHUF2(s0, s1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF2(s0, s1, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline float hsum(v8 a) {
    a = a + SHUF2(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a = a + SHUF2(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
    return a[0] + a[1];
}
static inline float hmax(v8 a) {
    a = vmax(a, SHUF2(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
    a = vmax(a, SHUF2(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
    return a[0] > a[1] ? a[0] : a[1];
}

static inline float bf16f(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* One work item: one sequence, blocks [blk0, blk1) of its table, all heads, tokens [start, len) only (a
 * sliding-window layer reads the last tokens; 0 for all). Writes the partial
 * (max[Hq], sum[Hq], unnormalised acc[Hq][D]). Query head j reads kv head j / G.
 * D = 8 * DC; callers pass a constant DC so the loops over it unroll into registers.
 * Blocks go CB at a time (one softmax rescale per CB * BS tokens). BS is a multiple of 8: scores are
 * computed 8 tokens at a time (slots past the length are read but masked to -inf before any use;
 * their V rows are never read). */
static inline __attribute__((always_inline)) void item(
        const float *q, int Hkv, int G, const int DC, const void *k, const void *v, int dt, int64_t s_block,
        int64_t s_tok, int64_t s_head, const int64_t *table, int64_t len, int64_t start, int BS, int64_t blk0,
        int64_t blk1, float scale, float *m, float *l, float *acc, float *kbuf, float *vbuf) {
    const int D = 8 * DC, Hq = Hkv * G;
    v8 part[8];
    float s[CB * MAX_BS];
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int j = 0; j < Hq; j++) { m[j] = -INFINITY; l[j] = 0.0f; }
    memset(acc, 0, sizeof(float) * (size_t)Hq * D);
    const int esz = dt == 0 ? 4 : 2;
    if (blk1 * BS > len + BS - 1) blk1 = (len + BS - 1) / BS;
    if (blk0 < start / BS) blk0 = start / BS;  /* whole blocks before the window: never read */
    for (int64_t c0 = blk0; c0 < blk1; c0 += CB) {
        const int nblk = blk1 - c0 < CB ? (int)(blk1 - c0) : CB;
        const int ntok = len - c0 * BS < (int64_t)nblk * BS ? (int)(len - c0 * BS) : nblk * BS;
        const int lo = start > c0 * BS ? (int)(start - c0 * BS) : 0;  /* tokens of this chunk before the window */
        int64_t base[CB];
        for (int i = 0; i < nblk; i++) base[i] = table[c0 + i] * s_block;
        for (int i = 0; i < CB && c0 + CB + i < blk1; i++) {  /* the next blocks are elsewhere: start fetching them */
            const char *nk = (const char *)k + table[c0 + CB + i] * s_block * esz;
            const char *nv = (const char *)v + table[c0 + CB + i] * s_block * esz;
            for (int64_t o = 0; o < (int64_t)BS * s_tok * esz; o += PF_STEP) { __builtin_prefetch(nk + o); __builtin_prefetch(nv + o); }
        }
        for (int h = 0; h < Hkv; h++) {
            const float *kb[CB], *vb[CB];
            int64_t ts;  /* token stride within kb[i]/vb[i] */
            if (dt == 0) {
                for (int i = 0; i < nblk; i++) {
                    kb[i] = (const float *)k + base[i] + h * s_head;
                    vb[i] = (const float *)v + base[i] + h * s_head;
                }
                ts = s_tok;
            } else {  /* bfloat16 pages: these blocks' rows of this head, widened once */
                for (int i = 0; i < nblk; i++) {
                    const uint16_t *k16 = (const uint16_t *)k + base[i] + h * s_head;
                    const uint16_t *v16 = (const uint16_t *)v + base[i] + h * s_head;
                    float *kd = kbuf + (int64_t)i * BS * D, *vd = vbuf + (int64_t)i * BS * D;
                    for (int t = 0; t < BS; t++)
                        for (int e = 0; e < D; e++) { kd[t * D + e] = bf16f(k16[t * s_tok + e]); vd[t * D + e] = bf16f(v16[t * s_tok + e]); }
                    kb[i] = kd; vb[i] = vd;
                }
                ts = D;
            }
            for (int g = 0; g < G; g++) {
                const int j = h * G + g;
                const float *qg = q + (int64_t)j * D;
                v8 qv[DC];
                for (int c = 0; c < DC; c++) qv[c] = ld8(qg + 8 * c) * scale;
                v8 mx8 = splat(m[j]);
                const int n8 = (ntok + 7) & ~7;
                for (int t0 = 0; t0 < n8; t0 += 8) {
                    const float *kt0 = kb[t0 / BS] + (t0 % BS) * ts;
                    for (int u = 0; u < 8; u++) {
                        const float *kt = kt0 + u * ts;
                        v8 a0 = qv[0] * ld8(kt), a1 = DC > 1 ? qv[1] * ld8(kt + 8) : splat(0.0f);
                        for (int c = 2; c + 1 < DC; c += 2) { a0 += qv[c] * ld8(kt + 8 * c); a1 += qv[c + 1] * ld8(kt + 8 * c + 8); }
                        if (DC > 2 && DC % 2) a0 += qv[DC - 1] * ld8(kt + 8 * (DC - 1));
                        part[u] = a0 + a1;
                    }
                    v8 sc = sel((lane + t0 < ntok) & (lane + t0 >= lo), reduce8(part), splat(-INFINITY));
                    st8(s + t0, sc);
                    mx8 = vmax(mx8, sc);
                }
                const float mx = hmax(mx8);
                const float corr = exp_neg(splat(m[j] - mx))[0];
                v8 sum8 = splat(0.0f);
                for (int t0 = 0; t0 < n8; t0 += 8) {
                    v8 p = sel((lane + t0 < ntok) & (lane + t0 >= lo), exp_neg(ld8(s + t0) - mx), splat(0.0f));
                    st8(s + t0, p);
                    sum8 += p;
                }
                l[j] = l[j] * corr + hsum(sum8);
                m[j] = mx;
                float *ag = acc + (int64_t)j * D;
                v8 av[DC];
                for (int c = 0; c < DC; c++) av[c] = ld8(ag + 8 * c) * corr;
                for (int i = 0; i < nblk; i++) {
                    const int nt = ntok - i * BS < BS ? ntok - i * BS : BS;
                    const float *vbi = vb[i], *si = s + i * BS;
                    for (int t = 0; t < nt; t++) {
                        const float *vt = vbi + t * ts;
                        v8 p = splat(si[t]);
                        for (int c = 0; c < DC; c++) av[c] += p * ld8(vt + 8 * c);
                    }
                }
                for (int c = 0; c < DC; c++) st8(ag + 8 * c, av[c]);
            }
        }
    }
}

/* q, out: [B, Hq, D] float32 contiguous. k, v: the (layer, k|v) base of a stage's pages, element
 * strides s_block (between blocks), s_tok (between tokens of a block), s_head (between kv heads);
 * head_dim is contiguous. kv_dtype: 0 float32, 1 bfloat16. tables [B, tstride] int64, lens [B] int64,
 * starts [B] int64 or NULL (the first token each sequence attends to: a sliding window).
 * Returns 0, or a negative error. */
int moorage_paged_decode(const float *q, float *out, const void *k, const void *v, int kv_dtype,
                         int64_t s_block, int64_t s_tok, int64_t s_head, const int64_t *tables,
                         int64_t tstride, const int64_t *lens, int B, int Hq, int Hkv, int D, int BS,
                         int64_t num_blocks, float scale, int nthreads, int part_blocks, const int64_t *starts) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D > MAX_D || D % 8 || D <= 0 || BS > MAX_BS || BS % 8 || part_blocks <= 0) return -1;
    const int G = Hq / Hkv;
    int64_t max_blocks = 0;
    for (int b = 0; b < B; b++) {
        int64_t nb = (lens[b] + BS - 1) / BS;
        if (lens[b] <= 0 || nb > tstride) return -2;
        if (starts && (starts[b] < 0 || starts[b] >= lens[b])) return -5;
        if (nb > max_blocks) max_blocks = nb;
        for (int64_t i = 0; i < nb; i++)
            if (tables[b * tstride + i] < 0 || tables[b * tstride + i] >= num_blocks) return -4;
    }
    const int64_t parts = (max_blocks + part_blocks - 1) / part_blocks;
    const int64_t items = (int64_t)B * parts;
    const int64_t wsz = (int64_t)Hq * (D + 2);  /* per item: m[Hq], l[Hq], acc[Hq*D] */
    float *ws = (float *)malloc(sizeof(float) * (size_t)(items * wsz));
    if (!ws) return -3;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = (int)items;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t it = 0; it < items; it++) {
        int64_t p = it % parts;
        int b = (int)(it / parts);
        float *w = ws + it * wsz, *kbuf = NULL;
        if (kv_dtype != 0 && !(kbuf = (float *)malloc(sizeof(float) * 2 * (size_t)CB * BS * D))) { failed = 1; continue; }
        const float *qb = q + (int64_t)b * Hq * D;
        int64_t blk0 = p * part_blocks, blk1 = blk0 + part_blocks;
        const int64_t *tb = tables + b * tstride;
        const int64_t start = starts ? starts[b] : 0;
#define ITEM(DC, DT) item(qb, Hkv, G, DC, k, v, DT, s_block, s_tok, s_head, tb, lens[b], start, BS, blk0, blk1, scale, \
                          w, w + Hq, w + 2 * Hq, kbuf, kbuf + CB * BS * D)
        if (D == 64) { if (kv_dtype == 0) ITEM(8, 0); else ITEM(8, 1); }
        else if (D == 128) { if (kv_dtype == 0) ITEM(16, 0); else ITEM(16, 1); }
        else { if (kv_dtype == 0) ITEM(D / 8, 0); else ITEM(D / 8, 1); }
#undef ITEM
        free(kbuf);
    }
    if (failed) { free(ws); return -3; }
    /* combine the partitions of each sequence (a partition past the end has l == 0) */
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < Hq; j++) {
            float M = -INFINITY, L = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float *w = ws + (b * parts + p) * wsz;
                if (w[Hq + j] > 0.0f && w[j] > M) M = w[j];
            }
            float *o = out + ((int64_t)b * Hq + j) * D;
            for (int i = 0; i < D; i++) o[i] = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float *w = ws + (b * parts + p) * wsz;
                if (!(w[Hq + j] > 0.0f)) continue;
                float c = exp_neg(splat(w[j] - M))[0];
                L += c * w[Hq + j];
                const float *a = w + 2 * Hq + (int64_t)j * D;
                for (int i = 0; i < D; i++) o[i] += c * a[i];
            }
            float inv = 1.0f / L;
            for (int i = 0; i < D; i++) o[i] *= inv;
        }
    }
    free(ws);
    return 0;
}
