/*
 * GAE over [T, N] float32 arrays for `rolloutcli gae` on the CPU, called through ctypes.
 *
 * Why C: the command's work on a 1 GB file takes about half a second, and loading numba (import and the
 * cached kernel's machine code) costs about 0.28 s of that before the first byte is computed. This kernel
 * loads in microseconds. rolloutcli.core.gae_kernels (numba) remains the kernel of the Python API
 * (compute_gae) and the fallback where this file was not compiled.
 *
 * The recurrence (RSL-RL PPO.compute_returns), reversed over t, with the time-out bootstrap first:
 *     r_t'    = r_t + gamma * (v_t * time_out_t)                    (only when time_outs is given)
 *     g_t     = (1 - done_t) * gamma
 *     A_t     = ((r_t' + g_t * next_value_t) - v_t) + (g_t * lam) * A_{t+1},   A_T = 0
 *     ret_t   = A_t + v_t
 * in float32, the same operations in the same order as RSL-RL and the numba kernel. It must be compiled
 * without contracting a * b + c into fused multiply-adds (-ffp-contract=off), which would change the bits.
 *
 * The carry A_{t+1} lives in its own [N] buffer rather than being read back from adv's next row: with
 * only distinct arrays in the env loop the compiler vectorises it without runtime alias checks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(_MSC_VER)
#define EXPORT __declspec(dllexport)
#define RESTRICT __restrict
#else
#define EXPORT __attribute__((visibility("default")))
#define RESTRICT __restrict__
#endif

EXPORT int rolloutcli_gae_abi_version(void) { return 1; }

/* r, v: [T, N] float32; d, to: [T, N] uint8, nonzero = set (to may be NULL); lv: [N] float32.
 * adv, ret: [T, N] float32 outputs; carry: [N] float32 scratch. All C-contiguous, none overlapping. */
EXPORT void rolloutcli_gae(const float *RESTRICT r, const float *RESTRICT v, const uint8_t *RESTRICT d,
                           const uint8_t *RESTRICT to, const float *RESTRICT lv, int64_t steps, int64_t envs,
                           float gamma, float lam, float *RESTRICT adv, float *RESTRICT ret,
                           float *RESTRICT carry) {
    for (int64_t n = 0; n < envs; n++) carry[n] = 0.0f;
    for (int64_t t = steps - 1; t >= 0; t--) {
        const int64_t row = t * envs;
        const float *RESTRICT next = (t == steps - 1) ? lv : v + row + envs;
        const float *RESTRICT rt = r + row;
        const float *RESTRICT vt = v + row;
        const uint8_t *RESTRICT dt = d + row;
        float *RESTRICT at = adv + row;
        float *RESTRICT qt = ret + row;
        if (to != NULL) {
            const uint8_t *RESTRICT tt = to + row;
            for (int64_t n = 0; n < envs; n++) {
                const float value = vt[n];
                const float reward = rt[n] + gamma * (value * (float)(tt[n] != 0));
                const float g = (float)(dt[n] == 0) * gamma;
                const float x = ((reward + g * next[n]) - value) + (g * lam) * carry[n];
                carry[n] = x;
                at[n] = x;
                qt[n] = x + value;
            }
        } else {
            for (int64_t n = 0; n < envs; n++) {
                const float value = vt[n];
                const float g = (float)(dt[n] == 0) * gamma;
                const float x = ((rt[n] + g * next[n]) - value) + (g * lam) * carry[n];
                carry[n] = x;
                at[n] = x;
                qt[n] = x + value;
            }
        }
    }
}

/* An importable (empty) module, so that setuptools builds this file like any extension and Python finds
 * its path; the kernel itself is called through ctypes. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gae_c", "GAE kernel for ctypes (rolloutcli_gae).",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gae_c(void) { return PyModule_Create(&module); }
