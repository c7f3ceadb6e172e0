/*
 * tenzro_kernels: GGUF-quantized weight x 8-bit-quantized activation dot products, and the data
 * plane's base64 codec (see the base64 section below).
 *
 * Weights: ggml blocks Q8_0 (34 B / 32 values), Q4_K (144 B / 256), Q6_K (210 B / 256), layouts of
 * ggml-common.h. Activations are quantized here, per row, as ggml's CPU backend does before its
 * integer dot products (ggml-quants.c quantize_row_q8_0_ref / quantize_row_q8_K_ref): Q8_0 weights
 * meet Q8_0 activations (f32 scale per 32 values), K-quant weights meet Q8_K activations (f32 scale
 * and int16 group sums per 256 values). The per-block integer sums are exact, whichever ISA computes
 * them; every float operation after them is the same IEEE operation in the same order on every path
 * (built with -ffp-contract=off: no FMA contraction), so the portable, AVX2 and AVX-512-VNNI paths are
 * bit-identical. The AVX2 path uses maddubs/madd (ggml's trick for signed x signed: |w| times
 * sign(x, w)); the VNNI path uses vpdpbusd (Q8_0) and vpdpwssd (K-quants).
 *
 * Q8_0 float order: block b's term (float)sumi_b * (d_w,b * d_x,b) is added to lane b % 8 of eight
 * accumulators; the lanes are summed as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).
 * K-quant float order: per super-block s, acc += d_s*(float)sumi_s (Q4_K then acc -= dmin_s*(float)mins_s).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define TK_X86 1
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2")))
#define TARGET_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define TK_X86 0
#endif

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avx512vnni"};
static int g_isa = ISA_PORTABLE;
static float F16[65536]; /* every IEEE half bit pattern -> float32, exact */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, f;
    if (ex == 0) {
        if (man == 0) {
            f = sign;
        } else { /* subnormal: normalise the mantissa */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400u));
            f = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (ex == 31) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((ex + 112u) << 23) | (man << 13);
    }
    float r;
    memcpy(&r, &f, 4);
    return r;
}

static inline float f16(const uint8_t *p) { return F16[(uint16_t)(p[0] | (p[1] << 8))]; }

/* ---------------------------------------------------------------- activation quantization */

/* ggml nearest_int: round half to even through the 1.5*2^23 magic add (|v| < 2^22). */
static inline int nearest_int(float v) {
    float val = v + 12582912.f;
    int32_t i;
    memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* Q8_0: per 32 values d = amax/127, q = roundf(x/d) (quantize_row_q8_0_ref, d kept as f32).
 * A non-finite value makes the block's scale NaN, so it shows in the output. */
static void quantize_q8_0(const float *x, int cols, int8_t *q, float *d) {
    for (int b = 0; b < cols / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        int bad = 0;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(xb[j]);
            if (!isfinite(a)) bad = 1;
            if (a > amax) amax = a;
        }
        float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        if (bad) { db = NAN; id = 0.f; }
        d[b] = db;
        for (int j = 0; j < 32; j++) q[32 * b + j] = (int8_t)roundf(xb[j] * id);
    }
}

/* Q8_K: per 256 values iscale = -127/max (max: the value of largest magnitude), q = min(127,
 * nearest_int(iscale*x)), d = 1/iscale, bsums = sums of 16 (quantize_row_q8_K_ref). */
static void quantize_q8_k(const float *x, int cols, int8_t *q, float *d, int16_t *bsums) {
    for (int b = 0; b < cols / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t *qb = q + 256 * b;
        float amax = 0.f, mx = 0.f;
        int bad = 0;
        for (int j = 0; j < 256; j++) {
            float a = fabsf(xb[j]);
            if (!isfinite(a)) bad = 1;
            if (a > amax) { amax = a; mx = xb[j]; }
        }
        if (amax == 0.f || bad) {
            d[b] = bad ? NAN : 0.f;
            memset(qb, 0, 256);
            for (int g = 0; g < 16; g++) bsums[16 * b + g] = 0;
            continue;
        }
        float iscale = -127.f / mx;
        for (int j = 0; j < 256; j++) {
            int v = nearest_int(iscale * xb[j]);
            qb[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += qb[16 * g + j];
            bsums[16 * b + g] = (int16_t)s;
        }
        d[b] = 1.f / iscale;
    }
}

/* ---------------------------------------------------------------- shared scalar pieces */

static inline void q4k_scale_min(const uint8_t *sc12, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = sc12[j] & 63;
        *mn = sc12[j + 4] & 63;
    } else {
        *sc = (sc12[j + 4] & 0x0F) | ((sc12[j - 4] >> 6) << 4);
        *mn = (sc12[j + 4] >> 4) | ((sc12[j] >> 6) << 4);
    }
}

static inline float reduce8(const float a[8]) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* Q8_0 term of block b added to lane b % 8 (scalar; the SIMD paths do the same per lane). */
static inline void q8_0_block_scalar(const uint8_t *wb, const int8_t *qx, const float *dx, int b, float acc[8]) {
    const int8_t *qw = (const int8_t *)(wb + 2);
    int32_t s = 0;
    for (int j = 0; j < 32; j++) s += (int32_t)qw[j] * qx[j];
    acc[b & 7] = acc[b & 7] + (float)s * (f16(wb) * dx[b]);
}

/* ---------------------------------------------------------------- portable path */

static float dot_q8_0_portable(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    (void)bs;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int b = 0; b < cols / 32; b++) q8_0_block_scalar(w + 34 * b, qx + 32 * b, dx, b, acc);
    return reduce8(acc);
}

static float dot_q4_k_portable(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        const int8_t *q8 = qx + 256 * b;
        const int16_t *bsb = bs + 16 * b;
        int32_t sumi = 0, mins = 0;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            q4k_scale_min(blk + 4, j, &sc, &mn);
            const uint8_t *qq = qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            int32_t s = 0;
            for (int l = 0; l < 32; l++) s += ((qq[l] >> shift) & 0x0F) * q8[32 * j + l];
            sumi += sc * s;
            mins += mn * (bsb[2 * j] + bsb[2 * j + 1]);
        }
        acc = acc + (f16(blk) * dx[b]) * (float)sumi;
        acc = acc - (f16(blk + 2) * dx[b]) * (float)mins;
    }
    return acc;
}

static float dot_q6_k_portable(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    (void)bs;
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 210 * b;
        const int8_t *sc = (const int8_t *)(blk + 192), *q8 = qx + 256 * b;
        int32_t sumi = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const int8_t *x = q8 + 128 * h;
            int32_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int l = 0; l < 32; l++) {
                int g = l / 16;
                s[0 + g] += (((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32) * x[l];
                s[2 + g] += (((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32) * x[l + 32];
                s[4 + g] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * x[l + 64];
                s[6 + g] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * x[l + 96];
            }
            for (int k = 0; k < 8; k++) sumi += sc[8 * h + k] * s[k];
        }
        acc = acc + (f16(blk + 208) * dx[b]) * (float)sumi;
    }
    return acc;
}

/* ---------------------------------------------------------------- x86 SIMD paths */
#if TK_X86

/* Eight vectors of eight int32 -> the vector of their eight horizontal sums, in order. */
#define HSUM8x8(p, out)                                                                   \
    do {                                                                                  \
        __m256i a_ = _mm256_hadd_epi32(p[0], p[1]), b_ = _mm256_hadd_epi32(p[2], p[3]);   \
        __m256i c_ = _mm256_hadd_epi32(p[4], p[5]), d_ = _mm256_hadd_epi32(p[6], p[7]);   \
        __m256i ab_ = _mm256_hadd_epi32(a_, b_), cd_ = _mm256_hadd_epi32(c_, d_);         \
        out = _mm256_add_epi32(_mm256_permute2x128_si256(ab_, cd_, 0x20),                  \
                               _mm256_permute2x128_si256(ab_, cd_, 0x31));                 \
    } while (0)

#define HSUM_EPI32(v, out)                                                                \
    do {                                                                                  \
        __m128i s_ = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); \
        s_ = _mm_add_epi32(s_, _mm_shuffle_epi32(s_, 0x4E));                              \
        s_ = _mm_add_epi32(s_, _mm_shuffle_epi32(s_, 0xB1));                              \
        out = _mm_cvtsi128_si32(s_);                                                      \
    } while (0)

/* Body of the Q8_0 row dot: BLOCKSUM(wq, xq) gives the 8 int32 partial sums of one block. */
#define DOT_Q8_0_BODY(BLOCKSUM)                                                            \
    int nb = cols / 32, b = 0;                                                            \
    __m256 acc = _mm256_setzero_ps();                                                     \
    for (; b + 8 <= nb; b += 8) {                                                         \
        __m256i p[8];                                                                     \
        for (int k = 0; k < 8; k++) {                                                     \
            const uint8_t *wb = w + 34 * (b + k);                                         \
            __m256i wq = _mm256_loadu_si256((const __m256i *)(wb + 2));                   \
            __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + 32 * (b + k)));        \
            p[k] = BLOCKSUM(wq, xq);                                                      \
        }                                                                                 \
        __m256i s;                                                                        \
        HSUM8x8(p, s);                                                                    \
        const uint8_t *wb = w + 34 * b;                                                   \
        __m256 dw = _mm256_set_ps(f16(wb + 238), f16(wb + 204), f16(wb + 170), f16(wb + 136), \
                                  f16(wb + 102), f16(wb + 68), f16(wb + 34), f16(wb));     \
        __m256 d = _mm256_mul_ps(dw, _mm256_loadu_ps(dx + b));                            \
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), d));                \
    }                                                                                     \
    float a8[8];                                                                          \
    _mm256_storeu_ps(a8, acc);                                                            \
    for (; b < nb; b++) q8_0_block_scalar(w + 34 * b, qx + 32 * b, dx, b, a8);           \
    return reduce8(a8);

TARGET_AVX2 static inline __m256i blocksum_avx2(__m256i wq, __m256i xq) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

TARGET_VNNI static inline __m256i blocksum_vnni(__m256i wq, __m256i xq) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
}

TARGET_AVX2 static float dot_q8_0_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    (void)bs;
    DOT_Q8_0_BODY(blocksum_avx2)
}

TARGET_VNNI static float dot_q8_0_vnni(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    (void)bs;
    DOT_Q8_0_BODY(blocksum_vnni)
}

/* Scale-weighted sum of maddubs pairs: MADD_SCALED(acc, p16, scale16). */
#define MADD_SCALED_AVX2(acc, p16, s16) _mm256_add_epi32(acc, _mm256_madd_epi16(p16, s16))
#define MADD_SCALED_VNNI(acc, p16, s16) _mm256_dpwssd_epi32(acc, p16, s16)

#define DOT_Q4_K_BODY(MADD_SCALED)                                                         \
    const __m256i m4 = _mm256_set1_epi8(0x0F);                                            \
    float acc = 0.f;                                                                      \
    for (int b = 0; b < cols / 256; b++) {                                                \
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;                                 \
        const int8_t *q8 = qx + 256 * b;                                                  \
        const int16_t *bsb = bs + 16 * b;                                                 \
        __m256i vacc = _mm256_setzero_si256();                                            \
        int32_t mins = 0;                                                                 \
        for (int p = 0; p < 4; p++) {                                                     \
            int sc0, mn0, sc1, mn1;                                                       \
            q4k_scale_min(blk + 4, 2 * p, &sc0, &mn0);                                    \
            q4k_scale_min(blk + 4, 2 * p + 1, &sc1, &mn1);                                \
            mins += mn0 * (bsb[4 * p] + bsb[4 * p + 1]) + mn1 * (bsb[4 * p + 2] + bsb[4 * p + 3]); \
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));                \
            __m256i lo = _mm256_and_si256(q, m4);                                         \
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);                   \
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * p));              \
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * p + 32));         \
            vacc = MADD_SCALED(vacc, _mm256_maddubs_epi16(lo, x0), _mm256_set1_epi16((short)sc0)); \
            vacc = MADD_SCALED(vacc, _mm256_maddubs_epi16(hi, x1), _mm256_set1_epi16((short)sc1)); \
        }                                                                                 \
        int32_t sumi;                                                                     \
        HSUM_EPI32(vacc, sumi);                                                           \
        acc = acc + (f16(blk) * dx[b]) * (float)sumi;                                     \
        acc = acc - (f16(blk + 2) * dx[b]) * (float)mins;                                 \
    }                                                                                     \
    return acc;

TARGET_AVX2 static float dot_q4_k_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    DOT_Q4_K_BODY(MADD_SCALED_AVX2)
}

/* Q4_K's 12 scale bytes -> u[0..1] the 8 six-bit scales, u[2..3] the 8 six-bit mins, one byte each
 * (the unpacking of q4k_scale_min done on 32-bit words, as ggml's kmask trick). */
static inline void q4k_unpack_scales(const uint8_t *sc12, uint32_t u[4]) {
    memcpy(u, sc12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3fu;
}

/* VNNI, 512-bit: one register holds the quants of two 32-byte chunks (four 32-value groups once
 * split into low and high nibbles); the activations arrive in the matching order (qx permuted
 * once per row by q4k_vnni_order: 32-value groups 0,2,1,3 of every 128), the per-group scales spread over int16 lanes with a byte shuffle, and the mins term
 * comes from the Q8_K pair sums with one madd. Integer sums identical to the scalar path. */
TARGET_VNNI static float dot_q4_k_vnni(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i idx[4]; /* [2*pp + nibble]: int16 lane L <- scale byte 4*pp + nibble + 2*(L/16), high byte 0 */
    for (int k = 0; k < 4; k++) {
        int8_t t[64];
        for (int l = 0; l < 64; l++) t[l] = (l & 1) ? (int8_t)0x80 : (int8_t)(4 * (k >> 1) + (k & 1) + 2 * (l / 32));
        idx[k] = _mm512_loadu_si512((const void *)t);
    }
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        const int8_t *q8 = qx + 256 * b;
        uint32_t u[4];
        q4k_unpack_scales(blk + 4, u);
        __m128i sm = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
        __m512i sc8 = _mm512_broadcast_i32x4(sm); /* bytes 0..7 scales, 8..15 mins, in every 128-bit lane */
        __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(bs + 16 * b)),
                                       _mm_loadu_si128((const __m128i *)(bs + 16 * b + 8)));
        __m128i mp = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)), pairs);
        mp = _mm_add_epi32(mp, _mm_shuffle_epi32(mp, 0x4E));
        mp = _mm_add_epi32(mp, _mm_shuffle_epi32(mp, 0xB1));
        int32_t mins = _mm_cvtsi128_si32(mp);
        __m512i vacc = _mm512_setzero_si512();
        for (int pp = 0; pp < 2; pp++) {
            __m512i q = _mm512_loadu_si512((const void *)(qs + 64 * pp));
            __m512i xlo = _mm512_loadu_si512((const void *)(q8 + 128 * pp));
            __m512i xhi = _mm512_loadu_si512((const void *)(q8 + 128 * pp + 64));
            __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            vacc = _mm512_dpwssd_epi32(vacc, _mm512_maddubs_epi16(lo, xlo), _mm512_shuffle_epi8(sc8, idx[2 * pp]));
            vacc = _mm512_dpwssd_epi32(vacc, _mm512_maddubs_epi16(hi, xhi),
                                       _mm512_shuffle_epi8(sc8, idx[2 * pp + 1]));
        }
        int32_t sumi = _mm512_reduce_add_epi32(vacc);
        acc = acc + (f16(blk) * dx[b]) * (float)sumi;
        acc = acc - (f16(blk + 2) * dx[b]) * (float)mins;
    }
    return acc;
}

/* Q6_K: quants taken unsigned (0..63) for maddubs; the -32 offset comes back through the Q8_K
 * group sums: sum sc*(q-32)*x = sum sc*q*x - 32 * sum_g sc_g*bsums_g. */
#define DOT_Q6_K_BODY(MADD_SCALED)                                                         \
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);              \
    float acc = 0.f;                                                                      \
    for (int b = 0; b < cols / 256; b++) {                                                \
        const uint8_t *blk = w + 210 * b;                                                 \
        const int8_t *sc = (const int8_t *)(blk + 192), *q8 = qx + 256 * b;               \
        const int16_t *bsb = bs + 16 * b;                                                 \
        __m256i vacc = _mm256_setzero_si256();                                            \
        int32_t off = 0;                                                                  \
        for (int g = 0; g < 16; g++) off += sc[g] * bsb[g];                               \
        for (int h = 0; h < 2; h++) {                                                     \
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;                    \
            const int8_t *x = q8 + 128 * h;                                               \
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);                          \
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));                   \
            __m256i hb = _mm256_loadu_si256((const __m256i *)qh);                          \
            __m256i q[4];                                                                 \
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)); \
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)); \
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)); \
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),        \
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));      \
            for (int k = 0; k < 4; k++) {                                                 \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * k));           \
                __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * k + 1]),     \
                                               _mm_set1_epi16(sc[8 * h + 2 * k]));        \
                vacc = MADD_SCALED(vacc, _mm256_maddubs_epi16(q[k], xv), s16);            \
            }                                                                             \
        }                                                                                 \
        int32_t sumi;                                                                     \
        HSUM_EPI32(vacc, sumi);                                                           \
        sumi -= 32 * off;                                                                 \
        acc = acc + (f16(blk + 208) * dx[b]) * (float)sumi;                               \
    }                                                                                     \
    return acc;

TARGET_AVX2 static float dot_q6_k_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    DOT_Q6_K_BODY(MADD_SCALED_AVX2)
}

/* VNNI, 512-bit: quants of 64 consecutive values per register, per-16 scales by an int16 permute. */
TARGET_VNNI static float dot_q6_k_vnni(const uint8_t *w, const int8_t *qx, const float *dx, const int16_t *bs, int cols) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    __m512i idx[4];
    for (int k = 0; k < 4; k++) { /* int16 lane L of register k takes scale 2k + L/16... per 16 values: L/8 */
        int16_t t[32];
        for (int l = 0; l < 32; l++) t[l] = (int16_t)(4 * (k & 1) + 8 * (k >> 1) + l / 8);
        idx[k] = _mm512_loadu_si512((const void *)t);
    }
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 210 * b;
        const int8_t *sc = (const int8_t *)(blk + 192), *q8 = qx + 256 * b;
        const int16_t *bsb = bs + 16 * b;
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m512i scales = _mm512_castsi256_si512(sc16);
        /* the -32 offset, 32 * sum_g sc_g * bsums_g, starts the accumulator (negated) */
        __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)bsb));
        __m512i vacc = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
        for (int h = 0; h < 2; h++) {
            __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), hb, 1);
            __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi64(hh, shl), m30));
            __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(l, 4), m4),
                                          _mm512_and_si512(_mm512_srlv_epi64(hh, shr), m30));
            __m512i x01 = _mm512_loadu_si512((const void *)(q8 + 128 * h));
            __m512i x23 = _mm512_loadu_si512((const void *)(q8 + 128 * h + 64));
            vacc = _mm512_dpwssd_epi32(vacc, _mm512_maddubs_epi16(q01, x01), _mm512_permutexvar_epi16(idx[2 * h], scales));
            vacc = _mm512_dpwssd_epi32(vacc, _mm512_maddubs_epi16(q23, x23),
                                       _mm512_permutexvar_epi16(idx[2 * h + 1], scales));
        }
        int32_t sumi = _mm512_reduce_add_epi32(vacc);
        acc = acc + (f16(blk + 208) * dx[b]) * (float)sumi;
    }
    return acc;
}
#endif /* TK_X86 */

/* ---------------------------------------------------------------- dispatch */

typedef float (*dot_fn)(const uint8_t *, const int8_t *, const float *, const int16_t *, int);

static int isa_supported(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#if TK_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2");
    if (isa == ISA_AVX512VNNI)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static dot_fn pick(int qtype, int isa) {
    static const dot_fn portable[3] = {dot_q8_0_portable, dot_q4_k_portable, dot_q6_k_portable};
#if TK_X86
    static const dot_fn avx2[3] = {dot_q8_0_avx2, dot_q4_k_avx2, dot_q6_k_avx2};
    static const dot_fn vnni[3] = {dot_q8_0_vnni, dot_q4_k_vnni, dot_q6_k_vnni};
    if (isa == ISA_AVX512VNNI) return vnni[qtype];
    if (isa == ISA_AVX2) return avx2[qtype];
#endif
    return portable[qtype];
}

static const int QK[3] = {32, 256, 256}, QBYTES[3] = {34, 144, 210};

static int qtype_index(const char *q) {
    if (!strcmp(q, "q8_0")) return 0;
    if (!strcmp(q, "q4_k")) return 1;
    if (!strcmp(q, "q6_k")) return 2;
    return -1;
}

#define ROWS_PER_TASK 16

/* y[n, rows] = dequant(W)[rows, cols] . quant(x)[n, cols]^T with activation rows quantized first. */
/* Reorder one row of Q8_K activations for dot_q4_k_vnni: in every 128 values the 32-value groups
 * 0,1,2,3 become 0,2,1,3, so one 512-bit load meets the low (or high) nibbles of two quant chunks.
 * Only the order of the products changes; the group sums (bsums) are taken before. */
static void q4k_vnni_order(int8_t *q, int cols) {
    int8_t t[32];
    for (int o = 0; o < cols; o += 128) {
        memcpy(t, q + o + 32, 32);
        memcpy(q + o + 32, q + o + 64, 32);
        memcpy(q + o + 64, t, 32);
    }
}

static int matmul(int qt, int isa, const uint8_t *W, int rows, int cols, const float *x, int n, float *y, int nthreads) {
    int nb = cols / QK[qt];
    size_t rb = (size_t)nb * QBYTES[qt];
    int8_t *qx = malloc((size_t)n * cols);
    float *dx = malloc(sizeof(float) * (size_t)n * (cols / 32));
    int16_t *bs = malloc(sizeof(int16_t) * ((size_t)n * (cols / 16) + 1));
    if (!qx || !dx || !bs) { free(qx); free(dx); free(bs); return -1; }
    for (int i = 0; i < n; i++) {
        if (qt == 0) quantize_q8_0(x + (size_t)i * cols, cols, qx + (size_t)i * cols, dx + (size_t)i * nb);
        else quantize_q8_k(x + (size_t)i * cols, cols, qx + (size_t)i * cols, dx + (size_t)i * nb, bs + (size_t)i * nb * 16);
        if (qt == 1 && isa == ISA_AVX512VNNI) q4k_vnni_order(qx + (size_t)i * cols, cols);
    }
    dot_fn dot = pick(qt, isa);
    int ntasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ntasks) nthreads = ntasks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int t = 0; t < ntasks; t++) {
        int r1 = (t + 1) * ROWS_PER_TASK < rows ? (t + 1) * ROWS_PER_TASK : rows;
        for (int r = t * ROWS_PER_TASK; r < r1; r++)
            for (int i = 0; i < n; i++)
                y[(size_t)i * rows + r] = dot(W + (size_t)r * rb, qx + (size_t)i * cols, dx + (size_t)i * nb,
                                              bs + (size_t)i * nb * 16, cols);
    }
    free(qx); free(dx); free(bs);
    return 0;
}

/* ---------------------------------------------------------------- base64 (RFC 4648 §4, padded)
 *
 * The data plane's JSON frames (iroh, HTTP /rpc) carry rows as base64: CPython's binascii codes
 * one character at a time (~0.35 GB/s encode, ~0.25 GB/s decode here). These table loops do the
 * same bytes at several GB/s. Encode: 12 input bits -> two output characters per lookup
 * (B64_PAIR). Decode: each character looks up its 6 bits already shifted to its place in the
 * 24-bit group (B64_DEC[position]); a character outside the alphabet sets B64_BAD, checked once
 * per call. The decoder takes only the canonical form (length a multiple of 4, '=' only as the
 * last one or two characters); it ignores the unused low bits of a padded group, as binascii
 * does. */

static const char B64_ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
static uint16_t B64_PAIR[4096];  /* 12 bits -> their two characters, in memory order */
static uint32_t B64_DEC[4][256]; /* character -> its 6 bits at position p of a group, or B64_BAD */
#define B64_BAD 0x01000000u

static void b64_init(void) {
    for (int i = 0; i < 4096; i++) {
        unsigned char pair[2] = {(unsigned char)B64_ALPHABET[i >> 6], (unsigned char)B64_ALPHABET[i & 63]};
        memcpy(&B64_PAIR[i], pair, 2);
    }
    for (int p = 0; p < 4; p++)
        for (int c = 0; c < 256; c++) B64_DEC[p][c] = B64_BAD;
    for (uint32_t v = 0; v < 64; v++) {
        unsigned char c = (unsigned char)B64_ALPHABET[v];
        B64_DEC[0][c] = v << 18;
        B64_DEC[1][c] = v << 12;
        B64_DEC[2][c] = v << 6;
        B64_DEC[3][c] = v;
    }
}

/* dst gets 4 * ceil(n / 3) characters. */
static void b64_encode(const uint8_t *s, size_t n, uint8_t *dst) {
    size_t i = 0;
    for (; i + 6 <= n; i += 6, dst += 8) { /* 48 bits -> 8 characters */
        uint64_t v = (uint64_t)s[i] << 40 | (uint64_t)s[i + 1] << 32 | (uint64_t)s[i + 2] << 24 |
                     (uint64_t)s[i + 3] << 16 | (uint64_t)s[i + 4] << 8 | (uint64_t)s[i + 5];
        uint16_t out[4] = {B64_PAIR[v >> 36], B64_PAIR[(v >> 24) & 0xfff], B64_PAIR[(v >> 12) & 0xfff],
                           B64_PAIR[v & 0xfff]};
        memcpy(dst, out, 8);
    }
    for (; i + 3 <= n; i += 3, dst += 4) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        memcpy(dst, &B64_PAIR[v >> 12], 2);
        memcpy(dst + 2, &B64_PAIR[v & 0xfff], 2);
    }
    if (i < n) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0);
        dst[0] = B64_ALPHABET[v >> 18];
        dst[1] = B64_ALPHABET[(v >> 12) & 63];
        dst[2] = i + 1 < n ? B64_ALPHABET[(v >> 6) & 63] : '=';
        dst[3] = '=';
    }
}

/* Bytes written to dst (at most 3 * n / 4), or -1 when s is not canonical padded base64. */
static Py_ssize_t b64_decode(const uint8_t *s, size_t n, uint8_t *dst) {
    if (n % 4) return -1;
    if (n == 0) return 0;
    uint8_t *d = dst;
    uint32_t bad = 0;
    const uint8_t *last = s + n - 4;
    for (; s < last; s += 4, d += 3) {
        uint32_t x = B64_DEC[0][s[0]] | B64_DEC[1][s[1]] | B64_DEC[2][s[2]] | B64_DEC[3][s[3]];
        bad |= x;
        d[0] = (uint8_t)(x >> 16);
        d[1] = (uint8_t)(x >> 8);
        d[2] = (uint8_t)x;
    }
    int pad = s[3] == '=' ? (s[2] == '=' ? 2 : 1) : 0;
    uint32_t x = B64_DEC[0][s[0]] | B64_DEC[1][s[1]] | (pad < 2 ? B64_DEC[2][s[2]] : 0) | (pad < 1 ? B64_DEC[3][s[3]] : 0);
    if ((bad | x) & B64_BAD) return -1;
    d[0] = (uint8_t)(x >> 16);
    if (pad < 2) d[1] = (uint8_t)(x >> 8);
    if (pad < 1) d[2] = (uint8_t)x;
    return (Py_ssize_t)(d - dst) + 3 - pad;
}

/* ---------------------------------------------------------------- Python API */

static int isa_from_name(const char *s) {
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, ISA_NAMES[i])) return i;
    return -1;
}

static PyObject *py_matmul_xt(PyObject *self, PyObject *args) {
    const char *qtype, *isa_name = NULL;
    Py_buffer wb, xb, yb;
    int rows, cols, n, nthreads;
    if (!PyArg_ParseTuple(args, "sy*iiy*iw*i|z", &qtype, &wb, &rows, &cols, &xb, &n, &yb, &nthreads, &isa_name))
        return NULL;
    PyObject *ret = NULL;
    int qt = qtype_index(qtype), isa = g_isa;
    if (qt < 0) { PyErr_Format(PyExc_ValueError, "qtype must be q8_0, q4_k or q6_k, got %s", qtype); goto done; }
    if (isa_name) {
        isa = isa_from_name(isa_name);
        if (isa < 0 || !isa_supported(isa)) {
            PyErr_Format(PyExc_ValueError, "ISA %s is not available on this CPU", isa_name);
            goto done;
        }
    }
    if (rows < 0 || n < 0 || cols <= 0 || cols % QK[qt]) {
        PyErr_Format(PyExc_ValueError, "cols must be a positive multiple of %d for %s, got %d", QK[qt], qtype, cols);
        goto done;
    }
    if (wb.len != (Py_ssize_t)rows * (cols / QK[qt]) * QBYTES[qt] || xb.len != (Py_ssize_t)n * cols * 4 ||
        yb.len != (Py_ssize_t)n * rows * 4) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match rows, cols and n");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul(qt, isa, wb.buf, rows, cols, xb.buf, n, yb.buf, nthreads);
    Py_END_ALLOW_THREADS
    if (rc) { PyErr_NoMemory(); goto done; }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&wb);
    PyBuffer_Release(&xb);
    PyBuffer_Release(&yb);
    return ret;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(ISA_NAMES[g_isa]); }

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int isa = isa_from_name(name);
    if (isa < 0) return PyErr_Format(PyExc_ValueError, "ISA must be portable, avx2 or avx512vnni, got %s", name);
    if (!isa_supported(isa)) return PyErr_Format(PyExc_ValueError, "ISA %s is not available on this CPU", name);
    g_isa = isa;
    Py_RETURN_NONE;
}

static PyObject *py_supported(PyObject *self, PyObject *noargs) {
    PyObject *t = PyList_New(0);
    for (int i = 0; i < 3; i++)
        if (isa_supported(i)) PyList_Append(t, PyUnicode_FromString(ISA_NAMES[i]));
    return t;
}

static PyObject *py_openmp(PyObject *self, PyObject *noargs) {
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}


#define B64_RELEASE_GIL (1 << 16) /* bytes past which the codecs run without the GIL */

static PyObject *py_b64encode(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    size_t n = (size_t)b.len;
    if (n > (size_t)(PY_SSIZE_T_MAX / 4 * 3 - 3)) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((n + 2) / 3 * 4));
    if (out) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        if (n >= B64_RELEASE_GIL) {
            Py_BEGIN_ALLOW_THREADS
            b64_encode(b.buf, n, dst);
            Py_END_ALLOW_THREADS
        } else {
            b64_encode(b.buf, n, dst);
        }
    }
    PyBuffer_Release(&b);
    return out;
}

static PyObject *py_b64decode(PyObject *self, PyObject *arg) {
    const uint8_t *s;
    Py_ssize_t n;
    Py_buffer b = {0};
    if (PyUnicode_Check(arg)) {
        if (!PyUnicode_IS_READY(arg) || !PyUnicode_IS_ASCII(arg)) Py_RETURN_NONE; /* not base64 */
        s = (const uint8_t *)PyUnicode_DATA(arg);
        n = PyUnicode_GET_LENGTH(arg);
    } else {
        if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
        s = b.buf;
        n = b.len;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n / 4 * 3);
    if (out) {
        Py_ssize_t got;
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        if (n >= B64_RELEASE_GIL) {
            Py_BEGIN_ALLOW_THREADS
            got = b64_decode(s, (size_t)n, dst);
            Py_END_ALLOW_THREADS
        } else {
            got = b64_decode(s, (size_t)n, dst);
        }
        if (got < 0) {
            Py_SETREF(out, Py_NewRef(Py_None));
        } else if (got != PyBytes_GET_SIZE(out)) {
            _PyBytes_Resize(&out, got);
        }
    }
    if (b.obj) PyBuffer_Release(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"matmul_xt", py_matmul_xt, METH_VARARGS,
     "matmul_xt(qtype, blocks, rows, cols, x, n, out, nthreads[, isa]): out f32[n, rows] = x . W^T."},
    {"isa", py_isa, METH_NOARGS, "The SIMD path in use: portable, avx2 or avx512vnni."},
    {"set_isa", py_set_isa, METH_VARARGS, "Force a SIMD path (ValueError if this CPU lacks it)."},
    {"supported", py_supported, METH_NOARGS, "SIMD paths this CPU can run."},
    {"openmp", py_openmp, METH_NOARGS, "Whether the module was built with OpenMP (row threads)."},
    {"b64encode", py_b64encode, METH_O, "b64encode(data) -> bytes: standard padded base64 (RFC 4648 §4)."},
    {"b64decode", py_b64decode, METH_O,
     "b64decode(text: bytes-like or str) -> bytes, or None when text is not canonical padded base64\n"
     "(length a multiple of 4, '=' only at the end; the caller's strict decoder says why)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "tenzro_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tenzro_kernels(void) {
    b64_init();
    for (int i = 0; i < 65536; i++) F16[i] = half_to_float((uint16_t)i);
    g_isa = isa_supported(ISA_AVX512VNNI) ? ISA_AVX512VNNI : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_PORTABLE;
    return PyModule_Create(&moddef);
}
