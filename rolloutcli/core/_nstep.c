/*
 * The n-step kernel of rolloutcli.core.nstep, called through ctypes; without it nstep.py runs torch with the
 * same bits. One pass over the rows: the window of step t takes rows t .. t+K-1 while they are in cache.
 *
 * For columns [0, width) of [T, stride] arrays, per step t and column n (m: rewards taken, K' = min(K, T - t)):
 *     total = 0; alive = 1; m = 0; stop = 0
 *     for k < K':  a = alive;  total = total + (r[t+k] * (float)a) * w[k];  m += a
 *                  e = dones[t+k] | time_outs[t+k];  stop |= (a & e) * (e | (time_outs[t+k] & boot) << 1)
 *                  alive = a & !e
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
 * has_time_outs = 0); w: [K] float32 weights; powers: [K + 1] float32; outputs [T, stride] (taken: int32). Pointers are already
 * offset to the block's first column. */
EXPORT void rolloutcli_nstep(const float *RESTRICT r, const uint8_t *RESTRICT dones,
                             const uint8_t *RESTRICT time_outs, int64_t has_time_outs, int64_t boot, int64_t steps,
                             int64_t width, int64_t stride, int64_t n, const float *RESTRICT w,
                             const float *RESTRICT powers, float *RESTRICT returns, float *RESTRICT discount,
                             int64_t *RESTRICT next_step, int32_t *RESTRICT taken) {
    /* every lane variable 32 bits wide, so the column loop vectorises without conversions between widths */
    const int32_t to_mask = has_time_outs ? 1 : 0, boot_mask = (has_time_outs && boot) ? 1 : 0;
    float total[LANES];
    int32_t alive[LANES], stop[LANES], m[LANES];
    for (int64_t c0 = 0; c0 < width; c0 += LANES) {
        const int64_t lanes = (width - c0 < LANES) ? width - c0 : LANES;
        for (int64_t t = 0; t < steps; t++) {
            const int64_t kmax = (n < steps - t) ? n : steps - t;
            for (int64_t j = 0; j < lanes; j++) {
                total[j] = 0.0f;
                alive[j] = 1;
                stop[j] = 0;
                m[j] = 0;
            }
            for (int64_t k = 0; k < kmax; k++) {
                const int64_t row = (t + k) * stride + c0;
                const float *RESTRICT rr = r + row;
                const uint8_t *RESTRICT dd = dones + row;
                const uint8_t *RESTRICT oo = time_outs + row;
                const float wk = w[k];
                for (int64_t j = 0; j < lanes; j++) {
                    const int32_t a = alive[j], o = (int32_t)oo[j] & to_mask, e = (int32_t)dd[j] | o;
                    total[j] = total[j] + (rr[j] * (float)a) * wk;
                    m[j] += a;
                    stop[j] |= (a & e) * (e | ((o & boot_mask) << 1));
                    alive[j] = a & (e ^ 1);
                }
            }
            const int64_t row = t * stride + c0;
            for (int64_t j = 0; j < lanes; j++) {
                returns[row + j] = total[j];
                discount[row + j] = stop[j] == 1 ? 0.0f : powers[m[j]];
                next_step[row + j] = stop[j] ? -1 : t + m[j];
                taken[row + j] = m[j];
            }
        }
    }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nstep_native", "rolloutcli's n-step kernel, for ctypes.",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nstep_native(void) { return PyModule_Create(&module); }
