/*
 * Kernels on the interleaved "x8" layout (see pack_x8 in _kernels.c), included once per x86 SIMD
 * path with:
 *   TK_SFX(name)  the function name with the path's suffix
 *   TK_TARGET     the path's target attribute
 *   TK_VNNI       0: AVX2 (maddubs + madd + add), 1: AVX-VNNI (VEX vpdpwssd / vpdpbusd, 256-bit),
 *                 2: AVX-512 VNNI (512-bit registers: one register holds all eight rows)
 *   TK_TILE       activation rows per tile (weights unpacked once per tile), Q6_K's and the most
 *   TK_TILE_Q80, TK_TILE_Q4K  Q8_0's and Q4_K's (see _kernels.c)
 *
 * One register holds eight bytes of each of four rows (256-bit, two halves per row group) or of
 * all eight rows (512-bit); an activation's eight bytes are broadcast to every row, so one
 * activation load feeds all rows (ggml's q4_K_8x8 idea). Per row the integer sums are the exact
 * sums of the portable path, and every float operation is the portable path's, in its order, one
 * row per vector lane: the results are bit-identical to it.
 *
 * int16 partial sums before the scale multiply are bounded: Q4_K 4 x 2 x 15 x 127 = 15240,
 * Q6_K 2 x 2 x 63 x 127 = 32004 (Q8_K activations lie in [-127, 127]).
 */

#if TK_VNNI == 2
#define TK_V __m512i
#define TK_NH 1
#define TK_VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define TK_AND _mm512_and_si512
#define TK_OR _mm512_or_si512
#define TK_XOR _mm512_xor_si512
#define TK_SRLI16 _mm512_srli_epi16
#define TK_SLLI16 _mm512_slli_epi16
#define TK_ADD16 _mm512_add_epi16
#define TK_ZERO _mm512_setzero_si512
#define TK_SET1_8 _mm512_set1_epi8
#define TK_SET1_32 _mm512_set1_epi32
#define TK_MADDUBS _mm512_maddubs_epi16
#define TK_BCAST8(p) _mm512_set1_epi64(ld64(p))
#define TK_MADDACC(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define TK_V __m256i
#define TK_NH 2
#define TK_VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define TK_AND _mm256_and_si256
#define TK_OR _mm256_or_si256
#define TK_XOR _mm256_xor_si256
#define TK_SRLI16 _mm256_srli_epi16
#define TK_SLLI16 _mm256_slli_epi16
#define TK_ADD16 _mm256_add_epi16
#define TK_ZERO _mm256_setzero_si256
#define TK_SET1_8 _mm256_set1_epi8
#define TK_SET1_32 _mm256_set1_epi32
#define TK_MADDUBS _mm256_maddubs_epi16
#define TK_BCAST8(p) _mm256_set1_epi64x(ld64(p))
/* AVX-VNNI too: a chain of vpdpwssd (latency 5) measured slower than madd + add here */
#define TK_MADDACC(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

/* D: eight int32 lanes (one per row) -> the register of half h whose dword lanes 2r, 2r+1 of
 * each of its rows carry D's lane of that row. */
TK_TARGET static inline TK_V TK_SFX(dup_rows)(__m256i D, int h) {
#if TK_VNNI == 2
    (void)h;
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                    _mm512_castsi256_si512(D));
#else
    return _mm256_permutevar8x32_epi32(D, h ? _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)
                                            : _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
#endif
}

/* Eight u8 / s8 scales (one per row) -> int32 lanes each holding the scale twice as int16. */
TK_TARGET static inline __m256i TK_SFX(pairs_u8)(const uint8_t *p) {
    __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(d, _mm256_slli_epi32(d, 16));
}
TK_TARGET static inline __m256i TK_SFX(pairs_s8)(const uint8_t *p) {
    __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(d, 16));
}

/* The int32 partials (two lanes per row) -> the eight row sums, row order. */
TK_TARGET static inline __m256i TK_SFX(rows8)(const TK_V s[TK_NH]) {
#if TK_VNNI == 2
    __m512i t = _mm512_add_epi32(s[0], _mm512_shuffle_epi32(s[0], (_MM_PERM_ENUM)0xB1));
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), t));
#else
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
#endif
}

/* Byte pairs (a[r], b[r]) of two eight-byte rows of scales, widened to int16 pairs per dword lane
 * (u: unsigned bytes, else signed). */
TK_TARGET static inline __m256i TK_SFX(pairs2)(const uint8_t *a, const uint8_t *b, int u) {
    __m128i t = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return u ? _mm256_cvtepu8_epi16(t) : _mm256_cvtepi8_epi16(t);
}

/* ---- Q4_K, block of 8 rows x 256 values: d[8], dmin[8] f16; sc[8 sub][8 rows], mn[8][8] u8;
 * qs: 16 chunks (quant bytes 8c..8c+7 of every row, row-major), see pack_x8. */
TK_TARGET static inline __attribute__((always_inline)) void TK_SFX(q4k_x8)(long pf, 
    const uint8_t *w, int nsb, const int8_t *qx, size_t qs_, const float *dx, size_t ds_, const int16_t *ps,
    size_t ps_, int A, float *y, size_t ys_) {
    const TK_V m4 = TK_SET1_8(0x0F);
    __m256 acc[TK_TILE];
    for (int a = 0; a < A; a++) acc[a] = _mm256_setzero_ps();
    for (int b = 0; b < nsb; b++) {
        const uint8_t *blk = w + (size_t)b * X8_Q4K, *sc = blk + 32, *mn = blk + 96, *qs = blk + 160;
        tk_prefetch(blk, pf, X8_Q4K);
        /* Row half h outermost, then the low and the high nibbles of a 64-value pair of
         * sub-blocks in turn: few live registers (16 on the VEX paths). */
        TK_V sumi[TK_TILE][TK_NH];
        for (int h = 0; h < TK_NH; h++) {
            for (int a = 0; a < A; a++) sumi[a][h] = TK_ZERO();
            for (int p = 0; p < 4; p++)
                for (int hi = 0; hi < 2; hi++) {
                    TK_V S = TK_SFX(dup_rows)(TK_SFX(pairs_u8)(sc + 16 * p + 8 * hi), h);
                    TK_V s16[TK_TILE];
                    for (int m = 0; m < 4; m++) {
                        TK_V q = TK_VLOAD(qs + (4 * p + m) * 64 + 32 * h);
                        TK_V nib = hi ? TK_AND(TK_SRLI16(q, 4), m4) : TK_AND(q, m4);
                        for (int a = 0; a < A; a++) {
                            TK_V pk = TK_MADDUBS(nib, TK_BCAST8(qx + a * qs_ + 256 * b + 64 * p + 32 * hi + 8 * m));
                            s16[a] = m ? TK_ADD16(s16[a], pk) : pk;
                        }
                    }
                    for (int a = 0; a < A; a++) sumi[a][h] = TK_MADDACC(sumi[a][h], s16[a], S);
                }
        }
        __m256i mnv[4];
        for (int k = 0; k < 4; k++) mnv[k] = TK_SFX(pairs2)(mn + 16 * k, mn + 16 * k + 8, 1);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 dmv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int a = 0; a < A; a++) {
            const int16_t *P = ps + a * ps_ + 8 * b;
            __m256i mins = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mnv[k], _mm256_set1_epi32(ld32(P + 2 * k))));
            __m256i s = TK_SFX(rows8)(sumi[a]);
            __m256 dxa = _mm256_set1_ps(dx[a * ds_ + b]);
            acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_mul_ps(dv, dxa), _mm256_cvtepi32_ps(s)));
            acc[a] = _mm256_sub_ps(acc[a], _mm256_mul_ps(_mm256_mul_ps(dmv, dxa), _mm256_cvtepi32_ps(mins)));
        }
    }
    for (int a = 0; a < A; a++) _mm256_storeu_ps(y + a * ys_, acc[a]);
}

/* ---- Q6_K, block of 8 rows x 256 values: d[8] f16; sc[16 groups][8 rows] s8; ql: for half h,
 * part c (bytes l or 32 + l) and chunk m, 8 bytes of every row; qh: for half h and chunk m, 8
 * bytes of every row. */
TK_TARGET static inline __attribute__((always_inline)) void TK_SFX(q6k_x8)(long pf, 
    const uint8_t *w, int nsb, const int8_t *qx, size_t qs_, const float *dx, size_t ds_, const int16_t *bs,
    size_t bs_, int A, float *y, size_t ys_) {
    const TK_V m4 = TK_SET1_8(0x0F), m30 = TK_SET1_8(0x30);
    __m256 acc[TK_TILE];
    for (int a = 0; a < A; a++) acc[a] = _mm256_setzero_ps();
    for (int b = 0; b < nsb; b++) {
        const uint8_t *blk = w + (size_t)b * X8_Q6K, *sc = blk + 16, *ql = blk + 144, *qhb = blk + 1168;
        tk_prefetch(blk, pf, X8_Q6K);
        /* Row half h outermost, then one quant part k of two chunks at a time: few live registers
         * (16 on the VEX paths), each part's int16 pair sums scaled at once. */
        TK_V sumi[TK_TILE][TK_NH];
        for (int h = 0; h < TK_NH; h++) {
            for (int a = 0; a < A; a++) sumi[a][h] = TK_ZERO();
            for (int hf = 0; hf < 2; hf++)
                for (int g2 = 0; g2 < 2; g2++)
                    for (int k = 0; k < 4; k++) {
                        TK_V S = TK_SFX(dup_rows)(TK_SFX(pairs_s8)(sc + 8 * (8 * hf + 2 * k + g2)), h);
                        TK_V q[2];
                        for (int mi = 0; mi < 2; mi++) {
                            int m = 2 * g2 + mi;
                            TK_V l = TK_VLOAD(ql + ((hf * 2 + (k & 1)) * 4 + m) * 64 + 32 * h);
                            TK_V hb = TK_VLOAD(qhb + (hf * 4 + m) * 64 + 32 * h);
                            TK_V lo = k < 2 ? TK_AND(l, m4) : TK_AND(TK_SRLI16(l, 4), m4);
                            TK_V hi = k == 0 ? TK_SLLI16(hb, 4) : k == 1 ? TK_SLLI16(hb, 2) : k == 2 ? hb : TK_SRLI16(hb, 2);
                            q[mi] = TK_OR(lo, TK_AND(hi, m30));
                        }
                        for (int a = 0; a < A; a++) {
                            const int8_t *x = qx + a * qs_ + 256 * b + 128 * hf + 16 * g2 + 32 * k;
                            TK_V s16 = TK_ADD16(TK_MADDUBS(q[0], TK_BCAST8(x)), TK_MADDUBS(q[1], TK_BCAST8(x + 8)));
                            sumi[a][h] = TK_MADDACC(sumi[a][h], s16, S);
                        }
                    }
        }
        __m256i scv[8];
        for (int k = 0; k < 8; k++) scv[k] = TK_SFX(pairs2)(sc + 16 * k, sc + 16 * k + 8, 0);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int a = 0; a < A; a++) {
            const int16_t *B = bs + a * bs_ + 16 * b;
            __m256i off = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) off = _mm256_add_epi32(off, _mm256_madd_epi16(scv[k], _mm256_set1_epi32(ld32(B + 2 * k))));
            __m256i s = _mm256_sub_epi32(TK_SFX(rows8)(sumi[a]), _mm256_slli_epi32(off, 5));
            acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_set1_ps(dx[a * ds_ + b])), _mm256_cvtepi32_ps(s)));
        }
    }
    for (int a = 0; a < A; a++) _mm256_storeu_ps(y + a * ys_, acc[a]);
}

/* ---- Q8_0, block of 8 rows x 32 values: d[8] f16; qs: 4 chunks of 8 bytes of every row.
 * VNNI: vpdpbusd on (w ^ 0x80) x x, plus -128 * sum(x) (bias: aux, per activation block, an int64
 * whose low dword is that value and high dword 0: on 512-bit registers one broadcast load puts it
 * in one of each row's two lanes, as the start of a vpdpbusd chain); AVX2: maddubs(|w|, sign(x, w)).
 * Block b's term goes to accumulator b % 8, as portable. */
#if TK_VNNI == 2
/* 512-bit: two blocks per step. Their row sums are gathered into one register (lanes 0-7: block
 * b's rows, 8-15: block b + 1's), so the scale arithmetic runs once per two blocks on full
 * registers (llvm-mca, icelake-server: 6.1 cycles per block and activation row, 7.5 one block at a
 * time); accumulator p holds blocks 2p and 2p + 1 (mod 8) in its two halves, the same lane-wise
 * float operations as portable. An odd last block pairs with a zero block (sum 0, scales 0: it
 * adds +0.0, which leaves every sum as it is: a sum started at +0.0 is never -0.0).
 * q80_pair: blocks b and b + 1 (two = 0: block b alone) of A activation rows into acc[a][(b / 2) % 4]. */
TK_TARGET static inline __attribute__((always_inline)) void TK_SFX(q80_pair)(long pf, int two, int b,
    const uint8_t *w, const int8_t *qx, size_t qs_, const float *dx, size_t ds_, const int64_t *bias,
    size_t bias_, int A, __m512 acc[][4]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i ia = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i ib = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const uint8_t *b0 = w + (size_t)b * X8_Q80, *b1 = b0 + X8_Q80;
    tk_prefetch(b0, pf, two ? 2 * X8_Q80 : X8_Q80);
    __m512i w0[4], w1[4];
    for (int m = 0; m < 4; m++) {
        w0[m] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b0 + 16 + 64 * m)), flip);
        if (two) w1[m] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b1 + 16 + 64 * m)), flip);
    }
    __m256 h0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b0));
    __m256 h1 = two ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b1)) : _mm256_setzero_ps();
    __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(h0), h1, 1);
#pragma GCC unroll 8 /* GCC kept the loop otherwise: acc indexed at run time, in memory */
    for (int a = 0; a < A; a++) {
        const int8_t *x = qx + a * qs_ + 32 * b;
        const int64_t *bi = bias + a * bias_ + b;
        /* two chains per block (vpdpbusd's latency), the bias starting one */
        __m512i s0 = _mm512_dpbusd_epi32(_mm512_set1_epi64(bi[0]), w0[0], TK_BCAST8(x));
        __m512i u0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0[1], TK_BCAST8(x + 8));
        s0 = _mm512_dpbusd_epi32(s0, w0[2], TK_BCAST8(x + 16));
        u0 = _mm512_dpbusd_epi32(u0, w0[3], TK_BCAST8(x + 24));
        s0 = _mm512_add_epi32(s0, u0);
        __m512i s1 = _mm512_setzero_si512();
        if (two) {
            s1 = _mm512_dpbusd_epi32(_mm512_set1_epi64(bi[1]), w1[0], TK_BCAST8(x + 32));
            __m512i u1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1[1], TK_BCAST8(x + 40));
            s1 = _mm512_dpbusd_epi32(s1, w1[2], TK_BCAST8(x + 48));
            u1 = _mm512_dpbusd_epi32(u1, w1[3], TK_BCAST8(x + 56));
            s1 = _mm512_add_epi32(s1, u1);
        }
        __m512i s = _mm512_add_epi32(_mm512_permutex2var_epi32(s0, ia, s1), _mm512_permutex2var_epi32(s0, ib, s1));
        const float *d = dx + a * ds_ + b;
        __m512 dxv = _mm512_permutexvar_ps(i01, _mm512_castps128_ps512(
            two ? _mm_castpd_ps(_mm_load_sd((const double *)d)) : _mm_load_ss(d)));
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, dxv));
        acc[a][(b >> 1) & 3] = _mm512_add_ps(acc[a][(b >> 1) & 3], t);
    }
}

TK_TARGET static inline __attribute__((always_inline)) void TK_SFX(q80_x8)(long pf,
    const uint8_t *w, int nb, const int8_t *qx, size_t qs_, const float *dx, size_t ds_, const int64_t *bias,
    size_t bias_, int A, float *y, size_t ys_) {
    __m512 acc[TK_TILE][4];
    for (int a = 0; a < A; a++)
        for (int k = 0; k < 4; k++) acc[a][k] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) TK_SFX(q80_pair)(pf, 1, b, w, qx, qs_, dx, ds_, bias, bias_, A, acc);
    if (b < nb) TK_SFX(q80_pair)(pf, 0, b, w, qx, qs_, dx, ds_, bias, bias_, A, acc);
    for (int a = 0; a < A; a++) {
        __m256 c[4];
        for (int k = 0; k < 4; k++)
            c[k] = _mm256_add_ps(_mm512_castps512_ps256(acc[a][k]), _mm512_extractf32x8_ps(acc[a][k], 1));
        _mm256_storeu_ps(y + a * ys_, _mm256_add_ps(_mm256_add_ps(c[0], c[1]), _mm256_add_ps(c[2], c[3])));
    }
}
#else
TK_TARGET static inline __attribute__((always_inline)) void TK_SFX(q80_x8)(long pf,
    const uint8_t *w, int nb, const int8_t *qx, size_t qs_, const float *dx, size_t ds_, const int64_t *bias,
    size_t bias_, int A, float *y, size_t ys_) {
    __m256 acc[TK_TILE][8];
    for (int a = 0; a < A; a++)
        for (int k = 0; k < 8; k++) acc[a][k] = _mm256_setzero_ps();
#if TK_VNNI
    const TK_V flip = TK_SET1_8((char)0x80);
#else
    const TK_V ones = _mm256_set1_epi16(1);
    (void)bias; (void)bias_;
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * X8_Q80, *qs = blk + 16;
        tk_prefetch(blk, pf, X8_Q80);
        TK_V si[TK_TILE][TK_NH];
        for (int h = 0; h < TK_NH; h++) {
            TK_V wv[4];
            for (int m = 0; m < 4; m++) wv[m] = TK_VLOAD(qs + 64 * m + 32 * h);
#if TK_VNNI
            for (int m = 0; m < 4; m++) wv[m] = TK_XOR(wv[m], flip);
            for (int a = 0; a < A; a++) {
                const int8_t *x = qx + a * qs_ + 32 * b;
                TK_V s0 = TK_ZERO(), s1 = TK_ZERO(); /* two chains: vpdpbusd's latency */
                for (int m = 0; m < 4; m += 2) {
                    s0 = _mm256_dpbusd_avx_epi32(s0, wv[m], TK_BCAST8(x + 8 * m));
                    s1 = _mm256_dpbusd_avx_epi32(s1, wv[m + 1], TK_BCAST8(x + 8 * m + 8));
                }
                si[a][h] = _mm256_add_epi32(s0, s1);
            }
#else
            TK_V wa[4];
            for (int m = 0; m < 4; m++) wa[m] = _mm256_sign_epi8(wv[m], wv[m]);
            for (int a = 0; a < A; a++) {
                const int8_t *x = qx + a * qs_ + 32 * b;
                TK_V s = TK_ZERO();
                for (int m = 0; m < 4; m++)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[m], _mm256_sign_epi8(TK_BCAST8(x + 8 * m), wv[m])), ones));
                si[a][h] = s;
            }
#endif
        }
        /* rows in hadd's order (0 1 4 5 2 3 6 7): the scales permuted once per block, the sums not
         * per activation row; the store puts the rows back (the same lane-wise float operations) */
        __m256 dv = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)),
                                             _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
        for (int a = 0; a < A; a++) {
            __m256i s = _mm256_hadd_epi32(si[a][0], si[a][1]);
#if TK_VNNI
            s = _mm256_add_epi32(s, _mm256_set1_epi32((int32_t)bias[a * bias_ + b])); /* low dword: -128 * sum(x) */
#endif
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(dx[a * ds_ + b])));
            acc[a][b & 7] = _mm256_add_ps(acc[a][b & 7], t);
        }
    }
    for (int a = 0; a < A; a++) {
        __m256 *c = acc[a];
        __m256 r = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c[0], c[1]), _mm256_add_ps(c[2], c[3])),
                                 _mm256_add_ps(_mm256_add_ps(c[4], c[5]), _mm256_add_ps(c[6], c[7])));
        _mm256_storeu_ps(y + a * ys_, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)));
    }
}
#endif

/* One row group (8 rows) x n activation rows, in tiles of the quant type's tile size (the remainder
 * one row at a time); the first tile prefetches the weight stream PF_BYTES ahead (the later ones
 * find it in cache). */
TK_TARGET static void TK_SFX(group_x8)(int qt, const uint8_t *w, int cols, const int8_t *qx, const float *dx,
                                       const void *aux, int n, float *y, size_t ys_) {
    const size_t qs_ = (size_t)cols, ds_ = (size_t)cols / 32;
    const int nb32 = cols / 32, nbk = cols / 256;
    int i = 0;
#define TK_ARGS i ? 0 : PF_BYTES, w
#define TK_X qx + i * qs_, qs_, dx + i * ds_, ds_
#define TK_TILES(T, CALL)                               \
    do {                                                \
        for (; i + (T) <= n; i += (T)) CALL(T);         \
        for (; i < n; i++) CALL(1);                     \
    } while (0)
#define TK_Q80(A_) TK_SFX(q80_x8)(TK_ARGS, nb32, TK_X, (const int64_t *)aux + i * nb32, nb32, A_, y + i * ys_, ys_)
#define TK_Q4K(A_) TK_SFX(q4k_x8)(TK_ARGS, nbk, TK_X, (const int16_t *)aux + i * nb32, nb32, A_, y + i * ys_, ys_)
#define TK_Q6K(A_) TK_SFX(q6k_x8)(TK_ARGS, nbk, TK_X, (const int16_t *)aux + i * (cols / 16), cols / 16, A_, y + i * ys_, ys_)
    if (qt == 0)
        TK_TILES(TK_TILE_Q80, TK_Q80);
    else if (qt == 1)
        TK_TILES(TK_TILE_Q4K, TK_Q4K);
    else
        TK_TILES(TK_TILE, TK_Q6K);
#undef TK_ARGS
#undef TK_X
#undef TK_TILES
#undef TK_Q80
#undef TK_Q4K
#undef TK_Q6K
}

#undef TK_V
#undef TK_NH
#undef TK_VLOAD
#undef TK_AND
#undef TK_OR
#undef TK_XOR
#undef TK_SRLI16
#undef TK_SLLI16
#undef TK_ADD16
#undef TK_ZERO
#undef TK_SET1_8
#undef TK_SET1_32
#undef TK_MADDUBS
#undef TK_BCAST8
#undef TK_MADDACC
