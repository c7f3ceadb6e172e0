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
 * sign(x, w)); the VNNI path uses 512-bit vpdpbusd on (w ^ 0x80) x x minus 128 * sum(x) (Q8_0) and
 * vpdpwssd (K-quants).
 *
 * Q8_0 float order: block b's term (float)sumi_b * (d_w,b * d_x,b) is added to lane b % 8 of eight
 * accumulators; the lanes are summed as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).
 * K-quant float order: per super-block s, acc += d_s*(float)sumi_s (Q4_K then acc -= dmin_s*(float)mins_s).
 *
 * The SIMD paths take four output rows at a time (dot4_*): the activation loads are shared, the four
 * rows' weights stream side by side (measured faster when the weights come from L3 or memory, likely
 * through more hardware-prefetch streams; software prefetch measured no gain), and the four rows'
 * float accumulators are lanes of one vector, each lane doing exactly the one-row float operations above.
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
#define TARGET_VNNI __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
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

static float dot_q8_0_portable(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    (void)aux;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int b = 0; b < cols / 32; b++) q8_0_block_scalar(w + 34 * b, qx + 32 * b, dx, b, acc);
    return reduce8(acc);
}

static float dot_q4_k_portable(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    const int16_t *bs = (const int16_t *)aux;
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

static float dot_q6_k_portable(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    (void)aux;
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

static const int SIGMA[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* dx and 128 * (sum of the block's quants) of one Q8_0 activation row in the VNNI kernel's order:
 * whole groups of eight blocks permuted by SIGMA, the remaining blocks as they are. */
static void q8_0_vnni_prepare(const int8_t *qx, const float *dx, int cols, float *dxp, int32_t *bias) {
    int nb = cols / 32;
    for (int b = 0; b < nb; b++) {
        int src = b < (nb & ~7) ? (b & ~7) + SIGMA[b & 7] : b;
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += qx[32 * src + j];
        dxp[b] = dx[src];
        bias[b] = 128 * s;
    }
}

/* ---------------------------------------------------------------- x86 SIMD paths */
#if TK_X86
/* The four-row kernels prefetch their weights PF_BYTES ahead of each row into L2 (pf: 0 = off, for
 * the second and later activation rows of a batch, which meet the same weights). Measured on the
 * AVX-512 VNNI Xeon, one thread, a 2304x2048 Q8_0 matrix from memory: median 6.2-7.4 -> 8.3-10.1 GB/s
 * (8 to 32 KiB ahead alike, 0.5 to 4 KiB less, prefetch to L1 less); the bench's expert, the machine
 * busy: Q8_0 0.36-0.46 -> 0.31-0.37 of numpy, Q4_K_M 0.30-0.37 -> 0.22-0.29 (avx2 forced: 0.51 -> 0.35,
 * 0.60 -> 0.52). */
#define PF_BYTES 8192
static inline void prefetch_l2(const uint8_t *p, long pf, int nbytes) {
    if (!pf) return;
    for (int o = 0; o < nbytes; o += 64) _mm_prefetch((const char *)p + pf + o, _MM_HINT_T1);
}

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

TARGET_AVX2 static inline __m256i blocksum_avx2(__m256i wq, __m256i xq) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* The terms of eight Q8_0 blocks of one row (block k in lane k): (float)sumi * (d_w * d_x). */
TARGET_AVX2 static inline __m256 q8_0_terms8_avx2(const uint8_t *wb, const int8_t *xb, __m256 dxv) {
    __m256i p[8], s;
    for (int k = 0; k < 8; k++)
        p[k] = blocksum_avx2(_mm256_loadu_si256((const __m256i *)(wb + 34 * k + 2)),
                             _mm256_loadu_si256((const __m256i *)(xb + 32 * k)));
    HSUM8x8(p, s);
    __m256 dw = _mm256_set_ps(f16(wb + 238), f16(wb + 204), f16(wb + 170), f16(wb + 136),
                              f16(wb + 102), f16(wb + 68), f16(wb + 34), f16(wb));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dxv));
}

TARGET_AVX2 static float dot_q8_0_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    (void)aux;
    int nb = cols / 32, b = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) acc = _mm256_add_ps(acc, q8_0_terms8_avx2(w + 34 * b, qx + 32 * b, _mm256_loadu_ps(dx + b)));
    float a8[8];
    _mm256_storeu_ps(a8, acc);
    for (; b < nb; b++) q8_0_block_scalar(w + 34 * b, qx + 32 * b, dx, b, a8);
    return reduce8(a8);
}

/* dot_q8_0_avx2 on four consecutive rows (row stride rb bytes), side by side (bit-identical per row). */
TARGET_AVX2 static void dot4_q8_0_avx2(const uint8_t *w, size_t rb, const int8_t *qx, const float *dx,
                                       const void *aux, int cols, long pf, float *out) {
    (void)aux;
    int nb = cols / 32, b = 0;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; b + 8 <= nb; b += 8) {
        __m256 dxv = _mm256_loadu_ps(dx + b);
        for (int r = 0; r < 4; r++) {
            prefetch_l2(w + r * rb + 34 * b, pf, 272);
            acc[r] = _mm256_add_ps(acc[r], q8_0_terms8_avx2(w + r * rb + 34 * b, qx + 32 * b, dxv));
        }
    }
    for (int r = 0; r < 4; r++) {
        float a8[8];
        _mm256_storeu_ps(a8, acc[r]);
        for (int bb = b; bb < nb; bb++) q8_0_block_scalar(w + r * rb + 34 * bb, qx + 32 * bb, dx, bb, a8);
        out[r] = reduce8(a8);
    }
}

/* VNNI Q8_0, two blocks per 512-bit register. vpdpbusd wants one unsigned operand: w ^ 0x80 is
 * w + 128 as u8, so the block sum is dpbusd(w ^ 0x80, x) - 128 * sum(x_b); the 128 * sum(x_b) come
 * precomputed per activation row (q8_0_vnni_prepare, the aux array). The eight int32 partials of
 * each block are summed by a transpose-add (unpack 32, unpack 64, 128-bit lane shuffle), which
 * leaves the blocks of every group of eight in the order SIGMA = 0,2,4,6,1,3,5,7; the scales
 * (gathered at that order), dx and the aux sums (prepared in that order) follow it, and so do the
 * eight accumulator lanes until the end. Every block's term and every accumulator add is the
 * scalar path's, so the result is bit-identical to it. */
/* quantize_q8_0 and quantize_q8_k in 512-bit registers for the VNNI path: the same float operations
 * per value (x * id, roundf as trunc + (|frac| >= 0.5 ? sign : 0), both exact; iscale * x + 2^23 * 1.5),
 * the same scalar scale arithmetic, max by exact max, so the same bytes and scales. A block with a
 * non-finite value gets a NaN scale (its quants do not matter then: every term it meets is NaN). */
TARGET_VNNI static void quantize_q8_0_avx512(const float *x, int cols, int8_t *q, float *d) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int b = 0; b < cols / 32; b++) {
        __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        int bad = _mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        if (bad) { db = NAN; id = 0.f; }
        d[b] = db;
        __m512 idv = _mm512_set1_ps(id);
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_mul_ps(h ? x1 : x0, idv);
            __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
            __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(v, _mm512_set1_ps(-0.0f))));
            _mm_storeu_si128((__m128i *)(q + 32 * b + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
        }
    }
}

TARGET_VNNI static void quantize_q8_k_avx512(const float *x, int cols, int8_t *q, float *d, int16_t *bsums) {
    for (int b = 0; b < cols / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t *qb = q + 256 * b;
        __m512 m = _mm512_setzero_ps();
        int bad = 0;
        for (int k = 0; k < 16; k++) {
            __m512 v = _mm512_loadu_ps(xb + 16 * k);
            bad |= _mm512_fpclass_ps_mask(v, 0x99);
            m = _mm512_max_ps(m, _mm512_abs_ps(v));
        }
        float amax = _mm512_reduce_max_ps(m);
        if (amax == 0.f || bad) {
            d[b] = bad ? NAN : 0.f;
            memset(qb, 0, 256);
            for (int g = 0; g < 16; g++) bsums[16 * b + g] = 0;
            continue;
        }
        float mx = 0.f; /* the first value of largest magnitude, as the scalar scan keeps it */
        __m512 av = _mm512_set1_ps(amax);
        for (int k = 0; k < 16; k++) {
            __mmask16 e = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * k)), av, _CMP_EQ_OQ);
            if (e) { mx = xb[16 * k + __builtin_ctz(e)]; break; }
        }
        float iscale = -127.f / mx;
        __m512 isv = _mm512_set1_ps(iscale), magic = _mm512_set1_ps(12582912.f);
        for (int k = 0; k < 16; k++) {
            __m512i i = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(isv, _mm512_loadu_ps(xb + 16 * k)), magic));
            i = _mm512_sub_epi32(_mm512_and_si512(i, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x00400000));
            i = _mm512_min_epi32(i, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(qb + 16 * k), _mm512_cvtepi32_epi8(i));
            bsums[16 * b + k] = (int16_t)_mm512_reduce_add_epi32(i);
        }
        d[b] = 1.f / iscale;
    }
}

/* Four 512-bit registers of per-dword partials (two blocks each, 2k and 2k+1) -> one register whose
 * 128-bit lanes hold the partial sums of blocks [0,2,4,6], [0,2,4,6], [1,3,5,7], [1,3,5,7]. */
TARGET_VNNI static inline __m512i q8_0_fold4(const __m512i p[4]) {
    __m512i q0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    __m512i q1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(q0, q1), _mm512_unpackhi_epi64(q0, q1));
}

TARGET_VNNI static inline __m512i q8_0_pair_vnni(const uint8_t *wb, __m512i xq) {
    __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb + 2))),
                                    _mm256_loadu_si256((const __m256i *)(wb + 36)), 1);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(wq, _mm512_set1_epi8((char)0x80)), xq);
}

TARGET_VNNI static float dot_q8_0_vnni(const uint8_t *w, const int8_t *qx, const float *dxp, const void *aux, int cols) {
    const int32_t *bias = (const int32_t *)aux;
    const int nb = cols / 32;
    const __m512i gidx16 = _mm512_setr_epi32(0, 68, 136, 204, 34, 102, 170, 238,
                                             272, 340, 408, 476, 306, 374, 442, 510); /* 34 * SIGMA, +8 */
    const __m256i gidx8 = _mm512_castsi512_si256(gidx16);
    __m256 acc = _mm256_setzero_ps();
    int b = 0;
    for (; b + 16 <= nb; b += 16) {
        __m512i p[8];
        for (int k = 0; k < 8; k++) p[k] = q8_0_pair_vnni(w + 34 * (b + 2 * k), _mm512_loadu_si512((const void *)(qx + 32 * (b + 2 * k))));
        __m512i r0 = q8_0_fold4(p), r1 = q8_0_fold4(p + 4);
        __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, 0x88), _mm512_shuffle_i32x4(r0, r1, 0xDD));
        s = _mm512_sub_epi32(s, _mm512_loadu_si512((const void *)(bias + b)));
        __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(gidx16, (const void *)(w + 34 * b), 1)));
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_loadu_ps(dxp + b)));
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(t));
        acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(t, 1));
    }
    if (b + 8 <= nb) {
        __m512i p[4];
        for (int k = 0; k < 4; k++) p[k] = q8_0_pair_vnni(w + 34 * (b + 2 * k), _mm512_loadu_si512((const void *)(qx + 32 * (b + 2 * k))));
        __m512i r = q8_0_fold4(p);
        r = _mm512_add_epi32(r, _mm512_shuffle_i32x4(r, r, 0xB1));
        __m256i s = _mm512_castsi512_si256(_mm512_shuffle_i32x4(r, r, 0x08));
        s = _mm256_sub_epi32(s, _mm256_loadu_si256((const __m256i *)(bias + b)));
        __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_i32gather_epi32((const int *)(w + 34 * b), gidx8, 1)));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_loadu_ps(dxp + b))));
        b += 8;
    }
    float perm[8], a8[8];
    _mm256_storeu_ps(perm, acc);
    for (int i = 0; i < 8; i++) a8[SIGMA[i]] = perm[i];
    for (; b < nb; b++) q8_0_block_scalar(w + 34 * b, qx + 32 * b, dxp, b, a8); /* dxp is dx past the groups */
    return reduce8(a8);
}

/* dot_q8_0_vnni on four consecutive rows (row stride rb bytes): the activation loads are shared and
 * the four rows stream side by side (four prefetch streams instead of one); per row the same terms
 * in the same order (bit-identical). */
TARGET_VNNI static void dot4_q8_0_vnni(const uint8_t *w, size_t rb, const int8_t *qx, const float *dxp,
                                       const void *aux, int cols, long pf, float *out) {
    const int32_t *bias = (const int32_t *)aux;
    const int nb = cols / 32;
    const __m512i gidx16 = _mm512_setr_epi32(0, 68, 136, 204, 34, 102, 170, 238,
                                             272, 340, 408, 476, 306, 374, 442, 510);
    const __m256i gidx8 = _mm512_castsi512_si256(gidx16);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int b = 0;
    for (; b + 16 <= nb; b += 16) {
        __m512i x[8];
        for (int k = 0; k < 8; k++) x[k] = _mm512_loadu_si512((const void *)(qx + 32 * (b + 2 * k)));
        const __m512i bv = _mm512_loadu_si512((const void *)(bias + b));
        const __m512 dxv = _mm512_loadu_ps(dxp + b);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rb + 34 * b;
            prefetch_l2(wr, pf, 544);
            __m512i p[8];
            for (int k = 0; k < 8; k++) p[k] = q8_0_pair_vnni(wr + 68 * k, x[k]);
            __m512i r0 = q8_0_fold4(p), r1 = q8_0_fold4(p + 4);
            __m512i sv = _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, 0x88), _mm512_shuffle_i32x4(r0, r1, 0xDD));
            sv = _mm512_sub_epi32(sv, bv);
            __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(gidx16, (const void *)wr, 1)));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(sv), _mm512_mul_ps(dw, dxv));
            acc[r] = _mm256_add_ps(acc[r], _mm512_castps512_ps256(t));
            acc[r] = _mm256_add_ps(acc[r], _mm512_extractf32x8_ps(t, 1));
        }
    }
    if (b + 8 <= nb) {
        __m512i x[4];
        for (int k = 0; k < 4; k++) x[k] = _mm512_loadu_si512((const void *)(qx + 32 * (b + 2 * k)));
        const __m256i bv = _mm256_loadu_si256((const __m256i *)(bias + b));
        const __m256 dxv = _mm256_loadu_ps(dxp + b);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rb + 34 * b;
            prefetch_l2(wr, pf, 272);
            __m512i p[4];
            for (int k = 0; k < 4; k++) p[k] = q8_0_pair_vnni(wr + 68 * k, x[k]);
            __m512i f = q8_0_fold4(p);
            f = _mm512_add_epi32(f, _mm512_shuffle_i32x4(f, f, 0xB1));
            __m256i sv = _mm256_sub_epi32(_mm512_castsi512_si256(_mm512_shuffle_i32x4(f, f, 0x08)), bv);
            __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_i32gather_epi32((const int *)wr, gidx8, 1)));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(sv), _mm256_mul_ps(dw, dxv)));
        }
        b += 8;
    }
    for (int r = 0; r < 4; r++) {
        float perm[8], a8[8];
        _mm256_storeu_ps(perm, acc[r]);
        for (int i = 0; i < 8; i++) a8[SIGMA[i]] = perm[i];
        for (int bb = b; bb < nb; bb++) q8_0_block_scalar(w + r * rb + 34 * bb, qx + 32 * bb, dxp, bb, a8);
        out[r] = reduce8(a8);
    }
}

/* One Q4_K super-block of one row: sumi = sum_j sc_j * (q_j . x_j), mins = sum_j mn_j * (x_j group sums). */
TARGET_AVX2 static inline void q4_k_sums_avx2(const uint8_t *blk, const int8_t *q8, const int16_t *bsb,
                                               int32_t *sumi, int32_t *mins) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t *qs = blk + 16;
    __m256i vacc = _mm256_setzero_si256();
    int32_t mn = 0;
    for (int p = 0; p < 4; p++) {
        int sc0, mn0, sc1, mn1;
        q4k_scale_min(blk + 4, 2 * p, &sc0, &mn0);
        q4k_scale_min(blk + 4, 2 * p + 1, &sc1, &mn1);
        mn += mn0 * (bsb[4 * p] + bsb[4 * p + 1]) + mn1 * (bsb[4 * p + 2] + bsb[4 * p + 3]);
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * p));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(q8 + 64 * p + 32));
        vacc = _mm256_add_epi32(vacc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_set1_epi16((short)sc0)));
        vacc = _mm256_add_epi32(vacc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), _mm256_set1_epi16((short)sc1)));
    }
    HSUM_EPI32(vacc, *sumi);
    *mins = mn;
}

TARGET_AVX2 static float dot_q4_k_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    const int16_t *bs = (const int16_t *)aux;
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 144 * b;
        int32_t sumi, mins;
        q4_k_sums_avx2(blk, qx + 256 * b, bs + 16 * b, &sumi, &mins);
        acc = acc + (f16(blk) * dx[b]) * (float)sumi;
        acc = acc - (f16(blk + 2) * dx[b]) * (float)mins;
    }
    return acc;
}

/* dot_q4_k_avx2 on four consecutive rows side by side, the float accumulators as vector lanes. */
TARGET_AVX2 static void dot4_q4_k_avx2(const uint8_t *w, size_t rb, const int8_t *qx, const float *dx,
                                       const void *aux, int cols, long pf, float *out) {
    const int16_t *bs = (const int16_t *)aux;
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *b0 = w + 144 * b;
        int32_t sumi[4], mins[4];
        for (int r = 0; r < 4; r++) {
            prefetch_l2(b0 + r * rb, pf, 144);
            q4_k_sums_avx2(b0 + r * rb, qx + 256 * b, bs + 16 * b, sumi + r, mins + r);
        }
        __m128 d = _mm_setr_ps(f16(b0), f16(b0 + rb), f16(b0 + 2 * rb), f16(b0 + 3 * rb));
        __m128 dm = _mm_setr_ps(f16(b0 + 2), f16(b0 + rb + 2), f16(b0 + 2 * rb + 2), f16(b0 + 3 * rb + 2));
        __m128 dxv = _mm_set1_ps(dx[b]);
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, dxv), _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)sumi))));
        acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(dm, dxv), _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)mins))));
    }
    _mm_storeu_ps(out, acc);
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
TARGET_VNNI static float dot_q4_k_vnni(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    const int16_t *bs = (const int16_t *)aux;
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

/* Four rows' 512-bit int32 partials -> their four sums, row order (transpose-add, exact). */
TARGET_VNNI static inline __m128i hsum4_rows(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* dot_q4_k_vnni on four consecutive rows (row stride rb bytes) at once: the activation loads, the
 * Q4_K scale unpacking (one 128-bit lane per row) and the block sums' reduction are shared, and
 * each row's float accumulator is one lane of a vector. Per row, the same integer sums and the same
 * float operations in the same order as the one-row kernels. */
TARGET_VNNI static void dot4_q4_k_vnni(const uint8_t *w, size_t rb, const int8_t *qx, const float *dx,
                                       const void *aux, int cols, long pf, float *out) {
    const int16_t *bs = (const int16_t *)aux;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i idx[4]; /* as dot_q4_k_vnni */
    for (int k = 0; k < 4; k++) {
        int8_t t[64];
        for (int l = 0; l < 64; l++) t[l] = (l & 1) ? (int8_t)0x80 : (int8_t)(4 * (k >> 1) + (k & 1) + 2 * (l / 32));
        idx[k] = _mm512_loadu_si512((const void *)t);
    }
    /* q4k_unpack_scales on the dwords [d|dmin, s0, s1, s2] of every lane: u = (A >> sh & mask) | ((B >> 6 & m2) << 4)
     * with A = [s0, s2, s1, s2], B = [., s0, ., s1] */
    const __m512i sh = _mm512_set4_epi32(4, 0, 0, 0), mask = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
    const __m512i m2 = _mm512_set4_epi32(0x03030303, 0, 0x03030303, 0), dsel = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i deint = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *b0 = w + 144 * b;
        const int8_t *q8 = qx + 256 * b;
        for (int r = 0; r < 4; r++) prefetch_l2(b0 + r * rb, pf, 144);
        __m512i hd = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b0));
        hd = _mm512_inserti32x4(hd, _mm_loadu_si128((const __m128i *)(b0 + rb)), 1);
        hd = _mm512_inserti32x4(hd, _mm_loadu_si128((const __m128i *)(b0 + 2 * rb)), 2);
        hd = _mm512_inserti32x4(hd, _mm_loadu_si128((const __m128i *)(b0 + 3 * rb)), 3);
        __m512i A = _mm512_shuffle_epi32(hd, (_MM_PERM_ENUM)0xED), B = _mm512_shuffle_epi32(hd, (_MM_PERM_ENUM)0xA5);
        __m512i u = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(A, sh), mask),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(B, 6), m2), 4));
        __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(bs + 16 * b)),
                                       _mm_loadu_si128((const __m128i *)(bs + 16 * b + 8)));
        __m512i mp = _mm512_madd_epi16(_mm512_unpackhi_epi8(u, _mm512_setzero_si512()), _mm512_broadcast_i32x4(pairs));
        mp = _mm512_add_epi32(mp, _mm512_shuffle_epi32(mp, (_MM_PERM_ENUM)0x4E));
        mp = _mm512_add_epi32(mp, _mm512_shuffle_epi32(mp, (_MM_PERM_ENUM)0xB1));
        __m128i mins = _mm512_castsi512_si128(_mm512_permutexvar_epi32(dsel, mp));
        __m512i x[4];
        for (int k = 0; k < 4; k++) x[k] = _mm512_loadu_si512((const void *)(q8 + 64 * k));
        __m512i vacc[4];
        const __m512i sc[4] = {_mm512_shuffle_i32x4(u, u, 0x00), _mm512_shuffle_i32x4(u, u, 0x55),
                               _mm512_shuffle_i32x4(u, u, 0xAA), _mm512_shuffle_i32x4(u, u, 0xFF)};
        for (int r = 0; r < 4; r++) {
            const uint8_t *qs = b0 + r * rb + 16;
            vacc[r] = _mm512_setzero_si512();
            for (int pp = 0; pp < 2; pp++) {
                __m512i q = _mm512_loadu_si512((const void *)(qs + 64 * pp));
                __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                vacc[r] = _mm512_dpwssd_epi32(vacc[r], _mm512_maddubs_epi16(lo, x[2 * pp]), _mm512_shuffle_epi8(sc[r], idx[2 * pp]));
                vacc[r] = _mm512_dpwssd_epi32(vacc[r], _mm512_maddubs_epi16(hi, x[2 * pp + 1]),
                                              _mm512_shuffle_epi8(sc[r], idx[2 * pp + 1]));
            }
        }
        __m128i sumi = hsum4_rows(vacc[0], vacc[1], vacc[2], vacc[3]);
        __m256 dm = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(dsel, hd))), deint);
        __m128 dxv = _mm_set1_ps(dx[b]);
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(_mm256_castps256_ps128(dm), dxv), _mm_cvtepi32_ps(sumi)));
        acc = _mm_sub_ps(acc, _mm_mul_ps(_mm_mul_ps(_mm256_extractf128_ps(dm, 1), dxv), _mm_cvtepi32_ps(mins)));
    }
    _mm_storeu_ps(out, acc);
}

/* Q6_K: quants taken unsigned (0..63) for maddubs; the -32 offset comes back through the Q8_K
 * group sums: sum sc*(q-32)*x = sum sc*q*x - 32 * sum_g sc_g*bsums_g. */
/* One Q6_K super-block of one row: its integer sum, offset included. */
TARGET_AVX2 static inline int32_t q6_k_sum_avx2(const uint8_t *blk, const int8_t *q8, const int16_t *bsb) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const int8_t *sc = (const int8_t *)(blk + 192);
    __m256i vacc = _mm256_setzero_si256();
    int32_t off = 0;
    for (int g = 0; g < 16; g++) off += sc[g] * bsb[g];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        const int8_t *x = q8 + 128 * h;
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
        for (int k = 0; k < 4; k++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * k));
            __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * k + 1]), _mm_set1_epi16(sc[8 * h + 2 * k]));
            vacc = _mm256_add_epi32(vacc, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), s16));
        }
    }
    int32_t sumi;
    HSUM_EPI32(vacc, sumi);
    return sumi - 32 * off;
}

TARGET_AVX2 static float dot_q6_k_avx2(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    const int16_t *bs = (const int16_t *)aux;
    float acc = 0.f;
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *blk = w + 210 * b;
        acc = acc + (f16(blk + 208) * dx[b]) * (float)q6_k_sum_avx2(blk, qx + 256 * b, bs + 16 * b);
    }
    return acc;
}

/* dot_q6_k_avx2 on four consecutive rows side by side, the float accumulators as vector lanes. */
TARGET_AVX2 static void dot4_q6_k_avx2(const uint8_t *w, size_t rb, const int8_t *qx, const float *dx,
                                       const void *aux, int cols, long pf, float *out) {
    const int16_t *bs = (const int16_t *)aux;
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *b0 = w + 210 * b;
        int32_t sumi[4];
        for (int r = 0; r < 4; r++) {
            prefetch_l2(b0 + r * rb, pf, 210);
            sumi[r] = q6_k_sum_avx2(b0 + r * rb, qx + 256 * b, bs + 16 * b);
        }
        __m128 d = _mm_setr_ps(f16(b0 + 208), f16(b0 + rb + 208), f16(b0 + 2 * rb + 208), f16(b0 + 3 * rb + 208));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, _mm_set1_ps(dx[b])), _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)sumi))));
    }
    _mm_storeu_ps(out, acc);
}

/* VNNI, 512-bit: quants of 64 consecutive values per register, per-16 scales by an int16 permute. */
TARGET_VNNI static float dot_q6_k_vnni(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) {
    const int16_t *bs = (const int16_t *)aux;
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
/* dot_q6_k_vnni on four consecutive rows (row stride rb bytes), sharing the activation loads and
 * the block sums' reduction; each row's float accumulator is one vector lane (bit-identical). */
TARGET_VNNI static void dot4_q6_k_vnni(const uint8_t *w, size_t rb, const int8_t *qx, const float *dx,
                                       const void *aux, int cols, long pf, float *out) {
    const int16_t *bs = (const int16_t *)aux;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    __m512i idx[4]; /* as dot_q6_k_vnni */
    for (int k = 0; k < 4; k++) {
        int16_t t[32];
        for (int l = 0; l < 32; l++) t[l] = (int16_t)(4 * (k & 1) + 8 * (k >> 1) + l / 8);
        idx[k] = _mm512_loadu_si512((const void *)t);
    }
    const __m128i rows = _mm_setr_epi32(0, (int)rb, (int)(2 * rb), (int)(3 * rb));
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < cols / 256; b++) {
        const uint8_t *b0 = w + 210 * b;
        const int8_t *q8 = qx + 256 * b;
        __m512i x[4];
        for (int k = 0; k < 4; k++) x[k] = _mm512_loadu_si512((const void *)(q8 + 64 * k));
        __m256i bsv = _mm256_loadu_si256((const __m256i *)(bs + 16 * b));
        __m512i vacc[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = b0 + r * rb;
            prefetch_l2(blk, pf, 210);
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            __m512i scales = _mm512_castsi256_si512(sc16);
            __m256i off = _mm256_madd_epi16(sc16, bsv);
            vacc[r] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
            for (int h = 0; h < 2; h++) {
                __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
                __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), hb, 1);
                __m512i q01 = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi64(hh, shl), m30));
                __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi64(l, 4), m4),
                                              _mm512_and_si512(_mm512_srlv_epi64(hh, shr), m30));
                vacc[r] = _mm512_dpwssd_epi32(vacc[r], _mm512_maddubs_epi16(q01, x[2 * h]),
                                              _mm512_permutexvar_epi16(idx[2 * h], scales));
                vacc[r] = _mm512_dpwssd_epi32(vacc[r], _mm512_maddubs_epi16(q23, x[2 * h + 1]),
                                              _mm512_permutexvar_epi16(idx[2 * h + 1], scales));
            }
        }
        __m128i sumi = hsum4_rows(vacc[0], vacc[1], vacc[2], vacc[3]);
        /* d of every row: the dword at 206 (two scale bytes, then d) stays inside the block */
        __m128i dh = _mm_srli_epi32(_mm_i32gather_epi32((const int *)(b0 + 206), rows, 1), 16);
        __m128 d = _mm_cvtph_ps(_mm_cvtepi32_epi16(dh));
        acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, _mm_set1_ps(dx[b])), _mm_cvtepi32_ps(sumi)));
    }
    _mm_storeu_ps(out, acc);
}
#endif /* TK_X86 */

/* ---------------------------------------------------------------- dispatch */

typedef float (*dot_fn)(const uint8_t *, const int8_t *, const float *, const void *, int);

static int isa_supported(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#if TK_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2");
    if (isa == ISA_AVX512VNNI)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c") &&
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

/* Four rows at once (row stride in bytes; out[0..3]), where a path has it; NULL otherwise. */
typedef void (*dot4_fn)(const uint8_t *, size_t, const int8_t *, const float *, const void *, int, long, float *);

static dot4_fn pick4(int qtype, int isa) {
#if TK_X86
    static const dot4_fn avx2[3] = {dot4_q8_0_avx2, dot4_q4_k_avx2, dot4_q6_k_avx2};
    static const dot4_fn vnni[3] = {dot4_q8_0_vnni, dot4_q4_k_vnni, dot4_q6_k_vnni};
    if (isa == ISA_AVX512VNNI) return vnni[qtype];
    if (isa == ISA_AVX2) return avx2[qtype];
#endif
    (void)qtype; (void)isa;
    return NULL;
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
    /* per row: Q8_K group sums (int16, cols / 16) or the VNNI Q8_0 block sums (int32, cols / 32) */
    int16_t *bs = malloc(sizeof(int16_t) * ((size_t)n * (cols / 16) + 1));
    float *dxq = malloc(sizeof(float) * ((size_t)nb + 1));
    if (!qx || !dx || !bs || !dxq) { free(qx); free(dx); free(bs); free(dxq); return -1; }
    for (int i = 0; i < n; i++) {
        int8_t *qi = qx + (size_t)i * cols;
        float *di = dx + (size_t)i * nb;
#if TK_X86
        if (isa == ISA_AVX512VNNI) {
            if (qt == 0) quantize_q8_0_avx512(x + (size_t)i * cols, cols, qi, di);
            else quantize_q8_k_avx512(x + (size_t)i * cols, cols, qi, di, bs + (size_t)i * (cols / 16));
        } else
#endif
        if (qt == 0) quantize_q8_0(x + (size_t)i * cols, cols, qi, di);
        else quantize_q8_k(x + (size_t)i * cols, cols, qi, di, bs + (size_t)i * (cols / 16));
        if (qt == 1 && isa == ISA_AVX512VNNI) q4k_vnni_order(qi, cols);
        if (qt == 0 && isa == ISA_AVX512VNNI) {
            q8_0_vnni_prepare(qi, di, cols, dxq, (int32_t *)(bs + (size_t)i * (cols / 16)));
            memcpy(di, dxq, sizeof(float) * nb);
        }
    }
    dot_fn dot = pick(qt, isa);
    dot4_fn dot4 = pick4(qt, isa);
#if TK_X86
    long pf = PF_BYTES;
#else
    long pf = 0;
#endif
    int ntasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ntasks) nthreads = ntasks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int t = 0; t < ntasks; t++) {
        int r1 = (t + 1) * ROWS_PER_TASK < rows ? (t + 1) * ROWS_PER_TASK : rows;
        for (int r = t * ROWS_PER_TASK; r < r1;) {
            if (dot4 && r + 4 <= r1) {
                for (int i = 0; i < n; i++) {
                    float o[4];
                    dot4(W + (size_t)r * rb, rb, qx + (size_t)i * cols, dx + (size_t)i * nb, bs + (size_t)i * (cols / 16), cols,
                         i == 0 ? pf : 0, o);
                    memcpy(y + (size_t)i * rows + r, o, sizeof o);
                }
                r += 4;
            } else {
                for (int i = 0; i < n; i++)
                    y[(size_t)i * rows + r] = dot(W + (size_t)r * rb, qx + (size_t)i * cols, dx + (size_t)i * nb,
                                                  bs + (size_t)i * (cols / 16), cols);
                r++;
            }
        }
    }
    free(qx); free(dx); free(bs); free(dxq);
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
