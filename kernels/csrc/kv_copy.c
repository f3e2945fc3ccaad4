/* KV copies as plain row copies, validated first (rc < 0 before any byte moves):
 * -2 a block id out of range, -3 a duplicate in a write target, -4 out of memory, -1 bad sizes,
 * -5 a CRC asked of a build without the CRC-32C instruction. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__) || defined(__SSE4_2__)
#include <immintrin.h>
#endif

static int check_ids(const int64_t *ids, int64_t n, int64_t num_blocks, int unique) {
    for (int64_t k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= num_blocks) return -2;
    if (!unique || n < 2) return 0;
    uint8_t *seen = calloc((size_t)(num_blocks + 7) / 8, 1);
    if (!seen) return -4;
    int rc = 0;
    for (int64_t k = 0; k < n && !rc; k++) {
        uint8_t bit = (uint8_t)(1u << (ids[k] & 7));
        if (seen[ids[k] >> 3] & bit) rc = -3;
        seen[ids[k] >> 3] |= bit;
    }
    free(seen);
    return rc;
}

/* n bytes; stream: non-temporal stores for the 64-byte-aligned middle of the destination (no read of
 * each destination line before it is overwritten: 2 memory transfers a byte instead of 3). */
static inline __attribute__((always_inline)) void copy_bytes(char *d, const char *s, int64_t n, int stream) {
#if defined(__AVX__)
    if (stream && n >= 256) {
        int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
        memcpy(d, s, (size_t)head);
        d += head, s += head, n -= head;
        int64_t body = n & ~(int64_t)63;
        for (int64_t i = 0; i < body; i += 64) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
            _mm256_stream_si256((__m256i *)(d + i), a);
            _mm256_stream_si256((__m256i *)(d + i + 32), b);
        }
        memcpy(d + body, s + body, (size_t)(n - body));
        return;
    }
#endif
    (void)stream;
    memcpy(d, s, (size_t)n);
}

static inline void fence(int stream) {
#if defined(__AVX__)
    if (stream) _mm_sfence();
#endif
    (void)stream;
}

/* CRC-32C (Castagnoli, reflected: bit 31 is x^0), the pool objects' checksum, computed while copying.
 * crc_* values are the raw register (no pre- or post-inversion), which is linear: over A then B,
 * raw(c, AB) = raw(c, A) * x^(8|B|) ^ raw(0, B), so ranges computed apart (lanes, threads) combine. */
#define CRC32C_POLY 0x82F63B78u
#define CRC_STEP 4096 /* a lane's bytes per step: 3 lanes of it stay in L1 between copy and checksum */

static uint32_t gf2_mul(uint32_t a, uint32_t b) { /* a * b mod P */
    uint32_t p = 0;
    for (int i = 0; i < 32; i++, a <<= 1) {
        if (a & 0x80000000u) p ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

static uint32_t crc_shift(uint32_t crc, int64_t nbytes) { /* crc * x^(8 nbytes) mod P */
    uint32_t sq = 0x40000000u, x = 0x80000000u; /* x^1, x^0 */
    for (uint64_t e = (uint64_t)nbytes * 8; e; e >>= 1, sq = gf2_mul(sq, sq))
        if (e & 1) x = gf2_mul(x, sq);
    return gf2_mul(crc, x);
}

#if defined(__SSE4_2__)
#define HAVE_CRC 1
static uint32_t crc_bytes(uint32_t c, const char *s, int64_t n) {
    uint64_t c64 = c, v;
    for (; n >= 8; s += 8, n -= 8) memcpy(&v, s, 8), c64 = _mm_crc32_u64(c64, v);
    c = (uint32_t)c64;
    for (; n > 0; n--) c = _mm_crc32_u8(c, (uint8_t)*s++);
    return c;
}

/* Three independent CRC chains (the instruction's latency is 3 cycles, its throughput 1); n % 8 == 0. */
static void crc_3lanes(uint32_t *c, const char *a, const char *b, const char *d, int64_t n) {
    uint64_t x = c[0], y = c[1], z = c[2], u, v, w;
    for (int64_t i = 0; i < n; i += 8) {
        memcpy(&u, a + i, 8), memcpy(&v, b + i, 8), memcpy(&w, d + i, 8);
        x = _mm_crc32_u64(x, u), y = _mm_crc32_u64(y, v), z = _mm_crc32_u64(z, w);
    }
    c[0] = (uint32_t)x, c[1] = (uint32_t)y, c[2] = (uint32_t)z;
}

/* Copies n bytes and returns raw(c, s[0..n)): three lanes, each copied a step at a time and then
 * checksummed while the step is still in L1 (the source is read from memory once). */
static uint32_t copy_crc(char *d, const char *s, int64_t n, int stream, uint32_t c) {
    int64_t lane = (n / 3) & ~(int64_t)63;
    if (lane < CRC_STEP) {
        copy_bytes(d, s, n, stream);
        return crc_bytes(c, s, n);
    }
    uint32_t cs[3] = {c, 0, 0};
    for (int64_t i = 0; i < lane; i += CRC_STEP) {
        int64_t m = lane - i < CRC_STEP ? lane - i : CRC_STEP;
        for (int L = 0; L < 3; L++) copy_bytes(d + L * lane + i, s + L * lane + i, m, stream);
        crc_3lanes(cs, s + i, s + lane + i, s + 2 * lane + i, m);
    }
    int64_t rest = n - 3 * lane; /* lane 3's bytes past 3 * lane: the tail, after it */
    copy_bytes(d + 3 * lane, s + 3 * lane, rest, stream);
    cs[2] = crc_bytes(cs[2], s + 3 * lane, rest);
    return crc_shift(crc_shift(cs[0], lane) ^ cs[1], lane + rest) ^ cs[2];
}
#if defined(__AVX512F__) && defined(__VPCLMULQDQ__)
/* raw(c, s[0..n)), n >= 256, by carry-less multiplication (the CRC instruction does 8 bytes a cycle; this,
 * 64 bytes per instruction pair). Reflected, a 16-byte lane X (first qword `lo`) and the bytes d after it
 * contribute X * x^(8d) mod P; clmul(lo, x^(8d+31)) ^ clmul(hi, x^(8d-33)) is that (clmul of reflected
 * operands carries one extra x), so XORed into the lane d bytes on, it leaves the CRC unchanged. Four
 * 64-byte accumulators fold d = 256 bytes each step, then into one (d = 64); its 64 bytes, congruent to
 * everything read so far, and the tail go through the CRC instruction. c joins the first 4 bytes: raw is
 * linear, raw(c, M) = raw(0, M with c XORed into its first 32 bits). */
static inline __m512i crc_fold_step(__m512i a, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11),
                                     next, 0x96);
}
static uint32_t crc_fold(const char *s, int64_t n, uint32_t c) {
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_set_epi64x(0xb9e02b86, 0xdcb17aa4)); /* x^2015, x^2079 */
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x9e4addf8, 0x740eef02));  /* x^479, x^543 */
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(s), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i a1 = _mm512_loadu_si512(s + 64), a2 = _mm512_loadu_si512(s + 128), a3 = _mm512_loadu_si512(s + 192);
    for (s += 256, n -= 256; n >= 256; s += 256, n -= 256) {
        a0 = crc_fold_step(a0, k256, _mm512_loadu_si512(s));
        a1 = crc_fold_step(a1, k256, _mm512_loadu_si512(s + 64));
        a2 = crc_fold_step(a2, k256, _mm512_loadu_si512(s + 128));
        a3 = crc_fold_step(a3, k256, _mm512_loadu_si512(s + 192));
    }
    a3 = crc_fold_step(crc_fold_step(crc_fold_step(a0, k64, a1), k64, a2), k64, a3);
    for (; n >= 64; s += 64, n -= 64) a3 = crc_fold_step(a3, k64, _mm512_loadu_si512(s));
    char last[64];
    _mm512_storeu_si512(last, a3);
    return crc_bytes(crc_bytes(0, last, 64), s, n);
}
#define CRC_FOLD 1
#else
#define CRC_FOLD 0
static uint32_t crc_fold(const char *s, int64_t n, uint32_t c) { return crc_bytes(c, s, n); }
#endif
/* raw(c, s[0..n)) without copying: folded where the CPU can, else three lanes of the instruction. */
static uint32_t crc_raw(const char *s, int64_t n, uint32_t c) {
    if (CRC_FOLD && n >= 256) return crc_fold(s, n, c);
    int64_t lane = (n / 3) & ~(int64_t)7;
    if (lane < 256) return crc_bytes(c, s, n);
    uint32_t cs[3] = {c, 0, 0};
    crc_3lanes(cs, s, s + lane, s + 2 * lane, lane);
    int64_t rest = n - 3 * lane;
    cs[2] = crc_bytes(cs[2], s + 3 * lane, rest);
    return crc_shift(crc_shift(cs[0], lane) ^ cs[1], lane + rest) ^ cs[2];
}
#else
#define HAVE_CRC 0
#define CRC_FOLD 0
static uint32_t copy_crc(char *d, const char *s, int64_t n, int stream, uint32_t c) {
    (void)d, (void)s, (void)n, (void)stream;
    return c;
}
static uint32_t crc_raw(const char *s, int64_t n, uint32_t c) { /* never called: HAVE_CRC is checked first */
    (void)s, (void)n;
    return c;
}
#endif

static int threads_for(int64_t bytes, int64_t min_split, int nthreads) {
#ifdef _OPENMP
    return bytes < min_split || nthreads < 1 ? 1 : nthreads;
#else
    (void)bytes, (void)min_split, (void)nthreads;
    return 1;
#endif
}

/* Stream copies past stream_bytes (bigger than the cache: nothing to keep there; measured 1.4-1.9x
 * faster on one thread and on two). Below it the destination may stay cached, and regular stores win. */
static int stream_for(int64_t bytes, int64_t stream_bytes) {
    return bytes >= stream_bytes;
}

/* Whole blocks. pack: dst[k] = src[ids[k]]; unpack: dst[ids[k]] = src[k]. Threads split the packed
 * side's bytes evenly; consecutive ids are one copy. crc (may be NULL): gets the CRC-32C of the packed
 * side's bytes, computed as they are copied (-5 before any byte moves when this build has no CRC
 * instruction). */
#define MAX_CRC_THREADS 256
int moorage_kv_blocks(const char *src, char *dst, const int64_t *ids, int64_t n, int64_t num_blocks,
                      int64_t block_bytes, int unpack, int64_t min_split, int64_t stream_bytes, int nthreads,
                      uint32_t *crc) {
    if (n < 0 || block_bytes < 0 || num_blocks < 0) return -1;
    if (crc && !HAVE_CRC) return -5;
    int rc = check_ids(ids, n, num_blocks, unpack);
    if (rc) return rc;
    if (crc) *crc = 0; /* the CRC-32C of no bytes */
    if (n == 0 || block_bytes == 0) return 0;
    int64_t total = n * block_bytes;
    int nt = threads_for(total, min_split, nthreads), stream = stream_for(total, stream_bytes), used = 1;
    if (nt > MAX_CRC_THREADS) nt = MAX_CRC_THREADS;
    uint32_t part[MAX_CRC_THREADS]; /* raw CRC of each thread's range */
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        if (t == 0) used = T;
        uint32_t c = 0;
        int64_t lo = total / T * t + (total % T) * t / T, hi = total / T * (t + 1) + (total % T) * (t + 1) / T;
        while (lo < hi) {
            int64_t k = lo / block_bytes, off = lo % block_bytes, first = k, len = block_bytes - off;
            while (lo + len < hi && k + 1 < n && ids[k + 1] == ids[k] + 1) k++, len += block_bytes;
            if (len > hi - lo) len = hi - lo;
            char *paged = (unpack ? dst : (char *)src) + ids[first] * block_bytes + off;
            char *d = unpack ? paged : dst + lo;
            const char *s = unpack ? src + lo : paged;
            if (crc) c = copy_crc(d, s, len, stream, c);
            else copy_bytes(d, s, len, stream);
            lo += len;
        }
        part[t] = c;
        fence(stream);
    }
    if (crc) {
        uint32_t c = 0xFFFFFFFFu;
        for (int t = 0; t < used; t++) {
            int64_t lo = total / used * t + (total % used) * t / used;
            int64_t hi = total / used * (t + 1) + (total % used) * (t + 1) / used;
            c = crc_shift(c, hi - lo) ^ part[t];
        }
        *crc = ~c;
    }
    return 0;
}

/* raw[k] = raw(0, block ids[k]'s bytes): each block's CRC register, to be kept while the block's bytes do
 * not change and joined into the CRC-32C of any run of them (moorage_crc_join) without reading them again.
 * Threads over blocks. -5 without the CRC instruction. */
int moorage_crc_blocks(const char *pages, const int64_t *ids, int64_t n, int64_t num_blocks, int64_t block_bytes,
                       uint32_t *raw, int64_t min_split, int nthreads) {
    if (n < 0 || block_bytes < 0 || num_blocks < 0) return -1;
    if (!HAVE_CRC) return -5;
    int rc = check_ids(ids, n, num_blocks, 0);
    if (rc) return rc;
    int nt = threads_for(n * block_bytes, min_split, nthreads);
    (void)nt;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t k = 0; k < n; k++) raw[k] = crc_raw(pages + ids[k] * block_bytes, block_bytes, 0);
    return 0;
}

/* 1 when crc_raw folds with VPCLMULQDQ (built for a CPU with AVX-512 and it), 0 when it uses three lanes. */
int moorage_crc_folds(void) { return CRC_FOLD; }

/* *crc = the CRC-32C of s[0..n) continuing a CRC-32C `crc` of the bytes before (0: none), one thread. */
int moorage_crc32c(const char *s, int64_t n, uint32_t *crc) {
    if (n < 0) return -1;
    if (!HAVE_CRC) return -5;
    *crc = ~crc_raw(s, n, ~*crc);
    return 0;
}

/* *crc = the CRC-32C of n blocks of block_bytes in the given order, from their raw registers. */
int moorage_crc_join(const uint32_t *raw, int64_t n, int64_t block_bytes, uint32_t *crc) {
    if (n < 0 || block_bytes < 0) return -1;
    uint32_t shift = crc_shift(0x80000000u, block_bytes), c = 0xFFFFFFFFu; /* x^(8 block_bytes) */
    for (int64_t k = 0; k < n; k++) c = gf2_mul(c, shift) ^ raw[k];
    *crc = ~c;
    return 0;
}

/* Token rows between block pages and token-major rank buffers. Stage s's pages hold planes[s] (= its
 * layers x 2) planes of B rows per block; a rank buffer holds, per token, all stages' planes in order.
 * Tokens t in [first, end) of block table[t / B]; token t belongs to rank t % cp, at that rank's local
 * index (t - its first token >= first) / cp. to_pages = 0: pages -> ranks (gather), 1: the reverse
 * (scatter; then the table must be duplicate-free). Threads split the blocks; the loops walk the source
 * in address order (measured: 1.4-2.5x faster than walking the destination in order). */
int moorage_kv_tokens(int to_pages, char *const *pages, const int64_t *planes, int64_t S, char *const *ranks,
                      int64_t cp, const int64_t *table, int64_t num_blocks, int64_t first, int64_t end, int64_t B,
                      int64_t row, int64_t min_split, int64_t stream_bytes, int nthreads) {
    if (S < 1 || S > 64 || cp < 1 || B < 1 || B > 1024 || row < 0 || first < 0 || end < first) return -1;
    int64_t j0 = first / B, j1 = (end + B - 1) / B, token_planes = 0, boff[64];
    int rc = check_ids(table, j1, num_blocks, to_pages);
    if (rc || end == first || row == 0) return rc;
    for (int64_t s = 0; s < S; s++) boff[s] = token_planes, token_planes += planes[s];
    int64_t token_bytes = token_planes * row;
    int64_t total = (end - first) * token_bytes;
    int nt = threads_for(total, min_split, nthreads), stream = stream_for(total, stream_bytes);
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        char *tok[1024]; /* this block's tokens: where each one's rank row starts */
#pragma omp for schedule(static) nowait
        for (int64_t j = j0; j < j1; j++) {
            int64_t t0 = j * B > first ? j * B : first, t1 = j * B + B < end ? j * B + B : end, n = t1 - t0;
            for (int64_t t = t0; t < t1; t++) {
                int64_t r = t % cp, base = first + ((r - first) % cp + cp) % cp;
                tok[t - t0] = ranks[r] + (t - base) / cp * token_bytes;
            }
            for (int64_t s = 0; s < S; s++) {
                int64_t P = planes[s];
                char *blk = pages[s] + (table[j] * P * B + (t0 - j * B)) * row;
                if (!to_pages) { /* gather: each page plane's rows in order */
                    for (int64_t x = 0; x < P; x++)
                        for (int64_t i = 0; i < n; i++)
                            copy_bytes(tok[i] + (boff[s] + x) * row, blk + (x * B + i) * row, row, stream);
                } else { /* scatter: each token's rank row in order */
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t x = 0; x < P; x++)
                            copy_bytes(blk + (x * B + i) * row, tok[i] + (boff[s] + x) * row, row, stream);
                }
            }
        }
        fence(stream);
    }
    return 0;
}

/* Whole blocks between float32 pages and a narrower packed buffer (compact pool objects), converted in the
 * copy. kind 1: bfloat16, round to nearest even (NaN -> 0x7FC0, as torch). kind 2: float8 e4m3fn (no
 * infinities, max 448), round to nearest even and saturating to +-448 as torch's cast does (infinities
 * included; NaN -> 0x7F with its sign). Unpack widens exactly. Block k of the packed side is block ids[k] of
 * the pages, as moorage_kv_blocks lays them out. *crc gets the CRC-32C of the packed bytes: each block's raw
 * register computed right after it is converted (pack, still in cache) or before it is widened (unpack),
 * then joined. Threads over blocks. block_elems: float32 elements per block. */
static inline uint16_t f32_to_bf16(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint8_t f32_to_e4m3(uint32_t u) {
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7F;             /* NaN */
    if (a >= 0x43E00000u) return sign | 0x7E;            /* >= 448 (infinity too): saturate */
    if (a < 0x3C800000u) {                               /* below 2^-6: a subnormal, m * 2^-9 (8 is 2^-6) */
        float f;
        memcpy(&f, &a, sizeof f);
        return sign | (uint8_t)nearbyintf(f * 512.0f);   /* exact scaling; the default mode rounds to even */
    }
    uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;  /* exponent and 3 mantissa bits, rounded to even */
    r -= (127u - 7u) << 3;                               /* rebias */
    return sign | (uint8_t)(r > 0x7Eu ? 0x7Eu : r);
}

static float E4M3[256];  /* e4m3fn code -> float32, built once as the library loads */

__attribute__((constructor)) static void e4m3_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : (e == 15 && m == 7) ? NAN : ldexpf(1.0f + m / 8.0f, e - 7);
        E4M3[c] = (c & 0x80) ? -v : v;
    }
}

int moorage_kv_blocks_narrow(const char *src, char *dst, const int64_t *ids, int64_t n, int64_t num_blocks,
                             int64_t block_elems, int unpack, int kind, int64_t min_split, int nthreads,
                             uint32_t *crc) {
    if (n < 0 || block_elems < 0 || num_blocks < 0 || (kind != 1 && kind != 2)) return -1;
    if (!HAVE_CRC) return -5;
    int rc = check_ids(ids, n, num_blocks, unpack);
    if (rc) return rc;
    *crc = 0;
    if (n == 0 || block_elems == 0) return 0;
    uint32_t *raw = malloc((size_t)n * sizeof(uint32_t));
    if (!raw) return -4;
    int64_t packed_bytes = block_elems * (kind == 1 ? 2 : 1);
    int nt = threads_for(n * block_elems * (4 + packed_bytes / block_elems), min_split, nthreads);
    (void)nt;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t k = 0; k < n; k++) {
        if (!unpack) {
            const uint32_t *f = (const uint32_t *)(src + ids[k] * block_elems * 4);
            char *out = dst + k * packed_bytes;
            if (kind == 1)
                for (int64_t i = 0; i < block_elems; i++) ((uint16_t *)out)[i] = f32_to_bf16(f[i]);
            else
                for (int64_t i = 0; i < block_elems; i++) ((uint8_t *)out)[i] = f32_to_e4m3(f[i]);
            raw[k] = crc_raw(out, packed_bytes, 0);
        } else {
            const char *in = src + k * packed_bytes;
            raw[k] = crc_raw(in, packed_bytes, 0);
            if (kind == 1) {
                uint32_t *f = (uint32_t *)(dst + ids[k] * block_elems * 4);
                for (int64_t i = 0; i < block_elems; i++) f[i] = (uint32_t)((const uint16_t *)in)[i] << 16;
            } else {
                float *f = (float *)(dst + ids[k] * block_elems * 4);
                for (int64_t i = 0; i < block_elems; i++) f[i] = E4M3[((const uint8_t *)in)[i]];
            }
        }
    }
    uint32_t shift = crc_shift(0x80000000u, packed_bytes), c = 0xFFFFFFFFu;
    for (int64_t k = 0; k < n; k++) c = gf2_mul(c, shift) ^ raw[k];
    free(raw);
    *crc = ~c;
    return 0;
}
