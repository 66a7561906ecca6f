/*
 * test_kernels.c — every kernel of the engine's kernel tables against a naive
 * double-precision loop written here, on fresh random inputs (never zeros) at sizes that
 * are not multiples of any vector width (1, 7, 33, 129, ...), plus exhaustive and
 * edge-case checks of the f16/bf16 conversions.
 *
 * Every table this CPU can run is checked (reference, avx2, avx512; a table the CPU or the
 * build lacks is reported as skipped), so the SIMD kernels are held to the same standard,
 * and each SIMD table is also compared with the reference table directly, including the
 * ranged entries (matmul_ld, attention_heads, expert_gateup, expert_down) that the thread
 * pool uses to split work, which must leave everything outside their range untouched.
 * Exit 0 when every check passes; otherwise prints each failure and exits 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/fast.h"    /* the fast numeric mode's tables */
#include "cpu/kernels.h" /* internal header (src/ is on the tests' include path): the kernels are not public API */
#include "cpu/registry.h" /* every table, exact and fast */

static int n_fail = 0, n_check = 0;
static uint64_t rng_state = 0x1234567887654321ull;

static double urand(void) { /* uniform in [-1, 1) */
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static void fill(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) {
        float v = (float)(urand() * scale);
        if (v == 0.0f) v = 0.5f; /* never zeros */
        x[i] = v;
    }
}

#define FAIL(...)                                                   \
    do {                                                            \
        n_fail++;                                                   \
        if (n_fail <= 40) {                                         \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);             \
            printf(__VA_ARGS__);                                    \
            printf("\n");                                           \
        }                                                           \
    } while (0)

/* |got - want| <= rel * mag + abs_tol, where mag is the sum of |terms| of the reduction */
static int close_to(double got, double want, double mag, double rel) {
    n_check++;
    return fabs(got - want) <= rel * mag + 1e-6;
}

static float f32_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ---- weights stored in a dtype, with their exact f32 value beside them ---- */

typedef struct wbuf {
    void *raw;    /* [n] in dt */
    float *val;   /* [n] what the stored values mean, exactly */
} wbuf;

static wbuf make_w(uint32_t dt, int64_t n, double scale) {
    wbuf w;
    w.raw = malloc((size_t)n * cb_dtype_size(dt) + 1);
    w.val = malloc((size_t)n * sizeof(float) + 1);
    for (int64_t i = 0; i < n; i++) {
        float v = (float)(urand() * scale);
        if (v == 0.0f) v = 0.25f;
        if (dt == COLIBRI_DTYPE_F32) {
            ((float *)w.raw)[i] = v;
            w.val[i] = v;
        } else if (dt == COLIBRI_DTYPE_F16) {
            uint16_t h = cb_f32_to_f16(v);
            ((uint16_t *)w.raw)[i] = h;
            w.val[i] = cb_f16_to_f32(h);
        } else {
            uint16_t h = cb_f32_to_bf16(v);
            ((uint16_t *)w.raw)[i] = h;
            w.val[i] = cb_bf16_to_f32(h);
        }
    }
    return w;
}
static void free_w(wbuf *w) {
    free(w->raw);
    free(w->val);
}

/* ---- conversions ---- */

static double f16_value(uint16_t h) { /* independent decoding via ldexp */
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0) v = ldexp((double)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexp((double)(m + 1024), e - 25);
    return s ? -v : v;
}

static void test_conversions(void) {
    /* f16 -> f32 for all 65536 values, and back */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = cb_f16_to_f32((uint16_t)h);
        double want = f16_value((uint16_t)h);
        n_check++;
        if (isnan(want)) {
            if (!isnan(f)) FAIL("f16 0x%04x: want nan, got %g", h, (double)f);
            else if (!isnan(cb_f16_to_f32(cb_f32_to_f16(f)))) FAIL("f16 nan 0x%04x does not round-trip as nan", h);
            continue;
        }
        if ((double)f != want || (signbit(f) != 0) != ((h >> 15) != 0)) {
            FAIL("f16 0x%04x -> %.9g, want %.9g", h, (double)f, want);
            continue;
        }
        uint16_t back = cb_f32_to_f16(f);
        if (back != h) FAIL("f16 round trip 0x%04x -> %g -> 0x%04x", h, (double)f, back);
    }
    /* f32 -> f16 rounding: compare with the nearest f16 found by search (ties to even) */
    for (int i = 0; i < 200000; i++) {
        float f;
        if (i % 4 == 0) f = (float)(urand() * 70000.0);
        else if (i % 4 == 1) f = (float)(urand() * 1e-4); /* subnormal range */
        else if (i % 4 == 2) f = (float)(urand() * 4.0);
        else { /* exact halfway points between adjacent halves */
            uint16_t h = (uint16_t)((uint64_t)(urand() * 32767.0 + 32767.0) & 0x7bff);
            if ((h & 0x7c00) == 0x7c00) h = 0x7bfe;
            f = (float)((f16_value(h) + f16_value((uint16_t)(h + 1))) / 2.0);
        }
        uint16_t got = cb_f32_to_f16(f);
        double a = fabs((double)f);
        /* candidates: brute-force nearest among all finite positive halves via bisection */
        uint16_t lo = 0, hi = 0x7bff;
        while (lo < hi) {
            uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
            if (f16_value(mid) <= a) lo = mid;
            else hi = (uint16_t)(mid - 1);
        }
        uint16_t want;
        if (a >= 65520.0) want = 0x7c00; /* rounds to inf */
        else {
            double dl = a - f16_value(lo), dh = lo < 0x7bff ? f16_value((uint16_t)(lo + 1)) - a : INFINITY;
            if (dl < dh) want = lo;
            else if (dh < dl) want = (uint16_t)(lo + 1);
            else want = (lo & 1) ? (uint16_t)(lo + 1) : lo;
        }
        if (signbit(f)) want |= 0x8000;
        n_check++;
        if (got != want) FAIL("f32 %.9g -> f16 0x%04x, want 0x%04x", (double)f, got, want);
    }
    /* special values */
    n_check += 4;
    if (cb_f32_to_f16(INFINITY) != 0x7c00) FAIL("f16(+inf)");
    if (cb_f32_to_f16(-INFINITY) != 0xfc00) FAIL("f16(-inf)");
    if (!isnan(cb_f16_to_f32(cb_f32_to_f16(NAN)))) FAIL("f16(nan) is not nan");
    if (cb_f32_to_f16(1e-10f) != 0 || cb_f32_to_f16(-0.0f) != 0x8000) FAIL("f16 tiny/neg zero");

    /* bf16: all values round-trip; f32 -> bf16 is round to nearest even */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = cb_bf16_to_f32((uint16_t)h);
        n_check++;
        if (bits_f32(f) != h << 16) FAIL("bf16 0x%04x widening", h);
        if (isnan(f)) {
            if (!isnan(cb_bf16_to_f32(cb_f32_to_bf16(f)))) FAIL("bf16 nan round trip 0x%04x", h);
        } else if (cb_f32_to_bf16(f) != h) {
            FAIL("bf16 round trip 0x%04x", h);
        }
    }
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)((uint64_t)((urand() + 1.0) * 2147483647.0));
        float f = f32_bits(u);
        if (isnan(f)) continue;
        uint16_t got = cb_f32_to_bf16(f);
        uint32_t lo = u & 0xffff0000u, low = u & 0xffffu;
        uint16_t want = (uint16_t)(lo >> 16);
        if (low > 0x8000u || (low == 0x8000u && (want & 1))) want++;
        n_check++;
        if (got != want) FAIL("f32 0x%08x -> bf16 0x%04x, want 0x%04x", u, got, want);
    }
}

/* ---- kernels ---- */

/* y[t, :] of a matmul against a double loop over the weights' exact values */
static void check_matmul_token(const cb_kernels *K, uint32_t dt, const float *y, const float *x, const float *val,
                               int64_t t, int64_t N, int64_t Kd) {
    for (int64_t n = 0; n < N; n++) {
        double s = 0, mag = 0;
        for (int64_t k = 0; k < Kd; k++) {
            double p = (double)x[t * Kd + k] * val[n * Kd + k];
            s += p;
            mag += fabs(p);
        }
        if (!close_to(y[t * N + n], s, mag, 1e-5))
            FAIL("[%s] matmul %s N%lld K%lld (%lld,%lld): %.9g vs %.9g", K->name, cb_dtype_name(dt), (long long)N,
                 (long long)Kd, (long long)t, (long long)n, (double)y[t * N + n], s);
    }
}

/* T random tokens through K->matmul of w [N, Kd] at once: each row against the exact sum
 * (check_matmul_token), and each token alone equal to its row of the batch, bit for bit. */
static void check_matmul_batch(const cb_kernels *K, uint32_t dt, const wbuf *w, int64_t T, int64_t N, int64_t Kd,
                               const char *what) {
    float *x = malloc((size_t)(T * Kd) * 4), *y = malloc((size_t)(T * N) * 4), *y1 = malloc((size_t)N * 4);
    fill(x, T * Kd, 2.0);
    K->matmul(y, x, w->raw, dt, T, N, Kd);
    for (int64_t t = 0; t < T; t++) {
        check_matmul_token(K, dt, y, x, w->val, t, N, Kd);
        K->matmul(y1, x + t * Kd, w->raw, dt, 1, N, Kd);
        n_check++;
        if (memcmp(y1, y + t * N, (size_t)N * 4) != 0)
            FAIL("[%s] matmul %s%s T%lld N%lld K%lld: token %lld alone differs from the batch", K->name,
                 cb_dtype_name(dt), what, (long long)T, (long long)N, (long long)Kd, (long long)t);
    }
    free(x);
    free(y);
    free(y1);
}

static void test_matmul(const cb_kernels *K) {
    const int64_t Ts[] = {1, 3, 7, 17, 33};
    const int64_t Ns[] = {1, 7, 67, 131};
    const int64_t Ks[] = {1, 7, 33, 67, 255};
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++)
        for (size_t a = 0; a < 5; a++)
            for (size_t b = 0; b < 4; b++)
                for (size_t c = 0; c < 5; c++) {
                    int64_t T = Ts[a], N = Ns[b], Kd = Ks[c];
                    wbuf w = make_w(dt, N * Kd, 1.0);
                    float *x = malloc((size_t)(T * Kd) * 4), *y = malloc((size_t)(T * N) * 4);
                    fill(x, T * Kd, 2.0);
                    K->matmul(y, x, w.raw, dt, T, N, Kd);
                    for (int64_t t = 0; t < T; t++) check_matmul_token(K, dt, y, x, w.val, t, N, Kd);
                    free(x);
                    free(y);
                    free_w(&w);
                }
}

static void test_matmul_i8(const cb_kernels *K) {
    const int64_t T = 5, N = 7, Kd = 33;
    int8_t q[7 * 33];
    float scale[7], zero[7], x[5 * 33], y[5 * 7];
    for (int64_t i = 0; i < N * Kd; i++) q[i] = (int8_t)(int)floor(urand() * 128.0);
    for (int64_t n = 0; n < N; n++) {
        scale[n] = (float)(0.001 + fabs(urand()) * 0.01);
        zero[n] = (float)floor(urand() * 100.0);
    }
    fill(x, T * Kd, 1.0);
    K->matmul_i8(y, x, q, scale, zero, T, N, Kd);
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < Kd; k++) {
                double wv = (double)(((float)q[n * Kd + k] - zero[n]) * scale[n]);
                s += wv * x[t * Kd + k];
                mag += fabs(wv * x[t * Kd + k]);
            }
            if (!close_to(y[t * N + n], s, mag, 1e-5))
                FAIL("[%s] matmul_i8 (%lld,%lld): %.9g vs %.9g", K->name, (long long)t, (long long)n,
                     (double)y[t * N + n], s);
        }
}

static void test_rmsnorm(const cb_kernels *K) {
    const int64_t Hs[] = {1, 7, 33, 129};
    for (size_t i = 0; i < 4; i++) {
        int64_t H = Hs[i], T = 3;
        float *x = malloc((size_t)(T * H) * 4), *y = malloc((size_t)(T * H) * 4), *w = malloc((size_t)H * 4);
        fill(x, T * H, 3.0);
        fill(w, H, 1.5);
        K->rmsnorm(y, x, w, T, H, 1e-5f);
        for (int64_t t = 0; t < T; t++) {
            double ss = 0;
            for (int64_t k = 0; k < H; k++) ss += (double)x[t * H + k] * x[t * H + k];
            double r = 1.0 / sqrt(ss / (double)H + 1e-5);
            for (int64_t k = 0; k < H; k++) {
                double want = (double)x[t * H + k] * r * w[k];
                if (!close_to(y[t * H + k], want, fabs(want), 2e-6))
                    FAIL("[%s] rmsnorm H%lld: %.9g vs %.9g", K->name, (long long)H, (double)y[t * H + k], want);
            }
        }
        /* in place gives the same result */
        K->rmsnorm(x, x, w, T, H, 1e-5f);
        n_check++;
        if (memcmp(x, y, (size_t)(T * H) * 4) != 0) FAIL("[%s] rmsnorm in place differs", K->name);
        free(x);
        free(y);
        free(w);
    }
}

static void test_rope(const cb_kernels *K) {
    const int64_t Ds[] = {2, 6, 16, 130};
    for (size_t i = 0; i < 4; i++) {
        int64_t D = Ds[i], T = 3, nh = 3, half = D / 2;
        float *x = malloc((size_t)(T * nh * D) * 4), *x0 = malloc((size_t)(T * nh * D) * 4);
        float *c = malloc((size_t)(T * half) * 4), *s = malloc((size_t)(T * half) * 4);
        fill(x, T * nh * D, 2.0);
        memcpy(x0, x, (size_t)(T * nh * D) * 4);
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < half; k++) {
                double ang = (double)(t + 17) * pow(10000.0, -2.0 * (double)k / (double)D);
                c[t * half + k] = (float)cos(ang);
                s[t * half + k] = (float)sin(ang);
            }
        K->rope(x, T, nh, D, c, s);
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < nh; h++)
                for (int64_t k = 0; k < half; k++) {
                    const float *v0 = x0 + (t * nh + h) * D;
                    const float *v = x + (t * nh + h) * D;
                    double a = v0[k], b = v0[k + half], cc = c[t * half + k], ss = s[t * half + k];
                    double w1 = a * cc - b * ss, w2 = b * cc + a * ss;
                    if (!close_to(v[k], w1, fabs(a * cc) + fabs(b * ss), 1e-6) ||
                        !close_to(v[k + half], w2, fabs(b * cc) + fabs(a * ss), 1e-6))
                        FAIL("[%s] rope D%lld t%lld h%lld k%lld", K->name, (long long)D, (long long)t,
                             (long long)h, (long long)k);
                }
        free(x);
        free(x0);
        free(c);
        free(s);
    }
}

/* rows_combine against a double sum, odd sizes, strided rows, several weight-row groups, and
 * o's prior contents kept (it accumulates). */
static void test_rows_combine(const cb_kernels *K) {
    const int64_t nhs[] = {1, 3, 4, 6, 9}, ns[] = {1, 5, 32, 37}, Ds[] = {1, 7, 16, 33, 260};
    for (size_t a = 0; a < 5; a++)
        for (size_t b = 0; b < 4; b++)
            for (size_t c = 0; c < 5; c++) {
                int64_t nh = nhs[a], n = ns[b], D = Ds[c], ldp = n + 3, ldr = D + 5, ldo = D + 2;
                float *p = malloc((size_t)(nh * ldp) * 4), *rows = malloc((size_t)(n * ldr) * 4);
                float *o = malloc((size_t)(nh * ldo) * 4), *o0 = malloc((size_t)(nh * ldo) * 4);
                fill(p, nh * ldp, 1.0);
                fill(rows, n * ldr, 2.0);
                fill(o, nh * ldo, 1.0);
                memcpy(o0, o, (size_t)(nh * ldo) * 4);
                K->rows_combine(o, ldo, p, ldp, rows, ldr, nh, n, D);
                for (int64_t h = 0; h < nh; h++)
                    for (int64_t i = 0; i < ldo; i++) {
                        if (i >= D) { /* past D: untouched */
                            n_check++;
                            if (o[h * ldo + i] != o0[h * ldo + i])
                                FAIL("[%s] rows_combine wrote past D=%lld", K->name, (long long)D);
                            continue;
                        }
                        double want = o0[h * ldo + i], mag = fabs(want);
                        for (int64_t j = 0; j < n; j++) {
                            want += (double)p[h * ldp + j] * rows[j * ldr + i];
                            mag += fabs((double)p[h * ldp + j] * rows[j * ldr + i]);
                        }
                        if (!close_to(o[h * ldo + i], want, mag, 1e-6))
                            FAIL("[%s] rows_combine nh%lld n%lld D%lld [%lld,%lld]: %.9g vs %.9g", K->name,
                                 (long long)nh, (long long)n, (long long)D, (long long)h, (long long)i,
                                 (double)o[h * ldo + i], want);
                    }
                free(p);
                free(rows);
                free(o);
                free(o0);
            }
}

static void test_softmax(const cb_kernels *K) {
    const int64_t Ns[] = {1, 7, 33, 129, 1000};
    for (size_t i = 0; i < 5; i++) {
        int64_t n = Ns[i];
        float *x = malloc((size_t)n * 4), *x0 = malloc((size_t)n * 4);
        fill(x, n, 20.0);
        memcpy(x0, x, (size_t)n * 4);
        K->softmax(x, n);
        double m = -INFINITY, sum = 0;
        for (int64_t k = 0; k < n; k++) m = x0[k] > m ? x0[k] : m;
        for (int64_t k = 0; k < n; k++) sum += exp((double)x0[k] - m);
        for (int64_t k = 0; k < n; k++) {
            double want = exp((double)x0[k] - m) / sum;
            if (!close_to(x[k], want, want, 1e-5)) FAIL("[%s] softmax n%lld k%lld: %.9g vs %.9g", K->name,
                                                        (long long)n, (long long)k, (double)x[k], want);
        }
        free(x);
        free(x0);
    }
}

/* A paged KV cache for `npos` positions of Hkv heads of D floats in blocks of `blen`
 * positions, the blocks in a shuffled order and padded (so no offset is a lucky multiple),
 * filled with random values; view->blocks points into *table (caller frees both). */
static cb_kv_view paged_cache(int64_t npos, int64_t Hkv, int64_t D, int64_t blen, float **pool, int32_t **table) {
    int64_t nb = (npos + blen - 1) / blen, total = nb + 2; /* two blocks nobody uses */
    int64_t hs = blen * D + 3, bs = Hkv * hs + 5;
    *pool = malloc((size_t)(2 * total * bs) * 4);
    *table = malloc((size_t)nb * 4);
    fill(*pool, 2 * total * bs, 1.5);
    int32_t *perm = malloc((size_t)total * 4);
    for (int64_t i = 0; i < total; i++) perm[i] = (int32_t)i;
    for (int64_t i = total - 1; i > 0; i--) { /* Fisher-Yates with the test's PRNG */
        int64_t j = (int64_t)((urand() + 1.0) * 0.5 * (double)(i + 1));
        if (j > i) j = i;
        int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    for (int64_t i = 0; i < nb; i++) (*table)[i] = perm[i];
    free(perm);
    cb_kv_view v = {*pool, *pool + total * bs, *table, blen, bs, hs};
    return v;
}

/* The same keys and values as a contiguous cache [Hkv, npos, D] (one block). */
static cb_kv_view contiguous_copy(const cb_kv_view *src, int64_t npos, int64_t Hkv, int64_t D, float **pool,
                                  int32_t *one_block) {
    *pool = malloc((size_t)(2 * Hkv * npos * D) * 4);
    float *k = *pool, *v = *pool + Hkv * npos * D;
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t p = 0; p < npos; p++) {
            memcpy(k + (g * npos + p) * D, cb_kv_at(src->k, src, g, p, D), (size_t)D * 4);
            memcpy(v + (g * npos + p) * D, cb_kv_at(src->v, src, g, p, D), (size_t)D * 4);
        }
    *one_block = 0;
    cb_kv_view c = {k, v, one_block, npos, 0, npos * D};
    return c;
}

/* The double reference of one query head's attention (kernels.h): o[d] and mag[d] (the sum
 * of |weight * value|, the scale of a float32 result's error) for query row qr at position
 * pos of KV head g, keys in the window; sink: NULL or the head's sink (its exp joins the
 * denominator); p: [pos + 1] scratch. */
static void ref_attention(double *o, double *mag, double *p, const float *qr, const cb_kv_view *kv, int64_t g,
                          int64_t pos, int64_t D, int64_t window, const float *sink) {
    double m = sink ? (double)*sink : -INFINITY, sum = 0;
    for (int64_t j = 0; j <= pos; j++) {
        double s = -INFINITY;
        if (window <= 0 || pos - j < window) {
            const float *kr = cb_kv_at(kv->k, kv, g, j, D);
            s = 0;
            for (int64_t d = 0; d < D; d++) s += (double)qr[d] * kr[d];
            s /= sqrt((double)D);
        }
        p[j] = s;
        if (s > m) m = s;
    }
    for (int64_t j = 0; j <= pos; j++) {
        p[j] = isinf(p[j]) ? 0.0 : exp(p[j] - m);
        sum += p[j];
    }
    if (sink) sum += exp((double)*sink - m);
    for (int64_t d = 0; d < D; d++) {
        o[d] = mag[d] = 0;
        for (int64_t j = 0; j <= pos; j++) {
            double vv = cb_kv_at(kv->v, kv, g, j, D)[d];
            o[d] += p[j] / sum * vv;
            mag[d] += fabs(p[j] / sum * vv);
        }
    }
}
#define REF_ATT_MAX_D 128 /* the tests' largest head */

/* Every case with and without attention sinks (gpt-oss): with sinks, each query head's
 * denominator gains exp(sink_h - m), m the max over its scores and sink_h. */
static void test_attention(const cb_kernels *K) {
    struct { int64_t T, start, Hq, Hkv, D, window, blen; } cs[] = {
        {1, 0, 1, 1, 2, 0, 1}, {7, 0, 4, 2, 6, 0, 3}, {3, 30, 6, 3, 16, 0, 16}, {33, 5, 4, 1, 10, 7, 5},
        {1, 128, 2, 2, 8, 129, 32}, {5, 3, 8, 8, 4, 1, 7}, {9, 4, 12, 2, 40, 0, 2}, {2, 17, 5, 1, 64, 0, 19},
    };
    for (size_t ii = 0; ii < 2 * sizeof cs / sizeof cs[0]; ii++) {
        size_t i = ii % (sizeof cs / sizeof cs[0]);
        int with_sinks = ii >= sizeof cs / sizeof cs[0];
        int64_t T = cs[i].T, P = cs[i].start + T, nq = cs[i].Hq * cs[i].D;
        int64_t D = cs[i].D, group = cs[i].Hq / cs[i].Hkv;
        float *q = malloc((size_t)(T * nq) * 4), *out = malloc((size_t)(T * nq) * 4);
        float *out_c = malloc((size_t)(T * nq) * 4);
        float *sc = malloc((size_t)(CB_ATT_HEADS * P) * 4);
        double *p = malloc((size_t)P * 8);
        float *pool, *cpool;
        int32_t *table, one;
        fill(q, T * nq, 1.5);
        float *sinks = NULL;
        if (with_sinks) { /* odd head counts; sinks both below and above the scores */
            sinks = malloc((size_t)cs[i].Hq * 4);
            fill(sinks, cs[i].Hq, 3.0);
        }
        cb_kv_view kv = paged_cache(P, cs[i].Hkv, D, cs[i].blen, &pool, &table);
        cb_kv_view ckv = contiguous_copy(&kv, P, cs[i].Hkv, D, &cpool, &one);
        K->attention(out, q, &kv, sc, T, cs[i].start, cs[i].Hq, cs[i].Hkv, D, cs[i].window, sinks);
        /* the block layout changes no bit: the same keys and values in one block */
        K->attention(out_c, q, &ckv, sc, T, cs[i].start, cs[i].Hq, cs[i].Hkv, D, cs[i].window, sinks);
        if (memcmp(out, out_c, (size_t)(T * nq) * 4) != 0)
            FAIL("[%s] attention case %zu%s: the paged cache (blocks of %lld) differs from the contiguous one",
                 K->name, i, sinks ? " (sinks)" : "", (long long)cs[i].blen);
        for (int64_t t = 0; t < T; t++) {
            int64_t pos = cs[i].start + t;
            for (int64_t h = 0; h < cs[i].Hq; h++) {
                double o[REF_ATT_MAX_D], mag[REF_ATT_MAX_D];
                ref_attention(o, mag, p, q + t * nq + h * D, &kv, h / group, pos, D, cs[i].window, sinks ? &sinks[h] : NULL);
                for (int64_t d = 0; d < D; d++)
                    if (!close_to(out[t * nq + h * D + d], o[d], mag[d], 2e-5))
                        FAIL("[%s] attention case %zu%s t%lld h%lld d%lld: %.9g vs %.9g", K->name, i, sinks ? " (sinks)" : "",
                             (long long)t, (long long)h, (long long)d, (double)out[t * nq + h * D + d], o[d]);
            }
        }
        free(q);
        free(out);
        free(out_c);
        free(pool);
        free(cpool);
        free(table);
        free(sc);
        free(p);
        free(sinks);
    }
}

/* Pack w1 (gate) [I, H], w3 (up) [I, H], w2 (down) [H, I] into the EXPERTS_PACKED rows. */
static void pack_expert(float *dst, const float *w1, const float *w3, const float *w2, int64_t I,
                        int64_t H, int64_t B) {
    int64_t row = 0;
    for (int64_t b0 = 0; b0 < I; b0 += B) {
        int64_t nb = I - b0 < B ? I - b0 : B;
        for (int64_t j = 0; j < nb; j++, row++) memcpy(dst + row * H, w1 + (b0 + j) * H, (size_t)H * 4);
        for (int64_t j = 0; j < nb; j++, row++) memcpy(dst + row * H, w3 + (b0 + j) * H, (size_t)H * 4);
    }
    for (int64_t i = 0; i < I; i++, row++)
        for (int64_t c = 0; c < H; c++) dst[row * H + c] = w2[c * I + i];
}

static void test_expert_ffn(const cb_kernels *K) {
    struct { int64_t R, H, I, B; } cs[] = {
        {1, 7, 5, 32}, {3, 33, 37, 1}, {4, 45, 37, 8}, {7, 17, 64, 32}, {2, 129, 33, 5}, {1, 1, 1, 1},
        {17, 67, 131, 32}, {33, 131, 67, 7}, {6, 255, 33, 32}, {13, 64, 96, 32},
    };
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            int64_t R = cs[i].R, H = cs[i].H, I = cs[i].I, B = cs[i].B;
            wbuf w = make_w(dt, 3 * I * H, 0.5);
            /* interpret the random stored rows as w1 | w3 | w2 in plain layout, then pack */
            const float *w1 = w.val, *w3 = w.val + I * H, *w2 = w.val + 2 * I * H;
            float *packed = malloc((size_t)(3 * I * H) * 4);
            pack_expert(packed, w1, w3, w2, I, H, B);
            void *raw = malloc((size_t)(3 * I * H) * cb_dtype_size(dt));
            for (int64_t k = 0; k < 3 * I * H; k++) {
                if (dt == COLIBRI_DTYPE_F32) ((float *)raw)[k] = packed[k];
                else if (dt == COLIBRI_DTYPE_F16) ((uint16_t *)raw)[k] = cb_f32_to_f16(packed[k]); /* exact */
                else ((uint16_t *)raw)[k] = cb_f32_to_bf16(packed[k]);
            }
            float *x = malloc((size_t)(R * H) * 4), *y = malloc((size_t)(R * H) * 4), *h = malloc((size_t)(R * I) * 4);
            double *hd = malloc((size_t)I * 8), *hm = malloc((size_t)I * 8);
            fill(x, R * H, 1.0);
            K->expert_ffn(y, h, x, raw, dt, R, H, I, B);
            for (int64_t r = 0; r < R; r++) {
                for (int64_t k = 0; k < I; k++) {
                    double g = 0, u = 0, mg = 0, mu = 0;
                    for (int64_t c = 0; c < H; c++) {
                        g += (double)w1[k * H + c] * x[r * H + c];
                        u += (double)w3[k * H + c] * x[r * H + c];
                        mg += fabs((double)w1[k * H + c] * x[r * H + c]);
                        mu += fabs((double)w3[k * H + c] * x[r * H + c]);
                    }
                    hd[k] = g / (1.0 + exp(-g)) * u;
                    hm[k] = (mg + 1e-3) * (mu + 1e-3);
                    if (!close_to(h[r * I + k], hd[k], hm[k], 2e-5))
                        FAIL("[%s] expert_ffn %s case %zu h[%lld,%lld]: %.9g vs %.9g", K->name, cb_dtype_name(dt),
                             i, (long long)r, (long long)k, (double)h[r * I + k], hd[k]);
                }
                for (int64_t c = 0; c < H; c++) {
                    double o = 0, mag = 0;
                    for (int64_t k = 0; k < I; k++) {
                        o += hd[k] * w2[c * I + k];
                        mag += fabs(hm[k] * w2[c * I + k]);
                    }
                    if (!close_to(y[r * H + c], o, mag, 3e-5))
                        FAIL("[%s] expert_ffn %s case %zu y[%lld,%lld]: %.9g vs %.9g", K->name, cb_dtype_name(dt),
                             i, (long long)r, (long long)c, (double)y[r * H + c], o);
                }
            }
            free(packed);
            free(raw);
            free(x);
            free(y);
            free(h);
            free(hd);
            free(hm);
            free_w(&w);
        }
}

/* ---- a table against the reference table, ranged entries included ---- */

#define SENTINEL 12345.0f

/* |a - b| <= rel * (|b| + scale) elementwise */
static void compare_arrays(const char *what, const cb_kernels *K, const float *got, const float *want,
                           int64_t n, double rel, double scale) {
    for (int64_t i = 0; i < n; i++) {
        n_check++;
        double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= rel * (fabs((double)want[i]) + scale))) {
            FAIL("[%s vs reference] %s element %lld: %.9g vs %.9g", K->name, what, (long long)i,
                 (double)got[i], (double)want[i]);
            return;
        }
    }
}

static void test_vs_ref(const cb_kernels *K) {
    const cb_kernels *R = cb_kernels_ref();
    /* matmul_ld on a slice of rows, into a wider output: outside the slice stays untouched */
    const int64_t Ts[] = {1, 3, 7, 17, 33};
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++)
        for (size_t a = 0; a < 5; a++) {
            int64_t T = Ts[a], N = 131, Kd = 255, n0 = 5, n1 = 98, ldy = N + 3;
            wbuf w = make_w(dt, N * Kd, 1.0);
            float *x = malloc((size_t)(T * Kd) * 4);
            float *y = malloc((size_t)(T * ldy) * 4), *yr = malloc((size_t)(T * ldy) * 4);
            fill(x, T * Kd, 1.0);
            for (int64_t i = 0; i < T * ldy; i++) y[i] = yr[i] = SENTINEL;
            size_t es = cb_dtype_size(dt);
            K->matmul_ld(y + n0, ldy, x, (const uint8_t *)w.raw + (size_t)(n0 * Kd) * es, dt, T, n1 - n0, Kd);
            R->matmul_ld(yr + n0, ldy, x, (const uint8_t *)w.raw + (size_t)(n0 * Kd) * es, dt, T, n1 - n0, Kd);
            compare_arrays("matmul_ld", K, y, yr, T * ldy, 2e-5, 2.0);
            free(x);
            free(y);
            free(yr);
            free_w(&w);
        }
    /* attention_heads for a middle range of heads, against the reference; and each head of
     * the range computed alone gives the bits of the range computed together (the score tile's
     * shape, nh heads by ATT_ACC / nh keys with their sums reduced together, changes no sum).
     * Groups of 3 heads, a head size with a partial vector on every table. */
    {
        int64_t T = 17, start = 40, Hq = 12, Hkv = 4, D = 44, P = start + T, nq = Hq * D;
        float *q = malloc((size_t)(T * nq) * 4), *o = malloc((size_t)(T * nq) * 4), *orf = malloc((size_t)(T * nq) * 4);
        float *o1 = malloc((size_t)(T * nq) * 4), *sc = malloc((size_t)(CB_ATT_HEADS * P) * 4), *pool;
        int32_t *table;
        fill(q, T * nq, 1.0);
        cb_kv_view kv = paged_cache(P, Hkv, D, 13, &pool, &table);
        float sinks[12];
        fill(sinks, 12, 3.0);
        for (int64_t window = 0; window <= 9; window += 9)
            for (int ws = 0; ws < 2; ws++) {
                const float *sk = ws ? sinks : NULL;
                for (int64_t i = 0; i < T * nq; i++) o[i] = orf[i] = o1[i] = SENTINEL;
                K->attention_heads(o, q, &kv, sc, T, start, Hq, Hkv, D, window, sk, 2, 9);
                R->attention_heads(orf, q, &kv, sc, T, start, Hq, Hkv, D, window, sk, 2, 9);
                compare_arrays(ws ? "attention_heads (sinks)" : "attention_heads", K, o, orf, T * nq, 2e-5, 1.0);
                for (int64_t h = 2; h < 9; h++)
                    K->attention_heads(o1, q, &kv, sc, T, start, Hq, Hkv, D, window, sk, h, h + 1);
                if (memcmp(o, o1, (size_t)(T * nq) * 4) != 0)
                    FAIL("[%s] attention_heads: one head at a time differs from the heads together", K->name);
            }
        free(q);
        free(o);
        free(orf);
        free(o1);
        free(pool);
        free(table);
        free(sc);
    }
    /* expert_gateup / expert_down on column ranges (odd, unaligned bounds) */
    struct { int64_t R, H, I, B, i0, i1, c0, c1; } cs[] = {
        {1, 131, 67, 32, 0, 67, 0, 131}, {1, 128, 96, 32, 31, 65, 16, 80}, {3, 67, 131, 7, 5, 100, 3, 60},
        {17, 255, 67, 32, 1, 66, 17, 250}, {33, 64, 64, 32, 0, 64, 0, 64}, {7, 96, 35, 32, 33, 35, 32, 96},
        /* I larger than the down kernel's packed panel (several panels chained) */
        {13, 96, 1100, 32, 500, 620, 0, 96}, {6, 67, 777, 32, 0, 777, 3, 67},
    };
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            int64_t Rr = cs[i].R, H = cs[i].H, I = cs[i].I, B = cs[i].B;
            wbuf w = make_w(dt, 3 * I * H, 0.3);
            float *x = malloc((size_t)(Rr * H) * 4);
            float *h = malloc((size_t)(Rr * I) * 4), *hr = malloc((size_t)(Rr * I) * 4);
            float *y = malloc((size_t)(Rr * H) * 4), *yr = malloc((size_t)(Rr * H) * 4);
            fill(x, Rr * H, 1.0);
            for (int64_t k = 0; k < Rr * I; k++) h[k] = hr[k] = SENTINEL;
            K->expert_gateup(h, x, w.raw, NULL, dt, Rr, H, I, B, cs[i].i0, cs[i].i1);
            R->expert_gateup(hr, x, w.raw, NULL, dt, Rr, H, I, B, cs[i].i0, cs[i].i1);
            compare_arrays("expert_gateup", K, h, hr, Rr * I, 5e-5, 1.0);
            fill(h, Rr * I, 1.0); /* an independent h for the down projection */
            for (int64_t k = 0; k < Rr * H; k++) y[k] = yr[k] = SENTINEL;
            K->expert_down(y, h, w.raw, dt, Rr, H, I, cs[i].c0, cs[i].c1);
            R->expert_down(yr, h, w.raw, dt, Rr, H, I, cs[i].c0, cs[i].c1);
            compare_arrays("expert_down", K, y, yr, Rr * H, 5e-5, 1.0);
            free(x);
            free(h);
            free(hr);
            free(y);
            free(yr);
            free_w(&w);
        }
}

/* A row's result does not depend on the batch it is computed in (bit for bit): the engine
 * relies on it so that group padding, decode vs prefill and the thread split change nothing. */
static void test_batch_invariance(const cb_kernels *K) {
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++) {
        int64_t T = 17, N = 67, Kd = 255, H = 96, I = 1100, B = 32;
        wbuf w = make_w(dt, N * Kd, 1.0), e = make_w(dt, 3 * I * H, 0.3);
        float *x = malloc((size_t)(T * Kd) * 4), *y = malloc((size_t)(T * N) * 4), *y1 = malloc((size_t)N * 4);
        float *xe = malloc((size_t)(T * H) * 4), *h = malloc((size_t)(T * I) * 4), *h1 = malloc((size_t)I * 4);
        float *ye = malloc((size_t)(T * H) * 4), *ye1 = malloc((size_t)H * 4);
        fill(x, T * Kd, 1.0);
        fill(xe, T * H, 1.0);
        K->matmul(y, x, w.raw, dt, T, N, Kd);
        K->expert_gateup(h, xe, e.raw, NULL, dt, T, H, I, B, 0, I);
        K->expert_down(ye, h, e.raw, dt, T, H, I, 0, H);
        for (int64_t t = 0; t < T; t++) {
            K->matmul(y1, x + t * Kd, w.raw, dt, 1, N, Kd);
            K->expert_gateup(h1, xe + t * H, e.raw, NULL, dt, 1, H, I, B, 0, I);
            K->expert_down(ye1, h + t * I, e.raw, dt, 1, H, I, 0, H);
            n_check += 3;
            if (memcmp(y1, y + t * N, (size_t)N * 4) != 0)
                FAIL("[%s] matmul %s: token %lld alone differs from the batch", K->name, cb_dtype_name(dt), (long long)t);
            if (memcmp(h1, h + t * I, (size_t)I * 4) != 0)
                FAIL("[%s] expert_gateup %s: row %lld alone differs from the batch", K->name, cb_dtype_name(dt), (long long)t);
            if (memcmp(ye1, ye + t * H, (size_t)H * 4) != 0)
                FAIL("[%s] expert_down %s: row %lld alone differs from the batch", K->name, cb_dtype_name(dt), (long long)t);
        }
        free(x);
        free(y);
        free(y1);
        free(xe);
        free(h);
        free(h1);
        free(ye);
        free(ye1);
        free_w(&w);
        free_w(&e);
    }
}

/* expert_down_part: the blocks' parts added in order equal expert_down bit for bit (the
 * engine splits few-row down projections this way), and each part is the block's sum. */
static void test_down_parts(const cb_kernels *K) {
    struct { int64_t R, H, I; } cs[] = {{1, 131, 67}, {1, 96, 1100}, {2, 67, 513}, {5, 33, 256},
                                        {3, 255, 257}, {7, 64, 600}, {1, 8, 1}};
    for (uint32_t dt = COLIBRI_DTYPE_F32; dt <= COLIBRI_DTYPE_BF16; dt++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            int64_t R = cs[i].R, H = cs[i].H, I = cs[i].I, nblk = (I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
            wbuf w = make_w(dt, 3 * I * H, 0.3);
            float *h = malloc((size_t)(R * I) * 4), *y = malloc((size_t)(R * H) * 4);
            float *sum = malloc((size_t)(R * H) * 4), *part = malloc((size_t)(R * H) * 4);
            fill(h, R * I, 1.0);
            K->expert_down(y, h, w.raw, dt, R, H, I, 0, H);
            const float *down = w.val + 2 * I * H; /* w2T [I, H], exact values */
            for (int64_t b = 0; b < nblk; b++) {
                for (int64_t k = 0; k < R * H; k++) part[k] = SENTINEL;
                K->expert_down_part(part, h, w.raw, dt, R, H, I, b);
                int64_t i0 = b * CB_DOWN_BLOCK, i1 = I - i0 < CB_DOWN_BLOCK ? I : i0 + CB_DOWN_BLOCK;
                for (int64_t r = 0; r < R; r++)
                    for (int64_t c = 0; c < H; c++) {
                        double want = 0.0, mag = 0.0;
                        for (int64_t j = i0; j < i1; j++) {
                            double t = (double)h[r * I + j] *
                                       (double)down[j * H + c];
                            want += t;
                            mag += fabs(t);
                        }
                        if (!close_to(part[r * H + c], want, mag, 2e-5))
                            FAIL("[%s] expert_down_part %s R=%lld H=%lld I=%lld blk %lld [%lld,%lld]: %g vs %g",
                                 K->name, cb_dtype_name(dt), (long long)R, (long long)H, (long long)I,
                                 (long long)b, (long long)r, (long long)c, part[r * H + c], want);
                    }
                for (int64_t k = 0; k < R * H; k++) sum[k] = b == 0 ? part[k] : sum[k] + part[k];
            }
            n_check++;
            if (memcmp(sum, y, (size_t)(R * H) * 4) != 0)
                FAIL("[%s] expert_down %s R=%lld H=%lld I=%lld: the parts added in order differ from expert_down",
                     K->name, cb_dtype_name(dt), (long long)R, (long long)H, (long long)I);
            free(h);
            free(y);
            free(sum);
            free(part);
            free_w(&w);
        }
}

/* ---- block-quantized weights ---- */

static const uint32_t QTYPES[] = {COLIBRI_DTYPE_Q8_0, COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q5_K, COLIBRI_DTYPE_Q6_K,
                                  COLIBRI_DTYPE_MXFP4, COLIBRI_DTYPE_Q4_0, COLIBRI_DTYPE_Q4_1, COLIBRI_DTYPE_Q5_0,
                                  COLIBRI_DTYPE_Q5_1, COLIBRI_DTYPE_Q2_K, COLIBRI_DTYPE_Q3_K, COLIBRI_DTYPE_IQ4_NL,
                                  COLIBRI_DTYPE_IQ4_XS, COLIBRI_DTYPE_IQ2_XXS, COLIBRI_DTYPE_IQ2_XS,
                                  COLIBRI_DTYPE_IQ2_S, COLIBRI_DTYPE_IQ3_XXS, COLIBRI_DTYPE_IQ3_S,
                                  COLIBRI_DTYPE_IQ1_S, COLIBRI_DTYPE_IQ1_M};
/* The grid types' codebooks for these tests: random entries within ggml's grids' ranges (IQ2
 * magnitudes 0 to 43, IQ3_XXS 0 to 62, IQ3_S 0 to 15: the fast mode's bytes are sized for them,
 * cb_fast_grid_off; IQ1: -1, 0, 1), installed without the CRC check that holds files to ggml's
 * grids. The kernels read whatever codebook is installed, so any such one tests them. */
static void install_test_codebooks(void) {
    static uint8_t book[2048 * 8];
    for (int b = 0; b < CB_N_CODEBOOKS; b++) {
        uint64_t n = cb_codebook_bytes(b);
        const double top = b == CB_BOOK_IQ3_XXS ? 62.0 : b == CB_BOOK_IQ3_S ? 15.0 : 43.0;
        for (uint64_t i = 0; i < n; i++)
            book[i] = b == CB_BOOK_IQ1_S ? (uint8_t)(int8_t)((int)((urand() + 1.0) * 1.5) - 1)
                                         : (uint8_t)((urand() + 1.0) * 0.5 * (top + 0.999));
        if (cb_codebook_install_any(b, book, n) != COLIBRI_OK) FAIL("installing the test codebook %s", cb_codebook_name(b));
    }
}
/* The block types of the fast mode's int8 path (the others run the exact kernels there: fast.h) */
static const uint32_t FAST_QTYPES[] = {COLIBRI_DTYPE_Q8_0,   COLIBRI_DTYPE_Q4_K, COLIBRI_DTYPE_Q5_K,
                                       COLIBRI_DTYPE_Q6_K,   COLIBRI_DTYPE_Q4_0, COLIBRI_DTYPE_Q4_1,
                                       COLIBRI_DTYPE_Q5_0,   COLIBRI_DTYPE_Q5_1, COLIBRI_DTYPE_Q2_K,
                                       COLIBRI_DTYPE_Q3_K,   COLIBRI_DTYPE_IQ4_NL, COLIBRI_DTYPE_IQ4_XS,
                                       COLIBRI_DTYPE_IQ2_XXS, COLIBRI_DTYPE_IQ2_XS, COLIBRI_DTYPE_IQ2_S,
                                       COLIBRI_DTYPE_IQ3_XXS, COLIBRI_DTYPE_IQ3_S,  COLIBRI_DTYPE_IQ1_S,
                                       COLIBRI_DTYPE_IQ1_M};

/* MXFP4 scale bytes of make_q: 0, typical ones (weights up to 0.75, as the float tests'), or
 * the extremes a matmul can still sum finitely (subnormal 2^-128 .. 2^-125 scales, 2^0, 2^33) */
static int mx_extreme = 0;
static uint8_t mx_scale(void) {
    static const uint8_t ext[] = {0, 1, 2, 3, 100, 127, 150, 160};
    if (mx_extreme) return ext[(int)((urand() + 1.0) * 4.0) & 7];
    return (uint8_t)(118 + (int)((urand() + 1.0) * 4.5)); /* 118 .. 126 */
}

static void put_f16(uint8_t *p, float v) {
    uint16_t h = cb_f32_to_f16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* rows x K random blocks of dt (random quants and scale bytes, finite f16 scales of either
 * sign), with val = their reference dequantization */
static wbuf make_q(uint32_t dt, int64_t rows, int64_t K) {
    wbuf w;
    size_t rb = (size_t)cb_row_bytes(dt, (uint64_t)K), bb = cb_dtype_block_bytes(dt);
    uint8_t *raw = malloc(rb * (size_t)rows + 1);
    w.val = malloc((size_t)(rows * K) * sizeof(float) + 1);
    for (size_t i = 0; i < rb * (size_t)rows; i++) raw[i] = (uint8_t)(urand() * 128.0 + 128.0);
    for (size_t b = 0; b < rb * (size_t)rows / bb; b++) {
        uint8_t *blk = raw + b * bb;
        /* weights of magnitude up to about 0.5, as the float tests' */
        if (dt == COLIBRI_DTYPE_Q8_0) put_f16(blk, (float)(urand() * 0.004));
        else if (dt == COLIBRI_DTYPE_MXFP4) blk[0] = mx_scale();
        else if (dt == COLIBRI_DTYPE_Q6_K) put_f16(blk + 208, (float)(urand() * 0.0001));
        else if (dt == COLIBRI_DTYPE_Q4_0 || dt == COLIBRI_DTYPE_Q5_0) put_f16(blk, (float)(urand() * 0.03));
        else if (dt == COLIBRI_DTYPE_Q4_1 || dt == COLIBRI_DTYPE_Q5_1) {
            put_f16(blk, (float)(urand() * 0.015));
            put_f16(blk + 2, (float)(urand() * 0.25));
        } else if (dt == COLIBRI_DTYPE_Q2_K) {
            put_f16(blk + 80, (float)(urand() * 0.01));
            put_f16(blk + 82, (float)(urand() * 0.02));
        } else if (dt == COLIBRI_DTYPE_Q3_K) put_f16(blk + 108, (float)(urand() * 0.004));
        else if (dt == COLIBRI_DTYPE_IQ4_NL) put_f16(blk, (float)(urand() * 0.004));
        else if (dt == COLIBRI_DTYPE_IQ4_XS) put_f16(blk, (float)(urand() * 0.0001));
        else if (dt == COLIBRI_DTYPE_IQ1_M) { /* its f16 d: the top nibbles of its four u16 scales */
            uint16_t h = cb_f32_to_f16((float)(urand() * 0.02));
            for (int k = 0; k < 4; k++) blk[49 + 2 * k] = (uint8_t)((blk[49 + 2 * k] & 0x0F) | (((h >> (4 * k)) & 0xF) << 4));
        } else if (cb_dtype_codebook(dt) >= 0) put_f16(blk, (float)(urand() * 0.002)); /* the grid types */
        else {
            put_f16(blk, (float)(urand() * 0.0005));
            put_f16(blk + 2, (float)(urand() * 0.0005));
        }
    }
    for (int64_t r = 0; r < rows; r++) cb_dtype_dequant(dt)(w.val + r * K, raw + (size_t)r * rb, K);
    w.raw = raw;
    return w;
}

/* A gate/up row computed alone (h1: [I]) against row r of the batch (h: [R, I]): the same
 * bits in columns i0 .. i1, and neither wrote outside them (SENTINEL there). */
static void check_gateup_row(const char *who, const char *dtn, const float *h, const float *h1, int64_t R, int64_t r,
                             int64_t I, int64_t i0, int64_t i1) {
    n_check++;
    if (memcmp(h1 + i0, h + r * I + i0, (size_t)(i1 - i0) * 4) != 0)
        FAIL("[%s] gateup %s R%lld: row %lld alone differs from the batch", who, dtn, (long long)R, (long long)r);
    for (int64_t k = 0; k < I; k++)
        if ((k < i0 || k >= i1) && (h[r * I + k] != SENTINEL || h1[k] != SENTINEL)) {
            FAIL("[%s] gateup %s wrote outside its range", who, dtn);
            break;
        }
}

static void test_quant(const cb_kernels *K) {
    const cb_kernels *R = cb_kernels_ref();
    for (size_t qi = 0; qi < sizeof QTYPES / sizeof QTYPES[0]; qi++) {
        uint32_t dt = QTYPES[qi];
        int64_t blk = cb_dtype_block(dt);
        /* dequant_row: the reference's bits */
        {
            int64_t n = blk == 32 ? 32 * 37 : 256 * 5;
            wbuf w = make_q(dt, 1, n);
            float *d = malloc((size_t)n * 4);
            K->dequant_row(d, w.raw, dt, n);
            n_check++;
            if (memcmp(d, w.val, (size_t)n * 4) != 0) FAIL("[%s] dequant_row %s differs from the reference dequantizer", K->name, cb_dtype_name(dt));
            free(d);
            free_w(&w);
        }
        /* matmul against a double loop on the dequantized values; each token alone gives the
         * batch's bits (decode tiles, few-token tiles, the widened prefill path, long rows) */
        const int64_t Ts[] = {1, 2, 3, 4, 5, 13, 17};
        const int64_t Ns[] = {1, 7, 67};
        const int64_t Kq[] = {256, 768, 4352, 32, 96, 288}; /* the last three: 32-element blocks only */
        for (size_t c = 0; c < 6; c++) {
            int64_t Kd = Kq[c];
            if (Kd % blk) continue;
            /* the byte-decoded types share one tile: K = 96 covers their odd sizes (keeps the
             * emulated aarch64 run short) */
            if ((Kd == 32 || Kd == 288) && dt != COLIBRI_DTYPE_Q8_0 && dt != COLIBRI_DTYPE_MXFP4) continue;
            for (size_t b = 0; b < 3; b++)
                for (size_t a = 0; a < 7; a++) {
                    int64_t T = Ts[a], N = Ns[b];
                    if (Kd > 1000 && (N > 7 || (T > 5 && T != 17))) continue; /* keep the long rows quick */
                    wbuf w = make_q(dt, N, Kd);
                    check_matmul_batch(K, dt, &w, T, N, Kd, "");
                    free_w(&w);
                }
        }
        /* split gate/up on a column range, against the reference table; row alone == batch */
        {
            int64_t H = blk == 32 ? 288 : 512, I = 37, i0 = 3, i1 = 30;
            wbuf g = make_q(dt, I, H), u = make_q(dt, I, H);
            const int64_t Rs[] = {1, 2, 3, 4, 6, 17};
            for (size_t a = 0; a < 6; a++) {
                int64_t Rr = Rs[a];
                float *x = malloc((size_t)(Rr * H) * 4), *h = malloc((size_t)(Rr * I) * 4);
                float *hr = malloc((size_t)(Rr * I) * 4), *h1 = malloc((size_t)I * 4);
                fill(x, Rr * H, 1.0);
                for (int64_t k = 0; k < Rr * I; k++) h[k] = hr[k] = SENTINEL;
                K->expert_gateup(h, x, g.raw, u.raw, dt, Rr, H, I, 0, i0, i1);
                R->expert_gateup(hr, x, g.raw, u.raw, dt, Rr, H, I, 0, i0, i1);
                compare_arrays("expert_gateup split", K, h, hr, Rr * I, 5e-5, 1.0);
                for (int64_t r = 0; r < Rr; r++) {
                    for (int64_t k = 0; k < I; k++) h1[k] = SENTINEL;
                    K->expert_gateup(h1, x + r * H, g.raw, u.raw, dt, 1, H, I, 0, i0, i1);
                    check_gateup_row(K->name, cb_dtype_name(dt), h, h1, Rr, r, I, i0, i1);
                }
                free(x);
                free(h);
                free(hr);
                free(h1);
            }
            free_w(&g);
            free_w(&u);
        }
    }
}

/* ---- the fast numeric mode (cpu/fast.h) ---- */

/* cb_round_bf16 against the conversion pair (round to nearest even, nan kept) */
static void test_round_bf16(void) {
    float x[4099];
    fill(x, 4096, 3.0);
    x[4096] = f32_bits(0x7fc00001u);
    x[4097] = f32_bits(0x3f80ffffu); /* rounds up across a mantissa carry */
    x[4098] = f32_bits(0x3f808000u); /* a tie: to even (down) */
    /* the same cases, and infinities, signed nans and a tie up, where a vectorized loop runs */
    const uint32_t special[] = {0x7fc00001u, 0x3f80ffffu, 0x3f808000u, 0x3f818000u,
                                0x7f800000u, 0xff800000u, 0xffc00001u, 0x7f7fffffu};
    for (int i = 0; i < 8; i++) x[16 + 3 * i] = f32_bits(special[i]);
    float r[4099];
    memcpy(r, x, sizeof x);
    cb_round_bf16(r, 4099);
    for (int i = 0; i < 4099; i++) {
        n_check++;
        float want = isnan(x[i]) ? x[i] : cb_bf16_to_f32(cb_f32_to_bf16(x[i]));
        if (isnan(x[i]) ? !isnan(r[i]) : bits_f32(r[i]) != bits_f32(want))
            FAIL("cb_round_bf16(%.9g) = %.9g, want %.9g", (double)x[i], (double)r[i], (double)want);
    }
}

/* The reference fast matmul against the exact product: each term's error is bounded by the
 * activation's quantization step (half of amax/127 of its block) times |w|. */
static void check_fast_token(const cb_fast_kernels *F, uint32_t dt, const float *y, int64_t ldy, const float *x,
                             const float *val, int64_t t, int64_t N, int64_t Kd) {
    for (int64_t n = 0; n < N; n++) {
        double s = 0, bound = 0;
        for (int64_t b = 0; b < Kd / 32; b++) {
            double amax = 0;
            for (int k = 0; k < 32; k++) { /* not fmax(): gcc 12's aarch64 vectorizer crashes on that reduction */
                double a = fabs((double)x[t * Kd + b * 32 + k]);
                if (a > amax) amax = a;
            }
            for (int k = 0; k < 32; k++) {
                int64_t i = b * 32 + k;
                s += (double)x[t * Kd + i] * val[n * Kd + i];
                bound += fabs((double)val[n * Kd + i]) * (amax / 127.0 * 0.5000001 + fabs((double)x[t * Kd + i]) * 1e-6);
            }
        }
        n_check++;
        if (!(fabs(y[t * ldy + n] - s) <= bound + 1e-6))
            FAIL("[fast %s] matmul %s N%lld K%lld (%lld,%lld): %.9g vs exact %.9g, bound %.3g", F->name,
                 cb_dtype_name(dt), (long long)N, (long long)Kd, (long long)t, (long long)n, (double)y[t * ldy + n],
                 s, bound);
    }
}

/* Every fast table: matmul_ld bit for bit the reference's (odd T, N and K, rows longer than
 * one pass, an output stride), each token alone the batch's bits; gateup too (its SiLU is one
 * definition, cb_fast_silu_mul), row alone == batch, only its column range written. The
 * reference itself against the exact product. */
static void test_fast(const cb_fast_kernels *F) {
    const cb_fast_kernels *R = cb_fast_ref();
    for (size_t qi = 0; qi < sizeof QTYPES / sizeof QTYPES[0]; qi++) { /* the others run the exact kernels */
        uint32_t dt = QTYPES[qi];
        int fast_type = 0;
        for (size_t j = 0; j < sizeof FAST_QTYPES / sizeof FAST_QTYPES[0]; j++) fast_type |= FAST_QTYPES[j] == dt;
        n_check++;
        if (!fast_type && cb_fast_takes(F, dt, 2560))
            FAIL("[fast %s] takes %s matrices: it has no int8 path for them (the exact kernels run them)", F->name,
                 cb_dtype_name(dt));
    }
    for (size_t qi = 0; qi < sizeof FAST_QTYPES / sizeof FAST_QTYPES[0]; qi++) {
        uint32_t dt = FAST_QTYPES[qi];
        int64_t blk = cb_dtype_block(dt);
        /* the types after the first four share their tiling, micro-kernels and sub-block
         * sizes (only the unpack differs): fewer shapes for them, still a decode, a partial
         * group of 4 tokens, more than one token tile, a partial and two whole panels and
         * rows longer than one pass, so that the emulated tables stay quick */
        int lite = qi >= 4;
        const int64_t Ts[] = {1, 2, 3, 5, 9, 37};
        const int64_t Ns[] = {1, 7, 17, 33, 67};
        const int64_t Kq[] = {256, 768, 4352, 32, 96, 2080}; /* the last three: 32-element blocks only */
        for (size_t c = 0; c < 6; c++) {
            int64_t Kd = Kq[c];
            if (Kd % blk) continue;
            for (size_t b = 0; b < 5; b++)
                for (size_t a = 0; a < 6; a++) {
                    int64_t T = Ts[a], N = Ns[b], ldy = N + 3;
                    if (lite && (a == 1 || a == 3 || a == 4 || b == 1 || b == 3 || (T == 37 && Kd != 256))) continue;
                    if (Kd > 1000 && (N > 17 || (T > 3 && T != 37))) continue; /* keep the long rows quick */
                    wbuf w = make_q(dt, N, Kd);
                    float *x = malloc((size_t)(T * Kd) * 4), *y = malloc((size_t)(T * ldy) * 4);
                    float *yr = malloc((size_t)(T * ldy) * 4), *y1 = malloc((size_t)N * 4);
                    fill(x, T * Kd, 2.0);
                    for (int64_t i = 0; i < T * ldy; i++) y[i] = yr[i] = SENTINEL;
                    F->matmul_ld(y, ldy, x, w.raw, dt, T, N, Kd);
                    if (F != R) { /* the reference itself: checked against the exact product below */
                        R->matmul_ld(yr, ldy, x, w.raw, dt, T, N, Kd);
                        n_check++;
                        if (memcmp(y, yr, (size_t)(T * ldy) * 4) != 0)
                            FAIL("[fast %s] matmul_ld %s T%lld N%lld K%lld differs from the reference's bits", F->name,
                                 cb_dtype_name(dt), (long long)T, (long long)N, (long long)Kd);
                    }
                    for (int64_t t = 0; t < T; t++) {
                        if (F == R && (T < 9 || t % 7 == 0)) check_fast_token(F, dt, y, ldy, x, w.val, t, N, Kd);
                        F->matmul_ld(y1, N, x + t * Kd, w.raw, dt, 1, N, Kd);
                        n_check++;
                        if (memcmp(y1, y + t * ldy, (size_t)N * 4) != 0)
                            FAIL("[fast %s] matmul_ld %s T%lld N%lld K%lld: token %lld alone differs from the batch",
                                 F->name, cb_dtype_name(dt), (long long)T, (long long)N, (long long)Kd, (long long)t);
                        for (int64_t n = N; n < ldy; n++)
                            if (y[t * ldy + n] != SENTINEL) {
                                FAIL("[fast %s] matmul_ld wrote past N", F->name);
                                break;
                            }
                    }
                    free(x);
                    free(y);
                    free(yr);
                    free(y1);
                    free_w(&w);
                }
        }
        for (int wide_h = 0; wide_h < 2; wide_h++) { /* rows of one pass, and of two (2304 > FKC) */
            if (wide_h && lite) continue;
            int64_t H = wide_h ? 2304 : blk == 32 ? 288 : 512, I = 301, i0 = 3, i1 = 290;
            wbuf g = make_q(dt, I, H), u = make_q(dt, I, H);
            const int64_t Rs[] = {1, 2, 5, 35};
            for (size_t a = 0; a < 4; a++) {
                int64_t Rr = Rs[a];
                if ((lite || wide_h) && (a == 1 || a == 2)) continue;
                float *x = malloc((size_t)(Rr * H) * 4), *h = malloc((size_t)(Rr * I) * 4);
                float *hr = malloc((size_t)(Rr * I) * 4), *h1 = malloc((size_t)I * 4);
                fill(x, Rr * H, 1.0);
                for (int64_t k = 0; k < Rr * I; k++) h[k] = hr[k] = SENTINEL;
                F->gateup(h, x, g.raw, u.raw, dt, Rr, H, I, i0, i1);
                if (F != R) {
                    R->gateup(hr, x, g.raw, u.raw, dt, Rr, H, I, i0, i1);
                    n_check++;
                    if (memcmp(h, hr, (size_t)(Rr * I) * 4) != 0)
                        FAIL("[fast %s] gateup %s R%lld differs from the reference's bits", F->name, cb_dtype_name(dt),
                             (long long)Rr);
                }
                for (int64_t r = 0; r < Rr; r++) {
                    for (int64_t k = 0; k < I; k++) h1[k] = SENTINEL;
                    F->gateup(h1, x + r * H, g.raw, u.raw, dt, 1, H, I, i0, i1);
                    check_gateup_row(F->name, cb_dtype_name(dt), h, h1, Rr, r, I, i0, i1);
                }
                free(x);
                free(h);
                free(hr);
                free(h1);
            }
            free_w(&g);
            free_w(&u);
        }
    }
}

/* Interleaved copies (cpu/qpanel.h): cb_qpanel_pack's placement against the layout's
 * definition, and a table's kernels on them (cb_fast_kernels.qpanels) against its matmul_ld
 * and gateup on the row-major blocks, bit for bit: odd token counts, rows of one and of
 * several passes, a part of the rows from a group's start, gate/up column ranges. */
static void test_qpanels(const cb_fast_kernels *F) {
    const cb_qpanel_kernels *Q = F->qpanels;
    for (size_t qi = 0; qi < sizeof FAST_QTYPES / sizeof FAST_QTYPES[0]; qi++) {
        uint32_t dt = FAST_QTYPES[qi];
        int64_t blk = cb_dtype_block(dt);
        const char *dn = cb_dtype_name(dt);
        n_check++;
        if (cb_qpanel_takes(dt, 16, 256) != (cb_dtype_codebook(dt) < 0))
            FAIL("cb_qpanel_takes %s: the grid types have no copies, every other int8 type has", dn);
        if (!cb_qpanel_takes(dt, 16, 256)) continue; /* the grid types: row-major blocks only */
        { /* placement: in group g's block b (at (g nb + b) 8 bb), byte i of row 8g + r's block at
           * (8 (i / 4) + r) 4 + i % 4 — the block without its scale kept apart, where the type
           * has one (at s: then the 8 rows' scales are 16 bytes, row r's at 2r, before the
           * dwords when s = 0, after them otherwise) */
            int64_t N = 16, K = 2 * (blk == 32 ? 64 : 256);
            wbuf w = make_q(dt, N, K);
            size_t rp = (size_t)cb_qpanel_row_bytes(dt, (uint64_t)K), rb = (size_t)cb_row_bytes(dt, (uint64_t)K);
            size_t bb = cb_dtype_block_bytes(dt);
            int sp = cb_qpanel_split(dt);
            int64_t nb = K / blk;
            uint8_t *c = malloc((size_t)N * rp);
            memset(c, 0xA5, (size_t)N * rp);
            cb_qpanel_pack(c, w.raw, dt, N, K);
            n_check++;
            if (rp != rb || (sp < 0 ? bb % 4 : (bb - 2) % 4 || (sp != 0 && (size_t)sp != bb - 2)))
                FAIL("qpanel %s: %zu row bytes for %zu, scale apart at %d of a %zu-byte block", dn, rp, rb, sp, bb);
            int bad = 0;
            for (int64_t n = 0; n < N && !bad; n++)
                for (int64_t b = 0; b < nb && !bad; b++)
                    for (size_t i = 0; i < bb && !bad; i++) {
                        size_t g0 = (size_t)((n / 8) * nb + b) * 8 * bb, r = (size_t)(n % 8), at;
                        if (sp >= 0 && i >= (size_t)sp && i < (size_t)sp + 2) /* the scale */
                            at = g0 + (sp == 0 ? 0 : 8 * (bb - 2)) + 2 * r + (i - (size_t)sp);
                        else {
                            size_t k = sp == 0 ? i - 2 : i; /* the byte's place among the dwords */
                            at = g0 + (sp == 0 ? 16 : 0) + (8 * (k / 4) + r) * 4 + k % 4;
                        }
                        bad = c[at] != ((const uint8_t *)w.raw)[(size_t)n * rb + (size_t)b * bb + i];
                    }
            n_check++;
            if (bad) FAIL("cb_qpanel_pack %s: a byte misplaced", dn);
            free(c);
            free_w(&w);
        }
        const int64_t Ts[] = {1, 3, 5, 35}; /* 35: a tile of 32, then 3 */
        const int64_t Ns[] = {8, 24, 40};
        const int64_t Kq[] = {256, 768, 4352, 96, 2080}; /* the last two: 32-element blocks only */
        for (size_t c = 0; c < 5; c++) {
            int64_t Kd = Kq[c];
            if (Kd % blk) continue;
            for (size_t b = 0; b < 3; b++)
                for (size_t a = 0; a < 4; a++) {
                    int64_t T = Ts[a], N = Ns[b], ldy = N + 3;
                    if (Kd > 1000 && (N > 24 || T == 5)) continue;
                    wbuf w = make_q(dt, N, Kd);
                    size_t rp = (size_t)cb_qpanel_row_bytes(dt, (uint64_t)Kd);
                    uint8_t *cp = malloc((size_t)N * rp);
                    cb_qpanel_pack(cp, w.raw, dt, N, Kd);
                    float *x = malloc((size_t)(T * Kd) * 4), *y = malloc((size_t)(T * ldy) * 4);
                    float *yr = malloc((size_t)(T * ldy) * 4);
                    fill(x, T * Kd, 2.0);
                    for (int64_t i = 0; i < T * ldy; i++) y[i] = yr[i] = SENTINEL;
                    F->matmul_ld(yr, ldy, x, w.raw, dt, T, N, Kd);
                    Q->matmul(y, ldy, x, cp, dt, T, N, Kd);
                    n_check++;
                    if (memcmp(y, yr, (size_t)(T * ldy) * 4) != 0)
                        FAIL("[fast %s] qpanels matmul %s T%lld N%lld K%lld differs from matmul_ld", F->name, dn,
                             (long long)T, (long long)N, (long long)Kd);
                    for (int64_t i = 0; i < T * ldy; i++) y[i] = SENTINEL;
                    Q->matmul(y + 8, ldy, x, cp + 8 * rp, dt, T, N - 8, Kd); /* rows 8 .. N */
                    int bad = 0;
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t n = 0; n < ldy; n++)
                            bad |= n < 8 || n >= N ? y[t * ldy + n] != SENTINEL
                                                   : memcmp(&y[t * ldy + n], &yr[t * ldy + n], 4) != 0;
                    n_check++;
                    if (bad)
                        FAIL("[fast %s] qpanels matmul %s T%lld N%lld K%lld: rows from 8 differ (or writes outside)",
                             F->name, dn, (long long)T, (long long)N, (long long)Kd);
                    free(x);
                    free(y);
                    free(yr);
                    free(cp);
                    free_w(&w);
                }
        }
        for (int wide_h = 0; wide_h < 2; wide_h++) { /* rows of one pass, and of two */
            int64_t H = wide_h ? 2304 : blk == 32 ? 288 : 512, I = 296, i0 = 8, i1 = 288;
            wbuf g = make_q(dt, I, H), u = make_q(dt, I, H);
            size_t rp = (size_t)cb_qpanel_row_bytes(dt, (uint64_t)H);
            uint8_t *gq = malloc((size_t)I * rp), *uq = malloc((size_t)I * rp);
            cb_qpanel_pack(gq, g.raw, dt, I, H);
            cb_qpanel_pack(uq, u.raw, dt, I, H);
            const int64_t Rs[] = {1, 5, 35};
            for (size_t a = 0; a < 3; a++) {
                int64_t Rr = Rs[a];
                if (wide_h && a == 1) continue;
                float *x = malloc((size_t)(Rr * H) * 4), *h = malloc((size_t)(Rr * I) * 4);
                float *hr = malloc((size_t)(Rr * I) * 4);
                fill(x, Rr * H, 1.0);
                for (int64_t k = 0; k < Rr * I; k++) h[k] = hr[k] = SENTINEL;
                F->gateup(hr, x, g.raw, u.raw, dt, Rr, H, I, i0, i1);
                Q->gateup(h, x, gq, uq, dt, Rr, H, I, i0, i1);
                n_check++;
                if (memcmp(h, hr, (size_t)(Rr * I) * 4) != 0)
                    FAIL("[fast %s] qpanels gateup %s R%lld H%lld differs from gateup", F->name, dn, (long long)Rr,
                         (long long)H);
                free(x);
                free(h);
                free(hr);
            }
            free(gq);
            free(uq);
            free_w(&g);
            free_w(&u);
        }
    }
}

/* Rows quantized beforehand (fast.h cb_fast_qrows): quant_rows gives cb_fast_quant_act's
 * bytes over whole rows, and matmul_q8 / gateup_q8 on them give matmul_ld's / gateup's bits
 * on the float rows (and, with il, the interleaved copy's kernels'): token counts past one
 * tile of either path, rows of one and of several passes, gate/up column ranges. */
static void test_fast_q8(const cb_fast_kernels *F) {
    for (size_t qi = 0; qi < sizeof FAST_QTYPES / sizeof FAST_QTYPES[0]; qi++) {
        uint32_t dt = FAST_QTYPES[qi];
        int64_t blk = cb_dtype_block(dt);
        const char *dn = cb_dtype_name(dt);
        const int64_t Ks[] = {256, 4352, 96};
        const int64_t Ts[] = {1, 3, 37, 70};
        for (size_t c = 0; c < 3; c++) {
            int64_t K = Ks[c], N = 40;
            if (K % blk) continue;
            for (size_t a = 0; a < 4; a++) {
                int64_t T = Ts[a], ldy = N + 3;
                if (K > 1000 && T > 3) continue; /* several passes: 1 and 3 tokens; several tiles: K 256 */
                if (qi >= 4 && a == 1) continue; /* fewer shapes past the first four types */
                wbuf w = make_q(dt, N, K);
                float *x = malloc((size_t)(T * K) * 4), *y = malloc((size_t)(T * ldy) * 4);
                float *yr = malloc((size_t)(T * ldy) * 4);
                int8_t *q = malloc((size_t)(T * K)), *qr = malloc((size_t)K);
                cb_fast_ablk *ab = malloc((size_t)(T * K / 32) * sizeof *ab), *abr = malloc((size_t)(K / 32) * sizeof *abr);
                fill(x, T * K, 2.0);
                F->quant_rows(q, ab, x, T, K);
                int bad = 0;
                for (int64_t t = 0; t < T; t++) {
                    cb_fast_quant_act(x + t * K, K, qr, abr);
                    bad |= memcmp(qr, q + t * K, (size_t)K) != 0 ||
                           memcmp(abr, ab + t * (K / 32), (size_t)(K / 32) * sizeof *abr) != 0;
                }
                n_check++;
                if (bad) FAIL("[fast %s] quant_rows T%lld K%lld: not cb_fast_quant_act's bytes", F->name, (long long)T,
                              (long long)K);
                cb_fast_qrows xq = {q, ab};
                for (int il = 0; il <= (F->qpanels && cb_dtype_codebook(dt) < 0 ? 1 : 0); il++) {
                    const void *wm = w.raw;
                    uint8_t *cp = NULL;
                    if (il) {
                        cp = malloc((size_t)N * cb_qpanel_row_bytes(dt, (uint64_t)K));
                        cb_qpanel_pack(cp, w.raw, dt, N, K);
                        wm = cp;
                    }
                    for (int64_t i = 0; i < T * ldy; i++) y[i] = yr[i] = SENTINEL;
                    F->matmul_ld(yr, ldy, x, w.raw, dt, T, N, K);
                    F->matmul_q8(y, ldy, &xq, wm, il, dt, T, N, K);
                    n_check++;
                    if (memcmp(y, yr, (size_t)(T * ldy) * 4) != 0)
                        FAIL("[fast %s] matmul_q8 %s%s T%lld K%lld differs from matmul_ld", F->name, dn,
                             il ? " (copy)" : "", (long long)T, (long long)K);
                    free(cp);
                }
                free(x), free(y), free(yr), free(q), free(qr), free(ab), free(abr);
                free_w(&w);
            }
        }
        /* past the first four types (whose kernels the others share): one column group, one
         * tile, so that the emulated tables stay quick */
        int lite = qi >= 4;
        int64_t H = blk == 32 ? 288 : 512, I = lite ? 104 : 296, i0 = 8, i1 = lite ? 96 : 288;
        wbuf g = make_q(dt, I, H), u = make_q(dt, I, H);
        const int64_t Rs[] = {1, lite ? 5 : 65}; /* 65: two tiles of rows quantized once */
        for (size_t a = 0; a < 2; a++) {
            int64_t Rr = Rs[a];
            float *x = malloc((size_t)(Rr * H) * 4), *h = malloc((size_t)(Rr * I) * 4), *hr = malloc((size_t)(Rr * I) * 4);
            int8_t *q = malloc((size_t)(Rr * H));
            cb_fast_ablk *ab = malloc((size_t)(Rr * H / 32) * sizeof *ab);
            fill(x, Rr * H, 1.0);
            F->quant_rows(q, ab, x, Rr, H);
            cb_fast_qrows xq = {q, ab};
            for (int il = 0; il <= (F->qpanels && cb_dtype_codebook(dt) < 0 ? 1 : 0); il++) {
                size_t rp = (size_t)cb_qpanel_row_bytes(dt, (uint64_t)H);
                uint8_t *gq = il ? malloc((size_t)I * rp) : NULL, *uq = il ? malloc((size_t)I * rp) : NULL;
                if (il) cb_qpanel_pack(gq, g.raw, dt, I, H), cb_qpanel_pack(uq, u.raw, dt, I, H);
                for (int64_t k = 0; k < Rr * I; k++) h[k] = hr[k] = SENTINEL;
                F->gateup(hr, x, g.raw, u.raw, dt, Rr, H, I, i0, i1);
                F->gateup_q8(h, &xq, il ? gq : g.raw, il ? uq : u.raw, il, dt, Rr, H, I, i0, i1);
                n_check++;
                if (memcmp(h, hr, (size_t)(Rr * I) * 4) != 0)
                    FAIL("[fast %s] gateup_q8 %s%s R%lld differs from gateup", F->name, dn, il ? " (copy)" : "",
                         (long long)Rr);
                free(gq), free(uq);
            }
            free(x), free(h), free(hr), free(q), free(ab);
        }
        free_w(&g);
        free_w(&u);
    }
}

/* A fast table's attention (fast.h attention_heads, where it has one): against a double loop
 * (float32: 2e-5 of the weighted values' magnitude, as the exact kernels'); the paged cache
 * = a contiguous one, each query alone (a decode step) = the batch, one head at a time = the
 * heads together, all bit for bit; and keys and values outside a query's window or after it,
 * NaN, change nothing. Head sizes 16 to 128, windows, sinks, odd head groups. */
static void test_fast_attention(const cb_fast_kernels *F) {
    struct { int64_t T, start, Hq, Hkv, D, window, blen; } cs[] = {
        {1, 0, 1, 1, 32, 0, 1},    {7, 0, 4, 2, 64, 0, 3},    {3, 30, 6, 3, 16, 0, 16},
        {33, 5, 4, 1, 64, 7, 5},   {1, 128, 2, 2, 96, 129, 32}, {40, 3, 8, 2, 128, 0, 7},
        {19, 50, 12, 2, 48, 20, 32}, {2, 17, 5, 1, 80, 0, 19}, {70, 0, 4, 4, 64, 33, 32},
        {18, 0, 24, 3, 112, 0, 32},
    };
    for (size_t ii = 0; ii < 2 * sizeof cs / sizeof cs[0]; ii++) {
        size_t i = ii % (sizeof cs / sizeof cs[0]);
        int with_sinks = ii >= sizeof cs / sizeof cs[0];
        int64_t T = cs[i].T, start = cs[i].start, P = start + T, Hq = cs[i].Hq, Hkv = cs[i].Hkv, D = cs[i].D;
        int64_t nq = Hq * D, group = Hq / Hkv, window = cs[i].window;
        float *q = malloc((size_t)(T * nq) * 4), *out = malloc((size_t)(T * nq) * 4), *o1 = malloc((size_t)(T * nq) * 4);
        void *work = malloc(F->att_work_bytes(P, D));
        double *p = malloc((size_t)P * 8);
        float *pool, *cpool, *sinks = NULL;
        int32_t *table, one;
        fill(q, T * nq, 1.5);
        if (with_sinks) {
            sinks = malloc((size_t)Hq * 4);
            fill(sinks, Hq, 3.0);
        }
        cb_kv_view kv = paged_cache(P, Hkv, D, cs[i].blen, &pool, &table);
        cb_kv_view ckv = contiguous_copy(&kv, P, Hkv, D, &cpool, &one);
        const char *tag = with_sinks ? " (sinks)" : "";
        F->attention_heads(out, q, &kv, work, T, start, Hq, Hkv, D, window, sinks, 0, Hq);
        F->attention_heads(o1, q, &ckv, work, T, start, Hq, Hkv, D, window, sinks, 0, Hq);
        n_check++;
        if (memcmp(out, o1, (size_t)(T * nq) * 4) != 0)
            FAIL("[fast %s/%s] attention case %zu%s: the paged cache differs from the contiguous one", F->name, F->bf16, i, tag);
        for (int64_t h = 0; h < Hq; h++) /* one head at a time */
            F->attention_heads(o1, q, &kv, work, T, start, Hq, Hkv, D, window, sinks, h, h + 1);
        n_check++;
        if (memcmp(out, o1, (size_t)(T * nq) * 4) != 0)
            FAIL("[fast %s/%s] attention case %zu%s: one head at a time differs from the heads together", F->name, F->bf16, i, tag);
        for (int64_t t = 0; t < T; t++) { /* each query alone, a decode step at its position */
            F->attention_heads(o1 + t * nq, q + t * nq, &kv, work, 1, start + t, Hq, Hkv, D, window, sinks, 0, Hq);
            n_check++;
            if (memcmp(out + t * nq, o1 + t * nq, (size_t)nq * 4) != 0)
                FAIL("[fast %s/%s] attention case %zu%s: query %lld alone differs from the batch", F->name, F->bf16, i, tag,
                     (long long)t);
        }
        for (int64_t t = 0; t < T; t++) {
            int64_t pos = start + t;
            for (int64_t h = 0; h < Hq; h++) {
                double o[REF_ATT_MAX_D], mag[REF_ATT_MAX_D];
                ref_attention(o, mag, p, q + t * nq + h * D, &kv, h / group, pos, D, window, sinks ? &sinks[h] : NULL);
                for (int64_t d = 0; d < D; d++)
                    if (!close_to(out[t * nq + h * D + d], o[d], mag[d], 2e-5))
                        FAIL("[fast %s/%s] attention case %zu%s t%lld h%lld d%lld: %.9g vs %.9g", F->name, F->bf16, i, tag,
                             (long long)t, (long long)h, (long long)d, (double)out[t * nq + h * D + d], o[d]);
            }
        }
        if (window > 0 && start >= window) { /* the positions before the first query's window: NaN */
            for (int64_t j = 0; j < start - window + 1; j++)
                for (int64_t g = 0; g < Hkv; g++)
                    for (int64_t d = 0; d < D; d++) {
                        ((float *)cb_kv_at(kv.k, &kv, g, j, D))[d] = NAN;
                        ((float *)cb_kv_at(kv.v, &kv, g, j, D))[d] = NAN;
                    }
            F->attention_heads(o1, q, &kv, work, T, start, Hq, Hkv, D, window, sinks, 0, Hq);
            n_check++;
            if (memcmp(out, o1, (size_t)(T * nq) * 4) != 0)
                FAIL("[fast %s/%s] attention case %zu%s: NaN keys/values outside the window changed the result", F->name,
                     F->bf16, i, tag);
        }
        if (T > 1) { /* the last position NaN: the queries before it do not see it */
            for (int64_t g = 0; g < Hkv; g++)
                for (int64_t d = 0; d < D; d++) {
                    ((float *)cb_kv_at(kv.k, &kv, g, P - 1, D))[d] = NAN;
                    ((float *)cb_kv_at(kv.v, &kv, g, P - 1, D))[d] = NAN;
                }
            F->attention_heads(o1, q, &kv, work, T, start, Hq, Hkv, D, window, sinks, 0, Hq);
            n_check++;
            if (memcmp(out, o1, (size_t)((T - 1) * nq) * 4) != 0)
                FAIL("[fast %s/%s] attention case %zu%s: a NaN key/value after a query changed its result", F->name, F->bf16, i,
                     tag);
        }
        free(q);
        free(out);
        free(o1);
        free(work);
        free(p);
        free(pool);
        free(cpool);
        free(table);
        free(sinks);
    }
}

/* A fast table's BF16 kernels (native_bf16: AMX tiles) on bf16-rounded activations: against
 * a double loop (float32 accumulation: 2e-6 of the terms' magnitude), each token alone the
 * batch's bits, nothing written outside the rows/columns asked for: the split FFN's matmul
 * and gate/up, and the packed expert's gate/up and down. */
static double silu_d(double g) { return g / (1.0 + exp(-g)); }
static void test_fast_bf16(const cb_fast_kernels *F) {
    const uint32_t BF = COLIBRI_DTYPE_BF16;
    /* tokens: the decode layout (<= 8), token lanes with a partial last vector (29: 16 + 13),
     * whole vectors then the decode layout for the rest (17, 37) */
    const int64_t Ks[] = {32, 96, 1024}, Ns[] = {1, 7, 33, 67}, Ts[] = {1, 3, 8, 17, 29, 37};
    for (size_t c = 0; c < 3; c++)
        for (size_t b = 0; b < 4; b++)
            for (size_t a = 0; a < 6; a++) {
                int64_t K = Ks[c], N = Ns[b], T = Ts[a], ldy = N + 2;
                if (K > 100 && T > 3 && N > 7) continue;
                wbuf w = make_w(BF, N * K, 0.5);
                float *x = malloc((size_t)(T * K) * 4), *y = malloc((size_t)(T * ldy) * 4), *y1 = malloc((size_t)N * 4);
                fill(x, T * K, 2.0);
                cb_round_bf16(x, T * K);
                for (int64_t i = 0; i < T * ldy; i++) y[i] = SENTINEL;
                F->matmul_ld(y, ldy, x, w.raw, BF, T, N, K);
                for (int64_t t = 0; t < T; t++) {
                    for (int64_t n = 0; n < N; n++) {
                        double sum = 0, mag = 0;
                        for (int64_t k = 0; k < K; k++) {
                            sum += (double)x[t * K + k] * w.val[n * K + k];
                            mag += fabs((double)x[t * K + k] * w.val[n * K + k]);
                        }
                        if (!close_to(y[t * ldy + n], sum, mag, 2e-6))
                            FAIL("[fast %s] bf16 matmul N%lld K%lld (%lld,%lld): %.9g vs %.9g", F->name, (long long)N,
                                 (long long)K, (long long)t, (long long)n, (double)y[t * ldy + n], sum);
                    }
                    for (int64_t n = N; n < ldy; n++)
                        if (y[t * ldy + n] != SENTINEL) FAIL("[fast %s] bf16 matmul wrote past N", F->name);
                    F->matmul_ld(y1, N, x + t * K, w.raw, BF, 1, N, K);
                    n_check++;
                    if (memcmp(y1, y + t * ldy, (size_t)N * 4) != 0)
                        FAIL("[fast %s] bf16 matmul T%lld N%lld K%lld: token %lld alone differs from the batch", F->name,
                             (long long)T, (long long)N, (long long)K, (long long)t);
                }
                free(x);
                free(y);
                free(y1);
                free_w(&w);
            }
    /* the packed expert (B = 32 and 16) and the split gate/up */
    struct { int64_t R, H, I, B; } cs[] = {{1, 64, 96, 32}, {5, 96, 64, 16}, {8, 64, 96, 32}, {37, 32, 160, 32}, {29, 64, 96, 32}, {17, 1024, 96, 32},
                                           {3, 160, 1056, 32}, /* I in three passes of AMX's down */
                                           {2, 64, 8224, 32}}; /* 33 down blocks, the last one short */
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        int64_t R = cs[ci].R, H = cs[ci].H, I = cs[ci].I, B = cs[ci].B;
        wbuf w1 = make_w(BF, I * H, 0.3), w3 = make_w(BF, I * H, 0.3), w2 = make_w(BF, H * I, 0.3);
        float *pk = malloc((size_t)(3 * I * H) * 4);
        pack_expert(pk, w1.val, w3.val, w2.val, I, H, B);
        uint16_t *pb = malloc((size_t)(3 * I * H) * 2);
        for (int64_t i = 0; i < 3 * I * H; i++) pb[i] = cb_f32_to_bf16(pk[i]); /* exact: bf16 values */
        float *x = malloc((size_t)(R * H) * 4), *h = malloc((size_t)(R * I) * 4), *hs = malloc((size_t)(R * I) * 4);
        float *y = malloc((size_t)(R * H) * 4), *h1 = malloc((size_t)I * 4), *y1 = malloc((size_t)H * 4);
        fill(x, R * H, 1.0);
        cb_round_bf16(x, R * H);
        int64_t i0 = 32, i1 = I; /* a range, as a thread's chunk */
        for (int64_t k = 0; k < R * I; k++) h[k] = hs[k] = SENTINEL;
        F->gateup_packed(h, x, pb, R, H, I, B, i0, i1);
        F->gateup(hs, x, w1.raw, w3.raw, BF, R, H, I, i0, i1);
        for (int64_t r = 0; r < R; r++) {
            for (int64_t i = 0; i < I; i++) {
                if (i < i0) {
                    if (h[r * I + i] != SENTINEL || hs[r * I + i] != SENTINEL)
                        FAIL("[fast %s] bf16 gate/up wrote outside its columns", F->name);
                    continue;
                }
                double g = 0, u = 0, mag = 0;
                for (int64_t k = 0; k < H; k++) {
                    g += (double)x[r * H + k] * w1.val[i * H + k];
                    u += (double)x[r * H + k] * w3.val[i * H + k];
                    mag += fabs((double)x[r * H + k]) * (fabs(w1.val[i * H + k]) + fabs(w3.val[i * H + k]));
                }
                double want = silu_d(g) * u;
                float hr = hs[r * I + i]; /* the packed expert's h: the split's, rounded to bf16 */
                cb_round_bf16(&hr, 1);
                n_check++;
                if (!close_to(hs[r * I + i], want, mag * (fabs(u) + 1.0), 1e-5) || memcmp(&hr, &h[r * I + i], 4) != 0)
                    FAIL("[fast %s] bf16 gate/up R%lld H%lld I%lld (%lld,%lld): packed %.9g split %.9g vs %.9g", F->name,
                         (long long)R, (long long)H, (long long)I, (long long)r, (long long)i, (double)h[r * I + i],
                         (double)hs[r * I + i], want);
            }
            for (int64_t k = 0; k < I; k++) h1[k] = SENTINEL;
            F->gateup_packed(h1, x + r * H, pb, 1, H, I, B, i0, i1);
            n_check++;
            if (memcmp(h1 + i0, h + r * I + i0, (size_t)(i1 - i0) * 4) != 0)
                FAIL("[fast %s] bf16 gate/up packed: row %lld alone differs from the batch", F->name, (long long)r);
        }
        /* down over every column but the first 16, from the (rounded) full h */
        for (int64_t k = 0; k < R * I; k++) h[k] = (float)(urand() * 0.5);
        cb_round_bf16(h, R * I);
        int64_t c0 = H > 16 ? 16 : 0;
        for (int64_t k = 0; k < R * H; k++) y[k] = SENTINEL;
        F->down_packed(y, h, pb, R, H, I, c0, H);
        for (int64_t r = 0; r < R; r++) {
            for (int64_t cc = 0; cc < H; cc++) {
                if (cc < c0) {
                    if (y[r * H + cc] != SENTINEL) FAIL("[fast %s] bf16 down wrote outside its columns", F->name);
                    continue;
                }
                double sum = 0, mag = 0;
                for (int64_t i = 0; i < I; i++) {
                    sum += (double)h[r * I + i] * w2.val[cc * I + i];
                    mag += fabs((double)h[r * I + i] * w2.val[cc * I + i]);
                }
                if (!close_to(y[r * H + cc], sum, mag, 2e-6))
                    FAIL("[fast %s] bf16 down R%lld H%lld I%lld (%lld,%lld): %.9g vs %.9g", F->name, (long long)R,
                         (long long)H, (long long)I, (long long)r, (long long)cc, (double)y[r * H + cc], sum);
            }
            F->down_packed(y1, h + r * I, pb, 1, H, I, c0, H);
            n_check++;
            if (memcmp(y1 + c0, y + r * H + c0, (size_t)(H - c0) * 4) != 0)
                FAIL("[fast %s] bf16 down: row %lld alone differs from the batch", F->name, (long long)r);
        }
        /* down_part: the blocks' parts added in order = down_packed, bit for bit (the first
         * CB_FAST_PART_MAX_ROWS rows; the last block may be short) */
        if (F->down_part) {
            int64_t Rp = R < CB_FAST_PART_MAX_ROWS ? R : CB_FAST_PART_MAX_ROWS;
            int64_t nblk = (I + CB_DOWN_BLOCK - 1) / CB_DOWN_BLOCK;
            float *part = malloc((size_t)(Rp * H) * 4), *sum = malloc((size_t)(Rp * H) * 4);
            F->down_packed(y, h, pb, Rp, H, I, 0, H);
            for (int64_t blk = 0; blk < nblk; blk++) {
                F->down_part(part, h, pb, Rp, H, I, blk);
                for (int64_t k = 0; k < Rp * H; k++) sum[k] = blk == 0 ? part[k] : sum[k] + part[k];
            }
            n_check++;
            if (memcmp(sum, y, (size_t)(Rp * H) * 4) != 0)
                FAIL("[fast %s] bf16 down_part R%lld H%lld I%lld: the parts' sum differs from down_packed", F->name,
                     (long long)Rp, (long long)H, (long long)I);
            free(part);
            free(sum);
        }
        free(pk);
        free(pb);
        free(x);
        free(h);
        free(hs);
        free(y);
        free(h1);
        free(y1);
        free_w(&w1);
        free_w(&w3);
        free_w(&w2);
    }
}

/* A panel layout (cpu/panel.h): cb_panel_pack's placement checked against the definition, and
 * the kernels that read it give the row-major kernels' bits, for any token count, shape
 * (groups cut short) and range of rows or units. The row-major kernels: the fast table F's
 * (on activations rounded to bf16), or with F NULL the exact table E's. */
static uint32_t pair_at(const uint16_t *row, int64_t q) { return (uint32_t)row[2 * q] | (uint32_t)row[2 * q + 1] << 16; }

static void pan_gateup_ref(const cb_fast_kernels *F, const cb_kernels *E, float *h, const float *x, const void *w,
                           int64_t R, int64_t H, int64_t I, int64_t B, int64_t i0, int64_t i1) {
    if (F) F->gateup_packed(h, x, w, R, H, I, B, i0, i1);
    else E->expert_gateup(h, x, w, NULL, COLIBRI_DTYPE_BF16, R, H, I, B, i0, i1);
}
static void pan_down_ref(const cb_fast_kernels *F, const cb_kernels *E, float *y, const float *h, const void *w,
                         int64_t R, int64_t H, int64_t I, int64_t c0, int64_t c1) {
    if (F) F->down_packed(y, h, w, R, H, I, c0, c1);
    else E->expert_down(y, h, w, COLIBRI_DTYPE_BF16, R, H, I, c0, c1);
}

static void test_panels(const cb_panel_kernels *pl, const cb_fast_kernels *F, const cb_kernels *E) {
    const uint32_t BF = COLIBRI_DTYPE_BF16;
    const char *name = F ? F->name : E->name;
    /* token counts: the decode layout's, then prefill's steps of 6 with every tail, and (77, 133:
     * at K 2112 or H 1024) more than one tile of tokens */
    const int64_t Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 29, 37, 77, 133};
    /* matrices: N with short last groups (16, 48, 80, 208 rows), K across MM_KC passes (2112) */
    const int64_t Ns[] = {16, 48, 80, 208}, Ks[] = {32, 96, 2112};
    for (size_t b = 0; b < 4; b++)
        for (size_t c = 0; c < 3; c++) {
            int64_t N = Ns[b], K = Ks[c];
            wbuf w = make_w(BF, N * K, 0.5);
            uint32_t *P = malloc((size_t)(N * K) * 2);
            cb_panel_pack_matrix(pl, P, w.raw, N, K);
            for (int64_t n = 0; n < N; n++) { /* the placement, by the definition */
                int64_t G = pl->rows, g0 = n / G * G, nv = (N - g0 < G ? N - g0 : G) / 16;
                int64_t v = (n - g0) / 16, l = (n - g0) % 16;
                for (int64_t q = 0; q < K / 2; q++)
                    if (P[(size_t)g0 * (size_t)(K / 2) + (size_t)((q * nv + v) * 16 + l)] != pair_at((const uint16_t *)w.raw + n * K, q))
                        FAIL("cb_panel_pack_matrix N%lld K%lld: row %lld pair %lld misplaced", (long long)N, (long long)K,
                             (long long)n, (long long)q);
            }
            n_check++;
            for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++) {
                int64_t T = Ts[a], ldy = N + 3;
                if (K > 100 && T > 9 && T != 37 && T != 77 && T != 133) continue;
                float *x = malloc((size_t)(T * K) * 4), *y = malloc((size_t)(T * ldy) * 4), *yp = malloc((size_t)(T * ldy) * 4);
                fill(x, T * K, 2.0);
                if (F) {
                    cb_round_bf16(x, T * K);
                    F->matmul_ld(y, ldy, x, w.raw, BF, T, N, K);
                } else {
                    E->matmul_ld(y, ldy, x, w.raw, BF, T, N, K);
                }
                int64_t n0 = N > pl->rows ? pl->rows : 0; /* a thread's range: rows [n0, N) */
                for (int64_t i = 0; i < T * ldy; i++) yp[i] = SENTINEL;
                pl->matmul_panels(yp + n0, ldy, x, P, T, N, K, n0, N);
                for (int64_t t = 0; t < T; t++) {
                    n_check++;
                    if (memcmp(yp + t * ldy + n0, y + t * ldy + n0, (size_t)(N - n0) * 4) != 0)
                        FAIL("[%s] matmul_panels T%lld N%lld K%lld: token %lld differs from matmul_ld", name,
                             (long long)T, (long long)N, (long long)K, (long long)t);
                    for (int64_t n = 0; n < ldy; n++)
                        if ((n < n0 || n >= N) && yp[t * ldy + n] != SENTINEL)
                            FAIL("[%s] matmul_panels wrote outside rows [%lld, %lld)", name, (long long)n0,
                                 (long long)N);
                }
                free(x);
                free(y);
                free(yp);
            }
            free(P);
            free_w(&w);
        }
    /* packed experts: I with a short last group (96, 160, 224), block sizes 16 and 32 */
    struct { int64_t H, I, B; } cs[] = {{32, 96, 32}, {96, 160, 16}, {1024, 224, 32}, {64, 64, 32}, {160, 288, 32}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        int64_t H = cs[ci].H, I = cs[ci].I, B = cs[ci].B;
        wbuf w1 = make_w(BF, I * H, 0.3), w3 = make_w(BF, I * H, 0.3), w2 = make_w(BF, H * I, 0.3);
        float *pf = malloc((size_t)(3 * I * H) * 4);
        pack_expert(pf, w1.val, w3.val, w2.val, I, H, B);
        uint16_t *pb = malloc((size_t)(3 * I * H) * 2), *pp = malloc((size_t)(3 * I * H) * 2);
        for (int64_t i = 0; i < 3 * I * H; i++) pb[i] = cb_f32_to_bf16(pf[i]);
        cb_panel_pack_expert(pl, pp, pb, H, I, B);
        if (pl->down_layout == CB_PANEL_DOWN_FILE && memcmp(pp + 2 * I * H, pb + 2 * I * H, (size_t)(I * H) * 2) != 0)
            FAIL("cb_panel_pack_expert H%lld I%lld: w2^T not as in the expert", (long long)H, (long long)I);
        for (int64_t i = 0; i < I && pl->down_layout != CB_PANEL_DOWN_FILE; i++) /* w2^T's slabs, by the definition */
            for (int64_t c = 0; c < H; c++) {
                int64_t i0 = i / CB_DOWN_BLOCK * CB_DOWN_BLOCK, ic = I - i0 < CB_DOWN_BLOCK ? I - i0 : CB_DOWN_BLOCK;
                int64_t c0 = c / pl->down_cols * pl->down_cols, nc = H - c0 < pl->down_cols ? H - c0 : pl->down_cols;
                const uint16_t *d = pp + 2 * I * H + i0 * H + ic * c0, *a = pb + (2 * I + i) * H + c;
                uint16_t got = pl->down_layout == CB_PANEL_DOWN_ROWS ? d[(i - i0) * nc + (c - c0)]
                                                                     : d[2 * ((i - i0) / 2 * nc + (c - c0)) + (i - i0) % 2];
                if (got != a[0])
                    FAIL("cb_panel_pack_expert H%lld I%lld: w2^T (%lld, %lld) misplaced", (long long)H, (long long)I,
                         (long long)i, (long long)c);
            }
        n_check++;
        for (int64_t i = 0; i < I; i++) { /* unit i's gate and up rows, by the definition */
            int64_t U = pl->units, u0 = i / U * U, nu = I - u0 < U ? I - u0 : U;
            for (int s = 0; s < 2; s++) { /* row r of the run's 2 nu, in groups of gu_rows */
                int64_t r = s * nu + (i - u0), g0 = r / pl->gu_rows * pl->gu_rows;
                int64_t nv = (2 * nu - g0 < pl->gu_rows ? 2 * nu - g0 : pl->gu_rows) / 16, v = (r - g0) / 16, l = r % 16;
                const uint32_t *g = (const uint32_t *)pp + (size_t)u0 * (size_t)H + (size_t)g0 * (size_t)(H / 2);
                const uint16_t *src = (const uint16_t *)(s ? w3.raw : w1.raw) + i * H;
                for (int64_t q = 0; q < H / 2; q++)
                    if (g[(q * nv + v) * 16 + l] != pair_at(src, q))
                        FAIL("cb_panel_pack_expert H%lld I%lld B%lld: unit %lld's %s pair %lld misplaced", (long long)H,
                             (long long)I, (long long)B, (long long)i, s ? "up" : "gate", (long long)q);
            }
        }
        n_check++;
        for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++) {
            int64_t R = Ts[a];
            if (H > 100 && R > 9 && R != 37 && R != 133) continue;
            float *x = malloc((size_t)(R * H) * 4), *h = malloc((size_t)(R * I) * 4), *hp = malloc((size_t)(R * I) * 4);
            fill(x, R * H, 1.0);
            if (F) cb_round_bf16(x, R * H);
            int64_t i0 = I > 32 ? 16 : 0, i1 = I > 64 ? I - 32 : I; /* a thread's range of units */
            for (int64_t k = 0; k < R * I; k++) h[k] = hp[k] = SENTINEL;
            pan_gateup_ref(F, E, h, x, pb, R, H, I, B, i0, i1);
            pl->gateup_panels(hp, x, pp, R, H, I, i0, i1);
            n_check++;
            if (memcmp(h, hp, (size_t)(R * I) * 4) != 0)
                FAIL("[%s] gateup_panels R%lld H%lld I%lld B%lld [%lld, %lld): differs from gateup_packed", name,
                     (long long)R, (long long)H, (long long)I, (long long)B, (long long)i0, (long long)i1);
            /* the down projection: whole and from the first slab on; by blocks for few tokens */
            for (int64_t k = 0; k < R * I; k++) h[k] = (float)(urand() * 0.5);
            if (F) cb_round_bf16(h, R * I);
            float *y = malloc((size_t)(R * H) * 4), *yp = malloc((size_t)(R * H) * 4);
            for (int64_t c0 = 0; c0 < H; c0 += pl->down_cols) {
                for (int64_t k = 0; k < R * H; k++) y[k] = yp[k] = SENTINEL;
                pan_down_ref(F, E, y, h, pb, R, H, I, c0, H);
                pl->down_panels(yp, h, pp, R, H, I, c0, H);
                n_check++;
                if (memcmp(y, yp, (size_t)(R * H) * 4) != 0)
                    FAIL("[%s] down_panels R%lld H%lld I%lld from column %lld: differs from down_packed", name,
                         (long long)R, (long long)H, (long long)I, (long long)c0);
            }
            if (R <= CB_FAST_PART_MAX_ROWS && (!F || F->down_part))
                for (int64_t blk = 0; blk * CB_DOWN_BLOCK < I; blk++) {
                    if (F) F->down_part(y, h, pb, R, H, I, blk);
                    else E->expert_down_part(y, h, pb, BF, R, H, I, blk);
                    pl->down_part_panels(yp, h, pp, R, H, I, blk);
                    n_check++;
                    if (memcmp(y, yp, (size_t)(R * H) * 4) != 0)
                        FAIL("[%s] down_part_panels R%lld H%lld I%lld block %lld: differs from down_part", name,
                             (long long)R, (long long)H, (long long)I, (long long)blk);
                }
            free(y);
            free(yp);
            free(x);
            free(h);
            free(hp);
        }
        free(pf);
        free(pb);
        free(pp);
        free_w(&w1);
        free_w(&w3);
        free_w(&w2);
    }
}

/* e2m1 value of a code, independently of core/dtype.h */
static double e2m1_value(unsigned c) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

/* MXFP4 at its extremes: every code with every scale byte (0 .. 255) through dequant_row,
 * the reference against ldexp (e2m1 * 2^(e - 127) in double, rounded to float: exact, or inf
 * where it overflows; e = 255 read as 2^127 times the doubled value, as ggml does), the table
 * against the reference bit for bit; then matmul and gate/up on blocks whose scales are
 * subnormal (2^-128 ..), 1 and 2^33, mixed within rows, against the double loop and each
 * token alone. */
static void test_mxfp4_extremes(const cb_kernels *K) {
    const uint32_t dt = COLIBRI_DTYPE_MXFP4;
    const int64_t nb = 256 * 8, n = nb * 32; /* block b: e = b % 256, codes cycle through all 16 */
    uint8_t *raw = malloc((size_t)nb * 17);
    float *d = malloc((size_t)n * 4), *ref = malloc((size_t)n * 4);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = raw + b * 17;
        blk[0] = (uint8_t)(b % 256);
        for (int j = 0; j < 16; j++) blk[1 + j] = (uint8_t)(((j + b / 256) & 15) | ((((j * 7 + 3 + b / 256)) & 15) << 4));
    }
    cb_dtype_dequant(dt)(ref, raw, n);
    for (int64_t b = 0; b < nb && K == cb_kernels_ref(); b++) {
        int e = b % 256;
        for (int j = 0; j < 32; j++) {
            const uint8_t *blk = raw + b * 17;
            unsigned c = j < 16 ? blk[1 + j] & 15u : blk[1 + j - 16] >> 4;
            double v = e == 255 ? e2m1_value(c) * 2.0 * ldexp(1.0, 127) : ldexp(e2m1_value(c), e - 127);
            float want = (float)v; /* exact, or +-inf past FLT_MAX */
            n_check++;
            if (!(ref[b * 32 + j] == want))
                FAIL("mxfp4 reference: e %d code %u = %.9g, want %.9g", e, c, (double)ref[b * 32 + j], (double)want);
        }
    }
    K->dequant_row(d, raw, dt, n);
    n_check++;
    if (memcmp(d, ref, (size_t)n * 4) != 0) FAIL("[%s] dequant_row mxfp4 (all scales) differs from the reference", K->name);
    free(raw);
    free(d);
    free(ref);
    mx_extreme = 1;
    const int64_t Ts[] = {1, 3, 4, 13}, Ns[] = {5, 67}, Kq[] = {96, 800};
    for (size_t c = 0; c < 2; c++)
        for (size_t b = 0; b < 2; b++)
            for (size_t a = 0; a < 4; a++) {
                int64_t T = Ts[a], N = Ns[b], Kd = Kq[c];
                wbuf w = make_q(dt, N, Kd);
                check_matmul_batch(K, dt, &w, T, N, Kd, " extremes");
                free_w(&w);
            }
    mx_extreme = 0;
}

/* add_scaled bit for bit against its definition (the product rounded, then the sum: the
 * reference, compiled without contraction) at odd sizes, nothing written past n. */
static void test_add_scaled(const cb_kernels *K) {
    const cb_kernels *R = cb_kernels_ref();
    const int64_t ns[] = {1, 5, 15, 16, 17, 33, 255, 2048};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
        int64_t n = ns[a];
        float *y = malloc((size_t)n * 4), *d = malloc((size_t)(n + 4) * 4), *want = malloc((size_t)(n + 4) * 4);
        fill(y, n, 3.0);
        fill(d, n + 4, 1.0);
        memcpy(want, d, (size_t)(n + 4) * 4);
        const float w = 0.3183099f;
        R->add_scaled(want, y, w, n);
        K->add_scaled(d, y, w, n);
        for (int64_t i = 0; i < n + 4; i++) {
            n_check++;
            if (memcmp(&d[i], &want[i], 4) != 0)
                FAIL("[%s] add_scaled n%lld [%lld]: %.9g vs %.9g", K->name, (long long)n, (long long)i, (double)d[i],
                     (double)want[i]);
        }
        free(y);
        free(d);
        free(want);
    }
}

static void test_table(const cb_kernels *K) {
    test_add_scaled(K);
    test_matmul(K);
    test_matmul_i8(K);
    test_rmsnorm(K);
    test_rows_combine(K);
    test_rope(K);
    test_softmax(K);
    test_attention(K);
    test_expert_ffn(K);
    test_batch_invariance(K);
    test_down_parts(K);
    test_quant(K);
    test_mxfp4_extremes(K);
    if (K != cb_kernels_ref()) test_vs_ref(K);
    if (K->panels) test_panels(K->panels, NULL, K);
}

/* --probe: which tables this CPU can run (the registry's run-time check), nothing checked;
 * for a run on an emulated CPU that lacks some extensions (tests/test_aarch64.py). */
static int probe(void) {
    size_t n_tables;
    const cb_table_entry *tables = cb_registry(&n_tables);
    for (size_t i = 0; i < n_tables; i++) {
        if (tables[i].exact)
            printf("test_kernels: table %s %s\n", tables[i].name,
                   cb_kernels_by_name(tables[i].name) ? "usable" : "skipped (not built, or this CPU lacks it)");
        if (tables[i].fast)
            printf("test_kernels: fast table %s %s\n", tables[i].name,
                   cb_fast_by_name(tables[i].name) ? "usable" : "skipped (not built, or this CPU lacks it)");
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--probe")) return probe();
    setvbuf(stdout, NULL, _IOLBF, 0); /* a line as each table ends (the emulated runs are long) */
    install_test_codebooks();
    test_conversions();
    test_table(cb_kernels_ref());
    printf("test_kernels: table reference checked (%s)\n", n_fail ? "FAILED" : "ok");
    size_t n_tables;
    const cb_table_entry *tables = cb_registry(&n_tables);
    for (size_t i = 0; i < n_tables; i++) { /* every exact table of the registry (the reference: above) */
        if (!tables[i].exact || tables[i].exact() == cb_kernels_ref()) continue;
        const cb_kernels *K = cb_kernels_by_name(tables[i].name);
        if (K) {
            int before = n_fail;
            test_table(K);
            printf("test_kernels: table %s checked (%s)\n", tables[i].name, n_fail == before ? "ok" : "FAILED");
        } else {
            printf("test_kernels: table %s skipped (not built, or this CPU lacks it)\n", tables[i].name);
        }
    }
    test_round_bf16();
    for (size_t i = 0; i < n_tables; i++) { /* every fast table of the registry */
        if (!tables[i].fast) continue;
        const char *name = tables[i].name;
        const cb_fast_kernels *F = cb_fast_by_name(name);
        if (F) {
            int before = n_fail;
            test_fast(F);
            if (F->native_bf16) test_fast_bf16(F);
            if (F->panels) test_panels(F->panels, F, NULL);
            if (F->qpanels) test_qpanels(F);
            test_fast_q8(F);
            if (F->attention_heads) test_fast_attention(F);
            printf("test_kernels: fast table %s checked (%s)\n", name, n_fail == before ? "ok" : "FAILED");
        } else {
            printf("test_kernels: fast table %s skipped (not built, or this CPU lacks it)\n", name);
        }
    }
    n_check++;
    if (!cb_kernels_best() || !cb_kernels_best()->expert_down) FAIL("cb_kernels_best() has no complete table");
    n_check++;
    if (!cb_fast_best() || !cb_fast_best()->matmul_ld) FAIL("cb_fast_best() has no complete table");
    if (n_fail) {
        printf("test_kernels: %d of %d checks FAILED\n", n_fail, n_check);
        return 1;
    }
    printf("test_kernels: OK (%d checks)\n", n_check);
    return 0;
}
