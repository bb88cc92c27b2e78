/* Native CPU kernels of dsv4's custom operators, loaded with ctypes by ``dsv4.native``.
 *
 * Plain C without torch's headers: it builds in a fraction of a second with any C compiler and
 * does not depend on torch's ABI. It is also an (empty) Python extension module, so whatever
 * imports every module of the package imports it too, and ``dsv4.native`` finds it by import. Each kernel says how it rounds against the
 * ATen kernels it replaces (tests/dsv4/test_sinkhorn.py and test_native_*.py draw the inputs
 * that show it). The compiler never contracts products and sums (``-ffp-contract=off``); the
 * matrix products use FMA instructions explicitly (``avx2,fma``, chosen at run time, ``fmaf``
 * elsewhere, which rounds the same). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Native CPU kernels of dsv4's operators; called through ctypes (dsv4.native).", -1, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The instruction sets the kernels choose between, widest last: ``dsv4_kernel_isa`` says which
 * they use, ``dsv4_cpu_isa`` which the CPU has; ``dsv4_select_isa`` narrows the choice (the
 * tests and ``DSV4_KERNEL_ISA`` run every one on a CPU that has the widest). Every kernel
 * computes the same bits whichever it uses. */
enum { ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

static int64_t cpu_isa(void) {
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
    return ISA_BASELINE;
}

static int64_t chosen_isa = -1;

int64_t dsv4_cpu_isa(void) { return cpu_isa(); }

int64_t dsv4_kernel_isa(void) {
    if (chosen_isa < 0) chosen_isa = cpu_isa();
    return chosen_isa;
}

/* Use instruction set ``isa`` (``ISA_*``) from now on; returns it, or -1 (and changes nothing)
 * where the CPU lacks it. */
int64_t dsv4_select_isa(int64_t isa) {
    if (isa < ISA_BASELINE || isa > cpu_isa()) return -1;
    chosen_isa = isa;
    return isa;
}

static int has_fma(void) { return dsv4_kernel_isa() >= ISA_AVX2; }

static int has_avx512(void) { return dsv4_kernel_isa() >= ISA_AVX512; }

/* The first ``count`` of 16 lanes (all of them from 16 on, none below 1). */
static inline __mmask16 lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : (count > 0 ? (__mmask16)((1u << count) - 1u) : 0);
}

/* ``linkage void name params``: the inline ``body`` compiled twice, for AVX-512 and for the
 * baseline, the first chosen where the CPU has it. The body does each element's operations in
 * its own order (no reduction the compiler could reorder, no contraction: ``-ffp-contract=off``),
 * so the wider vectors compute the same bits. */
#define TWO_ISAS(linkage, name, body, params, args)                                             \
    __attribute__((target("avx512f"))) static void name##_avx512 params { body args; }          \
    static void name##_baseline params { body args; }                                           \
    linkage void name params {                                                                  \
        if (has_avx512())                                                                       \
            name##_avx512 args;                                                                 \
        else                                                                                    \
            name##_baseline args;                                                               \
    }
#else
int64_t dsv4_cpu_isa(void) { return 0; }
int64_t dsv4_kernel_isa(void) { return 0; }
int64_t dsv4_select_isa(int64_t isa) { return isa == 0 ? 0 : -1; }
static int has_fma(void) { return 0; }
static int has_avx512(void) { return 0; }
#define TWO_ISAS(linkage, name, body, params, args) \
    linkage void name params { body args; }
#endif

/* ``iters`` Sinkhorn rounds, columns first, on the top-left n x n block of one contiguous float32
 * matrix of (n + 1) x (n + 1), in place. Its last row and column hold eps: a column's sum is its
 * n entries then the eps row below them, a row's sum its n entries then the eps column, added
 * in that order (as ``ones @ bordered`` adds them in ``dsv4.hyper``); every entry of the column
 * (row) is then divided by the sum. There are 2 * iters - 1 half-rounds, at least one (the
 * composite's first division comes before its loop). */
static void sinkhorn_one(float *m, int64_t n, int64_t iters) {
    const int64_t width = n + 1;
    const int64_t halves = iters > 1 ? 2 * iters - 1 : 1;
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

/* The Sinkhorn rounds on each of ``tokens`` contiguous (n + 1) x (n + 1) matrices: bit-equal to
 * the composite (its sums run over the same n + 1 entries in the same order). */
void dsv4_sinkhorn_f32(float *bordered, int64_t tokens, int64_t n, int64_t iters) {
    for (int64_t t = 0; t < tokens; ++t) sinkhorn_one(bordered + t * (n + 1) * (n + 1), n, iters);
}

/* ``e^x`` as every kernel here computes it (none calls libm's ``expf``, whose result depends on
 * the variant the C library picks for the CPU), the same bits in every lane and in the scalar form:
 * ``n = rint(x log2 e)``, ``r = x - n ln 2`` in two fused steps (ln 2 split in two, Cody and
 * Waite), ``e^r`` by Cephes' degree-7 polynomial (Horner, fused multiply-adds), times ``2^n`` as
 * two powers of two (never overflowing early; a subnormal result rounds twice). Measured within
 * one unit in the last place of glibc's ``expf`` wherever e^x is a normal float (a million
 * arguments from -110 to 90); +inf above 88.73, 0 below -104, NaN for NaN. */
#define EXP_HIGH 88.7228394f
#define EXP_LOW -104.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW -2.12194440e-4f

static inline float exp_poly(float r) {
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    return fmaf(p, r * r, r) + 1.0f;
}

static inline float power_of_two(int32_t n) {
    union {
        int32_t bits;
        float value;
    } v = {(n + 127) << 23};
    return v.value;
}

static inline float exp_scalar(float x) {
    if (x != x) return x;
    if (x > EXP_HIGH) return INFINITY;
    const float clamped = x < EXP_LOW ? EXP_LOW : x;
    const float n = rintf(clamped * EXP_LOG2E);
    const float r = fmaf(n, -EXP_LN2_LOW, fmaf(n, -EXP_LN2_HIGH, clamped));
    const int32_t whole = (int32_t)n, half = whole / 2;
    return (exp_poly(r) * power_of_two(half)) * power_of_two(whole - half);
}

/* ``1 / (1 + e^-v)``, as ATen's sigmoid computes it, with ``exp_scalar``. */
static inline float sigmoid(float v) { return 1.0f / (1.0f + exp_scalar(-v)); }

/* ``log(1 + y)`` for a float ``y >= 0`` (or +inf, NaN), computed in double from IEEE-exact
 * operations only (no libm call, no fused step), so every CPU gets the same bits: ``1 + y`` is
 * exact in double for ``y >= 2^-20`` (below, three terms of the series), ``log`` of it is
 * ``e ln 2 + log m`` with ``m`` in [sqrt(1/2), sqrt(2)) and ``log m = 2 atanh(s)``,
 * ``s = (m - 1) / (m + 1)``, summed to s^23 (truncation below 1e-19 relative), rounded once to
 * float: within a unit in the last place of libm's ``log1pf``. */
static float log1p_scalar(float y) {
    if (!(y < INFINITY)) return y;
    const double v = y;
    if (v < 0x1p-20) return (float)(v - v * v / 2.0 + v * v * v / 3.0);
    int e;
    double m = frexp(1.0 + v, &e);
    if (m < 0.70710678118654752440) {
        m *= 2.0;
        e -= 1;
    }
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double sum = 0.0;
    for (int k = 23; k >= 1; k -= 2) sum = sum * s2 + 1.0 / k;
    return (float)((double)e * 0.69314718055994530942 + 2.0 * s * sum);
}

/* ``sqrt(softplus(l))``, softplus as ATen's (``l`` above 20, else ``log1p(e^l)``). */
static inline float sqrt_softplus(float l) {
    return sqrtf(l > 20.0f ? l : log1p_scalar(exp_scalar(l)));
}

/* pi / 2 in four parts of 24 bits or fewer (the last the rest, rounded): ``k * part`` is exact
 * in double for |k| < 2^29. */
#define HALF_PI_1 0x1.921fb6p+0
#define HALF_PI_2 -0x1.777a5cp-25
#define HALF_PI_3 -0x1.ee59dap-50
#define HALF_PI_4 0x1.98a2e03707345p-77

/* Taylor coefficients of ``sin r = r + r^3 (S0 + r^2 (S1 + ...))`` and ``cos r = 1 + r^2 (C0 +
 * r^2 (C1 + ...))``: (-1)^(i+1) / (2i+3)! and (-1)^(i+1) / (2i+2)!, each rounded once. */
#define SIN_DEGREE 9
#define COS_DEGREE 10
static const double SIN_TERMS[SIN_DEGREE] = {
    -1.0 / 6.0,           1.0 / 120.0,           -1.0 / 5040.0,
    1.0 / 362880.0,       -1.0 / 39916800.0,     1.0 / 6227020800.0,
    -1.0 / 1307674368000.0, 1.0 / 355687428096000.0, -1.0 / 121645100408832000.0,
};
static const double COS_TERMS[COS_DEGREE] = {
    -1.0 / 2.0,          1.0 / 24.0,           -1.0 / 720.0,
    1.0 / 40320.0,       -1.0 / 3628800.0,     1.0 / 479001600.0,
    -1.0 / 87178291200.0, 1.0 / 20922789888000.0, -1.0 / 6402373705728000.0,
    1.0 / 2432902008176640000.0,
};

/* ``cos`` and ``sin`` of a float angle ``a``, in double from IEEE-exact operations only: ``a``
 * less the nearest multiple ``k`` of pi/2 (four parts, Cody and Waite; exact products for
 * |a| < 8e8, beyond which the reduction loses bits but stays the same on every CPU), then
 * Taylor polynomials to degree 19 and 20 on [-pi/4, pi/4] (truncation below 1e-19), the
 * quadrant from ``k``, each rounded once to float: within a unit in the last place of libm's ``cosf`` and
 * ``sinf``. NaN for an infinite or NaN angle. */
static void cos_sin_scalar(float a, float *cos_out, float *sin_out) {
    if (!(a - a == 0.0f)) {
        *cos_out = *sin_out = NAN;
        return;
    }
    const double x = a;
    const double k = rint(x * 0.63661977236758134308);
    const double r = (((x - k * HALF_PI_1) - k * HALF_PI_2) - k * HALF_PI_3) - k * HALF_PI_4;
    const double r2 = r * r;
    double sin_p = SIN_TERMS[SIN_DEGREE - 1], cos_p = COS_TERMS[COS_DEGREE - 1];
    for (int i = SIN_DEGREE - 2; i >= 0; --i) sin_p = sin_p * r2 + SIN_TERMS[i];
    for (int i = COS_DEGREE - 2; i >= 0; --i) cos_p = cos_p * r2 + COS_TERMS[i];
    const double sin_r = r + r * r2 * sin_p, cos_r = 1.0 + r2 * cos_p;
    const int64_t quadrant = (int64_t)k & 3;
    const double c = quadrant == 0 ? cos_r : quadrant == 1 ? -sin_r : quadrant == 2 ? -cos_r : sin_r;
    const double s = quadrant == 0 ? sin_r : quadrant == 1 ? cos_r : quadrant == 2 ? -sin_r : -cos_r;
    *cos_out = (float)c;
    *sin_out = (float)s;
}

/* ``out[i] = sigmoid(x[i])`` for ``count`` contiguous float32 values: the same bits on every CPU
 * and for every ``count`` (ATen's vectorized sigmoid rounds its vector body and its scalar tail
 * differently, so a value's result depends on where it falls in the tensor). */
void dsv4_sigmoid_f32(float *out, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; ++i) out[i] = sigmoid(x[i]);
}

/* ``cos[i], sin[i]`` of ``angles[i]`` (``cos_sin_scalar``) for ``count`` contiguous float32
 * angles: the rotary tables of a step, the same bits on every CPU. */
void dsv4_cos_sin_f32(float *cos, float *sin, const float *angles, int64_t count) {
    for (int64_t i = 0; i < count; ++i) cos_sin_scalar(angles[i], cos + i, sin + i);
}


/* A hyper-connection's mixing weights from its ``tokens`` x (2 + n) * n float32 ``logits``
 * (``dsv4.hyper.HyperConnection``): each logit times its part's ``scale`` (3 values: pre,
 * post, comb) plus its ``base``; ``pre = sigmoid + eps`` and ``post = 2 * sigmoid`` (tokens x
 * n each); ``comb``, the row-wise softmax of the last n * n plus eps, into the top-left block
 * of ``bordered`` (tokens x (n + 1) x (n + 1), its last row and column set to eps), then
 * ``iters`` Sinkhorn rounds on it. ATen's steps in its order; its exp (in sigmoid and softmax)
 * and the softmax's division may differ in the last place. */
void dsv4_hc_weights_f32(float *pre, float *post, float *bordered, const float *logits,
                         const float *scale, const float *base, int64_t tokens, int64_t n,
                         float eps, int64_t iters) {
    const int64_t width = (2 + n) * n, side = n + 1;
    for (int64_t t = 0; t < tokens; ++t) {
        const float *z = logits + t * width;
        float *m = bordered + t * side * side;
        for (int64_t i = 0; i < n; ++i) {
            pre[t * n + i] = sigmoid(z[i] * scale[0] + base[i]) + eps;
            post[t * n + i] = sigmoid(z[n + i] * scale[1] + base[n + i]) * 2.0f;
        }
        for (int64_t r = 0; r < n; ++r) {
            const float *row = z + 2 * n + r * n, *row_base = base + 2 * n + r * n;
            float *out = m + r * side, largest = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                out[j] = row[j] * scale[2] + row_base[j];
                largest = out[j] > largest ? out[j] : largest;
            }
            for (int64_t j = 0; j < n; ++j) {
                out[j] = exp_scalar(out[j] - largest);
                sum += out[j];
            }
            const float inverse = 1.0f / sum; /* ATen multiplies by the reciprocal */
            for (int64_t j = 0; j < n; ++j) out[j] = eps + out[j] * inverse;
            out[n] = eps;
        }
        for (int64_t j = 0; j <= n; ++j) m[n * side + j] = eps;
        sinkhorn_one(m, n, iters);
    }
}

static inline void hc_collapse_body(float *out, const float *pre, const float *x,
                                    int64_t tokens, int64_t n, int64_t hidden) {
    for (int64_t t = 0; t < tokens; ++t) {
        float *dst = out + t * hidden;
        for (int64_t h = 0; h < hidden; ++h) dst[h] = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            const float weight = pre[t * n + i], *src = x + (t * n + i) * hidden;
            for (int64_t h = 0; h < hidden; ++h) dst[h] += weight * src[h];
        }
    }
}

/* ``out[t, h] = sum over i of pre[t, i] * x[t, i, h]`` (``tokens`` x n x ``hidden`` float32
 * ``x``, contiguous): the pre-weighted sum of the streams, i ascending. */
TWO_ISAS(, dsv4_hc_collapse_f32, hc_collapse_body,
         (float *out, const float *pre, const float *x, int64_t tokens, int64_t n, int64_t hidden),
         (out, pre, x, tokens, n, hidden))

static inline void hc_mix_body(float *out, const float *streams, const float *post,
                               const float *comb_t, int64_t comb_stride_t, int64_t comb_stride_m,
                               int64_t comb_stride_i, const float *output, int64_t tokens,
                               int64_t n, int64_t hidden) {
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t m = 0; m < n; ++m) {
            float *dst = out + (t * n + m) * hidden;
            for (int64_t h = 0; h < hidden; ++h) dst[h] = 0.0f;
            for (int64_t i = 0; i < n; ++i) {
                const float weight = comb_t[t * comb_stride_t + m * comb_stride_m + i * comb_stride_i];
                const float *src = streams + (t * n + i) * hidden;
                for (int64_t h = 0; h < hidden; ++h) dst[h] += weight * src[h];
            }
            const float scale = post[t * n + m], *block = output + t * hidden;
            for (int64_t h = 0; h < hidden; ++h) dst[h] = scale * block[h] + dst[h];
        }
    }
}

/* New streams after a block (``dsv4.hyper.mix``): ``out[t, m, h] = post[t, m] * output[t, h]
 * + sum over i of comb_t[t, m, i] * streams[t, i, h]``, the sum over i ascending and added last.
 * ``comb_t`` is read through its strides (a transposed view of ``bordered``); everything else
 * is contiguous float32. */
TWO_ISAS(, dsv4_hc_mix_f32, hc_mix_body,
         (float *out, const float *streams, const float *post, const float *comb_t,
          int64_t comb_stride_t, int64_t comb_stride_m, int64_t comb_stride_i,
          const float *output, int64_t tokens, int64_t n, int64_t hidden),
         (out, streams, post, comb_t, comb_stride_t, comb_stride_m, comb_stride_i, output, tokens,
          n, hidden))

#define SQUARE_LANES 16

static inline void rms_norm_body(float *out, const float *x, const float *weight, int64_t rows,
                                 int64_t width, float eps) {
    const int64_t body = width - width % SQUARE_LANES;
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * width;
        float *dst = out + r * width;
        double lanes[SQUARE_LANES] = {0.0};
        for (int64_t i = 0; i < body; i += SQUARE_LANES)
            for (int l = 0; l < SQUARE_LANES; ++l)
                lanes[l] += (double)row[i + l] * (double)row[i + l];
        double squares = 0.0;
        for (int l = 0; l < SQUARE_LANES; ++l) squares += lanes[l];
        for (int64_t i = body; i < width; ++i) squares += (double)row[i] * (double)row[i];
        const float mean = (float)(squares / (double)width);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (weight == NULL) {
            for (int64_t i = 0; i < width; ++i) dst[i] = row[i] * scale;
        } else {
            for (int64_t i = 0; i < width; ++i) dst[i] = (row[i] * scale) * weight[i];
        }
    }
}

/* RMS norm of each of ``rows`` contiguous rows of ``width`` float32 values into ``out``:
 * ``x * (1 / sqrt(mean(x^2) + eps))``, then times ``weight`` (``width`` values) unless it is
 * NULL — ATen's ``rms_norm`` in the order it rounds, except that the sum of squares is
 * accumulated in double, in ``SQUARE_LANES`` partial sums (column i into sum i mod 16, in column
 * order) added in order, then the columns past the last multiple of 16 (ATen's vectorised
 * float sum rounds differently; the mean then differs from ATen's by at most a rounding of its
 * own). Each square is exact in double. */
TWO_ISAS(, dsv4_rms_norm_f32, rms_norm_body,
         (float *out, const float *x, const float *weight, int64_t rows, int64_t width,
          float eps),
         (out, x, weight, rows, width, eps))

/* One element of the clamped SwiGLU: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``. */
static inline float swiglu_one(float g, float u, float limit) {
    const float clamped = g > limit ? limit : g;
    const float bounded = u < -limit ? -limit : (u > limit ? limit : u);
    return (clamped / (1.0f + exp_scalar(-clamped))) * bounded;
}

static void swiglu_baseline(float *out, const float *gate, int64_t gate_stride, const float *up,
                            int64_t up_stride, int64_t rows, int64_t width, float limit) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *dst = out + r * width;
        for (int64_t i = 0; i < width; ++i) dst[i] = swiglu_one(g[i], u[i], limit);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* ``exp_scalar`` in 16 lanes, operation for operation. */
__attribute__((target("avx512f"))) static inline __m512 exp_lanes(__m512 x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 high = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HIGH), _CMP_GT_OQ);
    const __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LOW), _CMP_LT_OQ);
    const __m512 clamped = _mm512_mask_blend_ps(low, x, _mm512_set1_ps(EXP_LOW));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(
        n, _mm512_set1_ps(-EXP_LN2_LOW),
        _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_HIGH), clamped));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i whole = _mm512_cvtps_epi32(n); /* n is whole: exact */
    /* whole / 2 rounded toward zero, as C divides */
    const __m512i half = _mm512_srai_epi32(
        _mm512_add_epi32(whole, _mm512_srli_epi32(whole, 31)), 1);
    const __m512i bias = _mm512_set1_epi32(127);
    const __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
    const __m512 second = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(whole, half), bias), 23));
    __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, first), second);
    e = _mm512_mask_blend_ps(high, e, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(nan, e, x);
}

__attribute__((target("avx512f"))) static void swiglu_avx512(
    float *out, const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
    int64_t rows, int64_t width, float limit) {
    const __m512 top = _mm512_set1_ps(limit), bottom = _mm512_set1_ps(-limit);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *dst = out + r * width;
        for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 m = lanes(width - i);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
            const __m512 clamped =
                _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gv, top, _CMP_GT_OQ), gv, top);
            __m512 bounded =
                _mm512_mask_blend_ps(_mm512_cmp_ps_mask(uv, top, _CMP_GT_OQ), uv, top);
            bounded = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(uv, bottom, _CMP_LT_OQ), bounded,
                                           bottom);
            const __m512 negated = _mm512_sub_ps(_mm512_setzero_ps(), clamped);
            const __m512 silu =
                _mm512_div_ps(clamped, _mm512_add_ps(one, exp_lanes(negated)));
            _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(silu, bounded));
        }
    }
}
#endif

/* The clamped SwiGLU of ``rows`` x ``width`` float32 values (``dsv4.expert_kernels.swiglu``):
 * ``silu(min(gate, limit)) * clamp(up, -limit, limit)``, silu as ATen's ``x / (1 + exp(-x))``
 * with ``exp_scalar``'s exp (a unit in the last place from libm's), NaN kept as ATen's
 * clamp keeps it; 16 lanes at a time where the CPU has AVX-512, the same bits. ``gate`` and
 * ``up`` rows start ``gate_stride`` and ``up_stride`` values apart (the two halves of one
 * product); ``out`` is contiguous. */
void dsv4_swiglu_f32(float *out, const float *gate, int64_t gate_stride, const float *up,
                     int64_t up_stride, int64_t rows, int64_t width, float limit) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512()) {
        swiglu_avx512(out, gate, gate_stride, up, up_stride, rows, width, limit);
        return;
    }
#endif
    swiglu_baseline(out, gate, gate_stride, up, up_stride, rows, width, limit);
}

/* ``values[i] = exp_scalar(values[i])`` for ``count`` values, 16 lanes at a time where the CPU
 * has AVX-512 (the same bits). */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static void exp_avx512(float *values, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 m = lanes(count - i);
        _mm512_mask_storeu_ps(values + i, m, exp_lanes(_mm512_maskz_loadu_ps(m, values + i)));
    }
}
#endif

static void exp_in_place(float *values, int64_t count) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512()) {
        exp_avx512(values, count);
        return;
    }
#endif
    for (int64_t i = 0; i < count; ++i) values[i] = exp_scalar(values[i]);
}

/* Rotary embedding (``dsv4.rope.RotaryEmbedding.rotate``) of ``tokens`` x ``heads`` vectors of
 * ``width`` contiguous float32 values: ``x * cos + x[swap] * sin`` (``- x[swap] * sin`` when
 * ``inverse``), each product rounded, then the sum: ATen's three kernels, bit for bit. ``cos``
 * and ``sin`` hold one row of ``width`` per token, rows ``table_stride`` values apart; ``swap``
 * is the channel each channel pairs with. */
void dsv4_rope_f32(float *out, const float *x, const float *cos, const float *sin,
                   int64_t table_stride, const int64_t *swap, int64_t tokens, int64_t heads,
                   int64_t width, int64_t inverse) {
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * table_stride, *s = sin + t * table_stride;
        for (int64_t h = 0; h < heads; ++h) {
            const float *v = x + (t * heads + h) * width;
            float *dst = out + (t * heads + h) * width;
            for (int64_t j = 0; j < width; ++j) {
                const float kept = v[j] * c[j], turned = v[swap[j]] * s[j];
                dst[j] = inverse ? kept - turned : kept + turned;
            }
        }
    }
}

#define LANES 16

/* One output of ``linear_rows``: ``x . w`` over ``in_features`` columns as 16 partial sums
 * (column i into sum i mod 16, in column order, one fused multiply-add per term), added in
 * order, then the columns past the last multiple of 16, one fused multiply-add each. The vector
 * kernels below compute exactly this (a vector FMA rounds as ``fmaf``). */
static float dot_lanes(const float *x, const float *w, int64_t in_features) {
    const int64_t body = in_features - in_features % LANES;
    float acc[LANES] = {0};
    for (int64_t i = 0; i < body; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = fmaf(x[i + l], w[i + l], acc[l]);
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += acc[l];
    for (int64_t i = body; i < in_features; ++i) sum = fmaf(x[i], w[i], sum);
    return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* Values ahead of the weight being read that each step of ``dot_rows`` asks for into the
 * second-level cache (8 KiB: the weight rows follow one another, so this runs into the next
 * rows; a prefetch never faults past the end). */
#define DOT_PREFETCH 2048

/* ``dot_lanes`` of ROWS rows of ``x`` (``x_stride`` apart) with one weight row ``w``, into
 * ``out[r * out_stride]``: the weight row read once for all ROWS rows, the 16 sums of each row
 * in two vector registers. */
#define DEFINE_DOT_ROWS(ROWS)                                                                   \
    __attribute__((target("avx2,fma"))) static void dot_rows_##ROWS(                            \
        float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *w,       \
        int64_t in_features) {                                                                  \
        const int64_t body = in_features - in_features % LANES;                                 \
        const float *x0 = x, *x1 = x + x_stride * (ROWS > 1), *x2 = x + 2 * x_stride * (ROWS > 2); \
        const float *x3 = x + 3 * x_stride * (ROWS > 3);                                        \
        __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0;   \
        __m256 h3 = l0;                                                                         \
        for (int64_t i = 0; i < body; i += LANES) {                                             \
            _mm_prefetch((const char *)(w + i + DOT_PREFETCH), _MM_HINT_T1);                    \
            const __m256 wl = _mm256_loadu_ps(w + i), wh = _mm256_loadu_ps(w + i + 8);           \
            l0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), wl, l0);                              \
            h0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 8), wh, h0);                          \
            if (ROWS > 1) {                                                                     \
                l1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), wl, l1);                          \
                h1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 8), wh, h1);                      \
            }                                                                                   \
            if (ROWS > 2) {                                                                     \
                l2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i), wl, l2);                          \
                h2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 8), wh, h2);                      \
            }                                                                                   \
            if (ROWS > 3) {                                                                     \
                l3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i), wl, l3);                          \
                h3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i + 8), wh, h3);                      \
            }                                                                                   \
        }                                                                                       \
        const __m256 lows[4] = {l0, l1, l2, l3}, highs[4] = {h0, h1, h2, h3};                   \
        const float *rows_x[4] = {x0, x1, x2, x3};                                              \
        for (int r = 0; r < ROWS; ++r) {                                                        \
            float acc[LANES];                                                                   \
            _mm256_storeu_ps(acc, lows[r]);                                                     \
            _mm256_storeu_ps(acc + 8, highs[r]);                                                \
            float sum = 0.0f;                                                                   \
            for (int l = 0; l < LANES; ++l) sum += acc[l];                                      \
            for (int64_t i = body; i < in_features; ++i) sum = fmaf(rows_x[r][i], w[i], sum);   \
            out[r * out_stride] = sum;                                                          \
        }                                                                                       \
    }

DEFINE_DOT_ROWS(1)
DEFINE_DOT_ROWS(2)
DEFINE_DOT_ROWS(3)
DEFINE_DOT_ROWS(4)
#endif

/* ``out[m, o] = sum over i of x[m, i] * weight[o, i]`` for a few ``rows`` of ``x`` (``rows`` x
 * ``in_features``, rows ``x_stride`` values apart) and a contiguous ``weight`` (``out_features`` x
 * ``in_features``, as ``nn.Linear`` stores it) into ``out`` (rows ``out_stride`` values apart):
 * every weight row is read once, for every row of ``x`` (four at a time), so a decode step's
 * products stream their weights near the machine's read bandwidth, where a general matrix
 * product of one row reaches a third of it. Each output is ``dot_lanes``: the same operations
 * whatever ``rows`` is and whichever kernel ran, so a row's result does not depend on the rows
 * beside it. */
static void linear_rows(float *out, int64_t out_stride, const float *x, int64_t x_stride,
                        const float *weight, int64_t rows, int64_t out_features,
                        int64_t in_features) {
    const int vector = has_fma();
    for (int64_t o = 0; o < out_features; ++o) {
        const float *w = weight + o * in_features;
        int64_t m = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector) {
            for (; m + 4 <= rows; m += 4)
                dot_rows_4(out + m * out_stride + o, out_stride, x + m * x_stride, x_stride, w,
                           in_features);
            float *dst = out + m * out_stride + o;
            const float *src = x + m * x_stride;
            switch (rows - m) {
            case 3: dot_rows_3(dst, out_stride, src, x_stride, w, in_features); break;
            case 2: dot_rows_2(dst, out_stride, src, x_stride, w, in_features); break;
            case 1: dot_rows_1(dst, out_stride, src, x_stride, w, in_features); break;
            default: break;
            }
            continue;
        }
#endif
        (void)vector;
        for (; m < rows; ++m)
            out[m * out_stride + o] = dot_lanes(x + m * x_stride, w, in_features);
    }
}

/* ``linear_rows`` on contiguous rows: ``out`` is ``rows`` x ``out_features``. */
void dsv4_linear_f32(float *out, const float *x, const float *weight, int64_t rows,
                     int64_t out_features, int64_t in_features) {
    linear_rows(out, out_features, x, in_features, weight, rows, out_features, in_features);
}

/* ``groups`` independent products (``dsv4.layers.GroupedLinear``): ``x`` is ``rows`` x ``groups``
 * x ``in_features``, ``weight`` ``groups`` x ``out_features`` x ``in_features`` and ``out``
 * ``rows`` x ``groups`` x ``out_features``, all contiguous; group g's rows are ``linear_rows`` of
 * x[:, g] and weight[g], each weight read once for all rows. */
void dsv4_grouped_linear_f32(float *out, const float *x, const float *weight, int64_t rows,
                             int64_t groups, int64_t out_features, int64_t in_features) {
    for (int64_t g = 0; g < groups; ++g)
        linear_rows(out + g * out_features, groups * out_features, x + g * in_features,
                    groups * in_features, weight + g * out_features * in_features, rows,
                    out_features, in_features);
}

/* ---- Routed experts: each chosen expert's weights read once per block of its rows ---- */

#define STRIP_ROWS 6 /* rows whose sums one strip kernel keeps in registers */
#define MAX_BLOCK_ROWS 64 /* rows multiplied per read of a matrix in panels */

/* Expert matrices are read in *panels*: a matrix of ``depth`` x ``width`` (an expert's transpose,
 * ``in`` x ``out``) stored as ``width / panel`` panels of ``panel`` columns, each panel's
 * ``depth`` x ``panel`` values contiguous, one after the other. ``panel == width`` is the matrix
 * itself (``dsv4.experts.columns_first``); a narrow panel is read as one plain stream while its
 * sums stay in registers, which a strip of a wide matrix is not (one thread, 96 matrices of
 * 512 x 512 read from memory, four rows: 29 GB/s in panels of 64 columns, the machine's read
 * bandwidth, against 9-11 GB/s for every order that reads 64 columns of the whole matrix).
 *
 * ``out[r][p * panel + q] = sum over i of in[r][i] * w[p * depth * panel + i * panel + q]`` for
 * ``rows`` rows: one fused multiply-add per term, i ascending from zero. Every kernel below
 * computes each output with these very operations (``fmaf`` rounds once, as a vector FMA does),
 * so an output never depends on the layout, the rows or the kernel beside it. */
static inline void panel_columns(float *const *out, const float *const *in, int rows, const float *w,
                          int64_t depth, int64_t panel, int64_t panels) {
    for (int64_t p = 0; p < panels; ++p) {
        const float *wp = w + p * depth * panel;
        for (int r = 0; r < rows; ++r) {
            float *o = out[r] + p * panel;
            for (int64_t q = 0; q < panel; ++q) o[q] = 0.0f;
            for (int64_t i = 0; i < depth; ++i) {
                const float v = in[r][i], *wi = wp + i * panel;
                for (int64_t q = 0; q < panel; ++q) o[q] = fmaf(v, wi[q], o[q]);
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* ``panel_columns`` for ROWS rows, the ``count`` columns ``q0 ..`` of one panel (``wp``,
 * ``panel`` columns wide) and the terms ``from`` to ``to`` of the depth, in VECS vectors of 16
 * (``count`` at most 16 * VECS): the ROWS x VECS sums in registers, each weight vector loaded
 * once for every row, the columns past ``count`` masked off. The sums start at zero when
 * ``from`` is 0 and from the outputs otherwise, so running the depth in stretches performs each
 * output's fused multiply-adds in the same order as one run: the same bits. A narrow panel
 * (fewer than 64 columns) takes fewer vectors rather than multiplying masked-off lanes. */
#define STRIP_START(r, ROWS, VECS)                                                              \
    __m512 a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero;                      \
    if (ROWS > r && from > 0) {                                                                 \
        const float *o = out[r] + q0;                                                           \
        a##r##0 = _mm512_maskz_loadu_ps(m0, o);                                                 \
        if (VECS > 1) a##r##1 = _mm512_maskz_loadu_ps(m1, o + 16);                              \
        if (VECS > 2) a##r##2 = _mm512_maskz_loadu_ps(m2, o + 32);                              \
        if (VECS > 3) a##r##3 = _mm512_maskz_loadu_ps(m3, o + 48);                              \
    }
#define STRIP_FMA(r, ROWS, VECS)                                                                \
    if (ROWS > r) {                                                                             \
        const __m512 v = _mm512_set1_ps(x##r[i]);                                               \
        a##r##0 = _mm512_fmadd_ps(v, w0, a##r##0);                                              \
        if (VECS > 1) a##r##1 = _mm512_fmadd_ps(v, w1, a##r##1);                                \
        if (VECS > 2) a##r##2 = _mm512_fmadd_ps(v, w2, a##r##2);                                \
        if (VECS > 3) a##r##3 = _mm512_fmadd_ps(v, w3, a##r##3);                                \
    }
#define STRIP_STORE(r, ROWS, VECS)                                                              \
    if (ROWS > r) {                                                                             \
        float *o = out[r] + q0;                                                                 \
        _mm512_mask_storeu_ps(o, m0, a##r##0);                                                  \
        if (VECS > 1) _mm512_mask_storeu_ps(o + 16, m1, a##r##1);                               \
        if (VECS > 2) _mm512_mask_storeu_ps(o + 32, m2, a##r##2);                               \
        if (VECS > 3) _mm512_mask_storeu_ps(o + 48, m3, a##r##3);                               \
    }
/* Each strip asks for the weights ``PREFETCH_ROWS`` rows ahead into the second-level cache:
 * with the sums of six rows to update per row of weights, the out-of-order window holds too
 * few loads to keep the memory busy (measured, one thread, 6 rows x 64 columns, matrices of
 * 512 x 256 read from memory: 9.5 GB/s without, 14.4 GB/s with prefetches 32 rows ahead, the
 * machine's plain read reaching 15 GB/s; one row: 14.9 against 17.7 GB/s). A prefetch past the
 * matrix's end is harmless: it never faults. */
#define PREFETCH_ROWS 32
#define STRIP_PREFETCH(at, VECS)                                                                \
    _mm_prefetch((const char *)(at), _MM_HINT_T1);                                              \
    if (VECS > 1) _mm_prefetch((const char *)((at) + 16), _MM_HINT_T1);                         \
    if (VECS > 2) _mm_prefetch((const char *)((at) + 32), _MM_HINT_T1);                         \
    if (VECS > 3) _mm_prefetch((const char *)((at) + 48), _MM_HINT_T1);
/* (The sums are named variables, not an array: GCC 12 stores an array of them to the stack on
 * every iteration, which made the kernel store-bound at a quarter of its rate.) */
#define DEFINE_PANEL_STRIP(ROWS, VECS)                                                          \
    __attribute__((target("avx512f"))) static void panel_strip_##ROWS##_##VECS(                 \
        float *const *out, const float *const *in, const float *wp, int64_t from, int64_t to,   \
        int64_t panel, int64_t q0, int64_t count) {                                             \
        const __mmask16 m0 = lanes(count), m1 = lanes(count - 16), m2 = lanes(count - 32);      \
        const __mmask16 m3 = lanes(count - 48);                                                 \
        const float *x0 = in[0], *x1 = in[ROWS > 1 ? 1 : 0], *x2 = in[ROWS > 2 ? 2 : 0];        \
        const float *x3 = in[ROWS > 3 ? 3 : 0], *x4 = in[ROWS > 4 ? 4 : 0];                     \
        const float *x5 = in[ROWS > 5 ? 5 : 0];                                                 \
        const __m512 zero = _mm512_setzero_ps();                                                \
        STRIP_START(0, ROWS, VECS) STRIP_START(1, ROWS, VECS) STRIP_START(2, ROWS, VECS)        \
        STRIP_START(3, ROWS, VECS) STRIP_START(4, ROWS, VECS) STRIP_START(5, ROWS, VECS)        \
        const float *wi = wp + from * panel + q0;                                               \
        for (int64_t i = from; i < to; ++i, wi += panel) {                                      \
            STRIP_PREFETCH(wi + PREFETCH_ROWS * panel, VECS)                                    \
            const __m512 w0 = _mm512_maskz_loadu_ps(m0, wi);                                    \
            const __m512 w1 = VECS > 1 ? _mm512_maskz_loadu_ps(m1, wi + 16) : zero;             \
            const __m512 w2 = VECS > 2 ? _mm512_maskz_loadu_ps(m2, wi + 32) : zero;             \
            const __m512 w3 = VECS > 3 ? _mm512_maskz_loadu_ps(m3, wi + 48) : zero;             \
            STRIP_FMA(0, ROWS, VECS) STRIP_FMA(1, ROWS, VECS) STRIP_FMA(2, ROWS, VECS)          \
            STRIP_FMA(3, ROWS, VECS) STRIP_FMA(4, ROWS, VECS) STRIP_FMA(5, ROWS, VECS)          \
        }                                                                                       \
        STRIP_STORE(0, ROWS, VECS) STRIP_STORE(1, ROWS, VECS) STRIP_STORE(2, ROWS, VECS)        \
        STRIP_STORE(3, ROWS, VECS) STRIP_STORE(4, ROWS, VECS) STRIP_STORE(5, ROWS, VECS)        \
    }
#define DEFINE_PANEL_STRIPS(ROWS)                                                               \
    DEFINE_PANEL_STRIP(ROWS, 1)                                                                 \
    DEFINE_PANEL_STRIP(ROWS, 2)                                                                 \
    DEFINE_PANEL_STRIP(ROWS, 3)                                                                 \
    DEFINE_PANEL_STRIP(ROWS, 4)

DEFINE_PANEL_STRIPS(1)
DEFINE_PANEL_STRIPS(2)
DEFINE_PANEL_STRIPS(3)
DEFINE_PANEL_STRIPS(4)
DEFINE_PANEL_STRIPS(5)
DEFINE_PANEL_STRIPS(6)

typedef void (*panel_strip)(float *const *, const float *const *, const float *, int64_t,
                            int64_t, int64_t, int64_t, int64_t);
#define PANEL_STRIPS(ROWS)                                                                      \
    {panel_strip_##ROWS##_1, panel_strip_##ROWS##_2, panel_strip_##ROWS##_3,                    \
     panel_strip_##ROWS##_4}
static const panel_strip PANEL_STRIP[STRIP_ROWS][4] = {
    PANEL_STRIPS(1), PANEL_STRIPS(2), PANEL_STRIPS(3),
    PANEL_STRIPS(4), PANEL_STRIPS(5), PANEL_STRIPS(6),
};

/* The AVX2 strips: ``panel_strip_*`` with vectors of 8 (VECS of them, at most 32 columns) and
 * at most ``STRIP_ROWS_AVX2`` rows, so that the ROWS x VECS sums and a broadcast stay in the 16
 * registers (each weight vector is read from memory as an operand of the row's fused
 * multiply-add; the rows after the first find it in the first-level cache). The columns past
 * ``count`` are masked off. The same operations per output as ``panel_columns``: the same bits.
 * (Measured, one thread, AVX2, 48 weights of 512 x 1024 read from memory, four rows: 88 us a
 * matrix, 23.8 GB/s, where ``panel_columns`` compiled for AVX2 took 217 us, 9.7 GB/s: it keeps
 * the sums in memory.) */
#define STRIP_ROWS_AVX2 3
#define STRIP2_START(r, ROWS, VECS)                                                             \
    __m256 a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero;                      \
    if (ROWS > r && from > 0) {                                                                 \
        const float *o = out[r] + q0;                                                           \
        a##r##0 = full ? _mm256_loadu_ps(o) : _mm256_maskload_ps(o, m0);                        \
        if (VECS > 1) a##r##1 = full ? _mm256_loadu_ps(o + 8) : _mm256_maskload_ps(o + 8, m1);  \
        if (VECS > 2) a##r##2 = full ? _mm256_loadu_ps(o + 16) : _mm256_maskload_ps(o + 16, m2); \
        if (VECS > 3) a##r##3 = full ? _mm256_loadu_ps(o + 24) : _mm256_maskload_ps(o + 24, m3); \
    }
#define STRIP2_FMA(r, ROWS, VECS)                                                               \
    if (ROWS > r) {                                                                             \
        const __m256 v = _mm256_broadcast_ss(x##r + i);                                         \
        a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0);                                              \
        if (VECS > 1) a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1);                                \
        if (VECS > 2) a##r##2 = _mm256_fmadd_ps(v, w2, a##r##2);                                \
        if (VECS > 3) a##r##3 = _mm256_fmadd_ps(v, w3, a##r##3);                                \
    }
#define STRIP2_STORE_ONE(o, mask, a)                                                            \
    if (full)                                                                                   \
        _mm256_storeu_ps(o, a);                                                                 \
    else                                                                                        \
        _mm256_maskstore_ps(o, mask, a);
#define STRIP2_STORE(r, ROWS, VECS)                                                             \
    if (ROWS > r) {                                                                             \
        float *o = out[r] + q0;                                                                 \
        STRIP2_STORE_ONE(o, m0, a##r##0)                                                        \
        if (VECS > 1) { STRIP2_STORE_ONE(o + 8, m1, a##r##1) }                                  \
        if (VECS > 2) { STRIP2_STORE_ONE(o + 16, m2, a##r##2) }                                 \
        if (VECS > 3) { STRIP2_STORE_ONE(o + 24, m3, a##r##3) }                                 \
    }
/* A masked load or store costs several times a plain one on some CPUs (a masked store tens of
 * cycles on AMD's): the full strips do without. */
#define FULL_LOAD(at, mask) _mm256_loadu_ps(at)
#define MASKED_LOAD(at, mask) _mm256_maskload_ps(at, mask)
#define STRIP2_LOOP(ROWS, VECS, LOAD)                                                           \
    const float *wi = wp + from * panel + q0;                                                   \
    for (int64_t i = from; i < to; ++i, wi += panel) {                                          \
        _mm_prefetch((const char *)(wi + PREFETCH_ROWS * panel), _MM_HINT_T1);                  \
        if (VECS > 2) _mm_prefetch((const char *)(wi + PREFETCH_ROWS * panel + 16), _MM_HINT_T1); \
        const __m256 w0 = LOAD(wi, m0);                                                         \
        const __m256 w1 = VECS > 1 ? LOAD(wi + 8, m1) : zero;                                   \
        const __m256 w2 = VECS > 2 ? LOAD(wi + 16, m2) : zero;                                  \
        const __m256 w3 = VECS > 3 ? LOAD(wi + 24, m3) : zero;                                  \
        STRIP2_FMA(0, ROWS, VECS) STRIP2_FMA(1, ROWS, VECS) STRIP2_FMA(2, ROWS, VECS)           \
    }
#define DEFINE_PANEL_STRIP_AVX2(ROWS, VECS)                                                     \
    __attribute__((target("avx2,fma"))) static void panel_strip_avx2_##ROWS##_##VECS(           \
        float *const *out, const float *const *in, const float *wp, int64_t from, int64_t to,   \
        int64_t panel, int64_t q0, int64_t count) {                                             \
        const __m256i m0 = lanes8(count), m1 = lanes8(count - 8), m2 = lanes8(count - 16);      \
        const __m256i m3 = lanes8(count - 24);                                                  \
        const float *x0 = in[0], *x1 = in[ROWS > 1 ? 1 : 0], *x2 = in[ROWS > 2 ? 2 : 0];        \
        const __m256 zero = _mm256_setzero_ps();                                                \
        const int full = count == 8 * VECS;                                                     \
        STRIP2_START(0, ROWS, VECS) STRIP2_START(1, ROWS, VECS) STRIP2_START(2, ROWS, VECS)     \
        if (full) {                                                                             \
            STRIP2_LOOP(ROWS, VECS, FULL_LOAD)                                                  \
        } else {                                                                                \
            STRIP2_LOOP(ROWS, VECS, MASKED_LOAD)                                                \
        }                                                                                       \
        STRIP2_STORE(0, ROWS, VECS) STRIP2_STORE(1, ROWS, VECS) STRIP2_STORE(2, ROWS, VECS)     \
    }
#define DEFINE_PANEL_STRIPS_AVX2(ROWS)                                                          \
    DEFINE_PANEL_STRIP_AVX2(ROWS, 1)                                                            \
    DEFINE_PANEL_STRIP_AVX2(ROWS, 2)                                                            \
    DEFINE_PANEL_STRIP_AVX2(ROWS, 3)                                                            \
    DEFINE_PANEL_STRIP_AVX2(ROWS, 4)

/* The first ``count`` of 8 lanes as a mask of ``_mm256_maskload_ps`` (all from 8 on, none
 * below 1). */
__attribute__((target("avx2"))) static inline __m256i lanes8(int64_t count) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t n = count >= 8 ? 8 : (count > 0 ? (int32_t)count : 0);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), index);
}

DEFINE_PANEL_STRIPS_AVX2(1)
DEFINE_PANEL_STRIPS_AVX2(2)
DEFINE_PANEL_STRIPS_AVX2(3)

#define PANEL_STRIPS_AVX2(ROWS)                                                                 \
    {panel_strip_avx2_##ROWS##_1, panel_strip_avx2_##ROWS##_2, panel_strip_avx2_##ROWS##_3,     \
     panel_strip_avx2_##ROWS##_4}
static const panel_strip PANEL_STRIP_AVX2[STRIP_ROWS_AVX2][4] = {
    PANEL_STRIPS_AVX2(1), PANEL_STRIPS_AVX2(2), PANEL_STRIPS_AVX2(3),
};

/* Rows of weights in one stretch of a strip's depth: every block of ``STRIP_ROWS`` rows runs
 * over the stretch before the next one is read, so the stretch comes from memory once, for the
 * first block, and from the first-level cache for the others; the first block's prefetches keep
 * the memory busy while the others compute (measured, one thread, 16 rows, 512 x 256 matrices
 * read from memory: 47 us a matrix in stretches of 16 rows, 56 us in one stretch). */
#define STRETCH_ROWS 16

/* ``panel_columns`` by strips: each panel's columns ``columns`` at a time (4 vectors of the
 * widest instruction set there is), rows ``strip_rows`` at a time (``strips[rows - 1][vectors -
 * 1]``), the depth in stretches when more rows than one strip holds share the panel. */
static void panel_rows_in_strips(float *const *out, const float *const *in, int rows,
                                 const float *w, int64_t depth, int64_t panel, int64_t panels,
                                 const panel_strip (*strips)[4], int strip_rows, int64_t columns) {
    float *shifted[MAX_BLOCK_ROWS];
    const int64_t lanes_per_vector = columns / 4;
    for (int64_t p = 0; p < panels; ++p) {
        const float *wp = w + p * depth * panel;
        for (int r = 0; r < rows; ++r) shifted[r] = out[r] + p * panel;
        const int64_t stretch = rows <= strip_rows && panel <= columns ? depth : STRETCH_ROWS;
        for (int64_t from = 0; from < depth; from += stretch) {
            const int64_t to = depth - from < stretch ? depth : from + stretch;
            for (int64_t q0 = 0; q0 < panel; q0 += columns) {
                const int64_t count = panel - q0 < columns ? panel - q0 : columns;
                const int vecs = (int)((count + lanes_per_vector - 1) / lanes_per_vector);
                for (int first = 0; first < rows; first += strip_rows) {
                    const int block = rows - first < strip_rows ? rows - first : strip_rows;
                    strips[block - 1][vecs - 1](shifted + first, in + first, wp, from, to, panel,
                                                q0, count);
                }
            }
        }
    }
}

/* ``panel_columns`` compiled for each instruction set: its column loop becomes vector FMAs. */
__attribute__((target("avx2,fma"))) static void panel_columns_avx2(
    float *const *out, const float *const *in, int rows, const float *w, int64_t depth,
    int64_t panel, int64_t panels) {
    panel_columns(out, in, rows, w, depth, panel, panels);
}
__attribute__((target("avx512f"))) static void panel_columns_avx512(
    float *const *out, const float *const *in, int rows, const float *w, int64_t depth,
    int64_t panel, int64_t panels) {
    panel_columns(out, in, rows, w, depth, panel, panels);
}

/* ``panel_columns`` on the fastest kernel for the rows and the panel. One row on panels of 64
 * columns takes the plain loop: it streams each panel front to back with the row's 64 sums in
 * the first-level cache, where a strip keeps them in registers but reads the panel in 16-row
 * stretches (measured, one thread, 48 weights of 512 x 1024 read from memory: 26.6 GB/s
 * against a strip's 17.1 with AVX-512, 21.4 against 17.7 with AVX2). */
static void panel_rows(float *const *out, const float *const *in, int rows, const float *w,
                       int64_t depth, int64_t panel, int64_t panels) {
    const int one_stream = rows == 1 && panel == 64;
    if (one_stream && has_avx512())
        panel_columns_avx512(out, in, rows, w, depth, panel, panels);
    else if (one_stream && has_fma())
        panel_columns_avx2(out, in, rows, w, depth, panel, panels);
    else if (has_avx512())
        panel_rows_in_strips(out, in, rows, w, depth, panel, panels, PANEL_STRIP, STRIP_ROWS, 64);
    else if (has_fma())
        panel_rows_in_strips(out, in, rows, w, depth, panel, panels, PANEL_STRIP_AVX2,
                             STRIP_ROWS_AVX2, 32);
    else
        panel_columns(out, in, rows, w, depth, panel, panels);
}
#else
static void panel_rows(float *const *out, const float *const *in, int rows, const float *w,
                       int64_t depth, int64_t panel, int64_t panels) {
    panel_columns(out, in, rows, w, depth, panel, panels);
}
#endif

/* ``groups`` independent products of ``rows`` rows on matrices in panels: ``x`` is ``rows`` x
 * ``groups`` x ``depth`` and ``out`` ``rows`` x ``groups`` x ``panels * panel``, contiguous;
 * group g's matrix (``depth`` x ``panels * panel``, the transpose of its ``nn.Linear`` weight)
 * is ``panels`` panels of ``panel`` columns from ``w + g * depth * panels * panel``
 * (``panel_columns``). The rows go a block of ``MAX_BLOCK_ROWS`` at a time, each block
 * reading the matrix once; every output is ``panel_columns``' one: a row's result does not
 * depend on the rows beside it. */
void dsv4_linear_panels_f32(float *out, const float *x, const float *w, int64_t rows,
                            int64_t groups, int64_t depth, int64_t panel, int64_t panels) {
    const int64_t width = panel * panels;
    for (int64_t g = 0; g < groups; ++g) {
        const float *matrix = w + g * depth * width;
        for (int64_t first = 0; first < rows; first += MAX_BLOCK_ROWS) {
            const int block =
                rows - first < MAX_BLOCK_ROWS ? (int)(rows - first) : MAX_BLOCK_ROWS;
            float *out_rows[MAX_BLOCK_ROWS];
            const float *in_rows[MAX_BLOCK_ROWS];
            for (int r = 0; r < block; ++r) {
                out_rows[r] = out + ((first + r) * groups + g) * width;
                in_rows[r] = x + ((first + r) * groups + g) * depth;
            }
            panel_rows(out_rows, in_rows, block, matrix, depth, panel, panels);
        }
    }
}

/* The routed experts of ``dsv4.experts`` in one call: ``out[t] = sum over slots j of
 * weights[t, j] * expert_{experts[t, j]}(x[t])`` (``tokens`` x ``hidden``, contiguous), each
 * expert the clamped SwiGLU of ``dsv4_swiglu_f32`` between two products. ``gate_up`` holds each
 * expert's transpose (``hidden`` x 2 * ``inter``, gate columns first) in panels of
 * ``gate_up_panel`` columns and ``down`` likewise (``inter`` x ``hidden``, panels of
 * ``down_panel``), one expert after the other (``panel_columns``; a panel as wide as the matrix
 * is the stack laid out ``columns_first``). Slots go by expert, ascending, then by slot; the
 * rows of one expert are multiplied a block of ``MAX_BLOCK_ROWS`` at a time, so each chosen
 * expert's weights are read once per block and an unchosen one never. A token's output is its
 * own slots' terms added to zero in that order (each product rounded, then added): it depends
 * on its routing only, never on the tokens beside it or on the panels. Returns 0; -1 where
 * scratch memory could not be allocated, -2 where an expert index is outside the stacks (``out``
 * is then untouched). */
int64_t dsv4_routed_experts_f32(float *out, const float *x, const int64_t *experts,
                                const float *weights, const float *gate_up, const float *down,
                                int64_t tokens, int64_t k, int64_t num_experts, int64_t hidden,
                                int64_t inter, int64_t gate_up_panel, int64_t down_panel,
                                float limit) {
    const int64_t slots = tokens * k;
    for (int64_t s = 0; s < slots; ++s)
        if (experts[s] < 0 || experts[s] >= num_experts) return -2;
    int64_t *starts = malloc((size_t)(num_experts + 1) * sizeof(int64_t));
    int64_t *order = malloc((size_t)(slots > 0 ? slots : 1) * sizeof(int64_t));
    float *scratch = malloc((size_t)MAX_BLOCK_ROWS * (3 * inter + hidden) * sizeof(float));
    if (starts == NULL || order == NULL || scratch == NULL) {
        free(starts);
        free(order);
        free(scratch);
        return -1;
    }
    memset(starts, 0, (size_t)(num_experts + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < slots; ++s) ++starts[experts[s] + 1];
    for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
    int64_t *next = malloc((size_t)(num_experts > 0 ? num_experts : 1) * sizeof(int64_t));
    if (next == NULL) {
        free(starts);
        free(order);
        free(scratch);
        return -1;
    }
    memcpy(next, starts, (size_t)num_experts * sizeof(int64_t));
    for (int64_t s = 0; s < slots; ++s) order[next[experts[s]]++] = s;
    free(next);

    memset(out, 0, (size_t)(tokens * hidden) * sizeof(float));
    float *products = scratch, *activated = scratch + MAX_BLOCK_ROWS * 2 * inter;
    float *results = activated + MAX_BLOCK_ROWS * inter;
    float *product_rows[MAX_BLOCK_ROWS], *activated_rows[MAX_BLOCK_ROWS];
    float *result_rows[MAX_BLOCK_ROWS];
    for (int r = 0; r < MAX_BLOCK_ROWS; ++r) {
        product_rows[r] = products + r * 2 * inter;
        activated_rows[r] = activated + r * inter;
        result_rows[r] = results + r * hidden;
    }
    for (int64_t e = 0; e < num_experts; ++e) {
        const float *gate_up_t = gate_up + e * 2 * inter * hidden;
        const float *down_t = down + e * hidden * inter;
        for (int64_t first = starts[e]; first < starts[e + 1]; first += MAX_BLOCK_ROWS) {
            const int64_t left = starts[e + 1] - first;
            const int rows = left < MAX_BLOCK_ROWS ? (int)left : MAX_BLOCK_ROWS;
            const float *inputs[MAX_BLOCK_ROWS];
            for (int r = 0; r < rows; ++r) inputs[r] = x + (order[first + r] / k) * hidden;
            panel_rows(product_rows, inputs, rows, gate_up_t, hidden, gate_up_panel,
                       2 * inter / gate_up_panel);
            dsv4_swiglu_f32(activated, products, 2 * inter, products + inter, 2 * inter, rows,
                            inter, limit);
            panel_rows(result_rows, (const float *const *)activated_rows, rows, down_t, inter,
                       down_panel, hidden / down_panel);
            for (int r = 0; r < rows; ++r) {
                const int64_t slot = order[first + r];
                const float weight = weights[slot];
                float *dst = out + (slot / k) * hidden;
                for (int64_t h = 0; h < hidden; ++h) dst[h] = dst[h] + weight * result_rows[r][h];
            }
        }
    }
    free(starts);
    free(order);
    free(scratch);
    return 0;
}

/* ---- Rounding to a narrow dtype ---- */

/* The narrow dtype an operator on float32 copies of narrow tensors rounds its intermediate
 * values to, at the points where the composite it replaces computes in that dtype: none
 * (float32 throughout), bfloat16 or float16 (``dsv4.native_ops``'s ``rounding``). */
enum { ROUND_NONE = 0, ROUND_BF16 = 1, ROUND_F16 = 2 };

/* ``x`` rounded to ``rounding``'s dtype (to nearest, ties to even, as ATen converts; past the
 * largest finite value to infinity; NaN stays NaN) and back to float32, which holds it exactly. */
static inline float round_to(float x, int64_t rounding) {
    if (rounding == ROUND_BF16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return x;
        bits += 0x7fffu + ((bits >> 16) & 1u);
        bits &= 0xffff0000u;
        memcpy(&x, &bits, sizeof bits);
        return x;
    }
    if (rounding == ROUND_F16) return (float)(_Float16)x;
    return x;
}

/* ---- Attention of decode-sized steps, keys read in place ---- */

/* ``q . key`` over ``width`` values as 8 partial sums (column i into sum i mod 8, in column
 * order) added in order, then the columns past the last multiple of 8: the order every
 * attention and indexer dot product of this file takes. */
static inline float dot8(const float *q, const float *key, int64_t width) {
    const int64_t body = width - width % 8;
    float partial[8] = {0};
    for (int64_t i = 0; i < body; i += 8)
        for (int l = 0; l < 8; ++l) partial[l] += q[i + l] * key[i + l];
    float dot = 0.0f;
    for (int l = 0; l < 8; ++l) dot += partial[l];
    for (int64_t i = body; i < width; ++i) dot += q[i] * key[i];
    return dot;
}

/* One token's attention: one softmax per head over the ``count`` keys (pointers) it may see
 * (``seen``) and the head's sink, into ``out`` (``heads`` x ``width``); ``logits`` is scratch for
 * ``count`` values. ``l_k = dot8(q, key_k) * scaling``;
 * ``p_k = exp(l_k - m) / (sum over seen j of exp(l_j - m) + exp(sink - m))``, ``m`` the largest
 * seen logit or the sink, exp as ``exp_scalar`` (16 at a time where the CPU has AVX-512), the
 * sum in key order; ``out = sum over seen k of p_k * key_k``, keys in order. Where the composite
 * computes in a narrow dtype (``rounding``), the dot product, the scaled logit and ``p_k`` are
 * each rounded to it, as the composite's narrow product, scaling and softmax output are. */
static inline void attend_token_body(float *out, const float *queries,
                                     const float *const *keys, const uint8_t *seen,
                                     int64_t count, int64_t heads, int64_t width,
                                     const float *sinks, float scaling, int64_t rounding,
                                     float *logits) {
    for (int64_t h = 0; h < heads; ++h) {
        const float *q = queries + h * width;
        float largest = sinks[h];
        for (int64_t k = 0; k < count; ++k) {
            if (!seen[k]) continue;
            logits[k] = round_to(round_to(dot8(q, keys[k], width), rounding) * scaling, rounding);
            largest = logits[k] > largest ? logits[k] : largest;
        }
        for (int64_t k = 0; k < count; ++k) logits[k] = seen[k] ? logits[k] - largest : -INFINITY;
        exp_in_place(logits, count);
        float total = 0.0f;
        for (int64_t k = 0; k < count; ++k)
            if (seen[k]) total += logits[k];
        total += exp_scalar(sinks[h] - largest);
        float *dst = out + h * width;
        for (int64_t i = 0; i < width; ++i) dst[i] = 0.0f;
        for (int64_t k = 0; k < count; ++k) {
            if (!seen[k]) continue;
            const float p = round_to(logits[k] / total, rounding), *key = keys[k];
            for (int64_t i = 0; i < width; ++i) dst[i] += p * key[i];
        }
    }
}

TWO_ISAS(static, attend_token, attend_token_body,
         (float *out, const float *queries, const float *const *keys, const uint8_t *seen,
          int64_t count, int64_t heads, int64_t width, const float *sinks, float scaling,
          int64_t rounding, float *logits),
         (out, queries, keys, seen, count, heads, width, sinks, scaling, rounding, logits))

/* Attention of ``tokens`` queries (``tokens`` x ``heads`` x ``width``) over keys read in place
 * (``dsv4.attention``'s ``_attend_queries``): token t's keys are rows ``key_rows[t, j]`` of the
 * ``key_count`` x ``width`` table ``keys`` (its window, ``window`` per token), then rows
 * ``entry_rows[t, j]`` of the ``entry_count`` x ``width`` table ``entries`` (``per_entries`` per
 * token; none where ``entries`` is NULL), each taking part where its byte in ``key_seen`` /
 * ``entry_seen`` is set (a key the token may not see is left out, where the composite weighs it
 * by an exact zero). Everything is contiguous. Returns 0; -1 without scratch memory, -2 where a
 * seen row is outside its table (``out`` is then untouched). ``rounding`` as ``round_to``. */
int64_t dsv4_attend_f32(float *out, const float *queries, const float *keys,
                        const int64_t *key_rows, const uint8_t *key_seen, const float *entries,
                        const int64_t *entry_rows, const uint8_t *entry_seen, const float *sinks,
                        int64_t tokens, int64_t heads, int64_t width, int64_t key_count,
                        int64_t window, int64_t entry_count, int64_t per_entries, float scaling,
                        int64_t rounding) {
    if (entries == NULL) per_entries = 0;
    for (int64_t s = 0; s < tokens * window; ++s)
        if (key_seen[s] && (key_rows[s] < 0 || key_rows[s] >= key_count)) return -2;
    for (int64_t s = 0; s < tokens * per_entries; ++s)
        if (entry_seen[s] && (entry_rows[s] < 0 || entry_rows[s] >= entry_count)) return -2;
    const int64_t count = window + per_entries;
    const float **pointers = malloc((size_t)(count > 0 ? count : 1) * sizeof(float *));
    float *logits = malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
    uint8_t *seen = malloc((size_t)(count > 0 ? count : 1));
    if (pointers == NULL || logits == NULL || seen == NULL) {
        free(pointers);
        free(logits);
        free(seen);
        return -1;
    }
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t j = 0; j < window; ++j) {
            seen[j] = key_seen[t * window + j];
            pointers[j] = seen[j] ? keys + key_rows[t * window + j] * width : NULL;
        }
        for (int64_t j = 0; j < per_entries; ++j) {
            seen[window + j] = entry_seen[t * per_entries + j];
            pointers[window + j] =
                seen[window + j] ? entries + entry_rows[t * per_entries + j] * width : NULL;
        }
        attend_token(out + t * heads * width, queries + t * heads * width, pointers, seen, count,
                     heads, width, sinks, scaling, rounding, logits);
    }
    free(pointers);
    free(logits);
    free(seen);
    return 0;
}

/* ---- Selection ---- */

/* ``dsv4.selection.stable_topk`` on each of ``rows`` contiguous rows of ``width`` float32
 * ``scores``: the indices of the ``k`` largest into ``out`` (``rows`` x ``k`` int64), largest
 * first, equal scores in ascending index order (``-0.0`` equals ``0.0``; where NaN ranks is
 * unspecified). One pass per row keeping the best ``k`` in order: a score enters only if it
 * beats the last kept one strictly (an equal one came later, so ranks after it), and moves up
 * past every kept score it beats strictly. The answer is the rule's, so it equals the
 * composite's (a stable sort) index for index. */
void dsv4_stable_topk_f32(int64_t *out, const float *scores, int64_t rows, int64_t width,
                          int64_t k) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = scores + r * width;
        int64_t *kept = out + r * k, count = 0;
        for (int64_t i = 0; i < width; ++i) {
            const float v = row[i];
            if (count == k && !(v > row[kept[k - 1]])) continue;
            int64_t at = count < k ? count++ : k - 1;
            while (at > 0 && v > row[kept[at - 1]]) {
                kept[at] = kept[at - 1];
                --at;
            }
            kept[at] = i;
        }
    }
}

/* The router's weights (``dsv4.moe.Router``): for each of ``tokens`` rows, the ``k`` chosen
 * ``scores`` (``tokens`` x ``width``; ``experts`` ``tokens`` x ``k`` int64 indices into a row, all
 * contiguous) divided by their sum plus 1e-20, then times ``scaling``: ``out`` ``tokens`` x ``k``.
 * The sum adds the chosen scores in slot order. Returns 0, or -2 where an index is outside the
 * row (``out`` is then untouched). */
int64_t dsv4_route_weights_f32(float *out, const float *scores, const int64_t *experts,
                               int64_t tokens, int64_t width, int64_t k, float scaling) {
    for (int64_t s = 0; s < tokens * k; ++s)
        if (experts[s] < 0 || experts[s] >= width) return -2;
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = scores + t * width;
        const int64_t *chosen = experts + t * k;
        float total = 0.0f;
        for (int64_t j = 0; j < k; ++j) total += row[chosen[j]];
        const float denominator = total + 1e-20f;
        for (int64_t j = 0; j < k; ++j) out[t * k + j] = row[chosen[j]] / denominator * scaling;
    }
    return 0;
}

/* The lightning indexer's scores (``dsv4.indexer.Indexer.select``): ``out[t, s] = sum over h of
 * (relu(queries[t, h] . keys[t, s]) * scale) * weights[t, h]``, heads in order, for each entry
 * ``s`` token ``t`` may see, and -inf for the others. ``queries`` are ``tokens`` x ``heads`` x
 * ``width``, ``keys`` ``tokens`` x ``count`` x ``width``, ``weights`` ``tokens`` x ``heads``,
 * ``visible`` ``tokens`` x ``count`` bytes and ``out`` ``tokens`` x ``count``, all contiguous; each
 * dot product ``dot8``. */
static inline void index_scores_body(float *out, const float *queries, const float *keys,
                                     const float *weights, const uint8_t *visible,
                                     int64_t tokens, int64_t heads, int64_t count, int64_t width,
                                     float scale) {
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t s = 0; s < count; ++s) {
            float *dst = out + t * count + s;
            if (!visible[t * count + s]) {
                *dst = -INFINITY;
                continue;
            }
            const float *key = keys + (t * count + s) * width;
            float score = 0.0f;
            for (int64_t h = 0; h < heads; ++h) {
                const float dot = dot8(queries + (t * heads + h) * width, key, width);
                const float relu = dot > 0.0f ? dot : 0.0f;
                score += relu * scale * weights[t * heads + h];
            }
            *dst = score;
        }
}

TWO_ISAS(, dsv4_index_scores_f32, index_scores_body,
         (float *out, const float *queries, const float *keys, const float *weights,
          const uint8_t *visible, int64_t tokens, int64_t heads, int64_t count, int64_t width,
          float scale),
         (out, queries, keys, weights, visible, tokens, heads, count, width, scale))

/* ---- Compressor pooling ---- */

/* Window pooling (``dsv4.pooling.WindowPooler.update``): for each of ``tokens`` windows of
 * ``span`` rows (``rows``, ``tokens`` x ``span`` int64 indices into the ``kv`` and ``gate``
 * tables, ``count`` x ``width`` float32 each), each channel's softmax over the window of the gate
 * (exp as ``exp_scalar``; ``-inf`` at slots ``masked`` marks, a ``tokens`` x ``span`` byte mask, or none where NULL),
 * then the kv rows weighted by it and added, slots in order, into ``out`` (``tokens`` x
 * ``width``). A channel whose every slot is masked pools NaN, as the composite's softmax gives.
 * Where the composite computes in a narrow dtype (``rounding``, as ``round_to``), each weight
 * and each weighted row is rounded to it, as the composite's narrow weights and products are.
 * Returns 0; -1 without scratch memory, -2 where an index is outside the tables (``out`` is
 * then untouched). */
int64_t dsv4_pool_f32(float *out, const float *kv, const float *gate, const int64_t *rows,
                      const uint8_t *masked, int64_t tokens, int64_t span, int64_t count,
                      int64_t width, int64_t rounding) {
    for (int64_t s = 0; s < tokens * span; ++s)
        if (rows[s] < 0 || rows[s] >= count) return -2;
    float *largest = malloc((size_t)(width > 0 ? width : 1) * (2 + span) * sizeof(float));
    if (largest == NULL) return -1;
    float *total = largest + width, *exps = total + width;
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t *window = rows + t * span;
        const uint8_t *skip = masked == NULL ? NULL : masked + t * span;
        float *dst = out + t * width;
        for (int64_t c = 0; c < width; ++c) {
            largest[c] = -INFINITY;
            total[c] = 0.0f;
            dst[c] = 0.0f;
        }
        for (int64_t s = 0; s < span; ++s) {
            if (skip != NULL && skip[s]) continue;
            const float *g = gate + window[s] * width;
            for (int64_t c = 0; c < width; ++c) largest[c] = g[c] > largest[c] ? g[c] : largest[c];
        }
        for (int64_t s = 0; s < span; ++s) {
            if (skip != NULL && skip[s]) continue;
            const float *g = gate + window[s] * width;
            float *e = exps + s * width;
            for (int64_t c = 0; c < width; ++c) e[c] = g[c] - largest[c];
            exp_in_place(e, width);
            for (int64_t c = 0; c < width; ++c) total[c] += e[c];
        }
        for (int64_t s = 0; s < span; ++s) {
            if (skip != NULL && skip[s]) continue;
            const float *e = exps + s * width, *v = kv + window[s] * width;
            for (int64_t c = 0; c < width; ++c)
                dst[c] += round_to(v[c] * round_to(e[c] / total[c], rounding), rounding);
        }
        for (int64_t c = 0; c < width; ++c)
            if (largest[c] == -INFINITY) dst[c] = NAN;
    }
    free(largest);
    return 0;
}

/* ---- Fused sequences of the kernels above: the same calls in the same order, one op ---- */

/* A hyper-connection's mixing weights and its block's input (``dsv4.hyper.HyperConnection``)
 * from ``rows`` streams ``x`` (``rows`` x n x ``hidden``, contiguous): the unweighted RMS norm of
 * each token's flattened streams into ``flat``, their product with ``fn`` ((2 + n) * n x
 * n * ``hidden``) read in ``fn_panels`` (one matrix of ``panels`` panels of ``panel`` columns,
 * ``dsv4.panels``) into ``logits``, the weights into ``pre``, ``post`` and ``bordered``, then the
 * collapse into ``collapsed``: exactly ``dsv4_rms_norm_f32``, ``dsv4_linear_panels_f32``,
 * ``dsv4_hc_weights_f32`` and ``dsv4_hc_collapse_f32`` run one after the other. */
void dsv4_hc_pre_f32(float *pre, float *post, float *bordered, float *collapsed, float *flat,
                     float *logits, const float *x, const float *fn_panels, const float *scale,
                     const float *base, int64_t rows, int64_t n, int64_t hidden, int64_t panel,
                     int64_t panels, float norm_eps, float eps, int64_t iters) {
    const int64_t width = n * hidden;
    dsv4_rms_norm_f32(flat, x, NULL, rows, width, norm_eps);
    dsv4_linear_panels_f32(logits, flat, fn_panels, rows, 1, width, panel, panels);
    dsv4_hc_weights_f32(pre, post, bordered, logits, scale, base, rows, n, eps, iters);
    dsv4_hc_collapse_f32(collapsed, pre, x, rows, n, hidden);
}

/* A SwiGLU MLP (``dsv4.moe.SharedExpert``) on ``rows`` rows of ``x`` (``rows`` x ``hidden``), its
 * three matrices read in panels (``dsv4.panels``): the ``gate`` and ``up`` products (``hidden`` x
 * ``inter``, panels of ``inter_panel`` columns) into ``gated`` and ``upped``, their clamped
 * SwiGLU into ``activated``, the ``down`` product (``inter`` x ``hidden``, panels of
 * ``hidden_panel``) into ``out``: exactly ``dsv4_linear_panels_f32`` twice, ``dsv4_swiglu_f32``,
 * ``dsv4_linear_panels_f32``. */
void dsv4_swiglu_mlp_f32(float *out, float *gated, float *upped, float *activated,
                         const float *x, const float *gate, const float *up, const float *down,
                         int64_t rows, int64_t hidden, int64_t inter, int64_t inter_panel,
                         int64_t hidden_panel, float limit) {
    const int64_t inter_panels = inter / inter_panel, hidden_panels = hidden / hidden_panel;
    dsv4_linear_panels_f32(gated, x, gate, rows, 1, hidden, inter_panel, inter_panels);
    dsv4_linear_panels_f32(upped, x, up, rows, 1, hidden, inter_panel, inter_panels);
    dsv4_swiglu_f32(activated, gated, inter, upped, inter, rows, inter, limit);
    dsv4_linear_panels_f32(out, activated, down, rows, 1, inter, hidden_panel, hidden_panels);
}

/* ---- Row copies ---- */

/* ``out[i] = table[rows[i]]`` for ``count`` rows of ``row_bytes`` bytes (``index_select`` along
 * the first axis of a contiguous table of ``table_rows`` rows; any dtype: bytes are copied).
 * Returns 0, or -2 where an index is outside the table (``out`` is then untouched). */
int64_t dsv4_gather_rows(char *out, const char *table, const int64_t *rows, int64_t count,
                         int64_t table_rows, int64_t row_bytes) {
    for (int64_t i = 0; i < count; ++i)
        if (rows[i] < 0 || rows[i] >= table_rows) return -2;
    for (int64_t i = 0; i < count; ++i)
        memcpy(out + i * row_bytes, table + rows[i] * row_bytes, (size_t)row_bytes);
    return 0;
}

/* ``table[rows[i]] = values[i]`` for ``count`` rows of ``row_bytes`` bytes, in order (a row
 * written twice keeps the later value; ``index_copy_`` along the first axis). Returns 0, or -2
 * where an index is outside the table (``table`` is then untouched). */
int64_t dsv4_scatter_rows(char *table, const int64_t *rows, const char *values, int64_t count,
                          int64_t table_rows, int64_t row_bytes) {
    for (int64_t i = 0; i < count; ++i)
        if (rows[i] < 0 || rows[i] >= table_rows) return -2;
    for (int64_t i = 0; i < count; ++i)
        memcpy(table + rows[i] * row_bytes, values + i * row_bytes, (size_t)row_bytes);
    return 0;
}

/* The router (``dsv4.moe.Router``) from its ``tokens`` x ``width`` float32 ``logits``: the
 * scores into ``scores`` (``sigmoid``: ``1 / (1 + exp(-l))``; otherwise ``sqrt(softplus(l))``,
 * softplus as ATen's: ``l`` above 20, else ``log1p(exp(l))``; each may differ from ATen's in the
 * last place); then, with a ``bias`` (``width`` values), the scores plus the bias into ``biased``
 * and their top ``k`` into ``experts`` (``dsv4_stable_topk_f32``), or, without one (hash
 * routing), the ``experts`` already there; then their weights (``dsv4_route_weights_f32``).
 * Returns that kernel's status. */
int64_t dsv4_route_f32(int64_t *experts, float *weights, float *scores, float *biased,
                       const float *logits, const float *bias, int64_t tokens, int64_t width,
                       int64_t k, int64_t sigmoid, float scaling) {
    for (int64_t i = 0; i < tokens * width; ++i) {
        const float l = logits[i];
        scores[i] = sigmoid ? 1.0f / (1.0f + exp_scalar(-l)) : sqrt_softplus(l);
    }
    if (bias != NULL) {
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t e = 0; e < width; ++e)
                biased[t * width + e] = scores[t * width + e] + bias[e];
        dsv4_stable_topk_f32(experts, biased, tokens, width, k);
    }
    return dsv4_route_weights_f32(weights, scores, experts, tokens, width, k, scaling);
}
