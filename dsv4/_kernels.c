/* Native CPU kernels of dsv4's custom operators, loaded with ctypes by ``dsv4.native``.
 *
 * Plain C with no Python or torch headers: it builds in a fraction of a second with any C
 * compiler and does not depend on torch's ABI. Each kernel computes exactly what its
 * composite in Python computes, in the same floating-point order, so the two are bit-equal
 * (tests/dsv4/test_native.py draws the inputs that show it). */
#include <stdint.h>

/* ``iters`` Sinkhorn rounds, columns first, on the top-left n x n block of each of ``tokens``
 * contiguous float32 matrices of (n + 1) x (n + 1), in place. The last row and column of each
 * matrix hold eps: a column's sum is its n entries then the eps row below them, a row's sum its
 * n entries then the eps column, added in that order (as ``ones @ bordered`` adds them in
 * ``dsv4.hyper``); every entry of the column (row) is then divided by the sum. There are
 * 2 * iters - 1 half-rounds, at least one (the composite's first division comes before its
 * loop). */
void dsv4_sinkhorn_f32(float *bordered, int64_t tokens, int64_t n, int64_t iters) {
    const int64_t width = n + 1;
    const int64_t halves = iters > 1 ? 2 * iters - 1 : 1;
    for (int64_t t = 0; t < tokens; ++t) {
        float *m = bordered + t * width * width;
        for (int64_t half = 0; half < halves; ++half) {
            if (half % 2 == 0) { /* columns */
                for (int64_t j = 0; j < n; ++j) {
                    float sum = 0.0f;
                    for (int64_t i = 0; i <= n; ++i) sum += m[i * width + j];
                    for (int64_t i = 0; i < n; ++i) m[i * width + j] /= sum;
                }
            } else { /* rows */
                for (int64_t i = 0; i < n; ++i) {
                    float sum = 0.0f;
                    for (int64_t j = 0; j <= n; ++j) sum += m[i * width + j];
                    for (int64_t j = 0; j < n; ++j) m[i * width + j] /= sum;
                }
            }
        }
    }
}
