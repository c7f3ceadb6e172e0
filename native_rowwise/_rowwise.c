/* tenzro_rowwise: the row-invariant dense product Y = X·Wᵀ in a fixed summation order.
 *
 * Every output Y[r, o] is the dot product of X row r and W row o computed by one thread in
 * one order that depends on the width k alone (moe/rowwise.py states it; its numba fallback
 * reproduces it bit for bit):
 *   - 16 lane sums: lane l adds, in ascending j, the products X[r, j]·W[o, j] of every
 *     j ≡ l (mod 16), in steps of 16 with the last step's missing values taken as 0
 *     (k is zero-padded to a multiple of 16: adding 0·0 leaves a lane as it was);
 *   - the lanes are reduced by halves: s8[l] = p[l] + p[l+8], s4[l] = s8[l] + s8[l+4],
 *     s2[l] = s4[l] + s4[l+2], y = s2[0] + s2[1].
 * Products and sums are separate IEEE float32 operations (-ffp-contract=off: no FMA), so the
 * AVX-512, AVX2 and baseline clones, any thread count and any batch give the same bits.
 * Threads (OpenMP) split the outputs, never one dot product.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define LANES 16
#define RB 4          /* rows sharing one pass over a weight row */
#define OCHUNK 16     /* outputs per thread task (a 16 x k weight panel stays in L2) */

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* 16 float32 lanes (GCC/Clang vector extension: zmm, two ymm or four xmm by target; the
 * lane operations are elementwise IEEE operations, identical whichever). */
typedef float v16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) float reduce16(v16 p) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = p[l] + p[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    float a = s4[0] + s4[2], b = s4[1] + s4[3];
    return a + b;
}

/* k mod LANES trailing values of p, zero-padded to one lane step. */
static inline __attribute__((always_inline)) v16 tail16(const float *p, long t) {
    float buf[LANES] = {0};
    memcpy(buf, p, t * sizeof(float));
    return load16(buf);
}

/* RB rows of x (row stride k) · one weight row w → y[q * ldy], q < RB. */
static inline __attribute__((always_inline)) void dot_rb(const float *x, const float *w, long k, float *y, long ldy) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long k16 = k - k % LANES, j;
    for (j = 0; j < k16; j += LANES) {
        v16 wv = load16(w + j);
        a0 += load16(x + j) * wv;
        a1 += load16(x + k + j) * wv;
        a2 += load16(x + 2 * k + j) * wv;
        a3 += load16(x + 3 * k + j) * wv;
    }
    if (k16 < k) {
        long t = k - k16;
        v16 wv = tail16(w + k16, t);
        a0 += tail16(x + k16, t) * wv;
        a1 += tail16(x + k + k16, t) * wv;
        a2 += tail16(x + 2 * k + k16, t) * wv;
        a3 += tail16(x + 3 * k + k16, t) * wv;
    }
    y[0] = reduce16(a0);
    y[ldy] = reduce16(a1);
    y[2 * ldy] = reduce16(a2);
    y[3 * ldy] = reduce16(a3);
}

/* One row of x · one weight row w → *y (the same operations as one row of dot_rb). */
static inline __attribute__((always_inline)) void dot_1(const float *x, const float *w, long k, float *y, long ldy) {
    (void)ldy;
    v16 a0 = {0};
    long k16 = k - k % LANES, j;
    for (j = 0; j < k16; j += LANES) a0 += load16(x + j) * load16(w + j);
    if (k16 < k) a0 += tail16(x + k16, k - k16) * tail16(w + k16, k - k16);
    *y = reduce16(a0);
}

CLONES static void task(const float *x, long n, long k, const float *w, long o0, long o1, float *y, long m) {
    /* RB rows (L1) against each weight row of the task's panel (L2) */
    long r = 0;
    for (; r + RB <= n; r += RB)
        for (long o = o0; o < o1; o++) dot_rb(x + r * k, w + o * k, k, y + r * m + o, m);
    for (; r < n; r++)
        for (long o = o0; o < o1; o++) dot_1(x + r * k, w + o * k, k, y + r * m + o, m);
}

static void matmul(const float *x, long n, long k, const float *w, long m, float *y, int nthreads) {
    long tasks = (m + OCHUNK - 1) / OCHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && tasks > 1)
    for (long t = 0; t < tasks; t++) {
        long o0 = t * OCHUNK, o1 = o0 + OCHUNK < m ? o0 + OCHUNK : m;
        task(x, n, k, w, o0, o1, y, m);
    }
}

static PyObject *py_matmul_xt(PyObject *self, PyObject *args) {
    Py_buffer xb, wb, yb;
    Py_ssize_t n, k, m;
    int nthreads;
    if (!PyArg_ParseTuple(args, "y*nny*nw*i", &xb, &n, &k, &wb, &m, &yb, &nthreads)) return NULL;
    PyObject *ret = NULL;
    if (n < 0 || k < 1 || m < 0 || nthreads < 1) {
        PyErr_SetString(PyExc_ValueError, "matmul_xt: n, m >= 0, k >= 1 and threads >= 1 required");
    } else if (xb.len != (Py_ssize_t)(n * k * 4) || wb.len != (Py_ssize_t)(m * k * 4) ||
               yb.len != (Py_ssize_t)(n * m * 4)) {
        PyErr_Format(PyExc_ValueError, "matmul_xt: buffer sizes %zd, %zd, %zd do not fit n=%zd k=%zd m=%zd (float32)",
                     xb.len, wb.len, yb.len, n, k, m);
    } else {
        Py_BEGIN_ALLOW_THREADS
        matmul((const float *)xb.buf, n, k, (const float *)wb.buf, m, (float *)yb.buf, nthreads);
        Py_END_ALLOW_THREADS
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&xb);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&yb);
    return ret;
}

static PyMethodDef methods[] = {
    {"matmul_xt", py_matmul_xt, METH_VARARGS,
     "matmul_xt(x, n, k, w, m, y, threads): y[n, m] = x[n, k] · w[m, k]ᵀ, C-contiguous float32 buffers, "
     "in the fixed order of the module docstring."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tenzro_rowwise",
                                    "Row-invariant float32 X·Wᵀ in a fixed summation order (moe/rowwise.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit_tenzro_rowwise(void) { return PyModule_Create(&module); }
