/* Row-wise kernels of the torch backend on CPU, for small batches.
 *
 * At decode sizes a torch op costs a few microseconds of dispatch whatever its
 * work, and one primitive is 5-10 ops; each function below does one primitive
 * in one pass over memory. Built by native/__init__.py with -ffp-contract=off,
 * so every product is rounded before it is added, as torch's unfused ops do.
 *
 * Element types: 0 = float32, 1 = bfloat16 (stored as uint16, widened to float32
 * for arithmetic, rounded to nearest even once per stored value, as torch does).
 * Strides are in elements. Functions that index memory with runtime values
 * return -1 for an out-of-range index instead of reading or writing past an
 * allocation; 0 on success.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef union {
    uint32_t u;
    int32_t i;
    float f;
} bits32;

static inline float bf16_load(uint16_t b) {
    bits32 v = {.u = (uint32_t)b << 16};
    return v.f;
}

/* Round to nearest even; a NaN stays a (quiet) NaN. Branch-free, so loops vectorise. */
static inline uint16_t bf16_store(float f) {
    bits32 v = {.f = f};
    uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    uint32_t nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

#define LANES 16

/* exp(x) for float32 within 2 ulp over the range where it is finite and normal,
 * in straight-line arithmetic gcc vectorises (libm's expf is a call per element):
 * x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, as Cephes does), a degree-6
 * polynomial for e^r, and 2^n put in the exponent bits. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x; /* beyond: 0 and inf after the division in silu */
    /* n = round-to-nearest(x / ln2): adding and subtracting 1.5 * 2^23 drops the fraction. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Sum of a[i] * b[i] in LANES partial sums, in a fixed order (one AVX-512
 * register and a tree reduction where the CPU has it). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---- rms_norm, optionally after a residual add --------------------------------
 * res_out = x + res (rounded to the element type), y = res_out * rsqrt(mean(res_out^2) + eps) * w.
 */
#define DEF_RMS_NORM(SUF, T, LD, ST)                                                                        \
    int infer_rms_norm_##SUF(const T *x, int64_t xs, const T *res, int64_t rs, const T *w, T *out,          \
                             int64_t os, T *res_out, int64_t ros, int64_t rows, int64_t n, float eps) {     \
        float stack[4096];                                                                                  \
        float *t = n <= 4096 ? stack : (float *)malloc(sizeof(float) * n);                                  \
        if (!t) return -2;                                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const T *xr = x + r * xs;                                                                       \
            if (res) {                                                                                      \
                const T *rr = res + r * rs;                                                                 \
                T *ro = res_out + r * ros;                                                                  \
                for (int64_t i = 0; i < n; i++) {                                                           \
                    T s = ST(LD(xr[i]) + LD(rr[i]));                                                        \
                    ro[i] = s;                                                                              \
                    t[i] = LD(s);                                                                           \
                }                                                                                           \
            } else {                                                                                        \
                for (int64_t i = 0; i < n; i++) t[i] = LD(xr[i]);                                           \
            }                                                                                               \
            float inv = 1.0f / sqrtf(dot_f32(t, t, n) / (float)n + eps);                                    \
            T *o = out + r * os;                                                                            \
            for (int64_t i = 0; i < n; i++) o[i] = ST((t[i] * inv) * LD(w[i]));                             \
        }                                                                                                   \
        if (t != stack) free(t);                                                                            \
        return 0;                                                                                           \
    }

/* ---- rotary ----------------------------------------------------------------------
 * q [T, hq, d] and k [T, hk, d] (any row/head strides, unit inner stride) rotated
 * into out [T, hq + hk, d] (contiguous). cos_sin [npos, rot] float32: rot/2 cos then
 * rot/2 sin. Neox pairs (i, i + rot/2), gptj pairs (2i, 2i + 1); dims past rot are copied.
 */
#define DEF_ROTARY(SUF, T, LD, ST)                                                                          \
    int infer_rotary_##SUF(const T *q, int64_t q_ts, int64_t q_hs, int64_t hq, const T *k, int64_t k_ts,   \
                           int64_t k_hs, int64_t hk, const int64_t *pos, const float *cos_sin, int64_t npos, \
                           int64_t rot, int neox, T *out, int64_t ntok, int64_t d) {                        \
        int64_t half = rot / 2, heads = hq + hk;                                                            \
        for (int64_t t = 0; t < ntok; t++) {                                                                \
            int64_t p = pos[t];                                                                             \
            if (p < 0 || p >= npos) return -1;                                                              \
            const float *c = cos_sin + p * rot, *s = c + half;                                              \
            for (int64_t h = 0; h < heads; h++) {                                                           \
                const T *src = h < hq ? q + t * q_ts + h * q_hs : k + t * k_ts + (h - hq) * k_hs;           \
                T *o = out + (t * heads + h) * d;                                                           \
                if (neox) {                                                                                 \
                    for (int64_t i = 0; i < half; i++) {                                                    \
                        float x1 = LD(src[i]), x2 = LD(src[i + half]);                                      \
                        float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];                   \
                        o[i] = ST(a - b);                                                                   \
                        o[i + half] = ST(e + f);                                                            \
                    }                                                                                       \
                } else {                                                                                    \
                    for (int64_t i = 0; i < half; i++) {                                                    \
                        float x1 = LD(src[2 * i]), x2 = LD(src[2 * i + 1]);                                 \
                        float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];                   \
                        o[2 * i] = ST(a - b);                                                               \
                        o[2 * i + 1] = ST(e + f);                                                           \
                    }                                                                                       \
                }                                                                                           \
                for (int64_t i = rot; i < d; i++) o[i] = src[i];                                            \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }

/* ---- silu(x[:, :h]) * x[:, h:] ---------------------------------------------------- */
#define DEF_SILU_AND_MUL(SUF, T, LD, ST)                                                                    \
    int infer_silu_and_mul_##SUF(const T *restrict x, int64_t xs, T *restrict out, int64_t rows, int64_t h) {                \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const T *g = x + r * xs, *u = g + h;                                                            \
            T *o = out + r * h;                                                                             \
            for (int64_t i = 0; i < h; i++) {                                                               \
                float a = LD(g[i]);                                                                         \
                o[i] = ST(a / (1.0f + exp_f32(-a)) * LD(u[i]));                                                \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }

/* ---- kv_write: rows of k and v (hk * d contiguous values each) into their slots ------
 * cache [2, nslots, hk * d]; slot -1 skips a (padded) row.
 */
int infer_kv_write(const char *k, int64_t k_ts, const char *v, int64_t v_ts, const int64_t *slots, int64_t ntok,
                   char *cache, int64_t nslots, int64_t row, int64_t itemsize) {
    int64_t bytes = row * itemsize;
    char *vc = cache + nslots * bytes;
    for (int64_t t = 0; t < ntok; t++) {
        int64_t s = slots[t];
        if (s < -1 || s >= nslots) return -1;
    }
    for (int64_t t = 0; t < ntok; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        memcpy(cache + s * bytes, k + t * k_ts * itemsize, bytes);
        memcpy(vc + s * bytes, v + t * v_ts * itemsize, bytes);
    }
    return 0;
}

/* ---- fp8 (e4m3fn) KV cache codes --------------------------------------------------------
 * Encoding matches torch's float32 -> float8_e4m3fn cast of a value clamped to +-448 (round to
 * nearest even, subnormals down to 2^-9); decoding is a table of the 256 code values.
 */
static float e4m3_table[256];

__attribute__((constructor)) static void e4m3_init(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 15 && m == 7 ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        e4m3_table[c] = c & 128 ? -v : v;
    }
}

static inline uint8_t e4m3_encode(float x) {
    bits32 v = {.f = x};
    uint32_t sign = (v.u >> 24) & 128u, mag = v.u & 0x7fffffffu;
    if (mag > 0x7f800000u) return 0x7f; /* NaN */
    bits32 a = {.u = mag};
    if (a.f > 448.0f) a.f = 448.0f;
    uint32_t code;
    if (a.f < 0.015625f) { /* below 2^-6: multiples of 2^-9, rounded to nearest even */
        float m = (a.f * 512.0f + 8388608.0f) - 8388608.0f;
        code = (uint32_t)m;
    } else { /* drop 20 of float32's 23 mantissa bits, to nearest even, and rebias 127 -> 7 */
        uint32_t r = a.u + 0x7ffffu + ((a.u >> 20) & 1u);
        code = (r >> 20) - ((127u - 7u) << 3);
    }
    return (uint8_t)(sign | code);
}

/* kv_write into an fp8 cache: codes of k / k_scale and v / v_scale (division in float32). */
#define DEF_KV_WRITE_FP8(SUF, T, LD)                                                                        \
    int infer_kv_write_fp8_##SUF(const T *k, int64_t k_ts, const T *v, int64_t v_ts, const int64_t *slots, \
                                 int64_t ntok, uint8_t *cache, int64_t nslots, int64_t row, float k_scale,  \
                                 float v_scale) {                                                           \
        for (int64_t t = 0; t < ntok; t++)                                                                  \
            if (slots[t] < -1 || slots[t] >= nslots) return -1;                                             \
        uint8_t *vc = cache + nslots * row;                                                                 \
        for (int64_t t = 0; t < ntok; t++) {                                                                \
            int64_t s = slots[t];                                                                           \
            if (s < 0) continue;                                                                            \
            for (int64_t i = 0; i < row; i++) {                                                             \
                cache[s * row + i] = e4m3_encode(LD(k[t * k_ts + i]) / k_scale);                            \
                vc[s * row + i] = e4m3_encode(LD(v[t * v_ts + i]) / v_scale);                               \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }

/* ---- paged attention over a mixed batch, one query row at a time ---------------------
 * q [ntok, hq, d] (strides q_ts, q_hs); cache [2, nblocks, bs, hk, d] of C; request b owns rows
 * qsl[b]..qsl[b+1]-1 and has seq_lens[b] tokens of context after this step; its i-th row
 * sits at position seq_lens[b] - q_len + i and reads keys 0..pos (within `window` when > 0).
 * out [ntok, hq, d] contiguous; rows no request owns are zeroed. Softmax in float32.
 * The hq / hk query heads that share a KV head are done together, so each cached K and V
 * row is read (and widened) once. KLD(c, scale) is a cached value as the model dtype holds
 * it (fp8: code * scale, rounded).
 */
#define DEF_ATTENTION(NAME, T, LD, ST, C, KLD)                                                              \
    /* A cached K or V row as float32: read in place from a float32 cache, else widened into buf. */        \
    static inline const float *widen_##NAME(const C *row, int64_t d, float scale, float *buf) {              \
        if (sizeof(C) == sizeof(float)) return (const float *)row;                                          \
        for (int64_t e = 0; e < d; e++) buf[e] = KLD(row[e], scale);                                        \
        return buf;                                                                                         \
    }                                                                                                       \
    int infer_attention_##NAME(const T *q, int64_t q_ts, int64_t q_hs, int64_t ntok, int64_t hq,           \
                               const C *cache, int64_t nblocks, int64_t bs, int64_t hk, int64_t d,           \
                               const int32_t *block_table, int64_t bt_stride, int64_t bt_width,              \
                               const int32_t *qsl, const int32_t *seq_lens, int64_t nseq, float scale,       \
                               int64_t window, T *out, float k_scale, float v_scale) {                      \
        int64_t group = hq / hk, kv_row = hk * d;                                                           \
        const C *vcache = cache + nblocks * bs * kv_row;                                                    \
        int64_t max_len = 0;                                                                                \
        for (int64_t b = 0; b < nseq; b++) {                                                                \
            int64_t lo = qsl[b], hi = qsl[b + 1], len = seq_lens[b];                                        \
            if (lo < 0 || hi < lo || hi > ntok || len < hi - lo || (len + bs - 1) / bs > bt_width) return -1; \
            for (int64_t j = 0; j < (len + bs - 1) / bs; j++) {                                             \
                int32_t blk = block_table[b * bt_stride + j];                                               \
                if (blk < 0 || blk >= nblocks) return -1;                                                   \
            }                                                                                               \
            if (len > max_len) max_len = len;                                                               \
        }                                                                                                   \
        memset(out, 0, sizeof(T) * ntok * hq * d);                                                          \
        float *scores = (float *)malloc(sizeof(float) * group * (max_len > 0 ? max_len : 1));               \
        float *qf = (float *)malloc(sizeof(float) * d * (2 * group + 1));                                   \
        int64_t *koff = (int64_t *)malloc(sizeof(int64_t) * (max_len > 0 ? max_len : 1));                    \
        if (!scores || !qf || !koff) {                                                                      \
            free(scores); free(qf); free(koff);                                                             \
            return -2;                                                                                      \
        }                                                                                                   \
        float *acc = qf + group * d, *kf = qf + 2 * group * d;                                              \
        for (int64_t b = 0; b < nseq; b++) {                                                                \
            int64_t lo = qsl[b], qlen = qsl[b + 1] - lo, len = seq_lens[b];                                 \
            const int32_t *bt = block_table + b * bt_stride;                                                \
            for (int64_t i = 0; i < qlen; i++) {                                                            \
                int64_t qpos = len - qlen + i, start = 0, row = lo + i;                                     \
                if (window > 0 && qpos - window + 1 > 0) start = qpos - window + 1;                         \
                int64_t nkeys = qpos + 1 - start;                                                           \
                for (int64_t p = 0; p < nkeys; p++) /* where each key's row starts */                      \
                    koff[p] = ((int64_t)bt[(start + p) / bs] * bs + (start + p) % bs) * kv_row;             \
                for (int64_t g = 0; g < hk; g++) {                                                          \
                    for (int64_t hh = 0; hh < group; hh++) {                                                \
                        const T *qr = q + row * q_ts + (g * group + hh) * q_hs;                             \
                        for (int64_t e = 0; e < d; e++) qf[hh * d + e] = LD(qr[e]);                         \
                    }                                                                                       \
                    for (int64_t p = 0; p < nkeys; p++) {                                                   \
                        const float *kv = widen_##NAME(cache + koff[p] + g * d, d, k_scale, kf);            \
                        for (int64_t hh = 0; hh < group; hh++)                                              \
                            scores[hh * nkeys + p] = dot_f32(qf + hh * d, kv, d) * scale;                   \
                    }                                                                                       \
                    for (int64_t hh = 0; hh < group; hh++) {                                                \
                        float *sc = scores + hh * nkeys, m = -INFINITY, sum = 0.0f;                         \
                        for (int64_t p = 0; p < nkeys; p++) m = sc[p] > m ? sc[p] : m;                      \
                        for (int64_t p = 0; p < nkeys; p++) sc[p] = exp_f32(sc[p] - m);                     \
                        for (int64_t p = 0; p < nkeys; p++) sum += sc[p];                                   \
                        for (int64_t p = 0; p < nkeys; p++) sc[p] /= sum;                                   \
                    }                                                                                       \
                    for (int64_t e = 0; e < group * d; e++) acc[e] = 0.0f;                                  \
                    for (int64_t p = 0; p < nkeys; p++) {                                                   \
                        const float *vv = widen_##NAME(vcache + koff[p] + g * d, d, v_scale, kf);           \
                        for (int64_t hh = 0; hh < group; hh++) {                                            \
                            float w = scores[hh * nkeys + p], *a = acc + hh * d;                            \
                            for (int64_t e = 0; e < d; e++) a[e] += w * vv[e];                              \
                        }                                                                                   \
                    }                                                                                       \
                    for (int64_t hh = 0; hh < group; hh++) {                                                \
                        T *o = out + (row * hq + g * group + hh) * d;                                       \
                        for (int64_t e = 0; e < d; e++) o[e] = ST(acc[hh * d + e]);                         \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        free(scores); free(qf); free(koff);                                                                 \
        return 0;                                                                                           \
    }

#define KLD_F32(c, s) (c)
#define KLD_BF16(c, s) bf16_load(c)
#define KLD_FP8_F32(c, s) (e4m3_table[c] * (s))
#define KLD_FP8_BF16(c, s) bf16_load(bf16_store(e4m3_table[c] * (s)))

/* ---- int8 group-quantized GEMV (GGUF Q8_0) -----------------------------------------
 * y[t, n] = sum_k q[n, k] * scales[n, k / group] * x[t, k] for output rows n_lo <= n < n_hi:
 * q [N, K] int8, scales [N, K/group] float32, x [rows, K] (row stride xs), y [rows, N] float32.
 * Per group, 16 lanes of q * x sums are scaled and added to the row's 16 running
 * sums, summed once at the end of the row (AVX-512 intrinsics where the CPU has them).
 */
#if defined(__AVX512F__)
/* sum over one group of q[i] * x[i], 16 lanes at a time, scaled, into acc */
static inline __m512 int8_group_dot(__m512 acc, const int8_t *q, const float *x, int64_t group, float scale) {
    __m512 part = _mm512_setzero_ps();
    for (int64_t i = 0; i < group; i += 16) {
        __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i))));
        part = _mm512_add_ps(part, _mm512_mul_ps(qf, _mm512_loadu_ps(x + i)));
    }
    return _mm512_add_ps(acc, _mm512_mul_ps(part, _mm512_set1_ps(scale)));
}
#define INT8_ROW_DOT(qr, xr, sr, ng, group, out)                                         \
    do {                                                                                 \
        __m512 acc = _mm512_setzero_ps();                                                \
        for (int64_t g = 0; g < ng; g++)                                                 \
            acc = int8_group_dot(acc, qr + g * group, xr + g * group, group, sr[g]);      \
        float lanes[16];                                                                 \
        _mm512_storeu_ps(lanes, acc);                                                    \
        float sum = 0.0f;                                                                \
        for (int j = 0; j < 16; j++) sum += lanes[j];                                    \
        out = sum;                                                                       \
    } while (0)
#else
#define INT8_ROW_DOT(qr, xr, sr, ng, group, out)                                         \
    do {                                                                                 \
        float acc[16] = {0};                                                             \
        for (int64_t g = 0; g < ng; g++) {                                               \
            float part[16] = {0};                                                        \
            for (int64_t i = g * group; i < (g + 1) * group; i += 16)                     \
                for (int j = 0; j < 16; j++) part[j] += (float)qr[i + j] * xr[i + j];    \
            for (int j = 0; j < 16; j++) acc[j] += part[j] * sr[g];                      \
        }                                                                                \
        float sum = 0.0f;                                                                \
        for (int j = 0; j < 16; j++) sum += acc[j];                                      \
        out = sum;                                                                       \
    } while (0)
#endif

#define DEF_INT8_GEMV(SUF, T, LD)                                                                           \
    int infer_int8_gemv_##SUF(const int8_t *restrict q, const float *restrict scales, const T *restrict x, \
                              int64_t xs, int64_t rows, int64_t k, int64_t group, float *restrict y,        \
                              int64_t n, int64_t n_lo, int64_t n_hi) {                                      \
        if (group % 16 || k % group) return -1;                                                             \
        float *xf = (float *)malloc(sizeof(float) * rows * k);                                              \
        if (!xf) return -2;                                                                                 \
        for (int64_t t = 0; t < rows; t++)                                                                  \
            for (int64_t i = 0; i < k; i++) xf[t * k + i] = LD(x[t * xs + i]);                              \
        int64_t ng = k / group;                                                                             \
        for (int64_t r = n_lo; r < n_hi; r++) {                                                             \
            const int8_t *qr = q + r * k;                                                                   \
            const float *sr = scales + r * ng;                                                              \
            for (int64_t t = 0; t < rows; t++) {                                                            \
                const float *xr = xf + t * k;                                                               \
                INT8_ROW_DOT(qr, xr, sr, ng, group, y[t * n + r]);                                          \
            }                                                                                               \
        }                                                                                                   \
        free(xf);                                                                                           \
        return 0;                                                                                           \
    }

DEF_INT8_GEMV(f32, float, f32_load)
DEF_INT8_GEMV(bf16, uint16_t, bf16_load)
DEF_RMS_NORM(f32, float, f32_load, f32_store)
DEF_RMS_NORM(bf16, uint16_t, bf16_load, bf16_store)
DEF_ROTARY(f32, float, f32_load, f32_store)
DEF_ROTARY(bf16, uint16_t, bf16_load, bf16_store)
DEF_SILU_AND_MUL(f32, float, f32_load, f32_store)
DEF_SILU_AND_MUL(bf16, uint16_t, bf16_load, bf16_store)
DEF_ATTENTION(f32, float, f32_load, f32_store, float, KLD_F32)
DEF_ATTENTION(bf16, uint16_t, bf16_load, bf16_store, uint16_t, KLD_BF16)
DEF_ATTENTION(fp8_f32, float, f32_load, f32_store, uint8_t, KLD_FP8_F32)
DEF_ATTENTION(fp8_bf16, uint16_t, bf16_load, bf16_store, uint8_t, KLD_FP8_BF16)
DEF_KV_WRITE_FP8(f32, float, f32_load)
DEF_KV_WRITE_FP8(bf16, uint16_t, bf16_load)
