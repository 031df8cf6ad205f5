/*
 * rolloutcli's compiled kernels, called through ctypes (rolloutcli/core/native.py). Optional: where this file
 * was not compiled, the callers fall back to numba (GAE) and torch (row gathers), with the same results.
 *
 * 1. rolloutcli_gae: GAE over [T, N] float32 arrays for `rolloutcli gae` on the CPU.
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
#include <string.h>

#if defined(_MSC_VER)
#define EXPORT __declspec(dllexport)
#define RESTRICT __restrict
#else
#define EXPORT __attribute__((visibility("default")))
#define RESTRICT __restrict__
#endif

EXPORT int rolloutcli_native_abi_version(void) { return 2; }

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

/*
 * 2. Row gathers of the feed-forward export: out[i] = src[rows[i]] for rows of `row_bytes` bytes.
 *
 * A shard's rows are scattered over the whole source, so each row read is a cache (and TLB) miss; the loop is
 * bound by memory latency, not bandwidth. rolloutcli_gather_rows prefetches the rows PREFETCH_AHEAD
 * iterations ahead, so that many misses are in flight at once (measured, 128k rows of 192 bytes out of 1M:
 * 31.6 ms with index_select, 16 ms with this). rolloutcli_gather_sorted serves narrow rows (a scalar per
 * row): it reads them in ascending source order, so that neighbouring rows share cache lines and the
 * hardware prefetcher runs ahead, and writes each to its slot in the shard, a random write into an output
 * that stays in cache (20 ms -> 3 ms per scalar field of such a shard).
 *
 * Indices are trusted here: the Python wrapper checks them against the source's row count.
 */
#define PREFETCH_AHEAD 32

static inline void prefetch_row(const char *row, int64_t row_bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset, 0, 0);
#else
    (void)row;
    (void)row_bytes;
#endif
}

EXPORT void rolloutcli_gather_rows(const char *RESTRICT src, const int64_t *RESTRICT rows, int64_t count,
                                   int64_t row_bytes, char *RESTRICT out) {
    for (int64_t i = 0; i < count; i++) {
        if (i + PREFETCH_AHEAD < count) prefetch_row(src + rows[i + PREFETCH_AHEAD] * row_bytes, row_bytes);
        memcpy(out + i * row_bytes, src + rows[i] * row_bytes, (size_t)row_bytes);
    }
}

/* Narrow rows copied as one machine word: a memcpy of a run-time size would cost a call per row. */
#define GATHER_SORTED(TYPE)                                                                    \
    do {                                                                                       \
        const TYPE *RESTRICT s = (const TYPE *)src;                                            \
        TYPE *RESTRICT o = (TYPE *)out;                                                        \
        for (int64_t j = 0; j < count; j++) o[slots[j]] = s[sorted_rows[j]];                   \
    } while (0)

EXPORT void rolloutcli_gather_sorted(const char *RESTRICT src, const int64_t *RESTRICT sorted_rows,
                                     const int64_t *RESTRICT slots, int64_t count, int64_t row_bytes,
                                     char *RESTRICT out) {
    switch (row_bytes) {
        case 1: GATHER_SORTED(uint8_t); break;
        case 2: GATHER_SORTED(uint16_t); break;
        case 4: GATHER_SORTED(uint32_t); break;
        case 8: GATHER_SORTED(uint64_t); break;
        default:
            for (int64_t j = 0; j < count; j++)
                memcpy(out + slots[j] * row_bytes, src + sorted_rows[j] * row_bytes, (size_t)row_bytes);
    }
}

/* An importable (empty) module, so that setuptools builds this file like any extension and Python finds
 * its path; the kernels themselves are called through ctypes. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "rolloutcli's kernels, for ctypes.",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
