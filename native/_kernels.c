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
 * (built with -ffp-contract=off: no FMA contraction), so the portable, AVX2, AVX-VNNI, AVX-512 VNNI,
 * NEON and NEON-dotprod paths are bit-identical.
 *
 * Q8_0 float order: block b's term (float)sumi_b * (d_w,b * d_x,b) is added to lane b % 8 of eight
 * accumulators; the lanes are summed as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).
 * K-quant float order: per super-block s, acc += d_s*(float)sumi_s (Q4_K then acc -= dmin_s*(float)mins_s).
 *
 * The x86 paths read the x8 layout (pack_x8, made once per matrix at load time): rows interleaved in
 * groups of eight, so one broadcast activation load feeds eight rows, and a tile of eight weight rows
 * x up to eight activation rows unpacks each weight register once (x8_kernels.h, included once per
 * path). The portable and NEON paths read the GGUF bytes one row at a time. Neither depends on the
 * batch: a row's result is the same alone or among any neighbours, on any thread count.
 */
#ifndef TK_NO_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
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
#include <cpuid.h>
#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define TARGET_AVXVNNI __attribute__((target("avx2,f16c,avxvnni")))
#define TARGET_VNNI __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
/* AVX-VNNI (VEX-encoded vpdpbusd / vpdpwssd on 256-bit registers): CPUID.(EAX=7,ECX=1):EAX bit 4. */
static int cpu_has_avxvnni(void) {
    static int known = -1; /* cached: cpuid traps to the hypervisor in a VM (tens of microseconds measured) */
    if (known < 0) {
        unsigned a, b, c, d;
        known = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
    }
    return known;
}
#else
#define TK_X86 0
#endif
#if defined(__aarch64__)
#define TK_ARM 1
#include <arm_neon.h>
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#else
#define TK_ARM 0
#endif

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512VNNI = 3, ISA_NEON = 4, ISA_NEONDOT = 5, N_ISA = 6 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avxvnni", "avx512vnni", "neon", "neondot"};
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


/* ---------------------------------------------------------------- x8 layout (x86 SIMD paths)
 *
 * At load time (pack_x8) the rows of a GGUF matrix are interleaved in groups of eight: per group
 * and per block, the eight rows' scales side by side (Q4_K's 6-bit scales and mins unpacked to one
 * byte each), then the quants in chunks of eight bytes, the eight rows' chunk c next to each other.
 * A group past the last row is zero-padded (scale 0). Sizes per group and block: */
#define X8_Q80 272  /* d f16[8] | qs: 4 chunks x 8 rows x 8 B                                       (8 x 34) */
#define X8_Q4K 1184 /* d f16[8] | dmin f16[8] | sc u8[8][8] | mn u8[8][8] | qs: 16 x 8 x 8 B        (8 x 144 + 32) */
#define X8_Q6K 1680 /* d f16[8] | sc s8[16][8] | ql: 2 halves x 2 parts x 4 x 8 x 8 B | qh: 2 x 4 x 8 x 8 B (8 x 210) */
static const int QK[3] = {32, 256, 256}, QBYTES[3] = {34, 144, 210}, X8BYTES[3] = {X8_Q80, X8_Q4K, X8_Q6K};

static size_t x8_size(int qt, int rows, int cols) {
    return (size_t)((rows + 7) / 8) * (size_t)(cols / QK[qt]) * (size_t)X8BYTES[qt];
}

static void pack_x8(int qt, const uint8_t *src, int rows, int cols, uint8_t *dst) {
    const int nb = cols / QK[qt];
    const size_t rb = (size_t)nb * QBYTES[qt];
    memset(dst, 0, x8_size(qt, rows, cols));
    for (int g = 0; g < (rows + 7) / 8; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = dst + ((size_t)g * nb + b) * X8BYTES[qt];
            for (int r = 0; r < 8 && 8 * g + r < rows; r++) {
                const uint8_t *s = src + (size_t)(8 * g + r) * rb + (size_t)b * QBYTES[qt];
                if (qt == 0) {
                    memcpy(o + 2 * r, s, 2);
                    for (int c = 0; c < 4; c++) memcpy(o + 16 + 64 * c + 8 * r, s + 2 + 8 * c, 8);
                } else if (qt == 1) {
                    memcpy(o + 2 * r, s, 2);
                    memcpy(o + 16 + 2 * r, s + 2, 2);
                    for (int j = 0; j < 8; j++) {
                        int sc, mn;
                        q4k_scale_min(s + 4, j, &sc, &mn);
                        o[32 + 8 * j + r] = (uint8_t)sc;
                        o[96 + 8 * j + r] = (uint8_t)mn;
                    }
                    for (int c = 0; c < 16; c++) memcpy(o + 160 + 64 * c + 8 * r, s + 16 + 8 * c, 8);
                } else {
                    memcpy(o + 2 * r, s + 208, 2);
                    for (int k = 0; k < 16; k++) o[16 + 8 * k + r] = s[192 + k];
                    for (int h = 0; h < 2; h++)
                        for (int c = 0; c < 2; c++)
                            for (int m = 0; m < 4; m++)
                                memcpy(o + 144 + ((h * 2 + c) * 4 + m) * 64 + 8 * r, s + 64 * h + 32 * c + 8 * m, 8);
                    for (int h = 0; h < 2; h++)
                        for (int m = 0; m < 4; m++) memcpy(o + 1168 + (h * 4 + m) * 64 + 8 * r, s + 128 + 32 * h + 8 * m, 8);
                }
            }
        }
}

/* The inverse of pack_x8: the GGUF rows back from the x8 layout, byte for byte (the layout keeps
 * every bit of a block: Q4_K's twelve scale bytes are exactly its eight 6-bit scales and mins). */
static void unpack_x8(int qt, const uint8_t *src, int rows, int cols, uint8_t *dst) {
    const int nb = cols / QK[qt];
    const size_t rb = (size_t)nb * QBYTES[qt];
    for (int g = 0; g < (rows + 7) / 8; g++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *o = src + ((size_t)g * nb + b) * X8BYTES[qt];
            for (int r = 0; r < 8 && 8 * g + r < rows; r++) {
                uint8_t *s = dst + (size_t)(8 * g + r) * rb + (size_t)b * QBYTES[qt];
                if (qt == 0) {
                    memcpy(s, o + 2 * r, 2);
                    for (int c = 0; c < 4; c++) memcpy(s + 2 + 8 * c, o + 16 + 64 * c + 8 * r, 8);
                } else if (qt == 1) {
                    memcpy(s, o + 2 * r, 2);
                    memcpy(s + 2, o + 16 + 2 * r, 2);
                    uint8_t *sc12 = s + 4;
                    for (int j = 0; j < 4; j++) {
                        int sc = o[32 + 8 * j + r], mn = o[96 + 8 * j + r], sc4 = o[32 + 8 * (j + 4) + r], mn4 = o[96 + 8 * (j + 4) + r];
                        sc12[j] = (uint8_t)(sc | ((sc4 >> 4) << 6));
                        sc12[j + 4] = (uint8_t)(mn | ((mn4 >> 4) << 6));
                        sc12[j + 8] = (uint8_t)((sc4 & 0x0F) | ((mn4 & 0x0F) << 4));
                    }
                    for (int c = 0; c < 16; c++) memcpy(s + 16 + 8 * c, o + 160 + 64 * c + 8 * r, 8);
                } else {
                    memcpy(s + 208, o + 2 * r, 2);
                    for (int k = 0; k < 16; k++) s[192 + k] = o[16 + 8 * k + r];
                    for (int h = 0; h < 2; h++)
                        for (int c = 0; c < 2; c++)
                            for (int m = 0; m < 4; m++)
                                memcpy(s + 64 * h + 32 * c + 8 * m, o + 144 + ((h * 2 + c) * 4 + m) * 64 + 8 * r, 8);
                    for (int h = 0; h < 2; h++)
                        for (int m = 0; m < 4; m++) memcpy(s + 128 + 32 * h + 8 * m, o + 1168 + (h * 4 + m) * 64 + 8 * r, 8);
                }
            }
        }
}

static inline int64_t ld64(const void *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline int32_t ld32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* ---------------------------------------------------------------- x86 SIMD paths */
#if TK_X86
/* Software prefetch of the weight stream into L2, PF_BYTES ahead (pf = 0: off). The hardware
 * prefetchers alone left a one-row-at-a-time pass over weights in L3 or memory at about half of
 * numpy's GEMV bandwidth on the AVX-512 VNNI Xeon (bench_expert.py, batch 1). */
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif
static inline void tk_prefetch(const uint8_t *p, long pf, int nbytes) {
    if (!pf) return;
    for (int o = 0; o < nbytes; o += 64) _mm_prefetch((const char *)p + pf + o, _MM_HINT_T1);
}
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


/* quantize_q8_0 and quantize_q8_k in 256-bit registers for the AVX2 and AVX-VNNI paths: the same
 * float operations per value as the scalar code (and the 512-bit code above), so the same bytes,
 * scales and group sums. Non-finite: x - x is NaN exactly for NaN and infinity. */
TARGET_AVX2 static inline float tk_hmax_avx2(__m256 m) {
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

TARGET_AVX2 static void quantize_q8_0_avx2(const float *x, int cols, int8_t *q, float *d) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), half = _mm256_set1_ps(0.5f),
                 one = _mm256_set1_ps(1.0f), sgn = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < cols / 32; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        int bad = 0;
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(v[k], v[k]), v[k], _CMP_UNORD_Q));
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], absm));
        }
        float amax = tk_hmax_avx2(m);
        float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
        if (bad) { db = NAN; id = 0.f; }
        d[b] = db;
        __m256 idv = _mm256_set1_ps(id);
        __m256i r[4];
        for (int k = 0; k < 4; k++) {
            __m256 t0 = _mm256_mul_ps(v[k], idv);
            __m256 t = _mm256_round_ps(t0, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 up = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(t0, t), absm), half, _CMP_GE_OQ);
            __m256 rr = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(t0, sgn))));
            r[k] = _mm256_cvttps_epi32(rr);
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

TARGET_AVX2 static void quantize_q8_k_avx2(const float *x, int cols, int8_t *q, float *d, int16_t *bsums) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < cols / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t *qb = q + 256 * b;
        __m256 m = _mm256_setzero_ps();
        int bad = 0;
        for (int k = 0; k < 32; k++) {
            __m256 v = _mm256_loadu_ps(xb + 8 * k);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(v, v), v, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, _mm256_and_ps(v, absm));
        }
        float amax = tk_hmax_avx2(m);
        if (amax == 0.f || bad) {
            d[b] = bad ? NAN : 0.f;
            memset(qb, 0, 256);
            for (int g = 0; g < 16; g++) bsums[16 * b + g] = 0;
            continue;
        }
        float mx = 0.f; /* the first value of largest magnitude, as the scalar scan keeps it */
        __m256 av = _mm256_set1_ps(amax);
        for (int k = 0; k < 32; k++) {
            int e = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(xb + 8 * k), absm), av, _CMP_EQ_OQ));
            if (e) { mx = xb[8 * k + __builtin_ctz(e)]; break; }
        }
        float iscale = -127.f / mx;
        const __m256 isv = _mm256_set1_ps(iscale), magic = _mm256_set1_ps(12582912.f);
        const __m256i mant = _mm256_set1_epi32(0x007fffff), off = _mm256_set1_epi32(0x00400000), top = _mm256_set1_epi32(127);
        for (int g = 0; g < 8; g++) { /* 32 values: two groups of 16 */
            __m256i r[4];
            for (int k = 0; k < 4; k++) {
                __m256i i = _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(isv, _mm256_loadu_ps(xb + 32 * g + 8 * k)), magic));
                r[k] = _mm256_min_epi32(_mm256_sub_epi32(_mm256_and_si256(i, mant), off), top);
            }
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
            _mm256_storeu_si256((__m256i *)(qb + 32 * g), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            for (int h = 0; h < 2; h++) {
                __m256i s = _mm256_add_epi32(r[2 * h], r[2 * h + 1]);
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                t = _mm_hadd_epi32(t, t);
                t = _mm_hadd_epi32(t, t);
                bsums[16 * b + 2 * g + h] = (int16_t)_mm_cvtsi128_si32(t);
            }
        }
        d[b] = 1.f / iscale;
    }
}

/* Activation rows per tile: 16 (VEX) or 32 (EVEX) vector registers hold the partial sums. Q8_0 and
 * Q4_K run two on the VEX paths (a Zen 5 with TENZRO_KERNEL_ISA=avx2 / avxvnni, batch 8 to 512:
 * 5-16 % less time than four; Q6_K's four stay; llvm-mca skylake: the same cycles either way). */
#ifndef TK_TILE_256
#define TK_TILE_256 4
#endif
#define TK_SFX(name) name##_avx2
#define TK_TARGET TARGET_AVX2
#define TK_VNNI 0
#define TK_TILE TK_TILE_256
#define TK_TILE_Q80 2
#define TK_TILE_Q4K 2
#include "x8_kernels.h"
#undef TK_TILE_Q80
#undef TK_TILE_Q4K
#undef TK_SFX
#undef TK_TARGET
#undef TK_VNNI
#undef TK_TILE

#define TK_SFX(name) name##_avxvnni
#define TK_TARGET TARGET_AVXVNNI
#define TK_VNNI 1
#define TK_TILE TK_TILE_256
#define TK_TILE_Q80 2
#define TK_TILE_Q4K 2
#include "x8_kernels.h"
#undef TK_TILE_Q80
#undef TK_TILE_Q4K
#undef TK_SFX
#undef TK_TARGET
#undef TK_VNNI
#undef TK_TILE

#define TK_SFX(name) name##_vnni
#define TK_TARGET TARGET_VNNI
#define TK_VNNI 2
#ifndef TK_TILE_512
#define TK_TILE_512 8
#endif
#define TK_TILE TK_TILE_512
#define TK_TILE_Q80 4 /* as fast as eight, faster at batch 512 (fewer live pointers) */
#define TK_TILE_Q4K TK_TILE_512
#include "x8_kernels.h"
#undef TK_TILE_Q80
#undef TK_TILE_Q4K
#undef TK_SFX
#undef TK_TARGET
#undef TK_VNNI
#undef TK_TILE
#endif /* TK_X86 */

/* ---------------------------------------------------------------- ARM NEON path (GGUF layout, one row)
 *
 * The integer block sums with NEON (vdotq_s32 where the CPU has the dot-product extension, else
 * vmull_s8 + vpadalq_s16); every float operation is the portable path's, in its order. Tested bit
 * for bit against the golden vectors under qemu-user (tests/test_kernels_neon.py, native/neon_check.c). */
#if TK_ARM
#define TK_NEON_BODY(SFX, DOT16)                                                                       \
    static float dot_q8_0_##SFX(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) { \
        (void)aux;                                                                                     \
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                       \
        for (int b = 0; b < cols / 32; b++) {                                                          \
            const uint8_t *wb = w + 34 * b;                                                            \
            const int8_t *qw = (const int8_t *)(wb + 2), *x = qx + 32 * b;                             \
            int32x4_t s = vdupq_n_s32(0);                                                              \
            s = DOT16(s, vld1q_s8(qw), vld1q_s8(x));                                                   \
            s = DOT16(s, vld1q_s8(qw + 16), vld1q_s8(x + 16));                                         \
            acc[b & 7] = acc[b & 7] + (float)vaddvq_s32(s) * (f16(wb) * dx[b]);                        \
        }                                                                                              \
        return reduce8(acc);                                                                           \
    }                                                                                                  \
    static float dot_q4_k_##SFX(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) { \
        const int16_t *bs = (const int16_t *)aux;                                                      \
        const uint8x16_t m4 = vdupq_n_u8(0x0F);                                                        \
        float acc = 0.f;                                                                               \
        for (int b = 0; b < cols / 256; b++) {                                                         \
            const uint8_t *blk = w + 144 * b, *qs = blk + 16;                                          \
            const int8_t *q8 = qx + 256 * b;                                                           \
            const int16_t *bsb = bs + 16 * b;                                                          \
            int32_t sumi = 0, mins = 0;                                                                \
            for (int p = 0; p < 4; p++) {                                                              \
                int sc0, mn0, sc1, mn1;                                                                \
                q4k_scale_min(blk + 4, 2 * p, &sc0, &mn0);                                             \
                q4k_scale_min(blk + 4, 2 * p + 1, &sc1, &mn1);                                         \
                int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);                                    \
                for (int h = 0; h < 2; h++) {                                                          \
                    uint8x16_t q = vld1q_u8(qs + 32 * p + 16 * h);                                     \
                    lo = DOT16(lo, vreinterpretq_s8_u8(vandq_u8(q, m4)), vld1q_s8(q8 + 64 * p + 16 * h)); \
                    hi = DOT16(hi, vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), vld1q_s8(q8 + 64 * p + 32 + 16 * h)); \
                }                                                                                      \
                sumi += sc0 * vaddvq_s32(lo) + sc1 * vaddvq_s32(hi);                                   \
                mins += mn0 * (bsb[4 * p] + bsb[4 * p + 1]) + mn1 * (bsb[4 * p + 2] + bsb[4 * p + 3]); \
            }                                                                                          \
            acc = acc + (f16(blk) * dx[b]) * (float)sumi;                                              \
            acc = acc - (f16(blk + 2) * dx[b]) * (float)mins;                                          \
        }                                                                                              \
        return acc;                                                                                    \
    }                                                                                                  \
    static float dot_q6_k_##SFX(const uint8_t *w, const int8_t *qx, const float *dx, const void *aux, int cols) { \
        (void)aux;                                                                                     \
        const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);                                    \
        const int8x16_t m32 = vdupq_n_s8(32);                                                          \
        float acc = 0.f;                                                                               \
        for (int b = 0; b < cols / 256; b++) {                                                         \
            const uint8_t *blk = w + 210 * b;                                                          \
            const int8_t *sc = (const int8_t *)(blk + 192), *q8 = qx + 256 * b;                        \
            int32_t sumi = 0;                                                                          \
            for (int h = 0; h < 2; h++)                                                                \
                for (int g = 0; g < 2; g++) {                                                          \
                    const uint8_t *ql = blk + 64 * h + 16 * g, *qh = blk + 128 + 32 * h + 16 * g;      \
                    const int8_t *x = q8 + 128 * h + 16 * g;                                           \
                    uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 32), hb = vld1q_u8(qh);           \
                    uint8x16_t q[4] = {                                                                \
                        vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4)),                   \
                        vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4)),    \
                        vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4)),   \
                        vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))};                \
                    for (int k = 0; k < 4; k++) {                                                      \
                        int8x16_t qs = vsubq_s8(vreinterpretq_s8_u8(q[k]), m32);                       \
                        int32x4_t s = DOT16(vdupq_n_s32(0), qs, vld1q_s8(x + 32 * k));                 \
                        sumi += sc[8 * h + 2 * k + g] * vaddvq_s32(s);                                 \
                    }                                                                                  \
                }                                                                                      \
            acc = acc + (f16(blk + 208) * dx[b]) * (float)sumi;                                        \
        }                                                                                              \
        return acc;                                                                                    \
    }

static inline int32x4_t dot16_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}
TK_NEON_BODY(neon, dot16_neon)

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
static inline int32x4_t dot16_dotprod(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
TK_NEON_BODY(neondot, dot16_dotprod)
#pragma GCC pop_options
#endif /* TK_ARM */

/* ---------------------------------------------------------------- dispatch */

typedef float (*dot_fn)(const uint8_t *, const int8_t *, const float *, const void *, int);
/* One x8 row group x n activation rows (see x8_kernels.h). */
typedef void (*group_fn)(int, const uint8_t *, int, const int8_t *, const float *, const void *, int, float *, size_t);

static int isa_supported(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#if TK_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVXVNNI) return avx2 && cpu_has_avxvnni();
    if (isa == ISA_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
#if TK_ARM
    if (isa == ISA_NEON) return 1;
    if (isa == ISA_NEONDOT) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
    return 0;
}

/* Whether a path reads the x8 layout (else the GGUF bytes as they are). */
static int isa_x8(int isa) { return isa == ISA_AVX2 || isa == ISA_AVXVNNI || isa == ISA_AVX512VNNI; }

static dot_fn pick(int qtype, int isa) {
    static const dot_fn portable[3] = {dot_q8_0_portable, dot_q4_k_portable, dot_q6_k_portable};
#if TK_ARM
    static const dot_fn neon[3] = {dot_q8_0_neon, dot_q4_k_neon, dot_q6_k_neon};
    static const dot_fn neondot[3] = {dot_q8_0_neondot, dot_q4_k_neondot, dot_q6_k_neondot};
    if (isa == ISA_NEON) return neon[qtype];
    if (isa == ISA_NEONDOT) return neondot[qtype];
#endif
    (void)isa;
    return portable[qtype];
}

static group_fn pick_group(int isa) {
#if TK_X86
    if (isa == ISA_AVX2) return group_x8_avx2;
    if (isa == ISA_AVXVNNI) return group_x8_avxvnni;
    if (isa == ISA_AVX512VNNI) return group_x8_vnni;
#endif
    (void)isa;
    return NULL;
}

static int qtype_index(const char *q) {
    if (!strcmp(q, "q8_0")) return 0;
    if (!strcmp(q, "q4_k")) return 1;
    if (!strcmp(q, "q6_k")) return 2;
    return -1;
}

/* Bytes of W for a path: the x8 layout's or the GGUF rows'. */
static size_t weight_bytes(int qt, int isa, int rows, int cols) {
    return isa_x8(isa) ? x8_size(qt, rows, cols) : (size_t)rows * (cols / QK[qt]) * QBYTES[qt];
}

/* ys[k][n, rows] = dequant(Ws[k])[rows, cols] . quant(x)[n, cols]^T for k < nw (matrices of one
 * qtype and shape, e.g. an expert's gate and up projections): the activation rows are quantized
 * once, then each matrix is multiplied. W is in the path's layout (weight_bytes). Every row of y
 * depends on its own activation row only, and on no thread count. Returns -1 when out of memory. */
static int matmul_many(int qt, int isa, const uint8_t *const *Ws, int nw, int rows, int cols, const float *x, int n,
                       float *const *ys, int nthreads) {
    const int nb32 = cols / 32, nbk = cols / 256;
    int8_t *qx = malloc((size_t)n * cols + 1);
    float *dx = malloc(sizeof(float) * ((size_t)n * nb32 + 1));
    /* Q8_K group sums (int16 per 16 values), or the VNNI Q8_0 biases (int64 per 32: x8_kernels.h) */
    int16_t *bs = malloc(sizeof(int64_t) * ((size_t)n * nb32 + 1));
    int16_t *ps = malloc(sizeof(int16_t) * ((size_t)n * nb32 + 1));        /* Q4_K x8: sums of the 32-value subblocks */
    if (!qx || !dx || !bs || !ps) { free(qx); free(dx); free(bs); free(ps); return -1; }
    const int x8 = isa_x8(isa), vnni = isa == ISA_AVXVNNI || isa == ISA_AVX512VNNI;
    for (int i = 0; i < n; i++) {
        int8_t *qi = qx + (size_t)i * cols;
        float *di = dx + (size_t)i * nb32;
        int16_t *bi = bs + (size_t)i * (cols / 16);
#if TK_X86
        if (isa == ISA_AVX512VNNI) {
            if (qt == 0) quantize_q8_0_avx512(x + (size_t)i * cols, cols, qi, di);
            else quantize_q8_k_avx512(x + (size_t)i * cols, cols, qi, di, bi);
        } else if (isa == ISA_AVX2 || isa == ISA_AVXVNNI) {
            if (qt == 0) quantize_q8_0_avx2(x + (size_t)i * cols, cols, qi, di);
            else quantize_q8_k_avx2(x + (size_t)i * cols, cols, qi, di, bi);
        } else
#endif
        if (qt == 0) quantize_q8_0(x + (size_t)i * cols, cols, qi, di);
        else quantize_q8_k(x + (size_t)i * cols, cols, qi, di, bi);
        if (qt == 0 && vnni) {
            int64_t *bias = (int64_t *)bs + (size_t)i * nb32;
            for (int b = 0; b < nb32; b++) {
                int32_t s = 0;
                for (int j = 0; j < 32; j++) s += qi[32 * b + j];
                bias[b] = (int64_t)(uint32_t)(-128 * s); /* low dword -128 * sum, high dword 0 */
            }
        }
        if (qt == 1 && x8)
            for (int j = 0; j < 8 * nbk; j++) ps[(size_t)i * nb32 + j] = (int16_t)(bi[2 * j] + bi[2 * j + 1]);
    }
    int fail = 0;
    if (nthreads < 1) nthreads = 1;
    group_fn gfn = pick_group(isa);
    for (int k = 0; k < nw; k++) {
    const uint8_t *W = Ws[k];
    float *y = ys[k];
    if (x8 && gfn) {
        const int ngroups = (rows + 7) / 8;
        const size_t gbytes = (size_t)(cols / QK[qt]) * X8BYTES[qt];
        const void *aux = qt == 1 ? (const void *)ps : (const void *)bs;
        if (nthreads > ngroups) nthreads = ngroups;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int g = 0; g < ngroups; g++) {
            const uint8_t *wg = W + (size_t)g * gbytes;
            if (8 * g + 8 <= rows) {
                gfn(qt, wg, cols, qx, dx, aux, n, y + 8 * g, (size_t)rows);
            } else { /* the last, partial group: eight outputs per row into a scratch */
                float *t = malloc(sizeof(float) * (size_t)n * 8);
                if (!t) { fail = 1; continue; }
                gfn(qt, wg, cols, qx, dx, aux, n, t, 8);
                for (int i = 0; i < n; i++) memcpy(y + (size_t)i * rows + 8 * g, t + 8 * i, sizeof(float) * (rows - 8 * g));
                free(t);
            }
        }
    } else {
        dot_fn dot = pick(qt, isa);
        const size_t rb = (size_t)(cols / QK[qt]) * QBYTES[qt];
        if (nthreads > rows) nthreads = rows > 0 ? rows : 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < n; i++)
                y[(size_t)i * rows + r] = dot(W + (size_t)r * rb, qx + (size_t)i * cols, dx + (size_t)i * nb32,
                                              bs + (size_t)i * (cols / 16), cols);
    }
    }
    free(qx); free(dx); free(bs); free(ps);
    return fail ? -1 : 0;
}

static int matmul(int qt, int isa, const uint8_t *W, int rows, int cols, const float *x, int n, float *y, int nthreads) {
    return matmul_many(qt, isa, &W, 1, rows, cols, x, n, &y, nthreads);
}

/* The half -> float table and the best SIMD path of this CPU. */
static void tk_init(void) {
    for (int i = 0; i < 65536; i++) F16[i] = half_to_float((uint16_t)i);
    g_isa = ISA_PORTABLE;
    static const int best[] = {ISA_AVX512VNNI, ISA_AVXVNNI, ISA_AVX2, ISA_NEONDOT, ISA_NEON};
    for (int k = 0; k < 5; k++)
        if (isa_supported(best[k])) { g_isa = best[k]; break; }
}

static int isa_from_name(const char *s) {
    for (int i = 0; i < N_ISA; i++)
        if (!strcmp(s, ISA_NAMES[i])) return i;
    return -1;
}

#ifndef TK_NO_PYTHON
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

/* The ISA named by an optional argument (NULL: the process's), or -1 with ValueError set. */
static int isa_arg(const char *name) {
    if (!name) return g_isa;
    int isa = isa_from_name(name);
    if (isa < 0 || !isa_supported(isa)) {
        PyErr_Format(PyExc_ValueError, "ISA %s is not available on this CPU", name);
        return -1;
    }
    return isa;
}

#define TK_MANY 8 /* matrices one matmul_xt_many call takes */

static PyObject *py_matmul_xt(PyObject *self, PyObject *args) {
    const char *qtype, *isa_name = NULL;
    Py_buffer wb, xb, yb;
    int rows, cols, n, nthreads;
    if (!PyArg_ParseTuple(args, "sy*iiy*iw*i|z", &qtype, &wb, &rows, &cols, &xb, &n, &yb, &nthreads, &isa_name))
        return NULL;
    PyObject *ret = NULL;
    int qt = qtype_index(qtype), isa;
    if (qt < 0) { PyErr_Format(PyExc_ValueError, "qtype must be q8_0, q4_k or q6_k, got %s", qtype); goto done; }
    if ((isa = isa_arg(isa_name)) < 0) goto done;
    if (rows < 0 || n < 0 || cols <= 0 || cols % QK[qt]) {
        PyErr_Format(PyExc_ValueError, "cols must be a positive multiple of %d for %s, got %d", QK[qt], qtype, cols);
        goto done;
    }
    if ((size_t)wb.len != weight_bytes(qt, isa, rows, cols)) {
        PyErr_Format(PyExc_ValueError, "weights: %zd bytes, the %s layout of a %dx%d %s matrix has %zu (pack_x8 for the x86 SIMD paths)",
                     wb.len, isa_x8(isa) ? "x8" : "GGUF", rows, cols, qtype, weight_bytes(qt, isa, rows, cols));
        goto done;
    }
    if (xb.len != (Py_ssize_t)n * cols * 4 || yb.len != (Py_ssize_t)n * rows * 4) {
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

static PyObject *py_matmul_xt_many(PyObject *self, PyObject *args) {
    const char *qtype, *isa_name = NULL;
    PyObject *wseq, *yseq;
    Py_buffer xb;
    int rows, cols, n, nthreads;
    if (!PyArg_ParseTuple(args, "sOiiy*iOi|z", &qtype, &wseq, &rows, &cols, &xb, &n, &yseq, &nthreads, &isa_name))
        return NULL;
    PyObject *ret = NULL;
    Py_buffer wb[TK_MANY], yb[TK_MANY];
    int nw = 0, ny = 0;
    int qt = qtype_index(qtype), isa;
    if (qt < 0) { PyErr_Format(PyExc_ValueError, "qtype must be q8_0, q4_k or q6_k, got %s", qtype); goto done; }
    if ((isa = isa_arg(isa_name)) < 0) goto done;
    if (rows < 0 || n < 0 || cols <= 0 || cols % QK[qt]) {
        PyErr_Format(PyExc_ValueError, "cols must be a positive multiple of %d for %s, got %d", QK[qt], qtype, cols);
        goto done;
    }
    if (!PyTuple_Check(wseq) || !PyTuple_Check(yseq) || PyTuple_GET_SIZE(wseq) != PyTuple_GET_SIZE(yseq) ||
        PyTuple_GET_SIZE(wseq) < 1 || PyTuple_GET_SIZE(wseq) > TK_MANY) {
        PyErr_Format(PyExc_ValueError, "weights and out must be tuples of the same length, 1 to %d", TK_MANY);
        goto done;
    }
    if (xb.len != (Py_ssize_t)n * cols * 4) { PyErr_SetString(PyExc_ValueError, "x does not match n and cols"); goto done; }
    const uint8_t *W[TK_MANY];
    float *Y[TK_MANY];
    for (int k = 0; k < PyTuple_GET_SIZE(wseq); k++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(wseq, k), &wb[k], PyBUF_SIMPLE) < 0) goto done;
        nw++;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(yseq, k), &yb[k], PyBUF_WRITABLE) < 0) goto done;
        ny++;
        if ((size_t)wb[k].len != weight_bytes(qt, isa, rows, cols) || yb[k].len != (Py_ssize_t)n * rows * 4) {
            PyErr_Format(PyExc_ValueError, "weights %d: %zd bytes (the %s layout of a %dx%d %s matrix has %zu), or out of the wrong size",
                         k, wb[k].len, isa_x8(isa) ? "x8" : "GGUF", rows, cols, qtype, weight_bytes(qt, isa, rows, cols));
            goto done;
        }
        W[k] = wb[k].buf;
        Y[k] = yb[k].buf;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul_many(qt, isa, W, nw, rows, cols, xb.buf, n, Y, nthreads);
    Py_END_ALLOW_THREADS
    if (rc) { PyErr_NoMemory(); goto done; }
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (int k = 0; k < nw; k++) PyBuffer_Release(&wb[k]);
    for (int k = 0; k < ny; k++) PyBuffer_Release(&yb[k]);
    PyBuffer_Release(&xb);
    return ret;
}

static PyObject *py_pack_x8(PyObject *self, PyObject *args) {
    const char *qtype;
    Py_buffer wb, ob;
    int rows, cols;
    if (!PyArg_ParseTuple(args, "sy*iiw*", &qtype, &wb, &rows, &cols, &ob)) return NULL;
    PyObject *ret = NULL;
    int qt = qtype_index(qtype);
    if (qt < 0) { PyErr_Format(PyExc_ValueError, "qtype must be q8_0, q4_k or q6_k, got %s", qtype); goto done; }
    if (rows < 0 || cols <= 0 || cols % QK[qt] || wb.len != (Py_ssize_t)rows * (cols / QK[qt]) * QBYTES[qt]) {
        PyErr_Format(PyExc_ValueError, "%s blocks do not match a %dx%d matrix", qtype, rows, cols);
        goto done;
    }
    if ((size_t)ob.len != x8_size(qt, rows, cols)) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes, the x8 layout of a %dx%d %s matrix has %zu", ob.len, rows, cols,
                     qtype, x8_size(qt, rows, cols));
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    pack_x8(qt, wb.buf, rows, cols, (uint8_t *)ob.buf);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    return ret;
}

static PyObject *py_unpack_x8(PyObject *self, PyObject *args) {
    const char *qtype;
    Py_buffer ib, ob;
    int rows, cols;
    if (!PyArg_ParseTuple(args, "sy*iiw*", &qtype, &ib, &rows, &cols, &ob)) return NULL;
    PyObject *ret = NULL;
    int qt = qtype_index(qtype);
    if (qt < 0) { PyErr_Format(PyExc_ValueError, "qtype must be q8_0, q4_k or q6_k, got %s", qtype); goto done; }
    if (rows < 0 || cols <= 0 || cols % QK[qt] || (size_t)ib.len != x8_size(qt, rows, cols)) {
        PyErr_Format(PyExc_ValueError, "packed: %zd bytes is not the x8 layout of a %dx%d %s matrix", ib.len, rows, cols, qtype);
        goto done;
    }
    if (ob.len != (Py_ssize_t)rows * (cols / QK[qt]) * QBYTES[qt]) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes, the GGUF rows of a %dx%d %s matrix have %zd", ob.len, rows, cols, qtype,
                     (Py_ssize_t)rows * (cols / QK[qt]) * QBYTES[qt]);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    unpack_x8(qt, ib.buf, rows, cols, (uint8_t *)ob.buf);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&ib);
    PyBuffer_Release(&ob);
    return ret;
}

static PyObject *py_x8_nbytes(PyObject *self, PyObject *args) {
    const char *qtype;
    int rows, cols;
    if (!PyArg_ParseTuple(args, "sii", &qtype, &rows, &cols)) return NULL;
    int qt = qtype_index(qtype);
    if (qt < 0 || rows < 0 || cols <= 0 || cols % QK[qt])
        return PyErr_Format(PyExc_ValueError, "no x8 layout for a %dx%d %s matrix", rows, cols, qtype);
    return PyLong_FromSize_t(x8_size(qt, rows, cols));
}

static PyObject *py_layout(PyObject *self, PyObject *args) {
    const char *isa_name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &isa_name)) return NULL;
    int isa = isa_arg(isa_name);
    if (isa < 0) return NULL;
    return PyUnicode_FromString(isa_x8(isa) ? "x8" : "gguf");
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(ISA_NAMES[g_isa]); }

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int isa = isa_from_name(name);
    if (isa < 0) return PyErr_Format(PyExc_ValueError, "ISA must be one of portable, avx2, avxvnni, avx512vnni, neon, neondot; got %s", name);
    if (!isa_supported(isa)) return PyErr_Format(PyExc_ValueError, "ISA %s is not available on this CPU", name);
    g_isa = isa;
    Py_RETURN_NONE;
}

static PyObject *py_supported(PyObject *self, PyObject *noargs) {
    PyObject *t = PyList_New(0);
    for (int i = 0; i < N_ISA; i++)
        if (isa_supported(i)) {
            PyObject *s = PyUnicode_FromString(ISA_NAMES[i]);
            PyList_Append(t, s);
            Py_DECREF(s);
        }
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
     "matmul_xt(qtype, weights, rows, cols, x, n, out, nthreads[, isa]): out f32[n, rows] = x . W^T;\n"
     "weights in the path's layout (layout(isa))."},
    {"matmul_xt_many", py_matmul_xt_many, METH_VARARGS,
     "matmul_xt_many(qtype, (weights, ...), rows, cols, x, n, (out, ...), nthreads[, isa]): each out = x . W^T for\n"
     "matrices of one qtype and shape, x quantized once."},
    {"pack_x8", py_pack_x8, METH_VARARGS,
     "pack_x8(qtype, blocks, rows, cols, out): GGUF rows interleaved in groups of eight (the x86 SIMD paths' layout) into out."},
    {"unpack_x8", py_unpack_x8, METH_VARARGS,
     "unpack_x8(qtype, packed, rows, cols, out): the GGUF rows back from the x8 layout (pack_x8's inverse, byte for byte) into out."},
    {"x8_nbytes", py_x8_nbytes, METH_VARARGS, "x8_nbytes(qtype, rows, cols) -> bytes of the x8 layout."},
    {"layout", py_layout, METH_VARARGS, "layout([isa]) -> 'x8' or 'gguf': the weight layout a SIMD path reads."},
    {"isa", py_isa, METH_NOARGS, "The SIMD path in use: portable, avx2, avxvnni, avx512vnni, neon or neondot."},
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
    tk_init();
    return PyModule_Create(&moddef);
}
#endif /* TK_NO_PYTHON */
