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
 *     total = 0;  for k < K':  total = total + (r[t+k] * (float)(k < m)) * w[k]
 *     returns = total;  discount = stop == 1 ? 0 : powers[m];  next_step = stop ? -1 : t + m;  taken = m
 * the float32 operations of the torch path in its order (r * 0 adds a zero the sum absorbs, as there).
 * Compiled with -ffp-contract=off: a fused multiply-add would round once instead of twice and change bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
#define RESTRICT __restrict__
#define LANES 256

EXPORT int rolloutcli_nstep_abi_version(void) { return 1; }

/* r: [T, stride] float32; dones, time_outs: [T, stride] uint8 0/1 (time_outs may be dones with boot = 0 and
 * has_time_outs = 0); w: [K] float32 weights; powers: [K + 1] float32; outputs [T, stride] (taken: int32).
 * Pointers are already offset to the block's first column. */
EXPORT void rolloutcli_nstep(const float *RESTRICT r, const uint8_t *RESTRICT dones,
                             const uint8_t *RESTRICT time_outs, int64_t has_time_outs, int64_t boot, int64_t steps,
                             int64_t width, int64_t stride, int64_t n, const float *RESTRICT w,
                             const float *RESTRICT powers, float *RESTRICT returns, float *RESTRICT discount,
                             int64_t *RESTRICT next_step, int32_t *RESTRICT taken) {
    /* every lane variable 32 bits wide, so the column loops vectorise without conversions between widths */
    const int32_t to_mask = has_time_outs ? 1 : 0, boot_mask = (has_time_outs && boot) ? 1 : 0;
    const int32_t far = (int32_t)(n + 1);  /* "no end within reach" */
    int32_t dist[LANES], kind[LANES], m[LANES];
    for (int64_t c0 = 0; c0 < width; c0 += LANES) {
        const int64_t lanes = (width - c0 < LANES) ? width - c0 : LANES;
        for (int64_t j = 0; j < lanes; j++) {
            dist[j] = far;
            kind[j] = 0;
        }
        for (int64_t t = steps - 1; t >= 0; t--) {
            const int64_t row = t * stride + c0;
            const int64_t kmax = (n < steps - t) ? n : steps - t;
            const int32_t kmax32 = (int32_t)kmax;
            const uint8_t *RESTRICT dd = dones + row;
            const uint8_t *RESTRICT oo = time_outs + row;
            for (int64_t j = 0; j < lanes; j++) {
                const int32_t o = (int32_t)oo[j] & to_mask, e = (int32_t)dd[j] | o;
                const int32_t later = dist[j] + 1 < far ? dist[j] + 1 : far;
                dist[j] = e ? 0 : later;
                kind[j] = e ? (e | ((o & boot_mask) << 1)) : kind[j];
                const int32_t reach = dist[j] + 1;  /* rewards up to and including the next end */
                m[j] = reach < kmax32 ? reach : kmax32;
            }
            float *RESTRICT total = returns + row;
            for (int64_t j = 0; j < lanes; j++) total[j] = 0.0f;
            for (int64_t k = 0; k < kmax; k++) {
                const float *RESTRICT rr = r + row + k * stride;
                const float wk = w[k];
                const int32_t k32 = (int32_t)k;
                /* (k < m) as the sign bit of k - m: a comparison would become a branch and keep the loop scalar */
                for (int64_t j = 0; j < lanes; j++) {
                    const float taking = (float)(int32_t)((uint32_t)(k32 - m[j]) >> 31);
                    total[j] = total[j] + (rr[j] * taking) * wk;
                }
            }
            for (int64_t j = 0; j < lanes; j++) {
                const int32_t stop = (dist[j] + 1 <= kmax32) ? kind[j] : 0;
                discount[row + j] = stop == 1 ? 0.0f : powers[m[j]];
                next_step[row + j] = stop ? -1 : t + m[j];
                taken[row + j] = m[j];
            }
        }
    }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nstep_native", "rolloutcli's n-step kernel, for ctypes.",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nstep_native(void) { return PyModule_Create(&module); }
