/* Row-wise kernels of the torch backend on CPU, for small batches.
 *
 * At decode sizes a torch op costs a few microseconds of dispatch whatever its
 * work, and one primitive is 5-10 ops; each function below does one primitive
 * in one pass over memory. Built by native/__init__.py with -ffp-contract=off,
 * so every product is rounded before it is added, as torch's unfused ops do
 * (attention and the GEMVs use explicit FMAs: they are held to float32 rounding,
 * not to torch's bits).
 *
 * Element types: 0 = float32, 1 = bfloat16 (stored as uint16, widened to float32
 * for arithmetic, rounded to nearest even once per stored value, as torch does).
 * Strides are in elements. Functions that index memory with runtime values
 * return -1 for an out-of-range index instead of reading or writing past an
 * allocation; 0 on success.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
/* AVX512-BF16's dot product instruction (vdpbf16ps): the bf16 GEMV/GEMM and attention paths. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

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

/* ---- parallel parts: torch's OpenMP team, or a pool of our own ---------------------------
 * pool_run(task, args, parts) runs task(args, p, n) for p = 0..n-1 (n <= parts), part 0
 * on the calling thread, and returns when all are done.
 *
 * Built with INFER_OPENMP (native/__init__.py links the OpenMP runtime torch loaded),
 * the parts run on the calling thread's OpenMP team: the same threads that run torch's
 * ops, so the kernels and torch never compete for a core, and the team's spin-wait after
 * each torch op (libgomp's GOMP_SPINCOUNT, whatever the user or import order set) is a
 * thread ready for the next part instead of one that starves another pool.
 */
#ifdef INFER_OPENMP
#include <omp.h>
typedef void (*pool_task)(const void *args, int64_t part, int64_t parts);

/* libgomp's team does not survive fork: a forked child that enters a parallel region
 * waits forever (torch's own ops do). The kernels run serially there instead. */
static int pool_forked = 0;
static void pool_after_fork(void) { pool_forked = 1; }
__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void pool_run(pool_task task, const void *args, int64_t parts) {
    if (parts > 1 && !pool_forked && !omp_in_parallel()) {
#pragma omp parallel num_threads((int)parts)
        task(args, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    task(args, 0, 1);
}

int infer_openmp(void) { return 1; }

/* PAR_FOR(work): the row loop after it is split over the team when the call has PAR_MIN_WORK
 * elements or more (prefill-sized), serial below (decode-sized: a region costs more). */
#define PAR_MIN_WORK (1 << 16)
#define PAR_PRAGMA(x) _Pragma(#x)
#define PAR_FOR(work) PAR_PRAGMA(omp parallel for schedule(static) if ((work) >= PAR_MIN_WORK && !pool_forked))
#else
/* Without OpenMP:
 * a decode step runs ~120 GEMVs of 10-60 us each: handing each half to a Python
 * thread costs as much as the work. Workers here wait for the next job spinning
 * (with the pause hint, yielding to any runnable thread now and then: without the
 * yields SmolLM2's decode step took 2 ms longer) for POOL_SPIN_NS, then sleep on a
 * condition variable, so back-to-back GEMVs hand off within a microsecond or two
 * while an idle pool leaves the cores to torch. pool_run(task, args, parts) runs
 * task(args, p, parts) for p = 0..parts-1, part 0 on the calling thread, and
 * returns when all are done. Callers racing for the pool (ctypes drops the GIL)
 * run their job alone instead of waiting. A forked child starts with no workers
 * (pthread_atfork).
 */
#define POOL_MAX 64
#define POOL_SPIN_NS 200000
typedef void (*pool_task)(const void *args, int64_t part, int64_t parts);
static struct {
    pthread_mutex_t run, mu;
    pthread_cond_t wake;
    int started;
    uint64_t first_job[POOL_MAX]; /* the generation each worker started at */
    /* A seqlock: odd while the caller writes a job's fields, even once it is posted. */
    _Atomic uint64_t generation;
    _Atomic int remaining, sleeping; /* remaining: parts still running (the caller's excluded) */
    _Atomic(pool_task) task;
    _Atomic(const void *) args;
    _Atomic int64_t parts;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_worker(void *arg) {
    int64_t me = (int64_t)(intptr_t)arg;
    uint64_t seen = pool.first_job[me]; /* not the generation now: the first job may already be posted */
    for (;;) {
        uint64_t g;
        int64_t since = now_ns();
        for (int spins = 1; (g = atomic_load(&pool.generation)) == seen || (g & 1); spins++) {
            cpu_relax();
            /* yield now and then: a runnable thread (torch's OpenMP team) gets the core */
            if (spins % 64 == 0) sched_yield();
            if (spins % 256 == 0 && now_ns() - since > POOL_SPIN_NS) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleeping, 1);
                while ((g = atomic_load(&pool.generation)) == seen || (g & 1))
                    pthread_cond_wait(&pool.wake, &pool.mu);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        pool_task task = atomic_load(&pool.task);
        const void *args = atomic_load(&pool.args);
        int64_t parts = atomic_load(&pool.parts);
        /* Changed meanwhile: the caller only posts again once this job's parts are done, so
         * this worker had no part in it; it takes the newer job instead. */
        if (atomic_load(&pool.generation) != g) continue;
        seen = g;
        if (me < parts) { /* workers past the job's parts sit it out (and are not waited for) */
            task(args, me, parts);
            atomic_fetch_sub(&pool.remaining, 1);
        }
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    pool.run = fresh;
    pool.mu = fresh;
    pool.wake = cond;
    pool.started = 0;
    if (atomic_load(&pool.generation) & 1) atomic_fetch_add(&pool.generation, 1); /* forked mid-post */
    atomic_store(&pool.remaining, 0);
    atomic_store(&pool.sleeping, 0);
}

/* Workers for `parts` parts (parts - 1 threads); returns the parts it can run. Holds pool.run. */
static int64_t pool_grow(int64_t parts) {
    static int registered = 0, cpus = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
        cpu_set_t set; /* more parts than usable CPUs would wait on descheduled workers */
        cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : POOL_MAX;
    }
    if (parts > cpus) parts = cpus;
    if (parts > POOL_MAX) parts = POOL_MAX;
    while (pool.started < parts - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.first_job[pool.started + 1] = atomic_load(&pool.generation);
        int rc = pthread_create(&th, &attr, pool_worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
    return parts < pool.started + 1 ? parts : pool.started + 1;
}

static void pool_run(pool_task task, const void *args, int64_t parts) {
    if (parts > 1 && pthread_mutex_trylock(&pool.run) == 0) {
        parts = pool_grow(parts);
        if (parts > 1) {
            atomic_fetch_add(&pool.generation, 1); /* odd: the job is being written */
            atomic_store(&pool.task, task);
            atomic_store(&pool.args, args);
            atomic_store(&pool.parts, parts);
            atomic_store(&pool.remaining, parts - 1);
            atomic_fetch_add(&pool.generation, 1); /* even: posted */
            if (atomic_load(&pool.sleeping) > 0) {
                pthread_mutex_lock(&pool.mu);
                pthread_cond_broadcast(&pool.wake);
                pthread_mutex_unlock(&pool.mu);
            }
            task(args, 0, parts);
            /* yield now and then: on a busy machine a worker may wait for this core */
            for (int spins = 1; atomic_load(&pool.remaining) > 0; spins++) {
                cpu_relax();
                if (spins % 64 == 0) sched_yield();
            }
            pthread_mutex_unlock(&pool.run);
            return;
        }
        pthread_mutex_unlock(&pool.run);
    }
    task(args, 0, 1);
}

int infer_openmp(void) { return 0; }
#define PAR_FOR(work)
#endif

/* ---- rms_norm, optionally after a residual add --------------------------------
 * res_out = x + res (rounded to the element type), y = res_out * rsqrt(mean(res_out^2) + eps) * w.
 */
#define DEF_RMS_NORM(SUF, T, LD, ST)                                                                        \
    static void rms_row_##SUF(const T *xr, const T *rr, const T *w, T *o, T *ro, int64_t n, float eps,       \
                              float *t) {                                                                   \
        if (rr) {                                                                                           \
            for (int64_t i = 0; i < n; i++) {                                                               \
                T s = ST(LD(xr[i]) + LD(rr[i]));                                                            \
                ro[i] = s;                                                                                  \
                t[i] = LD(s);                                                                               \
            }                                                                                               \
        } else {                                                                                            \
            for (int64_t i = 0; i < n; i++) t[i] = LD(xr[i]);                                               \
        }                                                                                                   \
        float inv = 1.0f / sqrtf(dot_f32(t, t, n) / (float)n + eps);                                        \
        for (int64_t i = 0; i < n; i++) o[i] = ST((t[i] * inv) * LD(w[i]));                                 \
    }                                                                                                       \
    int infer_rms_norm_##SUF(const T *x, int64_t xs, const T *res, int64_t rs, const T *w, T *out,          \
                             int64_t os, T *res_out, int64_t ros, int64_t rows, int64_t n, float eps) {     \
        if (n > 4096) { /* wider than the per-row stack scratch: one heap row, serially */                  \
            float *t = (float *)malloc(sizeof(float) * n);                                                  \
            if (!t) return -2;                                                                              \
            for (int64_t r = 0; r < rows; r++)                                                              \
                rms_row_##SUF(x + r * xs, res ? res + r * rs : NULL, w, out + r * os,                       \
                              res ? res_out + r * ros : NULL, n, eps, t);                                   \
            free(t);                                                                                        \
            return 0;                                                                                       \
        }                                                                                                   \
        PAR_FOR(rows * n)                                                                                   \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            float t[4096];                                                                                  \
            rms_row_##SUF(x + r * xs, res ? res + r * rs : NULL, w, out + r * os,                           \
                          res ? res_out + r * ros : NULL, n, eps, t);                                       \
        }                                                                                                   \
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
        for (int64_t t = 0; t < ntok; t++)                                                                  \
            if (pos[t] < 0 || pos[t] >= npos) return -1;                                                    \
        PAR_FOR(ntok * heads * d)                                                                           \
        for (int64_t t = 0; t < ntok; t++) {                                                                \
            const float *c = cos_sin + pos[t] * rot, *s = c + half;                                         \
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

/* ---- act(x[:, :h]) * x[:, h:] ------------------------------------------------------
 * SiLU: a / (1 + exp(-a)). GELU's tanh form (Gemma's GeGLU): 0.5 a (1 + tanh(y)) with
 * y = sqrt(2/pi) (a + 0.044715 a^3), which is a / (1 + exp(-2y)): SiLU's form, which gcc
 * vectorises. */
#define ACT_SILU(a) (a)
#define ACT_GELU_TANH(a) (2.0f * 0.7978845608028654f * ((a) + 0.044715f * (a) * (a) * (a)))
#define DEF_ACT_AND_MUL(NAME, ARG, SUF, T, LD, ST)                                                          \
    int infer_##NAME##_and_mul_##SUF(const T *restrict x, int64_t xs, T *restrict out, int64_t rows, int64_t h) { \
        PAR_FOR(rows * h)                                                                                   \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const T *g = x + r * xs, *u = g + h;                                                            \
            T *o = out + r * h;                                                                             \
            for (int64_t i = 0; i < h; i++) {                                                               \
                float a = LD(g[i]);                                                                         \
                o[i] = ST(a / (1.0f + exp_f32(-ARG(a))) * LD(u[i]));                                        \
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

/* ---- token_bitmask: structured outputs' allowed tokens applied to float32 logits ----------
 * out[r, t] = x[r, t] if bit t % 32 of mask[r, t / 32] is set, else -inf. x rows are xs apart,
 * mask rows `words` apart, out is [rows, v]. A word that allows all 32 tokens (an unconstrained
 * row) is one copy, one that allows none (most words of a constrained row) one fill.
 */
int infer_token_bitmask(const float *x, int64_t xs, const int32_t *mask, int64_t words, float *out, int64_t rows,
                        int64_t v) {
    PAR_FOR(rows * v)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        float *o = out + r * v;
        for (int64_t w = 0; w * 32 < v; w++) {
            int64_t base = w * 32, n = v - base < 32 ? v - base : 32;
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) {
                memcpy(o + base, xr + base, (size_t)n * sizeof(float));
            } else if (bits == 0) {
                for (int64_t j = 0; j < n; j++) o[base + j] = -INFINITY;
            } else {
                for (int64_t j = 0; j < n; j++) o[base + j] = (bits >> j) & 1u ? xr[base + j] : -INFINITY;
            }
        }
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

/* ---- paged attention over a mixed batch ---------------------------------------------
 * q [ntok, hq, d] (strides q_ts, q_hs); cache [2, nblocks, bs, hk, d] of C; request b owns rows
 * qsl[b]..qsl[b+1]-1 and has seq_lens[b] tokens of context after this step; its i-th row
 * sits at position seq_lens[b] - q_len + i and reads keys 0..pos (within `window` when > 0).
 * out [ntok, hq, d] contiguous; rows no request owns are zeroed. Softmax in float32.
 * The hq / hk query heads that share a KV head are done together, so each cached K and V
 * row is read (and widened) once. KLD(c, scale) is a cached value as the model dtype holds
 * it (fp8: code * scale, rounded).
 * Work is cut into units of one (row, KV head) and up to ATT_CHUNK of its keys, which the
 * thread pool shares out (flash-decoding: one long context still uses every core); each
 * unit leaves its running max, its sum of exponentials and its unnormalised P @ V, and
 * the units of a (row, KV head) are merged at the end.
 */
#define ATT_CHUNK 64

typedef struct {
    const void *q;
    int64_t q_ts, q_hs, hq, hk, d, group, bs, kv_row, window;
    const void *cache, *vcache;
    const int32_t *block_table;
    int64_t bt_stride;
    const int32_t *qsl, *seq_lens;
    const int64_t *row_req;   /* [ntok] request owning each row, -1 for none */
    const int64_t *unit_item; /* [units] the (row * hk + KV head) of each unit */
    const int64_t *unit_key;  /* [units] its first key (from the row's first visible key) */
    float scale, k_scale, v_scale;
    float softcap;            /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
    const float *sinks;       /* [hq] or NULL: a logit per query head in each softmax's denominator (gpt-oss) */
    float *partial;           /* [units][group][d + 2]: max, sum of exp, then P @ V */
    _Atomic int failed;
} att_job;

/* The first key a row sees and how many (its position and the window). */
static inline void att_keys(const att_job *j, int64_t row, int64_t *start, int64_t *nkeys) {
    int64_t b = j->row_req[row], qlen = j->qsl[b + 1] - j->qsl[b];
    int64_t qpos = j->seq_lens[b] - qlen + (row - j->qsl[b]);
    *start = j->window > 0 && qpos - j->window + 1 > 0 ? qpos - j->window + 1 : 0;
    *nkeys = qpos + 1 - *start;
}

static inline float dot_fma(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    return dot_f32(a, b, n);
}

#define DEF_ATTENTION(NAME, T, LD, ST, C, KLD, FAST)                                                        \
    /* A cached K or V row as float32: read in place from a float32 cache, else widened into buf. */        \
    static inline const float *widen_##NAME(const C *row, int64_t d, float scale, float *buf) {              \
        if (sizeof(C) == sizeof(float)) return (const float *)row;                                          \
        for (int64_t e = 0; e < d; e++) buf[e] = KLD(row[e], scale);                                        \
        return buf;                                                                                         \
    }                                                                                                       \
    static void att_task_##NAME(const void *args, int64_t part, int64_t parts) {                            \
        att_job *j = (att_job *)args;                                                                       \
        int64_t units = j->unit_item[-1], lo = units * part / parts, hi = units * (part + 1) / parts;        \
        int64_t group = j->group, d = j->d;                                                                 \
        float *scratch = (float *)malloc(sizeof(float) * (group * ATT_CHUNK + group * d + d));              \
        if (!scratch) {                                                                                     \
            atomic_store(&j->failed, 1);                                                                    \
            return;                                                                                         \
        }                                                                                                   \
        float *scores = scratch, *qf = scores + group * ATT_CHUNK, *kf = qf + group * d;                    \
        int64_t offs[ATT_CHUNK]; /* where each key's row of this KV head starts */                          \
        const C *cache = (const C *)j->cache, *vcache = (const C *)j->vcache;                               \
        for (int64_t u = lo; u < hi; u++) {                                                                 \
            int64_t item = j->unit_item[u], row = item / j->hk, g = item % j->hk, start, nkeys;              \
            att_keys(j, row, &start, &nkeys);                                                               \
            int64_t first = start + j->unit_key[u], n = nkeys - j->unit_key[u];                             \
            n = n < ATT_CHUNK ? n : ATT_CHUNK;                                                              \
            const int32_t *bt = j->block_table + j->row_req[row] * j->bt_stride;                            \
            for (int64_t hh = 0; hh < group; hh++) {                                                        \
                const T *qr = (const T *)j->q + row * j->q_ts + (g * group + hh) * j->q_hs;                 \
                for (int64_t e = 0; e < d; e++) qf[hh * d + e] = LD(qr[e]);                                 \
            }                                                                                               \
            for (int64_t p = 0, blk = first / j->bs, in = first % j->bs; p < n; p++) {                     \
                offs[p] = ((int64_t)bt[blk] * j->bs + in) * j->kv_row + g * d; /* no division per key */     \
                if (++in == j->bs) {                                                                        \
                    in = 0;                                                                                 \
                    blk++;                                                                                  \
                }                                                                                           \
            }                                                                                               \
            for (int64_t p = 0; p < n; p++) {                                                               \
                const float *kv = widen_##NAME(cache + offs[p], d, j->k_scale, kf);                         \
                for (int64_t hh = 0; hh < group; hh++) scores[hh * n + p] = dot_fma(qf + hh * d, kv, d) * j->scale; \
            }                                                                                               \
            if (j->softcap > 0.0f)                                                                          \
                for (int64_t p = 0; p < group * n; p++) scores[p] = j->softcap * tanhf(scores[p] / j->softcap); \
            float *part_out = j->partial + u * group * (d + 2);                                             \
            for (int64_t hh = 0; hh < group; hh++) {                                                        \
                float *sc = scores + hh * n, m = -INFINITY, sum = 0.0f, *acc = part_out + hh * (d + 2) + 2; \
                for (int64_t p = 0; p < n; p++) m = sc[p] > m ? sc[p] : m;                                  \
                for (int64_t p = 0; p < n; p++) sc[p] = exp_f32(sc[p] - m);                                 \
                for (int64_t p = 0; p < n; p++) sum += sc[p];                                               \
                part_out[hh * (d + 2)] = m;                                                                 \
                part_out[hh * (d + 2) + 1] = sum;                                                           \
                for (int64_t e = 0; e < d; e++) acc[e] = 0.0f;                                              \
            }                                                                                               \
            for (int64_t p = 0; p < n; p++) {                                                               \
                const float *vv = widen_##NAME(vcache + offs[p], d, j->v_scale, kf);                        \
                for (int64_t hh = 0; hh < group; hh++) {                                                    \
                    float w = scores[hh * n + p], *acc = part_out + hh * (d + 2) + 2;                       \
                    for (int64_t e = 0; e < d; e++) acc[e] = fmaf(w, vv[e], acc[e]);                        \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        free(scratch);                                                                                      \
    }                                                                                                       \
    int infer_attention_##NAME(const T *q, int64_t q_ts, int64_t q_hs, int64_t ntok, int64_t hq,           \
                               const C *cache, int64_t nblocks, int64_t bs, int64_t hk, int64_t d,           \
                               const int32_t *block_table, int64_t bt_stride, int64_t bt_width,              \
                               const int32_t *qsl, const int32_t *seq_lens, int64_t nseq, float scale,       \
                               int64_t window, T *out, float k_scale, float v_scale, float softcap,         \
                               const float *sinks, int64_t threads) {                                       \
        int64_t group = hq / hk, kv_row = hk * d;                                                           \
        for (int64_t b = 0; b < nseq; b++) {                                                                \
            int64_t lo = qsl[b], hi = qsl[b + 1], len = seq_lens[b];                                        \
            /* len 0 with one query: a padding row, which reads no key and stays zero */                   \
            if (lo < 0 || hi < lo || hi > ntok || (len < hi - lo && !(len == 0 && hi - lo == 1)) ||          \
                (len + bs - 1) / bs > bt_width)                                                             \
                return -1;                                                                                  \
            for (int64_t j = 0; j < (len + bs - 1) / bs; j++) {                                             \
                int32_t blk = block_table[b * bt_stride + j];                                               \
                if (blk < 0 || blk >= nblocks) return -1;                                                   \
            }                                                                                               \
        }                                                                                                   \
        if (ntok > 0) memset(out, 0, sizeof(T) * ntok * hq * d);                                           \
        int64_t *row_req = (int64_t *)malloc(sizeof(int64_t) * (ntok > 0 ? ntok : 1));                      \
        if (!row_req) return -2;                                                                            \
        for (int64_t r = 0; r < ntok; r++) row_req[r] = -1;                                                 \
        for (int64_t b = 0; b < nseq; b++)                                                                  \
            for (int64_t r = qsl[b]; r < qsl[b + 1]; r++) row_req[r] = b;                                   \
        att_job job = {q, q_ts, q_hs, hq, hk, d, group, bs, kv_row, window, cache, cache + nblocks * bs * kv_row, \
                       block_table, bt_stride, qsl, seq_lens, row_req, NULL, NULL, scale, k_scale, v_scale,  \
                       softcap, sinks, NULL, 0};                                                            \
        int64_t units = 0;                                                                                  \
        for (int64_t r = 0; r < ntok; r++) {                                                                \
            if (row_req[r] < 0) continue;                                                                   \
            int64_t start, nkeys;                                                                           \
            att_keys(&job, r, &start, &nkeys);                                                              \
            units += hk * ((nkeys + ATT_CHUNK - 1) / ATT_CHUNK);                                            \
        }                                                                                                   \
        int64_t *unit_item = (int64_t *)malloc(sizeof(int64_t) * (2 * units + 1));                          \
        float *partial = (float *)malloc(sizeof(float) * (units > 0 ? units : 1) * group * (d + 2));        \
        if (!unit_item || !partial) {                                                                       \
            free(row_req); free(unit_item); free(partial);                                                  \
            return -2;                                                                                      \
        }                                                                                                   \
        unit_item[0] = units; /* read by the tasks as unit_item[-1] */                                      \
        int64_t *items = unit_item + 1, *keys = items + units, u = 0;                                       \
        for (int64_t r = 0; r < ntok; r++) {                                                                \
            if (row_req[r] < 0) continue;                                                                   \
            int64_t start, nkeys;                                                                           \
            att_keys(&job, r, &start, &nkeys);                                                              \
            for (int64_t g = 0; g < hk; g++)                                                                \
                for (int64_t k0 = 0; k0 < nkeys; k0 += ATT_CHUNK, u++) {                                    \
                    items[u] = r * hk + g;                                                                  \
                    keys[u] = k0;                                                                           \
                }                                                                                           \
        }                                                                                                   \
        job.unit_item = items;                                                                              \
        job.unit_key = keys;                                                                                \
        job.partial = partial;                                                                              \
        int64_t parts = threads < 1 ? 1 : threads;                                                          \
        if (parts > units) parts = units > 0 ? units : 1;                                                   \
        pool_task fast = (FAST);                                                                            \
        pool_run(fast ? fast : att_task_##NAME, &job, parts);                                               \
        int rc = atomic_load(&job.failed) ? -2 : 0;                                                         \
        /* merge the units of each (row, KV head): they are consecutive */                                  \
        for (int64_t first = 0; rc == 0 && first < units;) {                                                \
            int64_t last = first, item = items[first];                                                      \
            while (last + 1 < units && items[last + 1] == item) last++;                                     \
            int64_t row = item / hk, g = item % hk;                                                         \
            for (int64_t hh = 0; hh < group; hh++) {                                                        \
                float m = -INFINITY, sum = 0.0f;                                                            \
                for (int64_t v = first; v <= last; v++) {                                                   \
                    float mv = partial[(v * group + hh) * (d + 2)];                                         \
                    m = mv > m ? mv : m;                                                                    \
                }                                                                                           \
                /* a sink joins the denominator only: one more term of the sum, none of P @ V */             \
                float sink = sinks ? sinks[g * group + hh] : -INFINITY;                                     \
                m = sink > m ? sink : m;                                                                    \
                float *acc = partial + (first * group + hh) * (d + 2) + 2;                                  \
                float w0 = exp_f32(partial[(first * group + hh) * (d + 2)] - m);                            \
                sum = partial[(first * group + hh) * (d + 2) + 1] * w0;                                     \
                if (sinks) sum += exp_f32(sink - m);                                                        \
                for (int64_t e = 0; e < d; e++) acc[e] *= w0;                                               \
                for (int64_t v = first + 1; v <= last; v++) {                                               \
                    const float *pv = partial + (v * group + hh) * (d + 2);                                 \
                    float w = exp_f32(pv[0] - m);                                                           \
                    sum += pv[1] * w;                                                                       \
                    for (int64_t e = 0; e < d; e++) acc[e] = fmaf(w, pv[2 + e], acc[e]);                    \
                }                                                                                           \
                T *o = out + (row * hq + g * group + hh) * d;                                               \
                for (int64_t e = 0; e < d; e++) o[e] = ST(acc[e] / sum);                                    \
            }                                                                                               \
            first = last + 1;                                                                               \
        }                                                                                                   \
        free(row_req); free(unit_item); free(partial);                                                      \
        return rc;                                                                                          \
    }

#define KLD_F32(c, s) (c)
#define KLD_BF16(c, s) bf16_load(c)
#define KLD_FP8_F32(c, s) (e4m3_table[c] * (s))
#define KLD_FP8_BF16(c, s) bf16_load(bf16_store(e4m3_table[c] * (s)))

/* ---- int4 group-quantized GEMV for few rows (AWQ, GPTQ, GGUF Q4_0/Q4_1) --------------
 * y[t, n] = sum_k (q[n, k] * s[n, k/G] + o[n, k/G]) * x[t, k], per group as
 * s * sum(q * x) + o * sum(x): q [N, K/2] bytes with q[2j] in the low nibble of byte j and
 * q[2j+1] in the high one, s and o [N, K/G] float32, x [rows, K], y [rows, N] in x's type.
 *
 * With AVX512-VNNI, sum(q * x) is an integer dot product (vpdpwssd, 16-bit pairs into
 * 32-bit sums): each group of x is written as xi * 2^e with xi 16-bit integers and 2^e
 * putting the group's largest |x| just under 2^15. That is exact for every value within
 * 2^7 of the group's largest (all a bf16 x's significant bits fit) and off by at most
 * 2^-16 of the largest for the rest. A float32 x gets a second 16-bit part for what the
 * first leaves, which brings the error to 2^-31 of the group's largest: below float32
 * rounding. The integer sums are exact, and so is their conversion to float32 for groups
 * of up to 128 (a lane sums G/4 products of at most 15 * 2^15: below 2^24); beyond, it is
 * rounded once. The only other rounding is the float32 combination of groups. An x holding inf or nan is refused
 * (-4): the caller then runs torch's arithmetic.
 * Without VNNI the same sums run as plain float32 loops.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define INT4_VNNI 1
typedef int16_t xpart_t;
#else
#define INT4_VNNI 0
typedef float xpart_t;
#endif

typedef struct {
    const uint8_t *q;
    const void *s, *o;    /* float32, or float16 with half_scales (the VNNI build; see infer_int4_gemm) */
    const xpart_t *xp;    /* [rows][nparts][K]: the even elements of x, then the odd ones */
    const float *xscale;  /* [rows][nparts][K/G]: 2^e of each part's group (VNNI) */
    const float *xsum;    /* [rows][K/G] */
    void *y;
    int64_t rows, k, group, n, nparts, bf16_out, half_scales;
} int4_job;

#define INT4_MAX_ROWS 32

/* 1 when infer_int4_gemm reads float16 scales and offsets (f16 = 1): the VNNI build */
int infer_int4_half_scales(void) { return INT4_VNNI; }
/* Rows ahead whose weights are prefetched: streaming SmolLM2's layers from memory on
 * 2 cores went from ~4.3 to ~3.0 ms per pass with 4 (8-32 did no better). */
#define INT4_PREFETCH_ROWS 4

/* y[t, n] = v for any GEMM job with y (float32, or bf16 where bf16_out) and n output columns */
#define GEMM_STORE(j, t, r, v)                                                   \
    do {                                                                         \
        if ((j)->bf16_out)                                                       \
            ((uint16_t *)(j)->y)[(t) * (j)->n + (r)] = bf16_store(v);           \
        else                                                                     \
            ((float *)(j)->y)[(t) * (j)->n + (r)] = (v);                         \
    } while (0)

#if INT4_VNNI
static inline float hsum256(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

/* sum of a[i] * b[i] for any n (a masked tail) */
static inline float dot_f32_tail(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* the same with a in float16 */
static inline float dot_f16_tail(const uint16_t *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a + i))), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, a + i)), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* 32 weights of the row at `qr` from byte `at`: 16-bit low nibbles (wl) and high nibbles (wh) */
#define INT4_UNPACK(qr, at, wl, wh)                                                              \
    __m256i wl = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((qr) + (at))));        \
    __m256i wh = _mm256_srli_epi16(wl, 4);                                                       \
    wl = _mm256_and_si256(wl, low4)
#define INT4_DOT(isum, wl, wh, xe, xo) isum = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(isum, wl, xe), wh, xo)

/* Output rows r..r+3 for activation row t with NP (1 or 2, a constant at each call site)
 * 16-bit parts of x; every accumulator is a named register. PAIR: activation rows t and
 * t + 1 at once, each weight unpacked once for both (batched decode, speculative decoding's
 * verify steps); row t + 1's sums are formed exactly as if it ran alone. */
static inline __attribute__((always_inline)) void int4_rows4(const int4_job *j, int64_t r, int64_t t, const int NP,
                                                             const int G32, const int HALF, const int PAIR) {
    const __m256i low4 = _mm256_set1_epi16(15);
    int64_t k = j->k, half = k / 2, ng = k / j->group, sub = G32 ? 1 : j->group / 32; /* G32: groups of 32 */
    const int16_t *x1 = j->xp + t * NP * k, *x2 = x1 + k; /* x2: row t's second part (NP = 2) */
    const int16_t *y1 = x1 + NP * k, *y2 = y1 + k;         /* PAIR: row t + 1's parts */
    const float *sc1 = j->xscale + t * NP * ng, *sc2 = sc1 + ng, *sc3 = sc1 + NP * ng, *sc4 = sc3 + ng;
    const uint8_t *q0 = j->q + r * half, *q1 = q0 + half, *q2 = q1 + half, *q3 = q2 + half;
    int64_t s0 = r * ng, s1 = s0 + ng, s2 = s1 + ng, s3 = s2 + ng;
#define INT4_SCALE(i) (HALF ? _cvtsh_ss(((const uint16_t *)j->s)[i]) : ((const float *)j->s)[i])
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0; /* PAIR: row t + 1 */
    for (int64_t g = 0; g < ng; g++) {
        __m256i i0 = _mm256_setzero_si256(), i1 = i0, i2 = i0, i3 = i0;
        __m256i k0 = i0, k1 = i0, k2 = i0, k3 = i0; /* second parts */
        __m256i p0 = i0, p1 = i0, p2 = i0, p3 = i0; /* PAIR: row t + 1, and its second parts: */
        __m256i m0 = i0, m1 = i0, m2 = i0, m3 = i0;
        for (int64_t b = 0; b < sub; b++) {
            int64_t at = (g * sub + b) * 16; /* byte offset in the row = offset in the even/odd halves */
            if ((at & 63) == 0) { /* the same bytes of the next rows, ahead of their turn */
                const uint8_t *ahead = q0 + INT4_PREFETCH_ROWS * half + at;
                for (int m = 0; m < 4; m++) _mm_prefetch((const char *)(ahead + m * half), _MM_HINT_T0);
            }
            __m256i xe = _mm256_loadu_si256((const __m256i *)(x1 + at));
            __m256i xo = _mm256_loadu_si256((const __m256i *)(x1 + half + at));
            INT4_UNPACK(q0, at, l0, h0);
            INT4_UNPACK(q1, at, l1, h1);
            INT4_UNPACK(q2, at, l2, h2);
            INT4_UNPACK(q3, at, l3, h3);
            INT4_DOT(i0, l0, h0, xe, xo);
            INT4_DOT(i1, l1, h1, xe, xo);
            INT4_DOT(i2, l2, h2, xe, xo);
            INT4_DOT(i3, l3, h3, xe, xo);
            if (NP == 2) {
                __m256i ye = _mm256_loadu_si256((const __m256i *)(x2 + at));
                __m256i yo = _mm256_loadu_si256((const __m256i *)(x2 + half + at));
                INT4_DOT(k0, l0, h0, ye, yo);
                INT4_DOT(k1, l1, h1, ye, yo);
                INT4_DOT(k2, l2, h2, ye, yo);
                INT4_DOT(k3, l3, h3, ye, yo);
            }
            if (PAIR) {
                __m256i ye = _mm256_loadu_si256((const __m256i *)(y1 + at));
                __m256i yo = _mm256_loadu_si256((const __m256i *)(y1 + half + at));
                INT4_DOT(p0, l0, h0, ye, yo);
                INT4_DOT(p1, l1, h1, ye, yo);
                INT4_DOT(p2, l2, h2, ye, yo);
                INT4_DOT(p3, l3, h3, ye, yo);
                if (NP == 2) {
                    __m256i ze = _mm256_loadu_si256((const __m256i *)(y2 + at));
                    __m256i zo = _mm256_loadu_si256((const __m256i *)(y2 + half + at));
                    INT4_DOT(m0, l0, h0, ze, zo);
                    INT4_DOT(m1, l1, h1, ze, zo);
                    INT4_DOT(m2, l2, h2, ze, zo);
                    INT4_DOT(m3, l3, h3, ze, zo);
                }
            }
        }
        __m256 c1 = _mm256_set1_ps(sc1[g]);
        __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), c1), f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(i1), c1);
        __m256 f2 = _mm256_mul_ps(_mm256_cvtepi32_ps(i2), c1), f3 = _mm256_mul_ps(_mm256_cvtepi32_ps(i3), c1);
        if (NP == 2) {
            __m256 c2 = _mm256_set1_ps(sc2[g]);
            f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k0), c2, f0);
            f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k1), c2, f1);
            f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k2), c2, f2);
            f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k3), c2, f3);
        }
        __m256 w0 = _mm256_set1_ps(INT4_SCALE(s0 + g)), w1 = _mm256_set1_ps(INT4_SCALE(s1 + g));
        __m256 w2 = _mm256_set1_ps(INT4_SCALE(s2 + g)), w3 = _mm256_set1_ps(INT4_SCALE(s3 + g));
        a0 = _mm256_fmadd_ps(f0, w0, a0);
        a1 = _mm256_fmadd_ps(f1, w1, a1);
        a2 = _mm256_fmadd_ps(f2, w2, a2);
        a3 = _mm256_fmadd_ps(f3, w3, a3);
        if (PAIR) { /* as f and a above, for row t + 1 */
            __m256 c3 = _mm256_set1_ps(sc3[g]);
            __m256 e0 = _mm256_mul_ps(_mm256_cvtepi32_ps(p0), c3), e1 = _mm256_mul_ps(_mm256_cvtepi32_ps(p1), c3);
            __m256 e2 = _mm256_mul_ps(_mm256_cvtepi32_ps(p2), c3), e3 = _mm256_mul_ps(_mm256_cvtepi32_ps(p3), c3);
            if (NP == 2) {
                __m256 c4 = _mm256_set1_ps(sc4[g]);
                e0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m0), c4, e0);
                e1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m1), c4, e1);
                e2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m2), c4, e2);
                e3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m3), c4, e3);
            }
            b0 = _mm256_fmadd_ps(e0, w0, b0);
            b1 = _mm256_fmadd_ps(e1, w1, b1);
            b2 = _mm256_fmadd_ps(e2, w2, b2);
            b3 = _mm256_fmadd_ps(e3, w3, b3);
        }
    }
#undef INT4_SCALE
    const float *xs = j->xsum + t * ng;
#define INT4_OFFSETS(m) (HALF ? dot_f16_tail((const uint16_t *)j->o + (r + m) * ng, xs, ng) \
                              : dot_f32_tail((const float *)j->o + (r + m) * ng, xs, ng))
    GEMM_STORE(j, t, r, hsum256(a0) + INT4_OFFSETS(0));
    GEMM_STORE(j, t, r + 1, hsum256(a1) + INT4_OFFSETS(1));
    GEMM_STORE(j, t, r + 2, hsum256(a2) + INT4_OFFSETS(2));
    GEMM_STORE(j, t, r + 3, hsum256(a3) + INT4_OFFSETS(3));
    if (PAIR) {
        xs += ng;
        GEMM_STORE(j, t + 1, r, hsum256(b0) + INT4_OFFSETS(0));
        GEMM_STORE(j, t + 1, r + 1, hsum256(b1) + INT4_OFFSETS(1));
        GEMM_STORE(j, t + 1, r + 2, hsum256(b2) + INT4_OFFSETS(2));
        GEMM_STORE(j, t + 1, r + 3, hsum256(b3) + INT4_OFFSETS(3));
    }
#undef INT4_OFFSETS
}

/* int4_rows4 with 512-bit registers, for K a multiple of 64: a step takes 32 bytes of each
 * weight row (64 weights), so each unpack, dot, conversion and scaling covers twice the
 * weights. With groups of 32 a step holds two groups: the 16 sums of a dot are 8 of group g
 * (lanes 0-7) then 8 of group g + 1, scaled by vectors holding each group's scale in its
 * lanes. Larger groups take group / 64 steps each. As in int4_rows4, every activation row's
 * sums are formed the same way whether it runs alone or in a PAIR. */
static inline __m512 int4_lane_pairs(__m128 v) { /* lanes 0-7: v[0], lanes 8-15: v[1] */
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(v));
}
static inline __m512 int4_two_f32(const float *p) { return int4_lane_pairs(_mm_castpd_ps(_mm_load_sd((const double *)p))); }
static inline __m512 int4_two_f16(const uint16_t *p) { return int4_lane_pairs(_mm_cvtph_ps(_mm_loadu_si32(p))); }

#define INT4_UNPACK_Z(qr, at, wl, wh)                                                             \
    __m512i wl = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((qr) + (at))));       \
    __m512i wh = _mm512_srli_epi16(wl, 4);                                                        \
    wl = _mm512_and_si512(wl, low4)
#define INT4_DOT_Z(isum, wl, wh, xe, xo) isum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum, wl, xe), wh, xo)

static inline __attribute__((always_inline)) void int4_rows4_z(const int4_job *j, int64_t r, int64_t t, const int NP,
                                                               const int G32, const int HALF, const int PAIR) {
    const __m512i low4 = _mm512_set1_epi16(15);
    int64_t k = j->k, half = k / 2, ng = k / j->group, steps = half / 32, per = G32 ? 1 : j->group / 64;
    const int16_t *x1 = j->xp + t * NP * k, *x2 = x1 + k;
    const int16_t *y1 = x1 + NP * k, *y2 = y1 + k;
    const float *sc1 = j->xscale + t * NP * ng, *sc2 = sc1 + ng, *sc3 = sc1 + NP * ng, *sc4 = sc3 + ng;
    const uint8_t *q0 = j->q + r * half, *q1 = q0 + half, *q2 = q1 + half, *q3 = q2 + half;
    int64_t s0 = r * ng, s1 = s0 + ng, s2 = s1 + ng, s3 = s2 + ng;
#define INT4_SCALE(i) (HALF ? _cvtsh_ss(((const uint16_t *)j->s)[i]) : ((const float *)j->s)[i])
#define INT4_WSCALE(i) (G32 ? (HALF ? int4_two_f16((const uint16_t *)j->s + (i)) : int4_two_f32((const float *)j->s + (i))) \
                            : _mm512_set1_ps(INT4_SCALE(i)))
#define INT4_XSCALE(sc, g) (G32 ? int4_two_f32((sc) + (g)) : _mm512_set1_ps((sc)[g]))
    const __m512i zero = _mm512_setzero_si512();
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0; /* PAIR: row t + 1 */
    __m512i i0 = zero, i1 = zero, i2 = zero, i3 = zero, k0 = zero, k1 = zero, k2 = zero, k3 = zero;
    __m512i p0 = zero, p1 = zero, p2 = zero, p3 = zero, m0 = zero, m1 = zero, m2 = zero, m3 = zero;
    for (int64_t st = 0; st < steps; st++) {
        int64_t at = st * 32;
        if ((at & 63) == 0) {
            const uint8_t *ahead = q0 + INT4_PREFETCH_ROWS * half + at;
            for (int m = 0; m < 4; m++) _mm_prefetch((const char *)(ahead + m * half), _MM_HINT_T0);
        }
        __m512i xe = _mm512_loadu_si512((const void *)(x1 + at)), xo = _mm512_loadu_si512((const void *)(x1 + half + at));
        INT4_UNPACK_Z(q0, at, l0, h0);
        INT4_UNPACK_Z(q1, at, l1, h1);
        INT4_UNPACK_Z(q2, at, l2, h2);
        INT4_UNPACK_Z(q3, at, l3, h3);
        INT4_DOT_Z(i0, l0, h0, xe, xo);
        INT4_DOT_Z(i1, l1, h1, xe, xo);
        INT4_DOT_Z(i2, l2, h2, xe, xo);
        INT4_DOT_Z(i3, l3, h3, xe, xo);
        if (NP == 2) {
            __m512i ye = _mm512_loadu_si512((const void *)(x2 + at)), yo = _mm512_loadu_si512((const void *)(x2 + half + at));
            INT4_DOT_Z(k0, l0, h0, ye, yo);
            INT4_DOT_Z(k1, l1, h1, ye, yo);
            INT4_DOT_Z(k2, l2, h2, ye, yo);
            INT4_DOT_Z(k3, l3, h3, ye, yo);
        }
        if (PAIR) {
            __m512i ye = _mm512_loadu_si512((const void *)(y1 + at)), yo = _mm512_loadu_si512((const void *)(y1 + half + at));
            INT4_DOT_Z(p0, l0, h0, ye, yo);
            INT4_DOT_Z(p1, l1, h1, ye, yo);
            INT4_DOT_Z(p2, l2, h2, ye, yo);
            INT4_DOT_Z(p3, l3, h3, ye, yo);
            if (NP == 2) {
                __m512i ze = _mm512_loadu_si512((const void *)(y2 + at)), zo = _mm512_loadu_si512((const void *)(y2 + half + at));
                INT4_DOT_Z(m0, l0, h0, ze, zo);
                INT4_DOT_Z(m1, l1, h1, ze, zo);
                INT4_DOT_Z(m2, l2, h2, ze, zo);
                INT4_DOT_Z(m3, l3, h3, ze, zo);
            }
        }
        if (!G32 && (st + 1) % per) continue; /* the group goes on in the next step */
        int64_t g = G32 ? 2 * st : st / per;
        __m512 w0 = INT4_WSCALE(s0 + g), w1 = INT4_WSCALE(s1 + g), w2 = INT4_WSCALE(s2 + g), w3 = INT4_WSCALE(s3 + g);
        __m512 c1 = INT4_XSCALE(sc1, g);
        __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), c1), f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), c1);
        __m512 f2 = _mm512_mul_ps(_mm512_cvtepi32_ps(i2), c1), f3 = _mm512_mul_ps(_mm512_cvtepi32_ps(i3), c1);
        if (NP == 2) {
            __m512 c2 = INT4_XSCALE(sc2, g);
            f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k0), c2, f0);
            f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k1), c2, f1);
            f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k2), c2, f2);
            f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k3), c2, f3);
        }
        a0 = _mm512_fmadd_ps(f0, w0, a0);
        a1 = _mm512_fmadd_ps(f1, w1, a1);
        a2 = _mm512_fmadd_ps(f2, w2, a2);
        a3 = _mm512_fmadd_ps(f3, w3, a3);
        if (PAIR) { /* as f and a above, for row t + 1 */
            __m512 c3 = INT4_XSCALE(sc3, g);
            __m512 e0 = _mm512_mul_ps(_mm512_cvtepi32_ps(p0), c3), e1 = _mm512_mul_ps(_mm512_cvtepi32_ps(p1), c3);
            __m512 e2 = _mm512_mul_ps(_mm512_cvtepi32_ps(p2), c3), e3 = _mm512_mul_ps(_mm512_cvtepi32_ps(p3), c3);
            if (NP == 2) {
                __m512 c4 = INT4_XSCALE(sc4, g);
                e0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m0), c4, e0);
                e1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m1), c4, e1);
                e2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m2), c4, e2);
                e3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m3), c4, e3);
            }
            b0 = _mm512_fmadd_ps(e0, w0, b0);
            b1 = _mm512_fmadd_ps(e1, w1, b1);
            b2 = _mm512_fmadd_ps(e2, w2, b2);
            b3 = _mm512_fmadd_ps(e3, w3, b3);
        }
        i0 = i1 = i2 = i3 = k0 = k1 = k2 = k3 = p0 = p1 = p2 = p3 = m0 = m1 = m2 = m3 = zero;
    }
#undef INT4_XSCALE
#undef INT4_WSCALE
#undef INT4_SCALE
    const float *xs = j->xsum + t * ng;
#define INT4_OFFSETS(m) (HALF ? dot_f16_tail((const uint16_t *)j->o + (r + m) * ng, xs, ng) \
                              : dot_f32_tail((const float *)j->o + (r + m) * ng, xs, ng))
    GEMM_STORE(j, t, r, _mm512_reduce_add_ps(a0) + INT4_OFFSETS(0));
    GEMM_STORE(j, t, r + 1, _mm512_reduce_add_ps(a1) + INT4_OFFSETS(1));
    GEMM_STORE(j, t, r + 2, _mm512_reduce_add_ps(a2) + INT4_OFFSETS(2));
    GEMM_STORE(j, t, r + 3, _mm512_reduce_add_ps(a3) + INT4_OFFSETS(3));
    if (PAIR) {
        xs += ng;
        GEMM_STORE(j, t + 1, r, _mm512_reduce_add_ps(b0) + INT4_OFFSETS(0));
        GEMM_STORE(j, t + 1, r + 1, _mm512_reduce_add_ps(b1) + INT4_OFFSETS(1));
        GEMM_STORE(j, t + 1, r + 2, _mm512_reduce_add_ps(b2) + INT4_OFFSETS(2));
        GEMM_STORE(j, t + 1, r + 3, _mm512_reduce_add_ps(b3) + INT4_OFFSETS(3));
    }
#undef INT4_OFFSETS
}

/* the int4_rows4(_z) variant for this job: the kernel's constants as template arguments */
#define INT4_CALL(fn, pair)                                                                                 \
    do {                                                                                                    \
        int np2 = j->nparts == 2, g32 = j->group == 32, hs = j->half_scales != 0;                          \
        switch (np2 * 8 + g32 * 4 + hs * 2 + (pair)) {                                                      \
        case 0: fn(j, r, t, 1, 0, 0, 0); break;  case 1: fn(j, r, t, 1, 0, 0, 1); break;                    \
        case 2: fn(j, r, t, 1, 0, 1, 0); break;  case 3: fn(j, r, t, 1, 0, 1, 1); break;                    \
        case 4: fn(j, r, t, 1, 1, 0, 0); break;  case 5: fn(j, r, t, 1, 1, 0, 1); break;                    \
        case 6: fn(j, r, t, 1, 1, 1, 0); break;  case 7: fn(j, r, t, 1, 1, 1, 1); break;                    \
        case 8: fn(j, r, t, 2, 0, 0, 0); break;  case 9: fn(j, r, t, 2, 0, 0, 1); break;                    \
        case 10: fn(j, r, t, 2, 0, 1, 0); break; case 11: fn(j, r, t, 2, 0, 1, 1); break;                   \
        case 12: fn(j, r, t, 2, 1, 0, 0); break; case 13: fn(j, r, t, 2, 1, 0, 1); break;                   \
        case 14: fn(j, r, t, 2, 1, 1, 0); break; default: fn(j, r, t, 2, 1, 1, 1); break;                   \
        }                                                                                                   \
    } while (0)
#endif

static void int4_task(const void *args, int64_t part, int64_t parts) {
    const int4_job *j = (const int4_job *)args;
    /* the rows are cut in fours (N is a multiple of 4) */
    int64_t quads = j->n / 4, lo = quads * part / parts * 4, hi = quads * (part + 1) / parts * 4;
#if INT4_VNNI
    int wide = j->k % 64 == 0; /* 512-bit steps of 64 weights (a row's kernel depends only on the weight) */
    for (int64_t r = lo; r < hi; r += 4) {
        int64_t t = 0;
        for (; t + 1 < j->rows; t += 2) { /* rows in pairs */
            if (wide)
                INT4_CALL(int4_rows4_z, 1);
            else
                INT4_CALL(int4_rows4, 1);
        }
        for (; t < j->rows; t++) {
            if (wide)
                INT4_CALL(int4_rows4_z, 0);
            else
                INT4_CALL(int4_rows4, 0);
        }
    }
#else
    int64_t k = j->k, half = k / 2, ng = k / j->group;
    for (int64_t r = lo; r < hi; r++) {
        const uint8_t *qr = j->q + r * half;
        const float *sr = (const float *)j->s + r * ng;
        for (int64_t t = 0; t < j->rows; t++) {
            const float *xe = j->xp + t * k, *xo = xe + half;
            float total = 0.0f;
            for (int64_t g = 0; g < ng; g++) {
                float lanes[16] = {0};
                for (int64_t i = g * j->group / 2; i < (g + 1) * j->group / 2; i += 16)
                    for (int e = 0; e < 16; e++)
                        lanes[e] += (float)(qr[i + e] & 15) * xe[i + e] + (float)(qr[i + e] >> 4) * xo[i + e];
                float sum = 0.0f;
                for (int e = 0; e < 16; e++) sum += lanes[e];
                total += sum * sr[g];
            }
            GEMM_STORE(j, t, r, total + dot_f32((const float *)j->o + r * ng, j->xsum + t * ng, ng));
        }
    }
#endif
}

/* The group of x at xe[0..h-1] (its even elements) and xo[0..h-1] (its odd ones) as np
 * 16-bit integer parts, written to out_e / out_o + p * part_stride, with 2^e per part in
 * scale[p * scale_stride] (see above). */
static void int16_parts(const float *xe, const float *xo, int64_t h, int64_t np, int16_t *out_e, int16_t *out_o,
                        int64_t part_stride, float *scale, int64_t scale_stride) {
    float amax = 0.0f;
#if INT4_VNNI
    if (h % 16 == 0) {
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16)
            m = _mm512_max_ps(m, _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xe + i)), _mm512_abs_ps(_mm512_loadu_ps(xo + i))));
        amax = _mm512_reduce_max_ps(m);
    } else
#endif
    for (int64_t i = 0; i < h; i++) {
        float a = fabsf(xe[i]), b = fabsf(xo[i]);
        amax = a > amax ? a : amax;
        amax = b > amax ? b : amax;
    }
    int e = amax > 0.0f ? ilogbf(amax) - 14 : 0; /* amax / 2^e in [2^14, 2^15); the caller saw no inf/nan */
#if INT4_VNNI
    if (h % 16 == 0) { /* the loops below, 16 lanes at a time: the same operations, so the same values */
        for (int64_t p = 0; p < np; p++) {
            int ep = e - 15 * (int)p;
            int16_t *oe = out_e + p * part_stride, *oo = out_o + p * part_stride;
            if (ep < -149) {
                scale[p * scale_stride] = 0.0f;
                memset(oe, 0, sizeof(int16_t) * h);
                memset(oo, 0, sizeof(int16_t) * h);
                continue;
            }
            float up = ldexpf(1.0f, ep);
            scale[p * scale_stride] = up;
            __m512 vup = _mm512_set1_ps(up), lim = _mm512_set1_ps(32767.0f), nlim = _mm512_set1_ps(-32767.0f);
            __m512 vdown = _mm512_set1_ps(ep >= -126 ? ldexpf(1.0f, -ep) : 0.0f), vexp = _mm512_set1_ps((float)-ep);
            for (int half = 0; half < 2; half++) {
                float *src = (float *)(half ? xo : xe);
                int16_t *dst = half ? oo : oe;
                for (int64_t i = 0; i < h; i += 16) {
                    __m512 x = _mm512_loadu_ps(src + i);
                    __m512 sc = ep >= -126 ? _mm512_mul_ps(x, vdown) : _mm512_scalef_ps(x, vexp); /* exact either way */
                    __m512 v = _mm512_roundscale_ps(sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    v = _mm512_max_ps(_mm512_min_ps(v, lim), nlim);
                    _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
                    _mm512_storeu_ps(src + i, _mm512_sub_ps(x, _mm512_mul_ps(v, vup)));
                }
            }
        }
        return;
    }
#endif
    for (int64_t p = 0; p < np; p++) {
        int ep = e - 15 * (int)p;
        int16_t *oe = out_e + p * part_stride, *oo = out_o + p * part_stride;
        if (ep < -149) { /* 2^ep is below every float: what is left is too */
            scale[p * scale_stride] = 0.0f;
            memset(oe, 0, sizeof(int16_t) * h);
            memset(oo, 0, sizeof(int16_t) * h);
            continue;
        }
        /* Powers of two, so every product below is exact; 2^ep may be subnormal (tiny groups, such
         * as SiLU of a very negative gate), then 2^-ep overflows and x is scaled by ldexpf instead. */
        float up = ldexpf(1.0f, ep), down = ep >= -126 ? ldexpf(1.0f, -ep) : 0.0f;
        scale[p * scale_stride] = up;
        for (int half = 0; half < 2; half++) {
            float *src = (float *)(half ? xo : xe); /* the residual is kept in place for the next part */
            int16_t *dst = half ? oo : oe;
            for (int64_t i = 0; i < h; i++) {
                float v = nearbyintf(down != 0.0f ? src[i] * down : ldexpf(src[i], -ep));
                v = v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
                dst[i] = (int16_t)v;
                src[i] -= v * up; /* exact: v * 2^ep is within 2^ep of src[i] */
            }
        }
    }
}

/* One float32 row of x for the int4 GEMM, as the loop in DEF_INT4_GEMM, 16 lanes at a time
 * (groups of 32 or more): its even elements then its odd ones in xf, each group's sum in
 * xsum; 0 when the sum of |x| is not finite (inf or nan in x). */
static int int4_split_f32(const float *xr, int64_t k, int64_t group, float *xf, float *xsum) {
#if INT4_VNNI
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    int64_t half = k / 2;
    __m512 total = _mm512_setzero_ps(); /* of |x|: not finite where x holds inf or nan (or the sum overflows) */
    for (int64_t g = 0; g < k / group; g++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
            __m512 a = _mm512_loadu_ps(xr + i), b = _mm512_loadu_ps(xr + i + 16);
            _mm512_storeu_ps(xf + i / 2, _mm512_permutex2var_ps(a, evens, b));
            _mm512_storeu_ps(xf + half + i / 2, _mm512_permutex2var_ps(a, odds, b));
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            total = _mm512_add_ps(total, _mm512_add_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        }
        xsum[g] = _mm512_reduce_add_ps(sum);
    }
    return isfinite(_mm512_reduce_add_ps(total));
#else
    (void)xr, (void)k, (void)group, (void)xf, (void)xsum;
    return 0;
#endif
}

#define DEF_INT4_GEMM(SUF, T, LD, BF16_OUT)                                                                 \
    int infer_int4_gemm_##SUF(const uint8_t *q, const void *s, const void *o, int64_t group, int64_t f16,   \
                              const T *x, int64_t xs, int64_t rows, int64_t k, T *y, int64_t n,              \
                              int64_t threads) {                                                              \
        if (group % 32 || k % group || n % 4 || rows < 1 || rows > INT4_MAX_ROWS) return -1;               \
        if (f16 && !INT4_VNNI) return -3;                                                                   \
        int64_t ng = k / group, half = k / 2;                                                               \
        /* bf16 activations fit one 16-bit part (see above); float32 ones take two */                      \
        int64_t np = INT4_VNNI ? (BF16_OUT ? 1 : 2) : 1;                                                    \
        xpart_t *xp = (xpart_t *)malloc(sizeof(xpart_t) * rows * np * k);                                   \
        float *xsum = (float *)malloc(sizeof(float) * rows * ng * (1 + np));                                \
        float *xf = (float *)malloc(sizeof(float) * k);                                                     \
        if (!xp || !xsum || !xf) {                                                                          \
            free(xp); free(xsum); free(xf);                                                                 \
            return -2;                                                                                      \
        }                                                                                                   \
        float *xscale = xsum + rows * ng;                                                                   \
        for (int64_t t = 0; t < rows; t++) {                                                                \
            const T *xr = x + t * xs;                                                                       \
            if (sizeof(T) == 4 && INT4_VNNI && group % 32 == 0) {                                           \
                if (!int4_split_f32((const float *)xr, k, group, xf, xsum + t * ng)) {                     \
                    free(xp); free(xsum); free(xf);                                                         \
                    return -4;                                                                              \
                }                                                                                           \
            } else {                                                                                        \
            for (int64_t i = 0; i < half; i++) { /* even elements first, then odd */                        \
                xf[i] = LD(xr[2 * i]);                                                                      \
                xf[half + i] = LD(xr[2 * i + 1]);                                                           \
            }                                                                                               \
            float total = 0.0f;                                                                             \
            for (int64_t g = 0; g < ng; g++) {                                                              \
                float sum = 0.0f;                                                                           \
                for (int64_t i = g * group; i < (g + 1) * group; i++) {                                     \
                    sum += LD(xr[i]);                                                                       \
                    total += fabsf(LD(xr[i]));                                                              \
                }                                                                                           \
                xsum[t * ng + g] = sum;                                                                     \
            }                                                                                               \
            if (!isfinite(total)) { /* inf or nan in x: torch's arithmetic says what comes out */          \
                free(xp); free(xsum); free(xf);                                                             \
                return -4;                                                                                  \
            }                                                                                               \
            }                                                                                               \
            if (INT4_VNNI) {                                                                                \
                int16_t *xt = (int16_t *)xp + t * np * k;                                                   \
                for (int64_t g = 0; g < ng; g++) {                                                          \
                    int64_t at = g * group / 2;                                                             \
                    int16_parts(xf + at, xf + half + at, group / 2, np, xt + at, xt + half + at, k,          \
                                xscale + t * np * ng + g, ng);                                              \
                }                                                                                           \
            } else {                                                                                        \
                memcpy((float *)xp + t * k, xf, sizeof(float) * k);                                         \
            }                                                                                               \
        }                                                                                                   \
        int4_job job = {q, s, o, xp, xscale, xsum, y, rows, k, group, n, np, BF16_OUT, f16};                     \
        int64_t parts = threads < 1 ? 1 : threads;                                                          \
        if (parts > n / 64) parts = n / 64 > 0 ? n / 64 : 1;                                                \
        pool_run(int4_task, &job, parts);                                                                   \
        free(xp); free(xsum); free(xf);                                                                     \
        return 0;                                                                                           \
    }

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

typedef struct {
    const int8_t *q;
    const float *scales, *xf;
    float *y;
    int64_t rows, k, group, n;
} int8_job;

#if defined(__AVX512F__)
/* INT8_ROW_DOT for R (a constant at each call site) activation rows from t at once: each 16
 * weights are converted once for all R, and every row's sums are rounded as INT8_ROW_DOT's
 * (the same products and additions in the same order), so a row's result does not depend on
 * how many rows share the call (speculative decoding's verify steps equal plain decode). */
static inline __attribute__((always_inline)) void int8_rows(const int8_job *j, const int8_t *qr, const float *sr,
                                                            int64_t r, int64_t t, const int R) {
    int64_t ng = j->k / j->group, group = j->group;
    const float *x0 = j->xf + t * j->k;
    __m512 acc[4], part[4];
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        for (int m = 0; m < R; m++) part[m] = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
            __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qr + i))));
            for (int m = 0; m < R; m++)
                part[m] = _mm512_add_ps(part[m], _mm512_mul_ps(qf, _mm512_loadu_ps(x0 + m * j->k + i)));
        }
        __m512 sc = _mm512_set1_ps(sr[g]);
        for (int m = 0; m < R; m++) acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(part[m], sc));
    }
    for (int m = 0; m < R; m++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[m]);
        float sum = 0.0f;
        for (int e = 0; e < 16; e++) sum += lanes[e];
        j->y[(t + m) * j->n + r] = sum;
    }
}
#endif

static void int8_task(const void *args, int64_t part, int64_t parts) {
    const int8_job *j = (const int8_job *)args;
    int64_t ng = j->k / j->group, lo = j->n * part / parts, hi = j->n * (part + 1) / parts;
    for (int64_t r = lo; r < hi; r++) {
        const int8_t *qr = j->q + r * j->k;
        const float *sr = j->scales + r * ng;
        int64_t t = 0;
#if defined(__AVX512F__)
        for (; t + 4 <= j->rows; t += 4) int8_rows(j, qr, sr, r, t, 4);
        if (j->rows - t == 3) {
            int8_rows(j, qr, sr, r, t, 3);
            t += 3;
        } else if (j->rows - t == 2) {
            int8_rows(j, qr, sr, r, t, 2);
            t += 2;
        }
#endif
        for (; t < j->rows; t++) {
            const float *xr = j->xf + t * j->k;
            INT8_ROW_DOT(qr, xr, sr, ng, j->group, j->y[t * j->n + r]);
        }
    }
}

/* Output rows are cut into `threads` parts run by the pool; small weights take one. */
#define DEF_INT8_GEMV(SUF, T, LD)                                                                           \
    int infer_int8_gemv_##SUF(const int8_t *restrict q, const float *restrict scales, const T *restrict x, \
                              int64_t xs, int64_t rows, int64_t k, int64_t group, float *restrict y,        \
                              int64_t n, int64_t threads) {                                                 \
        if (group % 16 || k % group) return -1;                                                             \
        float *xf = (float *)malloc(sizeof(float) * rows * k);                                              \
        if (!xf) return -2;                                                                                 \
        for (int64_t t = 0; t < rows; t++)                                                                  \
            for (int64_t i = 0; i < k; i++) xf[t * k + i] = LD(x[t * xs + i]);                              \
        int8_job job = {q, scales, xf, y, rows, k, group, n};                                               \
        int64_t parts = threads < 1 ? 1 : threads;                                                          \
        if (parts > n / 64) parts = n / 64 > 0 ? n / 64 : 1;                                                \
        pool_run(int8_task, &job, parts);                                                                   \
        free(xf);                                                                                           \
        return 0;                                                                                           \
    }

/* ---- int8 group-quantized GEMM on integer dot products (VNNI) -------------------------
 * y[t, n] = sum_g scales[n, g] * (q[n, group g] . x[t, group g]) (+ offsets[n, g] * sum(x[t, group g]))
 * for q [N, K] int8 (GGUF Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, IQ4, MXFP4 codes), scales and
 * offsets [N, K/G] float32 (offsets NULL: none), x [rows, K], y [rows, N] in x's dtype.
 * x is written per group as 16-bit integer parts in K's order (int16_parts, as for int4:
 * exact for bf16 x in one part, within float32 rounding in two for float32 x), and each 32
 * codes meet it in one vpdpwssd (16 lanes of two products each): an integer sum per group
 * that is exact (|q| <= 128, so a lane of a group of up to 32 stays below 2^24 and
 * converts to float32 exactly; larger groups are rounded once). Groups of 16 share a
 * 512-bit step: lanes 0-7 are group g's, 8-15 group g + 1's, scaled lane-wise.
 * Needs K % 32 == 0, N % 4 == 0 and a group of 16 or a multiple of 32 (else -1).
 */
#if INT4_VNNI
typedef struct {
    const int8_t *q;
    const float *s, *o;
    const int16_t *xp;    /* [rows][nparts][K] */
    const float *xscale;  /* [rows][nparts][K/G] */
    const float *xsum;    /* [rows][K/G] */
    void *y;
    int64_t rows, k, group, n, nparts, bf16_out;
} int8v_job;

#define INT8V_CODES(qr, at) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((qr) + (at))))
/* Output rows r..r+3 for activation row t, NP (1 or 2) parts of x; G16: groups of 16. */
static inline __attribute__((always_inline)) void int8v_rows4(const int8v_job *j, int64_t r, int64_t t, const int NP,
                                                              const int G16) {
    int64_t k = j->k, ng = k / j->group, chunks = G16 ? 1 : j->group / 32, step = G16 ? 2 : 1;
    const int16_t *x1 = j->xp + t * NP * k, *x2 = x1 + k;
    const float *c1p = j->xscale + t * NP * ng, *c2p = c1p + ng;
    const int8_t *q0 = j->q + r * k, *q1 = q0 + k, *q2 = q1 + k, *q3 = q2 + k;
    const float *w0 = j->s + r * ng, *w1 = w0 + ng, *w2 = w1 + ng, *w3 = w2 + ng;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < ng; g += step) {
        __m512i i0 = _mm512_setzero_si512(), i1 = i0, i2 = i0, i3 = i0;
        __m512i k0 = i0, k1 = i0, k2 = i0, k3 = i0; /* second parts */
        for (int64_t c = 0; c < chunks; c++) {
            int64_t at = g * j->group + c * 32;
            if ((at & 63) == 0) { /* the same bytes of the rows ahead, before their turn */
                const int8_t *ahead = q0 + INT4_PREFETCH_ROWS * k + at;
                for (int m = 0; m < 4; m++) _mm_prefetch((const char *)(ahead + m * k), _MM_HINT_T0);
            }
            __m512i xv = _mm512_loadu_si512((const void *)(x1 + at));
            __m512i l0 = INT8V_CODES(q0, at), l1 = INT8V_CODES(q1, at);
            __m512i l2 = INT8V_CODES(q2, at), l3 = INT8V_CODES(q3, at);
            i0 = _mm512_dpwssd_epi32(i0, l0, xv);
            i1 = _mm512_dpwssd_epi32(i1, l1, xv);
            i2 = _mm512_dpwssd_epi32(i2, l2, xv);
            i3 = _mm512_dpwssd_epi32(i3, l3, xv);
            if (NP == 2) {
                __m512i yv = _mm512_loadu_si512((const void *)(x2 + at));
                k0 = _mm512_dpwssd_epi32(k0, l0, yv);
                k1 = _mm512_dpwssd_epi32(k1, l1, yv);
                k2 = _mm512_dpwssd_epi32(k2, l2, yv);
                k3 = _mm512_dpwssd_epi32(k3, l3, yv);
            }
        }
#define INT8V_SCALE(p) (G16 ? int4_two_f32(p) : _mm512_set1_ps(*(p)))
        __m512 c1 = INT8V_SCALE(c1p + g);
        __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), c1), f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), c1);
        __m512 f2 = _mm512_mul_ps(_mm512_cvtepi32_ps(i2), c1), f3 = _mm512_mul_ps(_mm512_cvtepi32_ps(i3), c1);
        if (NP == 2) {
            __m512 c2 = INT8V_SCALE(c2p + g);
            f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k0), c2, f0);
            f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k1), c2, f1);
            f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k2), c2, f2);
            f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k3), c2, f3);
        }
        a0 = _mm512_fmadd_ps(f0, INT8V_SCALE(w0 + g), a0);
        a1 = _mm512_fmadd_ps(f1, INT8V_SCALE(w1 + g), a1);
        a2 = _mm512_fmadd_ps(f2, INT8V_SCALE(w2 + g), a2);
        a3 = _mm512_fmadd_ps(f3, INT8V_SCALE(w3 + g), a3);
#undef INT8V_SCALE
    }
    const float *xs = j->xsum + t * ng;
#define INT8V_OFFSETS(m) (j->o ? dot_f32_tail(j->o + (r + m) * ng, xs, ng) : 0.0f)
    GEMM_STORE(j, t, r, _mm512_reduce_add_ps(a0) + INT8V_OFFSETS(0));
    GEMM_STORE(j, t, r + 1, _mm512_reduce_add_ps(a1) + INT8V_OFFSETS(1));
    GEMM_STORE(j, t, r + 2, _mm512_reduce_add_ps(a2) + INT8V_OFFSETS(2));
    GEMM_STORE(j, t, r + 3, _mm512_reduce_add_ps(a3) + INT8V_OFFSETS(3));
#undef INT8V_OFFSETS
}

static void int8v_task(const void *args, int64_t part, int64_t parts) {
    const int8v_job *j = (const int8v_job *)args;
    int64_t quads = j->n / 4, lo = quads * part / parts * 4, hi = quads * (part + 1) / parts * 4;
    int g16 = j->group == 16;
    for (int64_t r = lo; r < hi; r += 4)
        for (int64_t t = 0; t < j->rows; t++) {
            if (j->nparts == 2) {
                if (g16) int8v_rows4(j, r, t, 2, 1); else int8v_rows4(j, r, t, 2, 0);
            } else {
                if (g16) int8v_rows4(j, r, t, 1, 1); else int8v_rows4(j, r, t, 1, 0);
            }
        }
}
#endif

/* ---- int8 codes of few bits, packed (a private layout of the torch backend) -----------
 * An int8 group weight whose codes span fewer than 2^bits values (bits 4, 5 or 6: GGUF
 * Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, MXFP4's codes) is stored as u = q + c in 0..2^bits - 1, so a
 * decode step streams bits / 8 of the int8 bytes. Per 64 codes of a row (a block): 32 bytes
 * of nibbles (byte i: u[i] & 15 low, u[32 + i] & 15 high), then bits - 4 planes of 8 bytes
 * (plane p: bit i of the little-endian 64-bit word = bit 4 + p of u[i]). Other codes (bits 8,
 * c 0: GGUF Q8_0) keep their 64 bytes a block and gain the layout and float16 scales. The four rows of a
 * quad are interleaved block by block ([N/4][K/64][4][block bytes]), so the rows a thread
 * reads together are one sequential stream. Scales and offsets are float16 where that is
 * exact (kind's half bit), else float32.
 *   kind = 3 | bits << 4 | half << 8 | (c + 256) << 12
 * Each 32 codes meet x's 16-bit parts (as infer_int8_gemm writes them) in one vpdpwssd, the
 * sums starting from -c * x's pair sums (computed once per call), so a group's integer sum
 * is exactly int8_gemm's sum(q * x). Groups of 32 are packed with the first 16 codes of
 * groups 2b and 2b + 1 in a block's first half and their last 16 in the second (lowbit_lo),
 * so one dot product's lanes hold both groups and one scaling serves them; groups of 16 the
 * same with four groups in quarters (lowbit_quarters). Their lanes sum in another order than
 * int8_gemm's (results equal to float32 rounding); larger groups keep its results bit for bit.
 */
#if INT4_VNNI
#define LOWBIT_KIND(kind) (((kind) & 3) == 3)
typedef struct {
    const uint8_t *q;
    const void *s, *o;
    const int16_t *xp;    /* [rows][nparts][K] */
    const float *xscale;  /* [rows][nparts][K/G] */
    const float *xsum;    /* [rows][K/G] */
    const __m512i *corr;  /* [rows][nparts][units]: -c * x's pair sums, a unit = max(G, 32) codes */
    void *y;
    int64_t rows, k, group, n, nparts, bf16_out, bits, half;
} lowbit_job;

static inline __m512 lowbit_scale1(const void *p, int64_t i, const int HALF) {
    return _mm512_set1_ps(HALF ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i]);
}
static inline __m512 lowbit_scale2(const void *p, int64_t i, const int HALF) { /* lanes 0-7: [i], 8-15: [i + 1] */
    return HALF ? int4_two_f16((const uint16_t *)p + i) : int4_two_f32((const float *)p + i);
}
static inline __m512 lowbit_four(__m128 v) { /* lanes 4m..4m + 3: v[m] */
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}
static inline __m512 lowbit_scale4(const void *p, int64_t i, const int HALF) { /* lanes 4m..4m + 3: [i + m] */
    return lowbit_four(HALF ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i)))
                            : _mm_loadu_ps((const float *)p + i));
}

/* x's 16-bit parts for the two halves of a block of groups of 32: codes 0-15 of both groups
 * (lanes 0-7 of a dot product: group 2b, 8-15: group 2b + 1), then codes 16-31 of both. */
static inline __m512i lowbit_lo(const int16_t *x) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x)),
                              _mm256_loadu_si256((const __m256i *)(x + 32)), 1);
}
static inline __m512i lowbit_hi(const int16_t *x) { return lowbit_lo(x + 16); }
/* groups of 16: codes 0-7 of the block's four groups (a dot product's lanes 4m..4m + 3: group
 * 4b + m); at x + 8, codes 8-15 of each */
static inline __m512i lowbit_quarters(const int16_t *x) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)x));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x + 16)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x + 32)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x + 48)), 3);
}

/* The 32 + 32 codes of a block at `blk` as 16-bit lanes: lo = the block's codes 0..31, hi =
 * 32..63, in the packed order (groups of 32: lowbit_lo's, then lowbit_hi's). */
#define LOWBIT_CODES(blk, lo, hi)                                                                  \
    __m512i lo, hi;                                                                                \
    if (BITS == 8) {                                                                               \
        lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk)));                    \
        hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((blk) + 32)));             \
    } else {                                                                                       \
        lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk)));                    \
        hi = _mm512_srli_epi16(lo, 4);                                                             \
        lo = _mm512_and_si512(lo, low4);                                                           \
    }                                                                                              \
    if (BITS == 5 || BITS == 6) {                                                                  \
        uint64_t pl;                                                                               \
        memcpy(&pl, (blk) + 32, 8);                                                                \
        lo = _mm512_mask_add_epi16(lo, (__mmask32)pl, lo, b16);                                   \
        hi = _mm512_mask_add_epi16(hi, (__mmask32)(pl >> 32), hi, b16);                           \
    }                                                                                              \
    if (BITS == 6) {                                                                               \
        uint64_t pl;                                                                               \
        memcpy(&pl, (blk) + 40, 8);                                                                \
        lo = _mm512_mask_add_epi16(lo, (__mmask32)pl, lo, b32);                                   \
        hi = _mm512_mask_add_epi16(hi, (__mmask32)(pl >> 32), hi, b32);                           \
    }

/* Output rows r..r+3 (quad r / 4) for activation row t. GK: 16, 32, or 64 (any multiple of 64). */
static inline __attribute__((always_inline)) void lowbit_rows4(const lowbit_job *j, int64_t r, int64_t t,
                                                               const int NP, const int GK, const int BITS,
                                                               const int HALF) {
    const __m512i low4 = _mm512_set1_epi16(15), b16 = _mm512_set1_epi16(16), b32 = _mm512_set1_epi16(32);
    const int64_t k = j->k, ng = k / j->group, nb = k / 64, sb = BITS == 8 ? 64 : 32 + 8 * (BITS - 4);
    const int64_t units = GK >= 64 ? ng : nb;
    const int64_t per = GK >= 64 ? j->group / 64 : 1; /* blocks a group spans */
    const uint8_t *base = j->q + (r / 4) * nb * 4 * sb, *ahead = base + nb * 4 * sb;
    const int16_t *x1 = j->xp + t * NP * k, *x2 = x1 + k;
    const float *c1p = j->xscale + t * NP * ng, *c2p = c1p + ng;
    const __m512i *r1 = j->corr + t * NP * units, *r2 = r1 + units;
    const int64_t s0 = r * ng, s1 = s0 + ng, s2 = s1 + ng, s3 = s2 + ng;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m512i i0 = _mm512_setzero_si512(), i1 = i0, i2 = i0, i3 = i0, k0 = i0, k1 = i0, k2 = i0, k3 = i0;
/* one group's sums (i: first parts, kk: second) scaled by x's 2^e (cp) and the weight scales into a */
#define LOWBIT_FINISH(g, XS, WS)                                                                   \
    do {                                                                                           \
        __m512 c1 = XS(c1p, g);                                                                    \
        __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), c1), f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), c1); \
        __m512 f2 = _mm512_mul_ps(_mm512_cvtepi32_ps(i2), c1), f3 = _mm512_mul_ps(_mm512_cvtepi32_ps(i3), c1); \
        if (NP == 2) {                                                                             \
            __m512 c2 = XS(c2p, g);                                                                \
            f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k0), c2, f0);                                  \
            f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k1), c2, f1);                                  \
            f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k2), c2, f2);                                  \
            f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k3), c2, f3);                                  \
        }                                                                                          \
        a0 = _mm512_fmadd_ps(f0, WS(j->s, s0 + (g), HALF), a0);                                    \
        a1 = _mm512_fmadd_ps(f1, WS(j->s, s1 + (g), HALF), a1);                                    \
        a2 = _mm512_fmadd_ps(f2, WS(j->s, s2 + (g), HALF), a2);                                    \
        a3 = _mm512_fmadd_ps(f3, WS(j->s, s3 + (g), HALF), a3);                                    \
    } while (0)
#define LOWBIT_X1(p, g) _mm512_set1_ps((p)[g])
#define LOWBIT_X2(p, g) int4_two_f32((p) + (g))
#define LOWBIT_X4(p, g) lowbit_four(_mm_loadu_ps((p) + (g)))
/* the sums of one 32-code half (codes L0..L3 against x at xa / ya) started from unit u's corrections */
#define LOWBIT_DOT(u, L0, L1, L2, L3, XA, YA, START)                                               \
    do {                                                                                           \
        if (START) i0 = i1 = i2 = i3 = r1[u];                                                      \
        i0 = _mm512_dpwssd_epi32(i0, L0, XA);                                                      \
        i1 = _mm512_dpwssd_epi32(i1, L1, XA);                                                      \
        i2 = _mm512_dpwssd_epi32(i2, L2, XA);                                                      \
        i3 = _mm512_dpwssd_epi32(i3, L3, XA);                                                      \
        if (NP == 2) {                                                                             \
            if (START) k0 = k1 = k2 = k3 = r2[u];                                                  \
            k0 = _mm512_dpwssd_epi32(k0, L0, YA);                                                  \
            k1 = _mm512_dpwssd_epi32(k1, L1, YA);                                                  \
            k2 = _mm512_dpwssd_epi32(k2, L2, YA);                                                  \
            k3 = _mm512_dpwssd_epi32(k3, L3, YA);                                                  \
        }                                                                                          \
    } while (0)
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = base + b * 4 * sb;
        for (int64_t off = 0; off < 4 * sb; off += 64) _mm_prefetch((const char *)(ahead + b * 4 * sb + off), _MM_HINT_T0);
        LOWBIT_CODES(blk, l0, h0);
        LOWBIT_CODES(blk + sb, l1, h1);
        LOWBIT_CODES(blk + 2 * sb, l2, h2);
        LOWBIT_CODES(blk + 3 * sb, l3, h3);
        const int16_t *xb = x1 + b * 64, *yb = x2 + b * 64;
        __m512i xa = _mm512_loadu_si512((const void *)xb), xh = _mm512_loadu_si512((const void *)(xb + 32));
        __m512i ya = xa, yh = xh;
        if (NP == 2 && GK >= 64) {
            ya = _mm512_loadu_si512((const void *)yb);
            yh = _mm512_loadu_si512((const void *)(yb + 32));
        }
        if (GK == 32) { /* groups 2b and 2b + 1, a half of each in each half of the block (lowbit_lo/hi) */
            xa = lowbit_lo(xb), xh = lowbit_hi(xb);
            if (NP == 2) ya = lowbit_lo(yb), yh = lowbit_hi(yb);
            LOWBIT_DOT(b, l0, l1, l2, l3, xa, ya, 1);
            LOWBIT_DOT(b, h0, h1, h2, h3, xh, yh, 0);
            LOWBIT_FINISH(2 * b, LOWBIT_X2, lowbit_scale2);
        } else if (GK == 16) { /* groups 4b..4b + 3, each in four lanes of both halves (lowbit_quarters) */
            xa = lowbit_quarters(xb), xh = lowbit_quarters(xb + 8);
            if (NP == 2) ya = lowbit_quarters(yb), yh = lowbit_quarters(yb + 8);
            LOWBIT_DOT(b, l0, l1, l2, l3, xa, ya, 1);
            LOWBIT_DOT(b, h0, h1, h2, h3, xh, yh, 0);
            LOWBIT_FINISH(4 * b, LOWBIT_X4, lowbit_scale4);
        } else { /* a group of `per` blocks */
            int64_t g = b / per;
            LOWBIT_DOT(g, l0, l1, l2, l3, xa, ya, b % per == 0);
            LOWBIT_DOT(g, h0, h1, h2, h3, xh, yh, 0);
            if ((b + 1) % per == 0) LOWBIT_FINISH(g, LOWBIT_X1, lowbit_scale1);
        }
    }
#undef LOWBIT_DOT
#undef LOWBIT_X4
#undef LOWBIT_X2
#undef LOWBIT_X1
#undef LOWBIT_FINISH
    const float *xs = j->xsum + t * ng;
#define LOWBIT_OFFSETS(m)                                                                          \
    (!j->o ? 0.0f : HALF ? dot_f16_tail((const uint16_t *)j->o + (r + m) * ng, xs, ng)           \
                         : dot_f32_tail((const float *)j->o + (r + m) * ng, xs, ng))
    GEMM_STORE(j, t, r, _mm512_reduce_add_ps(a0) + LOWBIT_OFFSETS(0));
    GEMM_STORE(j, t, r + 1, _mm512_reduce_add_ps(a1) + LOWBIT_OFFSETS(1));
    GEMM_STORE(j, t, r + 2, _mm512_reduce_add_ps(a2) + LOWBIT_OFFSETS(2));
    GEMM_STORE(j, t, r + 3, _mm512_reduce_add_ps(a3) + LOWBIT_OFFSETS(3));
#undef LOWBIT_OFFSETS
}
#undef LOWBIT_CODES

static void lowbit_task(const void *args, int64_t part, int64_t parts) {
    const lowbit_job *j = (const lowbit_job *)args;
    int64_t quads = j->n / 4, lo = quads * part / parts * 4, hi = quads * (part + 1) / parts * 4;
    int gk = j->group == 16 ? 16 : j->group == 32 ? 32 : 64;
    int variant = ((j->nparts == 2) * 3 + (gk == 16 ? 0 : gk == 32 ? 1 : 2)) * 8 + (int)(j->bits == 8 ? 3 : j->bits - 4) * 2
                  + (j->half != 0);
    for (int64_t r = lo; r < hi; r += 4)
        for (int64_t t = 0; t < j->rows; t++) {
            switch (variant) {
#define LOWBIT_CASE(v, NP, GK, BITS, HALF) case v: lowbit_rows4(j, r, t, NP, GK, BITS, HALF); break;
#define LOWBIT_CASES_BITS(v, NP, GK) LOWBIT_CASE(v, NP, GK, 4, 0) LOWBIT_CASE(v + 1, NP, GK, 4, 1)               \
    LOWBIT_CASE(v + 2, NP, GK, 5, 0) LOWBIT_CASE(v + 3, NP, GK, 5, 1) LOWBIT_CASE(v + 4, NP, GK, 6, 0)          \
    LOWBIT_CASE(v + 5, NP, GK, 6, 1) LOWBIT_CASE(v + 6, NP, GK, 8, 0) LOWBIT_CASE(v + 7, NP, GK, 8, 1)
            LOWBIT_CASES_BITS(0, 1, 16) LOWBIT_CASES_BITS(8, 1, 32) LOWBIT_CASES_BITS(16, 1, 64)
            LOWBIT_CASES_BITS(24, 2, 16) LOWBIT_CASES_BITS(32, 2, 32) LOWBIT_CASES_BITS(40, 2, 64)
#undef LOWBIT_CASES_BITS
#undef LOWBIT_CASE
            default: break;
            }
        }
}

/* the packed kernel on x prepared as infer_int8_gemm prepares it; -1: a shape it does not take */
static int lowbit_run(const uint8_t *q, const void *s, const void *o, int64_t group, int64_t kind, const int16_t *xp,
                      const float *xscale, const float *xsum, void *y, int64_t rows, int64_t k, int64_t n, int64_t np,
                      int64_t bf16_out, int64_t threads) {
    int64_t bits = (kind >> 4) & 15, half = (kind >> 8) & 1, c = ((kind >> 12) & 511) - 256;
    if (bits < 4 || bits == 7 || bits > 8 || k % 64 || (group != 16 && group != 32 && group % 64)) return -1;
    int64_t ng = k / group, units = group >= 64 ? ng : k / 64, per = group >= 64 ? group / 32 : 1;
    __m512i *corr = (__m512i *)aligned_alloc(64, sizeof(__m512i) * rows * np * units);
    if (!corr) return -2;
    const __m512i minus_c = _mm512_set1_epi16((int16_t)-c);
    for (int64_t tp = 0; tp < rows * np; tp++) /* row t's part p is tp = t * np + p: parts are K apart */
        for (int64_t u = 0; u < units; u++) {
            __m512i acc = _mm512_setzero_si512();
            const int16_t *xb = xp + tp * k + u * 64;
            if (c && group == 32)
                acc = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc, minus_c, lowbit_lo(xb)), minus_c, lowbit_hi(xb));
            if (c && group == 16)
                acc = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc, minus_c, lowbit_quarters(xb)), minus_c,
                                          lowbit_quarters(xb + 8));
            for (int64_t ch = 0; c && group >= 64 && ch < per; ch++)
                acc = _mm512_dpwssd_epi32(acc, minus_c, _mm512_loadu_si512((const void *)(xp + tp * k + (u * per + ch) * 32)));
            corr[tp * units + u] = acc;
        }
    lowbit_job job = {q, s, o, xp, xscale, xsum, corr, y, rows, k, group, n, np, bf16_out, bits, half};
    int64_t parts = threads < 1 ? 1 : threads;
    if (parts > n / 64) parts = n / 64 > 0 ? n / 64 : 1;
    pool_run(lowbit_task, &job, parts);
    free(corr);
    return 0;
}
#endif

#define INT8V_MAX_ROWS 32
#define DEF_INT8_GEMM(SUF, T, LD, BF16_OUT)                                                                 \
    int infer_int8_gemm_##SUF(const int8_t *q, const float *s, const float *o, int64_t group, int64_t kind, \
                              const T *x, int64_t xs, int64_t rows, int64_t k, T *y, int64_t n,              \
                              int64_t threads) {                                                              \
        if (!INT4_VNNI) return -3;                                                                          \
        if ((group != 16 && group % 32) || k % 32 || k % group || n % 4 || rows < 1 || rows > INT8V_MAX_ROWS) \
            return -1;                                                                                      \
        int64_t ng = k / group, np = BF16_OUT ? 1 : 2;                                                      \
        int16_t *xp = (int16_t *)malloc(sizeof(int16_t) * rows * np * k);                                   \
        float *xsum = (float *)malloc(sizeof(float) * rows * ng * (1 + np));                                \
        float *xf = (float *)malloc(sizeof(float) * k);                                                     \
        if (!xp || !xsum || !xf) {                                                                          \
            free(xp); free(xsum); free(xf);                                                                 \
            return -2;                                                                                      \
        }                                                                                                   \
        float *xscale = xsum + rows * ng;                                                                   \
        for (int64_t t = 0; t < rows; t++) {                                                                \
            const T *xr = x + t * xs;                                                                       \
            float total = 0.0f;                                                                             \
            for (int64_t g = 0; g < ng; g++) {                                                              \
                float sum = 0.0f;                                                                           \
                for (int64_t i = g * group; i < (g + 1) * group; i++) {                                     \
                    xf[i] = LD(xr[i]);                                                                      \
                    sum += xf[i];                                                                           \
                    total += fabsf(xf[i]);                                                                  \
                }                                                                                           \
                xsum[t * ng + g] = sum;                                                                     \
            }                                                                                               \
            if (!isfinite(total)) { /* inf or nan in x: torch's arithmetic says what comes out */          \
                free(xp); free(xsum); free(xf);                                                             \
                return -4;                                                                                  \
            }                                                                                               \
            int16_t *xt = xp + t * np * k;                                                                  \
            for (int64_t g = 0; g < ng; g++) { /* a group's two halves share its exponent */               \
                int64_t at = g * group, h = group / 2;                                                      \
                int16_parts(xf + at, xf + at + h, h, np, xt + at, xt + at + h, k, xscale + t * np * ng + g, ng); \
            }                                                                                               \
        }                                                                                                   \
        int rc = 0;                                                                                         \
        INT8V_RUN(BF16_OUT)                                                                                 \
        free(xp); free(xsum); free(xf);                                                                     \
        return rc;                                                                                          \
    }
#if INT4_VNNI
#define INT8V_RUN(BF16_OUT)                                                                                 \
    if (LOWBIT_KIND(kind)) {                                                                                \
        rc = lowbit_run((const uint8_t *)q, s, o, group, kind, xp, xscale, xsum, y, rows, k, n, np, BF16_OUT, threads); \
    } else {                                                                                                \
        int8v_job job = {q, s, o, xp, xscale, xsum, y, rows, k, group, n, np, BF16_OUT};                    \
        int64_t parts = threads < 1 ? 1 : threads;                                                          \
        if (parts > n / 64) parts = n / 64 > 0 ? n / 64 : 1;                                                \
        pool_run(int8v_task, &job, parts);                                                                  \
    }
#else
#define INT8V_RUN(BF16_OUT) (void)y, (void)threads, (void)xscale, (void)xs, (void)kind;
#endif

DEF_INT8_GEMM(f32, float, f32_load, 0)
DEF_INT8_GEMM(bf16, uint16_t, bf16_load, 1)
DEF_INT8_GEMV(f32, float, f32_load)
DEF_INT4_GEMM(f32, float, f32_load, 0)
DEF_INT4_GEMM(bf16, uint16_t, bf16_load, 1)
DEF_INT8_GEMV(bf16, uint16_t, bf16_load)
DEF_RMS_NORM(f32, float, f32_load, f32_store)
DEF_RMS_NORM(bf16, uint16_t, bf16_load, bf16_store)
DEF_ROTARY(f32, float, f32_load, f32_store)
DEF_ROTARY(bf16, uint16_t, bf16_load, bf16_store)
DEF_ACT_AND_MUL(silu, ACT_SILU, f32, float, f32_load, f32_store)
DEF_ACT_AND_MUL(silu, ACT_SILU, bf16, uint16_t, bf16_load, bf16_store)
DEF_ACT_AND_MUL(gelu_tanh, ACT_GELU_TANH, f32, float, f32_load, f32_store)
DEF_ACT_AND_MUL(gelu_tanh, ACT_GELU_TANH, bf16, uint16_t, bf16_load, bf16_store)
#if BF16_DOT
/* exp_f32 on 16 lanes: the same operations in the same order, so the same results (NaN included). */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    /* max/min return their second operand when either is NaN: x goes second, so NaN stays NaN */
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
    __m512 big = _mm512_set1_ps(12582912.0f);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* The 16 lanes of each of a0..a3 summed: [sum a0, sum a1, sum a2, sum a3] (every input summed in
 * the same order: lanes i and i + 2 of each 128-bit quarter, then the pairs, then the quarters). */
static inline __attribute__((always_inline)) __m128 sum_lanes4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* bf16 q and cache, AVX512-BF16, head size 64/128/256, up to 8 query heads per KV head: the
 * same units and partial results as the generic task, with q . k as bf16 dot products
 * (vdpbf16ps: the exact products summed in float32, as the widened path sums them, in another
 * order) and P @ V with the unit's V rows widened once and every query head's accumulator
 * held in registers over the keys. */
static inline __attribute__((always_inline)) void att_bf16_unit(const att_job *j, int64_t u, float *scores,
                                                                float *vf, const int ND) {
    int64_t item = j->unit_item[u], row = item / j->hk, g = item % j->hk, start, nkeys, group = j->group;
    const int64_t d = 32 * ND;
    att_keys(j, row, &start, &nkeys);
    int64_t first = start + j->unit_key[u], n = nkeys - j->unit_key[u];
    n = n < ATT_CHUNK ? n : ATT_CHUNK;
    const int32_t *bt = j->block_table + j->row_req[row] * j->bt_stride;
    const uint16_t *cache = (const uint16_t *)j->cache, *vcache = (const uint16_t *)j->vcache;
    int64_t offs[ATT_CHUNK];
    for (int64_t p = 0, blk = first / j->bs, in = first % j->bs; p < n; p++) {
        offs[p] = ((int64_t)bt[blk] * j->bs + in) * j->kv_row + g * d;
        if (++in == j->bs) {
            in = 0;
            blk++;
        }
    }
    __m512bh qv[8][ND];
    for (int64_t hh = 0; hh < group; hh++) {
        const uint16_t *qr = (const uint16_t *)j->q + row * j->q_ts + (g * group + hh) * j->q_hs;
#pragma GCC unroll 8
        for (int c = 0; c < ND; c++) qv[hh][c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
    }
    const __m128 scale = _mm_set1_ps(j->scale);
    for (int64_t p0 = 0; p0 < n; p0 += 4) { /* four keys at a time: their sums of lanes together */
        __m512bh kv[4][ND];
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            const uint16_t *kr = cache + offs[p0 + e < n ? p0 + e : p0]; /* past n: key p0 again, not kept */
            if (p0 + e + 8 < n) _mm_prefetch((const char *)(cache + offs[p0 + e + 8]), _MM_HINT_T0);
#pragma GCC unroll 8
            for (int c = 0; c < ND; c++) kv[e][c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
        }
        for (int64_t hh = 0; hh < group; hh++) {
            __m512 acc[4];
#pragma GCC unroll 4
            for (int e = 0; e < 4; e++) {
                acc[e] = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int c = 0; c < ND; c++) acc[e] = _mm512_dpbf16_ps(acc[e], qv[hh][c], kv[e][c]);
            }
            __m128 s4 = _mm_mul_ps(sum_lanes4(acc[0], acc[1], acc[2], acc[3]), scale);
            _mm_storeu_ps(scores + hh * ATT_CHUNK + p0, s4); /* ATT_CHUNK is a multiple of 4: in bounds */
        }
    }
    if (j->softcap > 0.0f)
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t p = 0; p < n; p++)
                scores[hh * ATT_CHUNK + p] = j->softcap * tanhf(scores[hh * ATT_CHUNK + p] / j->softcap);
    for (int64_t p = 0; p < n; p++) { /* V rows widened once for every query head */
        const uint16_t *vr = vcache + offs[p];
#pragma GCC unroll 16
        for (int c = 0; c < 2 * ND; c++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * c)));
            _mm512_storeu_ps(vf + p * d + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    }
    float *part_out = j->partial + u * group * (d + 2);
    for (int64_t hh = 0; hh < group; hh++) {
        float *sc = scores + hh * ATT_CHUNK;
        __m512 mv = _mm512_set1_ps(-INFINITY), sv = _mm512_setzero_ps();
        for (int64_t p = 0; p < n; p += 16) {
            __mmask16 live = n - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - p)) - 1);
            /* a NaN score is passed over, as the generic loop does; its exp (NaN) reaches the output */
            mv = _mm512_mask_max_ps(mv, live, _mm512_maskz_loadu_ps(live, sc + p), mv);
        }
        float m = _mm512_reduce_max_ps(mv);
        for (int64_t p = 0; p < n; p += 16) {
            __mmask16 live = n - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - p)) - 1);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + p), _mm512_set1_ps(m)));
            _mm512_mask_storeu_ps(sc + p, live, e);
            sv = _mm512_mask_add_ps(sv, live, sv, e);
        }
        float sum = _mm512_reduce_add_ps(sv);
        __m512 acc[2 * ND];
#pragma GCC unroll 16
        for (int c = 0; c < 2 * ND; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < n; p++) {
            __m512 w = _mm512_set1_ps(sc[p]);
#pragma GCC unroll 16
            for (int c = 0; c < 2 * ND; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vf + p * d + 16 * c), acc[c]);
        }
        float *o = part_out + hh * (d + 2);
        o[0] = m;
        o[1] = sum;
#pragma GCC unroll 16
        for (int c = 0; c < 2 * ND; c++) _mm512_storeu_ps(o + 2 + 16 * c, acc[c]);
    }
}

static void att_task_bf16_dot(const void *args, int64_t part, int64_t parts) {
    att_job *j = (att_job *)args;
    int64_t units = j->unit_item[-1], lo = units * part / parts, hi = units * (part + 1) / parts;
    float *scores = (float *)malloc(sizeof(float) * (8 * ATT_CHUNK + ATT_CHUNK * j->d));
    if (!scores) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *vf = scores + 8 * ATT_CHUNK;
    for (int64_t u = lo; u < hi; u++) switch (j->d) {
        case 64: att_bf16_unit(j, u, scores, vf, 2); break;
        case 128: att_bf16_unit(j, u, scores, vf, 4); break;
        default: att_bf16_unit(j, u, scores, vf, 8); break;
        }
    free(scores);
}
#define ATT_FAST_BF16 (bf16_att_fast && group <= 8 && (d == 64 || d == 128 || d == 256) ? att_task_bf16_dot : NULL)
static int bf16_att_fast = 1; /* 0: the generic loop (tests compare the two) */
#else
#define ATT_FAST_BF16 NULL
static int bf16_att_fast = 0;
#endif
int infer_attention_bf16_fast(int on) {
    int was = bf16_att_fast;
    if (on >= 0) bf16_att_fast = on;
    return was;
}
DEF_ATTENTION(f32, float, f32_load, f32_store, float, KLD_F32, NULL)
DEF_ATTENTION(bf16, uint16_t, bf16_load, bf16_store, uint16_t, KLD_BF16, ATT_FAST_BF16)
DEF_ATTENTION(fp8_f32, float, f32_load, f32_store, uint8_t, KLD_FP8_F32, NULL)
DEF_ATTENTION(fp8_bf16, uint16_t, bf16_load, bf16_store, uint8_t, KLD_FP8_BF16, NULL)
DEF_KV_WRITE_FP8(f32, float, f32_load)
DEF_KV_WRITE_FP8(bf16, uint16_t, bf16_load)

/* ---- bfloat16 dense GEMM: rows of x against a [n, k] bf16 weight --------------------------
 * y[t, r] = bf16(sum_i x[t, i] * w[r, i]), the products of bf16 pairs summed in float32 by
 * AVX512-BF16's dot instruction (vdpbf16ps, 32 pairs per instruction, denormal inputs read
 * as zero) into 16 lanes, the lanes added at the end: the sum in another order than oneDNN's,
 * the same float32 accumulation, one rounding to bf16 (nearest even; a sum below
 * float32's normal range, 2^-126, becomes zero).
 * The loop is a register tile: four weight rows against up to six rows of x, 24 accumulators,
 * so each 64-byte piece of x loaded feeds four dot products and each piece of weight up to
 * six. The four weight rows stay in L1 while every block of x rows passes over them (x, a
 * step's activations, sits in L2), so the weight streams from memory once per call, and the
 * next four rows are prefetched while these are used. Each output is the same chain of dot
 * products and the same sum of lanes whatever the number of rows or threads: a row of x gets
 * the same result alone as in a batch. Output rows are cut into `threads` parts. Without
 * AVX512-BF16 it returns -3 and the caller keeps torch's GEMM. */
#if BF16_DOT
typedef struct {
    const uint16_t *x;
    int64_t xs, rows, k;
    const uint16_t *w;
    int64_t n;
    uint16_t *y;
} bf16_job;

/* The lanes of a0..a3 summed, one float each, rounded to bf16 and stored at y[0..3] (y[0..nc-1]). */
static inline __attribute__((always_inline)) void bf16_store4(uint16_t *y, int nc, __m512 a0, __m512 a1,
                                                              __m512 a2, __m512 a3) {
    __m128i v = (__m128i)_mm_cvtneps_pbh(sum_lanes4(a0, a1, a2, a3));
    if (nc == 4) {
        _mm_storel_epi64((__m128i *)y, v);
    } else {
        uint16_t out[8];
        _mm_storeu_si128((__m128i *)out, v);
        for (int c = 0; c < nc; c++) y[c] = out[c];
    }
}

/* Weight rows r..r+nc-1 (nc <= 4; the missing ones read row r again and are not stored)
 * against rows t..t+R-1 of x. */
static inline __attribute__((always_inline)) void bf16_tile(const bf16_job *j, int64_t r, int nc, int64_t t,
                                                            const int R) {
    __m512 acc[4][6];
    const int64_t k = j->k;
    const uint16_t *wr[4], *xr = j->x + t * j->xs;
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        wr[c] = j->w + (r + (c < nc ? c : 0)) * k;
#pragma GCC unroll 6
        for (int m = 0; m < R; m++) acc[c][m] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh w[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) w[c] = (__m512bh)_mm512_loadu_si512(wr[c] + i);
#pragma GCC unroll 6
        for (int m = 0; m < R; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + m * j->xs + i);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[c][m] = _mm512_dpbf16_ps(acc[c][m], xv, w[c]);
        }
    }
    if (i < k) { /* the last k % 32 columns, masked: the lanes past k add nothing */
        __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh w[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) w[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[c] + i);
#pragma GCC unroll 6
        for (int m = 0; m < R; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr + m * j->xs + i);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[c][m] = _mm512_dpbf16_ps(acc[c][m], xv, w[c]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < R; m++)
        bf16_store4(j->y + (t + m) * j->n + r, nc, acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
}

static void bf16_task(const void *args, int64_t part, int64_t parts) {
    const bf16_job *j = (const bf16_job *)args;
    /* parts cut the weight rows in fours; the last part takes the n % 4 left over */
    int64_t quads = j->n / 4, lo = 4 * (quads * part / parts), hi = 4 * (quads * (part + 1) / parts);
    if (part == parts - 1) hi = j->n;
    /* blocks of at most 6 rows of x, as even as they come (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2) */
    int64_t blocks = (j->rows + 5) / 6;
    for (int64_t r = lo; r < hi; r += 4) {
        int nc = hi - r < 4 ? (int)(hi - r) : 4;
        if (r + 4 < hi) { /* the next four rows: one prefetch per line, to L2 */
            int64_t next = hi - (r + 4) < 4 ? hi - (r + 4) : 4;
            for (int64_t i = 0; i < next * j->k; i += 32) _mm_prefetch((const char *)(j->w + (r + 4) * j->k + i), _MM_HINT_T1);
        }
        for (int64_t b = 0, t = 0; b < blocks; b++) {
            int64_t size = j->rows * (b + 1) / blocks - t;
            switch (size) {
            case 6: bf16_tile(j, r, nc, t, 6); break;
            case 5: bf16_tile(j, r, nc, t, 5); break;
            case 4: bf16_tile(j, r, nc, t, 4); break;
            case 3: bf16_tile(j, r, nc, t, 3); break;
            case 2: bf16_tile(j, r, nc, t, 2); break;
            default: bf16_tile(j, r, nc, t, 1); break;
            }
            t += size;
        }
    }
}
#endif

#if BF16_DOT
/* several GEMVs in one parallel run (an MoE step's experts): each part takes its share of each */
typedef struct {
    const bf16_job *jobs;
    int64_t count;
} bf16_multi;

static void bf16_multi_task(const void *args, int64_t part, int64_t parts) {
    const bf16_multi *m = (const bf16_multi *)args;
    for (int64_t i = 0; i < m->count; i++) bf16_task(&m->jobs[i], part, parts);
}
#endif

int infer_bf16_dot(void) { return BF16_DOT; }

int infer_bf16_gemv(const uint16_t *x, int64_t xs, int64_t rows, int64_t k, const uint16_t *w, uint16_t *y,
                    int64_t n, int64_t threads) {
#if BF16_DOT
    bf16_job job = {x, xs, rows, k, w, n, y};
    int64_t parts = threads < 1 ? 1 : threads;
    if (parts > n / 64) parts = n / 64 > 0 ? n / 64 : 1;
    pool_run(bf16_task, &job, parts);
    return 0;
#else
    (void)x, (void)xs, (void)rows, (void)k, (void)w, (void)y, (void)n, (void)threads;
    return -3;
#endif
}

/* y[t, :] += b (a linear's bias, added after its product in y's type, as torch's y + b) */
static void add_bias_f32(float *y, int64_t rows, int64_t n, const float *b) {
    for (int64_t t = 0; b && t < rows; t++)
        for (int64_t i = 0; i < n; i++) y[t * n + i] += b[i];
}

static void add_bias_bf16(uint16_t *y, int64_t rows, int64_t n, const uint16_t *b) {
    for (int64_t t = 0; b && t < rows; t++)
        for (int64_t i = 0; i < n; i++) y[t * n + i] = bf16_store(bf16_load(y[t * n + i]) + bf16_load(b[i]));
}

/* ---- a decode step's routed experts, one call (bf16, AVX512-BF16) ---------------------
 * What `torch_native.moe.routed_moe` does with the bf16 GEMV, minus ~25 torch ops a layer:
 *   routing (route != 0; else ids/weights come in): the `moe` primitive's. Scores are the
 *     softmax of the router logits, or (sigmoid) each logit's sigmoid; experts are chosen by
 *     score plus `bias` (DeepSeek V3's selection bias; NULL: none), among the `keep` best of
 *     `groups` groups (0: no groups) by their best (kind 0) or two best (kind 1) choice
 *     values; the top_k, lowest id first on ties (the stable sort); weights are their
 *     scores, renormalised to sum to 1 (renorm) and scaled;
 *   each expert's rows: gate_up = x @ W13[e] (+ b13[e]) -> act -> y = . @ W2[e] (+ b2[e]),
 *     bf16 after each step as the torch ops round them; act 0: SwiGLU (silu(g) * u),
 *     1: gpt-oss's clamped form ((clamp(u) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit));
 *   out[t] = sum_j weight[t, j] * y[t, j] in float32 (j in choice order), plus the shared
 *     expert's output (times sigmoid(shared_gate[t]) when given), rounded once to bf16.
 * counts[E] receives the tokens each expert got. */
int infer_moe_bf16(const uint16_t *x, int64_t rows, int64_t hidden, int64_t inter, int64_t nexp, int64_t top_k,
                   const float *logits, int64_t route, int64_t renorm, float scaling, int64_t sigmoid,
                   const float *bias, int64_t groups, int64_t keep, int64_t group_kind, int64_t *ids, float *weights,
                   const uint16_t *w13, const uint16_t *w2, const uint16_t *b13, const uint16_t *b2, int64_t act,
                   float alpha, float limit, const uint16_t *shared, const float *shared_gate, uint16_t *out,
                   int64_t *counts, int64_t threads) {
#if BF16_DOT
    if (top_k < 1 || top_k > nexp || (groups && (nexp % groups || keep < 1 || keep > groups))) return -1;
    int64_t pairs = rows * top_k;
    float *score = (float *)malloc(sizeof(float) * (2 * nexp + groups + 1));
    if (!score) return -2;
    float *choice = score + nexp, *gscore = choice + nexp;
    for (int64_t t = 0; route && t < rows; t++) {
        const float *l = logits + t * nexp;
        int64_t *id = ids + t * top_k;
        float m = -INFINITY, sum = 0.0f, kept = 0.0f;
        if (sigmoid) {
            for (int64_t e = 0; e < nexp; e++) score[e] = 1.0f / (1.0f + exp_f32(-l[e]));
        } else {
            for (int64_t e = 0; e < nexp; e++) m = l[e] > m ? l[e] : m;
            for (int64_t e = 0; e < nexp; e++) sum += (score[e] = exp_f32(l[e] - m));
            for (int64_t e = 0; e < nexp; e++) score[e] /= sum;
        }
        /* without a bias or groups the logits order the experts as their scores do, exactly */
        for (int64_t e = 0; e < nexp; e++) choice[e] = bias ? score[e] + bias[e] : sigmoid || groups ? score[e] : l[e];
        if (groups) {
            int64_t per = nexp / groups;
            for (int64_t g = 0; g < groups; g++) {
                float a = -INFINITY, b = -INFINITY; /* the group's best and second best */
                for (int64_t e = g * per; e < (g + 1) * per; e++) {
                    float v = choice[e];
                    if (v > a) b = a, a = v;
                    else if (v > b) b = v;
                }
                gscore[g] = group_kind && per > 1 ? b + a : a;
            }
            for (int64_t k = 0; k < keep; k++) { /* the kept groups marked +inf, lowest index on ties */
                int64_t best = -1;
                for (int64_t g = 0; g < groups; g++)
                    if (gscore[g] != INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
                gscore[best] = INFINITY;
            }
            for (int64_t e = 0; e < nexp; e++)
                if (gscore[e / per] != INFINITY) choice[e] = -INFINITY;
        }
        for (int64_t j = 0; j < top_k; j++) { /* selection: k passes over E (both small) */
            int64_t best = -1;
            for (int64_t e = 0; e < nexp; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
            }
            id[j] = best;
            weights[t * top_k + j] = score[best];
            kept += score[best];
        }
        for (int64_t j = 0; j < top_k; j++) {
            float w = weights[t * top_k + j];
            weights[t * top_k + j] = renorm ? w / kept * scaling : w * scaling;
        }
    }
    free(score);
    for (int64_t e = 0; e < nexp; e++) counts[e] = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if (ids[p] < 0 || ids[p] >= nexp) return -1;
        counts[ids[p]]++;
    }
    /* the pairs sorted by expert (counting sort: stable), each expert's rows one slice */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (nexp + 1 + 2 * pairs));
    uint16_t *xs = (uint16_t *)malloc(sizeof(uint16_t) * pairs * (2 * hidden + 3 * inter));
    bf16_job *jobs = (bf16_job *)malloc(sizeof(bf16_job) * nexp);
    if (!first || !xs || !jobs) {
        free(first), free(xs), free(jobs);
        return -2;
    }
    int64_t *sorted = first + nexp + 1, *place = sorted + pairs; /* sorted[i]: a pair; place[pair]: its row */
    first[0] = 0;
    for (int64_t e = 0; e < nexp; e++) first[e + 1] = first[e] + counts[e];
    for (int64_t e = 0, i = 0; e < nexp; e++)
        for (int64_t p = 0; p < pairs; p++)
            if (ids[p] == e) sorted[i] = p, place[p] = i, i++;
    uint16_t *gu = xs + pairs * hidden, *a = gu + pairs * 2 * inter, *ys = a + pairs * inter;
    for (int64_t i = 0; i < pairs; i++) memcpy(xs + i * hidden, x + (sorted[i] / top_k) * hidden, sizeof(uint16_t) * hidden);
    /* gate_up of every chosen expert in one parallel run, each part taking its share of each */
    int64_t njobs = 0;
    for (int64_t e = 0; e < nexp; e++)
        if (counts[e])
            jobs[njobs++] = (bf16_job){xs + first[e] * hidden, hidden, counts[e], hidden,
                                       w13 + e * 2 * inter * hidden, 2 * inter, gu + first[e] * 2 * inter};
    bf16_multi multi = {jobs, njobs};
    int64_t parts = threads < 1 ? 1 : threads;
    if (parts > 2 * inter / 64) parts = 2 * inter / 64 > 0 ? 2 * inter / 64 : 1;
    pool_run(bf16_multi_task, &multi, parts);
    for (int64_t e = 0; b13 && e < nexp; e++)
        add_bias_bf16(gu + first[e] * 2 * inter, counts[e], 2 * inter, b13 + e * 2 * inter);
    int rc = 0;
    if (act == 0) {
        rc = infer_silu_and_mul_bf16(gu, 2 * inter, a, pairs, inter);
    } else {
        for (int64_t r = 0; r < pairs; r++)
            for (int64_t i = 0; i < inter; i++) {
                float g = bf16_load(gu[r * 2 * inter + i]), u = bf16_load(gu[r * 2 * inter + inter + i]);
                g = g < limit ? g : limit;
                u = u < -limit ? -limit : u > limit ? limit : u;
                a[r * inter + i] = bf16_store((u + 1.0f) * (g / (1.0f + exp_f32(-g * alpha))));
            }
    }
    /* then every expert's down projection, the same way */
    njobs = 0;
    for (int64_t e = 0; e < nexp; e++)
        if (counts[e])
            jobs[njobs++] = (bf16_job){a + first[e] * inter, inter, counts[e], inter, w2 + e * hidden * inter, hidden,
                                       ys + first[e] * hidden};
    multi.count = njobs;
    parts = threads < 1 ? 1 : threads;
    if (parts > hidden / 64) parts = hidden / 64 > 0 ? hidden / 64 : 1;
    if (rc == 0) pool_run(bf16_multi_task, &multi, parts);
    for (int64_t e = 0; rc == 0 && b2 && e < nexp; e++) add_bias_bf16(ys + first[e] * hidden, counts[e], hidden, b2 + e * hidden);
    for (int64_t t = 0; rc == 0 && t < rows; t++) {
        float g = shared_gate ? 1.0f / (1.0f + exp_f32(-shared_gate[t])) : 1.0f;
        for (int64_t i = 0; i < hidden; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < top_k; j++)
                acc += weights[t * top_k + j] * bf16_load(ys[place[t * top_k + j] * hidden + i]);
            if (shared) acc += g * bf16_load(shared[t * hidden + i]);
            out[t * hidden + i] = bf16_store(acc);
        }
    }
    free(first), free(xs), free(jobs);
    return rc;
#else
    (void)x, (void)rows, (void)hidden, (void)inter, (void)nexp, (void)top_k, (void)logits, (void)route, (void)renorm;
    (void)sigmoid, (void)bias, (void)groups, (void)keep, (void)group_kind;
    (void)scaling, (void)ids, (void)weights, (void)w13, (void)w2, (void)b13, (void)b2, (void)act, (void)alpha;
    (void)limit, (void)shared, (void)shared_gate, (void)out, (void)counts, (void)threads;
    return -3;
#endif
}

/* ---- a step's latent attention (DeepSeek MLA), one call (bf16, AVX512-BF16) -------------
 * What the `_mla_attention` expansion runs, absorbed as `torch_native.attention.mla_attention`:
 *   q (and with a q LoRA: qa = rms_norm(x @ Wqa) first, q = qa @ Wqb; else q = x @ Wq),
 *   kva = x @ Wkva; c = rms_norm(kva[:r]); rotary on each head's q_pe and on k_pe = kva[r:];
 *   the latent [c, k_pe] written to the cache (split over its two planes of `half` values);
 *   per (row, head): q_lat = q_nope @ W_UK[h] (bf16), scores = (q_lat . c_s + q_pe . k_pe_s) *
 *   scale over the row's keys (float32), softmax, o_lat = P @ c (bf16), o = o_lat @ W_UV[h]^T
 *   (bf16); out = o @ Wo. kv_b [H, n + vd, r] holds each head's W_UK rows then W_UV rows.
 *   layer[] = {wq, wa, qr (0: no q LoRA), q_a_norm, kv_a_norm, kv_b, wo, cos_sin, npos, neox,
 *              cache, nblocks, bs, half, heads, nope, rope, rank, vd, hidden, eps, scale (float32 bits)}
 *   step[]  = as the attention block's */
#if BF16_DOT
typedef struct {
    const uint16_t *q, *rot, *kvb, *cache;
    uint16_t *att;
    const int32_t *block_table, *qsl, *seq_lens;
    const int64_t *row_req;
    int64_t heads, nope, rope, rank, vd, half, bs, bt_stride, nslots, units;
    float scale;
    _Atomic int failed;
} mla_job;

/* sum a[i] * b[i] of two bf16 vectors: the exact products summed in float32 (vdpbf16ps) */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        __mmask32 live = n - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (n - i)) - 1);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(live, a + i),
                               (__m512bh)_mm512_maskz_loadu_epi16(live, b + i));
    }
    return _mm512_reduce_add_ps(acc);
}

static void mla_task(const void *args, int64_t part, int64_t parts) {
    mla_job *j = (mla_job *)args;
    int64_t lo = j->units * part / parts, hi = j->units * (part + 1) / parts;
    int64_t H = j->heads, n = j->nope, p = j->rope, r = j->rank, vd = j->vd, lat = r + p;
    int64_t most = 0;
    for (int64_t u = lo; u < hi; u++) {
        int64_t b = j->row_req[u / H];
        most = b >= 0 && j->seq_lens[b] > most ? j->seq_lens[b] : most;
    }
    float *ql = (float *)malloc(sizeof(float) * (2 * r + most + 1) + sizeof(uint16_t) * (lat + r));
    if (!ql) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *ol = ql + r, *sc = ol + r;         /* q_lat, o_lat (float32), scores */
    uint16_t *qb = (uint16_t *)(sc + most + 1), *ob = qb + lat; /* q_lat then q_pe; o_lat (bf16) */
    const uint16_t *plane1 = j->cache + j->nslots * j->half;
    for (int64_t u = lo; u < hi; u++) {
        int64_t t = u / H, h = u % H, b = j->row_req[t];
        if (b < 0) continue; /* a padding row: its output stays zero */
        int64_t qlen = j->qsl[b + 1] - j->qsl[b], nkeys = j->seq_lens[b] - qlen + (t - j->qsl[b]) + 1;
        const uint16_t *qn = j->q + (t * H + h) * (n + p), *qp = j->rot + (t * (H + 1) + h) * p;
        const uint16_t *wuk = j->kvb + h * (n + vd) * r, *wuv = wuk + n * r;
        for (int64_t e = 0; e < r; e++) ql[e] = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float a = bf16_load(qn[i]);
            const uint16_t *row = wuk + i * r;
            for (int64_t e = 0; e < r; e++) ql[e] += a * bf16_load(row[e]);
        }
        for (int64_t e = 0; e < r; e++) qb[e] = bf16_store(ql[e]);
        memcpy(qb + r, qp, sizeof(uint16_t) * p);
        const int32_t *bt = j->block_table + b * j->bt_stride;
        int64_t hf = j->half; /* a latent [c, k_pe] is k0 (its first hf values) then k1 */
        float m = -INFINITY;
        for (int64_t s = 0; s < nkeys; s++) {
            int64_t slot = (int64_t)bt[s / j->bs] * j->bs + s % j->bs;
            const uint16_t *k0 = j->cache + slot * hf, *k1 = plane1 + slot * hf;
            /* q_lat . c + q_pe . k_pe, the two sums as the torch ops form them */
            float qc = dot_bf16(qb, k0, hf) + dot_bf16(qb + hf, k1, r - hf);
            sc[s] = (qc + dot_bf16(qb + r, k1 + r - hf, p)) * j->scale;
            m = sc[s] > m ? sc[s] : m;
        }
        float sum = 0.0f;
        for (int64_t s = 0; s < nkeys; s++) sum += (sc[s] = exp_f32(sc[s] - m));
        for (int64_t e = 0; e < r; e++) ol[e] = 0.0f;
        for (int64_t s = 0; s < nkeys; s++) {
            int64_t slot = (int64_t)bt[s / j->bs] * j->bs + s % j->bs;
            const uint16_t *k0 = j->cache + slot * hf, *k1 = plane1 + slot * hf;
            float w = sc[s] / sum;
            for (int64_t e = 0; e < hf; e++) ol[e] += w * bf16_load(k0[e]);
            for (int64_t e = hf; e < r; e++) ol[e] += w * bf16_load(k1[e - hf]);
        }
        for (int64_t e = 0; e < r; e++) ob[e] = bf16_store(ol[e]);
        uint16_t *o = j->att + (t * H + h) * vd;
        for (int64_t v = 0; v < vd; v++) o[v] = bf16_store(dot_bf16(ob, wuv + v * r, r));
    }
    free(ql);
}

#endif

int infer_mla_block_bf16(const uint16_t *x, int64_t rows, const int64_t *positions, const int64_t *a,
                         const int64_t *m, uint16_t *out, int64_t threads) {
#if BF16_DOT
#define A(i, TYPE) ((TYPE)(intptr_t)a[i])
    const uint16_t *wq = A(0, const uint16_t *), *wa = A(1, const uint16_t *), *qan = A(3, const uint16_t *);
    const uint16_t *kvan = A(4, const uint16_t *), *kvb = A(5, const uint16_t *), *wo = A(6, const uint16_t *);
    const float *cos_sin = A(7, const float *);
    uint16_t *cache = A(10, uint16_t *);
    int64_t qr = a[2], npos = a[8], neox = a[9], nblocks = a[11], bs = a[12], half = a[13], H = a[14], n = a[15];
    int64_t p = a[16], r = a[17], vd = a[18], hidden = a[19];
    float eps = *(const float *)&a[20], scale = *(const float *)&a[21];
#undef A
    const int64_t *slots = (const int64_t *)(intptr_t)m[0];
    const int32_t *block_table = (const int32_t *)(intptr_t)m[1], *qsl = (const int32_t *)(intptr_t)m[4];
    const int32_t *seq_lens = (const int32_t *)(intptr_t)m[5];
    int64_t bt_stride = m[2], bt_width = m[3], nseq = m[6], lat = r + p, qw = H * (n + p), wa_n = qr + lat;
    for (int64_t b = 0; b < nseq; b++) {
        int64_t lo = qsl[b], hi = qsl[b + 1], len = seq_lens[b];
        if (lo < 0 || hi < lo || hi > rows || (len < hi - lo && !(len == 0 && hi - lo == 1)) ||
            (len + bs - 1) / bs > bt_width)
            return -1;
        for (int64_t i = 0; i < (len + bs - 1) / bs; i++) {
            int32_t blk = block_table[b * bt_stride + i];
            if (blk < 0 || blk >= nblocks) return -1;
        }
    }
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * rows * (wa_n + qw + (H + 1) * p + lat + H * vd) + 1);
    int64_t *row_req = (int64_t *)malloc(sizeof(int64_t) * (rows + 1));
    if (!buf || !row_req) {
        free(buf), free(row_req);
        return -2;
    }
    uint16_t *kva_all = buf, *q = kva_all + rows * wa_n, *rot = q + rows * qw, *latent = rot + rows * (H + 1) * p;
    uint16_t *att = latent + rows * lat;
    for (int64_t t = 0; t < rows; t++) row_req[t] = -1;
    for (int64_t b = 0; b < nseq; b++)
        for (int64_t t = qsl[b]; t < qsl[b + 1]; t++) row_req[t] = b;
    int rc = infer_bf16_gemv(x, hidden, rows, hidden, wa, kva_all, wa_n, threads);
    if (rc == 0 && qr) { /* q LoRA: qa normalised in place, then up */
        rc = infer_rms_norm_bf16(kva_all, wa_n, NULL, 0, qan, kva_all, wa_n, NULL, 0, rows, qr, eps);
        if (rc == 0) rc = infer_bf16_gemv(kva_all, wa_n, rows, qr, wq, q, qw, threads);
    } else if (rc == 0) {
        rc = infer_bf16_gemv(x, hidden, rows, hidden, wq, q, qw, threads);
    }
    const uint16_t *kva = kva_all + qr;
    if (rc == 0) rc = infer_rms_norm_bf16(kva, wa_n, NULL, 0, kvan, latent, lat, NULL, 0, rows, r, eps);
    if (rc == 0)
        rc = infer_rotary_bf16(q + n, qw, n + p, H, kva + r, wa_n, p, 1, positions, cos_sin, npos, p, (int)neox, rot,
                               rows, p);
    for (int64_t t = 0; rc == 0 && t < rows; t++)
        memcpy(latent + t * lat + r, rot + (t * (H + 1) + H) * p, sizeof(uint16_t) * p);
    if (rc == 0)
        rc = infer_kv_write((const char *)latent, lat, (const char *)(latent + half), lat, slots, rows, (char *)cache,
                            nblocks * bs, half, sizeof(uint16_t));
    if (rc == 0) {
        memset(att, 0, sizeof(uint16_t) * rows * H * vd);
        mla_job job = {q, rot, kvb, cache, att, block_table, qsl, seq_lens, row_req, H, n, p, r, vd, half, bs,
                       bt_stride, nblocks * bs, rows * H, scale, 0};
        int64_t parts = threads < 1 ? 1 : threads;
        if (parts > rows * H) parts = rows * H;
        pool_run(mla_task, &job, parts);
        rc = atomic_load(&job.failed) ? -2 : 0;
    }
    if (rc == 0) rc = infer_bf16_gemv(att, H * vd, rows, H * vd, wo, out, hidden, threads);
    free(buf), free(row_req);
    return rc;
#else
    (void)x, (void)rows, (void)positions, (void)a, (void)m, (void)out, (void)threads;
    return -3;
#endif
}

/* A fused layer's projection: an int4 weight (as infer_int4_gemm), or with bf16 activations
 * a dense bf16 [n, k] weight, passed as `q` with no scales (s NULL). */
/* kind (the `f16` slot of a weight's arguments) 2: an int8 weight (infer_int8_gemm); 3 | ...: its packed few-bit codes (LOWBIT_KIND) */
#define LAYER_INT8 2
static int layer_gemm_f32(const uint8_t *q, const void *s, const void *o, int64_t group, int64_t f16, const float *x,
                          int64_t xs, int64_t rows, int64_t k, float *y, int64_t n, int64_t threads) {
    if (!s) return -3;
    if (f16 >= LAYER_INT8)
        return infer_int8_gemm_f32((const int8_t *)q, s, o, group, f16, x, xs, rows, k, y, n, threads);
    return infer_int4_gemm_f32(q, s, o, group, f16, x, xs, rows, k, y, n, threads);
}

static int layer_gemm_bf16(const uint8_t *q, const void *s, const void *o, int64_t group, int64_t f16,
                           const uint16_t *x, int64_t xs, int64_t rows, int64_t k, uint16_t *y, int64_t n,
                           int64_t threads) {
    if (!s) return infer_bf16_gemv(x, xs, rows, k, (const uint16_t *)q, y, n, threads);
    if (f16 >= LAYER_INT8)
        return infer_int8_gemm_bf16((const int8_t *)q, s, o, group, f16, x, xs, rows, k, y, n, threads);
    return infer_int4_gemm_bf16(q, s, o, group, f16, x, xs, rows, k, y, n, threads);
}

/* ---- a decode step's attention block and MLP, one call each ---------------------------
 * What the runner does with the primitives of these nodes, through the kernels above and
 * with the same roundings, minus a Python call (and a few tensor views) between each two:
 *   attention block: qkv = x @ Wqkv (int4) -> [q/k norms] -> rotary(q, k) -> kv_write(k, v) -> attention(q)
 *                    -> out = o @ Wo (int4);
 *   MLP:             out = silu_and_mul (or gelu_tanh_and_mul)(x @ Wgate_up) @ Wdown (int4 both).
 * An int4 weight is (q, scales, offsets, group, half) as in infer_int4_gemm, an int8 one
 * (q, scales, offsets or NULL, group, 2) as in infer_int8_gemm; with bf16
 * activations a weight may also be dense bf16 (its pointer as q, scales NULL: layer_gemm).
 */
#define DEF_FUSED(SUF, T)                                                                                   \
    int infer_attention_block_##SUF(const T *x, int64_t rows, int64_t hidden, const uint8_t *wq,           \
                                    const void *sq, const void *oq, int64_t gq, int64_t fq, const uint8_t *wo, \
                                    const void *so, const void *oo, int64_t go, int64_t fo,                 \
                                    const int64_t *positions,                                               \
                                    const float *cos_sin, int64_t npos, int64_t rot, int neox, T *cache,     \
                                    int64_t nblocks, int64_t bs, int64_t hq, int64_t hk, int64_t d,          \
                                    const int64_t *slots, const int32_t *block_table, int64_t bt_stride,     \
                                    int64_t bt_width, const int32_t *qsl, const int32_t *seq_lens,           \
                                    int64_t nseq, float scale, int64_t window, float softcap,                \
                                    const T *qn, const T *kn, int64_t qk_whole, float eps, const T *bq,      \
                                    const T *bo, const float *sinks, T *out, int64_t threads) {               \
        int64_t nqkv = (hq + 2 * hk) * d, nqk = (hq + hk) * d;                                              \
        T *qkv = (T *)malloc(sizeof(T) * rows * (nqkv + nqk + hq * d));                                     \
        if (!qkv) return -2;                                                                                \
        T *rotated = qkv + rows * nqkv, *att = rotated + rows * nqk;                                        \
        int rc = layer_gemm_##SUF(wq, sq, oq, gq, fq, x, hidden, rows, hidden, qkv, nqkv, threads);     \
        if (rc == 0) add_bias_##SUF(qkv, rows, nqkv, bq);                                                   \
        /* q/k norms (Qwen3, Gemma 3: each head over d; OLMo 2: all heads at once), in place */             \
        for (int64_t t = 0; rc == 0 && qn && t < rows; t++) {                                               \
            T *qr = qkv + t * nqkv, *kr = qr + hq * d;                                                      \
            if (qk_whole) {                                                                                 \
                rc = infer_rms_norm_##SUF(qr, hq * d, NULL, 0, qn, qr, hq * d, NULL, 0, 1, hq * d, eps);     \
                if (rc == 0)                                                                                \
                    rc = infer_rms_norm_##SUF(kr, hk * d, NULL, 0, kn, kr, hk * d, NULL, 0, 1, hk * d, eps); \
            } else {                                                                                        \
                rc = infer_rms_norm_##SUF(qr, d, NULL, 0, qn, qr, d, NULL, 0, hq, d, eps);                   \
                if (rc == 0) rc = infer_rms_norm_##SUF(kr, d, NULL, 0, kn, kr, d, NULL, 0, hk, d, eps);      \
            }                                                                                               \
        }                                                                                                   \
        if (rc == 0)                                                                                        \
            rc = infer_rotary_##SUF(qkv, nqkv, d, hq, qkv + hq * d, nqkv, d, hk, positions, cos_sin, npos,  \
                                    rot, neox, rotated, rows, d);                                           \
        if (rc == 0)                                                                                        \
            rc = infer_kv_write((const char *)(rotated + hq * d), nqk, (const char *)(qkv + nqk), nqkv,     \
                                slots, rows, (char *)cache, nblocks * bs, hk * d, sizeof(T));               \
        if (rc == 0)                                                                                        \
            rc = infer_attention_##SUF(rotated, nqk, d, rows, hq, cache, nblocks, bs, hk, d, block_table,   \
                                       bt_stride, bt_width, qsl, seq_lens, nseq, scale, window, att, 1.0f,   \
                                       1.0f, softcap, sinks, threads);                                      \
        if (rc == 0) rc = layer_gemm_##SUF(wo, so, oo, go, fo, att, hq * d, rows, hq * d, out, hidden, threads); \
        if (rc == 0) add_bias_##SUF(out, rows, hidden, bo);                                                 \
        free(qkv);                                                                                          \
        return rc;                                                                                          \
    }                                                                                                       \
    int infer_mlp_##SUF(const T *x, int64_t rows, int64_t hidden, int64_t inter, const uint8_t *wg,         \
                        const void *sg, const void *og, int64_t gg, int64_t fg, const uint8_t *wd,           \
                        const void *sd, const void *od, int64_t gd, int64_t fd, int64_t gelu, T *out,        \
                        int64_t threads) {                                                                    \
        T *gate_up = (T *)malloc(sizeof(T) * rows * 3 * inter);                                             \
        if (!gate_up) return -2;                                                                            \
        T *act = gate_up + rows * 2 * inter;                                                                \
        int rc = layer_gemm_##SUF(wg, sg, og, gg, fg, x, hidden, rows, hidden, gate_up, 2 * inter, threads); \
        if (rc == 0)                                                                                        \
            rc = gelu ? infer_gelu_tanh_and_mul_##SUF(gate_up, 2 * inter, act, rows, inter)                 \
                      : infer_silu_and_mul_##SUF(gate_up, 2 * inter, act, rows, inter);                     \
        if (rc == 0) rc = layer_gemm_##SUF(wd, sd, od, gd, fd, act, inter, rows, inter, out, hidden, threads); \
        free(gate_up);                                                                                      \
        return rc;                                                                                          \
    }

DEF_FUSED(f32, float)
DEF_FUSED(bf16, uint16_t)

/* The same two with their arguments packed (one ctypes argument instead of ~30: ~3 us a call):
 *   layer[] = {wq, sq, oq, gq, fq, wo, so, oo, go, fo, cos_sin, npos, rot, neox, cache, nblocks, bs,
 *              hq, hk, d, hidden, window, softcap (float32 bits; 0: none), q_norm, k_norm (NULL: none),
 *              qk_whole, eps (float32 bits), qkv bias, o bias (NULL: none), sinks (float32 [hq]; NULL:
 *              none)}   (fixed for a layer; rot 0 with cos_sin NULL: no rotary, q and k as projected)
 *   step[]  = {slots, block_table, bt_stride, bt_width, qsl, seq_lens, nseq}   (fixed for a step)
 *   mlp[]   = {wg, sg, og, gg, fg, wd, sd, od, gd, fd, hidden, inter, gelu (0: SiLU, 1: GELU tanh)}
 * Pointers travel as int64. */
#define P(i, TYPE) ((TYPE)(intptr_t)a[i])
#define DEF_PACKED(SUF, T)                                                                                  \
    int infer_attention_block_packed_##SUF(const T *x, int64_t rows, const int64_t *positions,              \
                                           const int64_t *a, const int64_t *m, float scale, T *out,         \
                                           int64_t threads) {                                               \
        return infer_attention_block_##SUF(x, rows, a[20], P(0, const uint8_t *), P(1, const void *),       \
                                           P(2, const void *), a[3], a[4], P(5, const uint8_t *),           \
                                           P(6, const void *), P(7, const void *), a[8], a[9], positions,     \
                                           P(10, const float *), a[11], a[12], (int)a[13], P(14, T *), a[15], \
                                           a[16], a[17], a[18], a[19], (const int64_t *)(intptr_t)m[0],      \
                                           (const int32_t *)(intptr_t)m[1], m[2], m[3],                     \
                                           (const int32_t *)(intptr_t)m[4], (const int32_t *)(intptr_t)m[5], \
                                           m[6], scale, a[21], *(const float *)&a[22], P(23, const T *),    \
                                           P(24, const T *), a[25], *(const float *)&a[26], P(27, const T *), \
                                           P(28, const T *), P(29, const float *), out, threads);           \
    }                                                                                                       \
    int infer_mlp_packed_##SUF(const T *x, int64_t rows, const int64_t *a, T *out, int64_t threads) {        \
        return infer_mlp_##SUF(x, rows, a[10], a[11], P(0, const uint8_t *), P(1, const void *),             \
                               P(2, const void *), a[3], a[4], P(5, const uint8_t *), P(6, const void *),    \
                               P(7, const void *), a[8], a[9], a[12], out, threads);                        \
    }

DEF_PACKED(f32, float)
DEF_PACKED(bf16, uint16_t)
#undef P
