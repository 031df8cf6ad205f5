/*
 * The n-step kernel of rolloutcli.core.nstep, called through ctypes; without it nstep.py runs torch with the
 * same bits. Per block of columns, one pass over the steps in reverse: the distance to the next episode end
 * (and its kind) is carried from step t + 1, which gives the window's length m at once; the window's rows
 * t .. t+K-1 were just visited and are still in cache.
 *
 * For columns [0, width) of [T, stride] arrays, per step t and column n (K' = min(K, T - t)):
 *     dist  = steps from t to the next end (dones | time_outs) at or after t, kind = that end's kind
 *             (1 termination, 3 time-out that bootstraps)
 *     m     = min(dist + 1, K');   stop = dist + 1 <= K' ? kind : 0
 *     total = r[t] + 0;  for 0 < k < K':  total = total + (k < m ? r[t+k] * powers[k] : +0)
 *     returns = total;  discount = stop == 1 ? 0 : powers[m];  next_step = stop ? -1 : t + m;  taken = m
 * the float32 operations of the torch path in its order (w[0] = 1; the torch path adds (r * 0) * w = +-0 where
 * this adds +0: the sum is never -0 after its first step, so both leave it as it is).
 * Every per-lane step is a select between computed values, never a branch or a lookup, so each column loop
 * vectorises; with GCC or Clang on x86-64 Linux the kernel is also built for AVX2 and the loader picks the widest
 * the CPU has (IEEE float32 add and multiply: the same bits at every width).
 * Compiled with -ffp-contract=off: a fused multiply-add would round once instead of twice and change bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))
#define RESTRICT __restrict__
#define LANES 1024 /* columns per pass over the steps: whole rows of narrow rollouts, read in order */
/* blocks at least STREAMED wide of a call of at least STREAMED_ELEMENTS are computed in local rows and streamed out;
 * narrower ones are written in place (the copy costs more than streaming saves), and smaller calls too (their
 * outputs fit in the caches, where the reader finds them): benchmarks/README.md */
#define STREAMED 128
#define STREAMED_ELEMENTS (1 << 18)

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WIDEST __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef WIDEST
#define WIDEST
#endif

EXPORT int rolloutcli_nstep_abi_version(void) { return 2; }

/* x where keep is 1, +0 where it is 0: a bit mask, so the loop stays a vector loop (no FP select) */
static inline float kept(float x, int32_t keep) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits &= (uint32_t)-keep;
    memcpy(&x, &bits, sizeof bits);
    return x;
}

/* copies a finished output row past the caches (streaming stores: no read of the line before it is written, the
 * bandwidth bound's traffic); the unaligned head and tail are plain copies. bytes >= 16 (rows of STREAMED lanes) */
static inline void stream_out(void *dst, const void *src, size_t bytes) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__SSE2__)
    const size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    for (; bytes >= 16; bytes -= 16, d += 16, s += 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
#endif
    memcpy(d, s, bytes);
}

static inline uint32_t bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* r: [T, stride] float32; dones, time_outs: [T, stride] uint8, nonzero = set (time_outs may be dones with boot = 0 and
 * has_time_outs = 0); powers: [K + 1] float32, powers[k] = float32(gamma^k); outputs [T, stride] (taken: int32).
 * Pointers are already offset to the block's first column. */
EXPORT WIDEST void rolloutcli_nstep(const float *RESTRICT r, const uint8_t *RESTRICT dones,
                                    const uint8_t *RESTRICT time_outs, int64_t has_time_outs, int64_t boot,
                                    int64_t steps, int64_t width, int64_t stride, int64_t n,
                                    const float *RESTRICT powers, float *RESTRICT returns,
                                    float *RESTRICT discount, int64_t *RESTRICT next_step, int32_t *RESTRICT taken) {
    /* every lane variable 32 bits wide, so the column loops vectorise without conversions between widths */
    const int32_t to_mask = has_time_outs ? 1 : 0, boot_mask = (has_time_outs && boot) ? 1 : 0;
    const int32_t far = (int32_t)(n + 1); /* "no end within reach" */
    int32_t dist[LANES], kind[LANES], m_row[LANES], stop[LANES];
    uint32_t power[LANES]; /* the bits of float32 powers[m] */
    float total_row[LANES]; /* a block's outputs, streamed out when its rows are wide (see STREAMED) */
    uint32_t disc_row[LANES];
    int64_t next_row[LANES];
    for (int64_t c0 = 0; c0 < width; c0 += LANES) {
        const int64_t lanes = (width - c0 < LANES) ? width - c0 : LANES;
        const int streamed = lanes >= STREAMED && steps * width >= STREAMED_ELEMENTS;
        for (int64_t j = 0; j < lanes; j++) {
            dist[j] = far;
            kind[j] = 0;
        }
        for (int64_t t = steps - 1; t >= 0; t--) {
            const int64_t row = t * stride + c0;
            const int32_t kmax = (int32_t)((n < steps - t) ? n : steps - t);
            const uint8_t *RESTRICT dd = dones + row;
            const uint8_t *RESTRICT oo = time_outs + row;
            const float *RESTRICT r0 = r + row;
            float *RESTRICT total = streamed ? total_row : returns + row;
            uint32_t *RESTRICT disc = streamed ? disc_row : (uint32_t *)(discount + row); /* float32 bits */
            int64_t *RESTRICT next = streamed ? next_row : next_step + row;
            int32_t *RESTRICT m = streamed ? m_row : taken + row;
            const uint32_t p1 = bits_of(powers[1]);
            for (int64_t j = 0; j < lanes; j++) {
                const int32_t o = (int32_t)(oo[j] != 0) & to_mask, e = (int32_t)(dd[j] != 0) | o;
                const int32_t later = dist[j] + 1 < far ? dist[j] + 1 : far;
                dist[j] = e ? 0 : later;
                kind[j] = e ? (e | ((o & boot_mask) << 1)) : kind[j];
                const int32_t reach = dist[j] + 1; /* rewards up to and including the next end */
                m[j] = reach < kmax ? reach : kmax;
                stop[j] = reach <= kmax ? kind[j] : 0;
                total[j] = r0[j] + 0.0f;
                power[j] = p1;
            }
            for (int32_t k = 1; k < kmax; k++) {
                const float *RESTRICT rr = r0 + k * stride;
                const float wk = powers[k];
                const uint32_t next_power = bits_of(powers[k + 1]);
                for (int64_t j = 0; j < lanes; j++) {
                    const int32_t taking = k < m[j];
                    total[j] = total[j] + kept(rr[j] * wk, taking);
                    power[j] = taking ? next_power : power[j];
                }
            }
            const int32_t t32 = (int32_t)t;
            for (int64_t j = 0; j < lanes; j++) {
                disc[j] = stop[j] == 1 ? 0u : power[j]; /* float32 bits; +0 is all zeros */
                next[j] = (int64_t)(stop[j] ? -1 : t32 + m[j]);
            }
            if (streamed) {
                stream_out(returns + row, total, (size_t)lanes * 4);
                stream_out(discount + row, disc, (size_t)lanes * 4);
                stream_out(next_step + row, next, (size_t)lanes * 8);
                stream_out(taken + row, m, (size_t)lanes * 4);
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed rows are visible to the thread that joins this one */
#endif
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nstep_native", "rolloutcli's n-step kernel, for ctypes.",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nstep_native(void) { return PyModule_Create(&module); }
