/* Native CPU kernels of dsv4's custom operators, loaded with ctypes by ``dsv4.native``.
 *
 * Plain C with no Python or torch headers: it builds in a fraction of a second with any C
 * compiler and does not depend on torch's ABI. Each kernel says how it rounds against the
 * ATen kernels it replaces (tests/dsv4/test_sinkhorn.py and test_native_norm.py draw the inputs
 * that show it). */
#include <math.h>
#include <stddef.h>
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

/* RMS norm of each of ``rows`` contiguous rows of ``width`` float32 values into ``out``:
 * ``x * (1 / sqrt(mean(x^2) + eps))``, then times ``weight`` (``width`` values) unless it is
 * NULL — ATen's ``rms_norm`` in the order it rounds, except that the sum of squares is
 * accumulated in double (ATen's vectorised float sum rounds differently; the mean then differs
 * from ATen's by at most a rounding of its own). */
void dsv4_rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows,
                       int64_t width, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * width;
        float *dst = out + r * width;
        double squares = 0.0;
        for (int64_t i = 0; i < width; ++i) squares += (double)row[i] * (double)row[i];
        const float mean = (float)(squares / (double)width);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (weight == NULL) {
            for (int64_t i = 0; i < width; ++i) dst[i] = row[i] * scale;
        } else {
            for (int64_t i = 0; i < width; ++i) dst[i] = (row[i] * scale) * weight[i];
        }
    }
}
