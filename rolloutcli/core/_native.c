/*
 * rolloutcli's optional compiled kernels, called through ctypes (rolloutcli/core/native.py); without them the
 * callers run numpy / torch with the same bits.
 *
 * 1. rolloutcli_gae: RSL-RL's GAE (PPO.compute_returns) over the columns [0, width) of [T, stride] float32
 *    arrays, serial in time, vectorised over the columns. Callers run disjoint column blocks on threads; each
 *    column's result depends only on that column, so the bits never depend on the blocks or the threads.
 *    Rewards come already bootstrapped on time-outs (rolloutcli.core.gae_numpy.bootstrap_rewards).
 *        g_t   = (1 - done_t) * gamma
 *        A_t   = ((r_t + g_t * next_value_t) - v_t) + (g_t * lam) * A_{t+1},   A_T = 0
 *        ret_t = A_t + v_t,   adv_t = ret_t - v_t          (RSL-RL stores returns - values)
 *    Compiled with -ffp-contract=off: a fused multiply-add would round once instead of twice and change bits.
 *    The carry A_{t+1} lives in its own buffer: with only distinct arrays in the column loop the compiler
 *    vectorises it without runtime alias checks.
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

EXPORT int rolloutcli_native_abi_version(void) { return 3; }

/* r, v: [T, stride] float32; d: [T, stride] uint8, nonzero = done; lv: [width] float32 (values after the last
 * step); adv, ret: [T, stride] float32 outputs; carry: [width] float32 scratch. Pointers are already offset to
 * the block's first column; only columns [0, width) of each row are read or written. None overlap. */
EXPORT void rolloutcli_gae(const float *RESTRICT r, const float *RESTRICT v, const uint8_t *RESTRICT d,
                           const float *RESTRICT lv, int64_t steps, int64_t width, int64_t stride, float gamma,
                           float lam, float *RESTRICT adv, float *RESTRICT ret, float *RESTRICT carry) {
    for (int64_t n = 0; n < width; n++) carry[n] = 0.0f;
    for (int64_t t = steps - 1; t >= 0; t--) {
        const int64_t row = t * stride;
        const float *RESTRICT next = (t == steps - 1) ? lv : v + row + stride;
        const float *RESTRICT rt = r + row;
        const float *RESTRICT vt = v + row;
        const uint8_t *RESTRICT dt = d + row;
        float *RESTRICT at = adv + row;
        float *RESTRICT qt = ret + row;
        for (int64_t n = 0; n < width; n++) {
            const float value = vt[n];
            const float g = (float)(dt[n] == 0) * gamma;
            const float x = ((rt[n] + g * next[n]) - value) + (g * lam) * carry[n];
            const float q = x + value;
            carry[n] = x;
            qt[n] = q;
            at[n] = q - value;
        }
    }
}

/*
 * 2. Row gathers of the feed-forward export: out[i] = src[rows[i]] for rows of `row_bytes` bytes.
 *
 * A shard's rows are scattered over the source, so each read is a cache miss, bound by memory latency:
 * rolloutcli_gather_rows prefetches PREFETCH_AHEAD rows ahead so that many misses are in flight at once;
 * rolloutcli_gather_sorted reads narrow rows in ascending source order (shared cache lines, hardware prefetch)
 * and writes each to its slot, in an output that stays in cache. Both move bytes only (index_select's bytes).
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
