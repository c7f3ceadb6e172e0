/*
 * neon_check: runs the kernels of _kernels.c (built without Python) on golden cases and compares
 * every output bit for bit. Built for aarch64 and run under qemu-user by tests/test_kernels_neon.py
 * (Python under qemu is too slow); it builds on any target, checking every path the CPU has.
 *
 * Usage: neon_check CASES_FILE. The file (little-endian): "TKG1", u32 case count, then per case
 * u32 qtype (0 q8_0, 1 q4_k, 2 q6_k), u32 rows, u32 cols, u32 n, the GGUF weight bytes, x f32[n][cols],
 * the expected y f32[n][rows]. Prints one line per path ("path neon: 40/40 cases bit-identical" or
 * "path neondot: not supported by this CPU") and exits 1 on any mismatch or a malformed file.
 */
#define TK_NO_PYTHON 1
#include "_kernels.c"

#include <stdio.h>

static int read_u32(FILE *f, uint32_t *v) { return fread(v, 4, 1, f) == 1; }

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CASES_FILE\n", argv[0]);
        return 2;
    }
    tk_init();
    FILE *f = fopen(argv[1], "rb");
    char magic[4];
    uint32_t ncases;
    if (!f || fread(magic, 1, 4, f) != 4 || memcmp(magic, "TKG1", 4) || !read_u32(f, &ncases)) {
        fprintf(stderr, "%s: not a TKG1 cases file\n", argv[1]);
        return 2;
    }
    int ok[N_ISA] = {0}, bad = 0;
    for (uint32_t c = 0; c < ncases; c++) {
        uint32_t qt, rows, cols, n;
        if (!read_u32(f, &qt) || !read_u32(f, &rows) || !read_u32(f, &cols) || !read_u32(f, &n) || qt > 2 ||
            cols % QK[qt]) {
            fprintf(stderr, "case %u: malformed header\n", c);
            return 2;
        }
        size_t wbytes = (size_t)rows * (cols / QK[qt]) * QBYTES[qt];
        uint8_t *w = malloc(wbytes);
        float *x = malloc(sizeof(float) * n * cols), *want = malloc(sizeof(float) * n * rows),
              *got = malloc(sizeof(float) * n * rows);
        if (!w || !x || !want || !got || fread(w, 1, wbytes, f) != wbytes || fread(x, 4, (size_t)n * cols, f) != (size_t)n * cols ||
            fread(want, 4, (size_t)n * rows, f) != (size_t)n * rows) {
            fprintf(stderr, "case %u: truncated\n", c);
            return 2;
        }
        for (int isa = 0; isa < N_ISA; isa++) {
            if (!isa_supported(isa) || isa_x8(isa)) continue; /* the x86 paths are checked from Python */
            if (matmul((int)qt, isa, w, (int)rows, (int)cols, x, (int)n, got, 1)) {
                fprintf(stderr, "case %u: out of memory\n", c);
                return 2;
            }
            if (memcmp(got, want, sizeof(float) * n * rows)) {
                bad = 1;
                for (size_t i = 0; i < (size_t)n * rows; i++)
                    if (memcmp(got + i, want + i, 4)) {
                        fprintf(stderr, "case %u (%s %ux%u, n %u) path %s: output %zu is %a, expected %a\n", c,
                                qt == 0 ? "q8_0" : qt == 1 ? "q4_k" : "q6_k", rows, cols, n, ISA_NAMES[isa], i,
                                (double)got[i], (double)want[i]);
                        break;
                    }
            } else {
                ok[isa]++;
            }
        }
        free(w); free(x); free(want); free(got);
    }
    fclose(f);
    for (int isa = 0; isa < N_ISA; isa++) {
        if (isa_x8(isa)) continue;
        if (isa_supported(isa)) printf("path %s: %d/%u cases bit-identical\n", ISA_NAMES[isa], ok[isa], ncases);
        else printf("path %s: not supported by this CPU\n", ISA_NAMES[isa]);
    }
    return bad;
}
