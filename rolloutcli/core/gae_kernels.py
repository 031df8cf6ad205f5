"""GAE's CPU kernels on numpy arrays: numba-compiled loops, and RSL-RL's bootstrap and normalisation in numpy.

This module imports neither torch nor h5py. :mod:`rolloutcli.core.gae` (the torch API) calls these kernels on
zero-copy views of CPU tensors; ``rolloutcli gae`` on the CPU uses the compiled C kernel of
:mod:`rolloutcli.core.native` (no numba start-up) and these kernels only where that was not built.
Shapes: ``[T, N]`` float32 / uint8 arrays, time first, C-contiguous.

The recurrence (RSL-RL ``PPO.compute_returns``), reversed over ``t``, with ``c_t = gamma * lam * (1 - done_t)``::

    delta_t = r_t + (1 - done_t) * gamma * next_value_t - values_t
    A_t     = delta_t + c_t * A_{t+1}            (A_T = 0)
    returns_t = A_t + values_t
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from rolloutcli.core.gae_numpy import bootstrap_time_outs_array, cpu_threads, normalize_array

__all__ = ["bootstrap_time_outs_array", "cpu_threads", "gae_into", "normalize_array"]

# Below this many elements waking a second thread costs more than it saves (24 x 4096: 50 us on one thread, 70 on two).
_PARALLEL_MIN_ELEMENTS = 1 << 18
# Env blocks are multiples of this many envs: one AVX-512 register of float32.
_LANE = 16
# A time chunk shorter than this makes the carry fix-up pass cost more than the parallelism gains.
_MIN_CHUNK = 256
# N = 1: steps whose recurrence terms are computed together into L1 buffers before the serial pass.
_TILE = 512
# Widest env block per task: keeps the carry and product rows of a block in L1/L2. Narrower blocks only to feed
# threads: each row of a block pays ~30 ns of loop setup (measured: 1000 x 1024 on one thread takes 1.9x as long
# in blocks of 128 as in one block of 1024).
_MAX_BLOCK = 2048


# ----------------------------------------------------------------------------------------------------------------
# Numba backend
# ----------------------------------------------------------------------------------------------------------------
# Every kernel is serial and releases the GIL; parallelism comes from calling them on disjoint tasks from a small
# pool of Python threads. numba's own parallel layer is avoided on purpose: its OpenMP layer loads the system
# libgomp next to torch's own copy, and the two spinning OpenMP pools stall each other (measured here: ~8 ms per
# call instead of 0.1-2 ms once torch had run ops in the same process); its workqueue layer is not safe to call
# from several threads at once.
#
# Arrays are passed flat (``[T * N]``) and indexed with unsigned offsets, so numba emits neither slices (each costs
# reference-count updates) nor negative-index wraparound code. The offset of each time step's row is read from a
# small array (``offs``) instead of computed: when the env loop's addresses are affine in t, LLVM hoists the
# runtime alias check of the vectorised env loop out of the time loop, where it always fails, and the loop runs
# scalar (4x slower). A lone env (N = 1) has no env loop to vectorise; its kernel, _chains, vectorises over a tile
# of steps instead and runs four independent chains in the serial part.


@njit(cache=True, nogil=True)
def _rows_tasks(r, v, d, to, lv, offs, envs, gamma, lam, has_to, adv, ret, prods, chunk, block, lo, hi):  # noqa: ANN001, ANN202
    """Tasks ``lo .. hi-1`` of the (time chunk, env block) grid: local GAE assuming ``A = 0`` after each chunk.

    Flat ``[T * N]`` arrays; ``offs[t] = t * N``. ``prods[k, n]`` receives the product of ``c`` over chunk ``k``
    (needed to carry across chunks).
    """
    steps = offs.shape[0]
    nb = (envs + block - 1) // block
    un = np.uint64(envs)
    for task in range(lo, hi):
        k = task // nb
        n0 = (task - k * nb) * block
        m = min(envs, n0 + block) - n0
        t0 = k * chunk
        t1 = min(steps, t0 + chunk)
        carry = np.zeros(m, np.float32)  # A_{t+1} of each env of the block
        prod = np.ones(m, np.float32)
        for t in range(t1 - 1, t0 - 1, -1):
            # The row offset comes from memory on purpose: LLVM cannot express it in t, so it keeps the alias
            # check of the vectorised env loop per row instead of hoisting it out of the time loop.
            i0 = offs[t] + np.uint64(n0)
            if t == steps - 1:
                vnext, j0 = lv, np.uint64(n0)
            else:
                vnext, j0 = v, i0 + un
            if has_to:
                for j in range(m):
                    i = i0 + np.uint64(j)
                    vt = v[i]
                    # RSL-RL's time-out bootstrap, same operation order: r + gamma * (v * time_out).
                    rt = r[i] + gamma * (vt * np.float32(to[i] != 0))
                    g = np.float32(d[i] == 0) * gamma
                    c = g * lam
                    x = rt + g * vnext[j0 + np.uint64(j)] - vt + c * carry[j]
                    carry[j] = x
                    prod[j] = prod[j] * c
                    adv[i] = x
                    ret[i] = x + vt
            else:
                for j in range(m):
                    i = i0 + np.uint64(j)
                    vt = v[i]
                    g = np.float32(d[i] == 0) * gamma
                    c = g * lam
                    x = r[i] + g * vnext[j0 + np.uint64(j)] - vt + c * carry[j]
                    carry[j] = x
                    prod[j] = prod[j] * c
                    adv[i] = x
                    ret[i] = x + vt
        prods[k, n0 : n0 + m] = prod


@njit(cache=True, nogil=True)
def _fix_tasks(v, d, offs, envs, gamma, lam, adv, ret, carries, chunk, block, lo, hi):  # noqa: ANN001, ANN202
    """Carry fix-up for tasks ``lo .. hi-1`` of the (chunk ``k < K-1``, env block) grid, backwards from chunk ends.

    ``A_t += (c_t * ... * c_{chunk end}) * carry``. Stops once every term of a step is exactly 0 (a done, or the
    product underflowed): with ``|c| <= 1`` it stays 0 further back, so stopping changes nothing.
    """
    nb = (envs + block - 1) // block
    gl = gamma * lam
    for task in range(lo, hi):
        k = task // nb
        n0 = (task - k * nb) * block
        m = min(envs, n0 + block) - n0
        t0 = k * chunk
        if m == 1:
            # A lone env: a plain scalar loop.
            q = np.float32(1.0)
            carry1 = carries[k, n0]
            for t in range(t0 + chunk - 1, t0 - 1, -1):
                i = t * envs + n0
                q = q * (np.float32(d[i] == 0) * gl)
                term = q * carry1
                if term == 0:
                    break
                x = adv[i] + term
                adv[i] = x
                ret[i] = x + v[i]
            continue
        p = np.ones(m, np.float32)
        carry = carries[k, n0 : n0 + m].copy()
        for t in range(t0 + chunk - 1, t0 - 1, -1):
            i0 = offs[t] + np.uint64(n0)  # from memory: see _rows_tasks
            nz = 0
            for j in range(m):
                i = i0 + np.uint64(j)
                q = p[j] * (np.float32(d[i] == 0) * gl)
                p[j] = q
                term = q * carry[j]
                nz += term != 0
                x = adv[i] + term
                adv[i] = x
                ret[i] = x + v[i]
            if nz == 0:
                break


@njit(cache=True, nogil=True)
def _tile_terms(r, v, d, to, lv, steps, gamma, lam, has_to, t0, t1, b, c):  # noqa: ANN001, ANN202
    """N = 1: ``b[q] = delta_{t0+q}``, ``c[q] = gamma * lam * not_done`` for ``t0 <= t < t1`` (vectorised).

    Steps past the rollout's end get ``b = 0, c = 1``, which leave the running ``A`` at 0.
    """
    n = t1 - t0
    m = max(0, min(t1, steps - 1) - t0)  # steps whose next value is v[t + 1]
    one = np.uint64(1)
    for q in range(m):
        t = np.uint64(t0 + q)
        vt = v[t]
        rt = r[t]
        if has_to:
            rt = rt + gamma * (vt * np.float32(to[t] != 0))
        g = np.float32(d[t] == 0) * gamma
        b[q] = rt + g * v[t + one] - vt
        c[q] = g * lam
    q = m
    if t0 <= steps - 1 < t1:  # the last step bootstraps from last_values
        t = steps - 1
        vt = v[t]
        rt = r[t]
        if has_to:
            rt = rt + gamma * (vt * np.float32(to[t] != 0))
        g = np.float32(d[t] == 0) * gamma
        b[q] = rt + g * lv[0] - vt
        c[q] = g * lam
        q += 1
    for k in range(q, n):
        b[k] = np.float32(0.0)
        c[k] = np.float32(1.0)


@njit(cache=True, nogil=True)
def _tile_store(v, steps, t0, t1, a, adv, ret):  # noqa: ANN001, ANN202
    """N = 1: write ``adv = a`` and ``ret = a + v`` for ``t0 <= t < min(t1, steps)`` (vectorised)."""
    for q in range(min(t1, steps) - t0):
        t = np.uint64(t0 + q)
        x = a[q]
        adv[t] = x
        ret[t] = x + v[t]


@njit(cache=True, nogil=True)
def _chains(r, v, d, to, lv, steps, gamma, lam, has_to, adv, ret, prods, chunk, k0):  # noqa: ANN001, ANN202
    """N = 1: chunks ``k0 .. k0+3`` scanned in lockstep, each assuming ``A = 0`` after its end.

    One chain is bound by the latency of ``A_t = b_t + c_t A_{t+1}``; four independent chains in registers
    overlap. Each tile of ``_TILE`` steps first gets its ``b, c`` computed by vectorised loops into L1 buffers, so
    the serial part is one multiply-add per step. Chunks past ``steps`` are empty. ``prods[k, 0]`` receives the
    product of ``c`` over chunk ``k``.
    """
    b0, c0 = np.empty(_TILE, np.float32), np.empty(_TILE, np.float32)
    b1, c1 = np.empty(_TILE, np.float32), np.empty(_TILE, np.float32)
    b2, c2 = np.empty(_TILE, np.float32), np.empty(_TILE, np.float32)
    b3, c3 = np.empty(_TILE, np.float32), np.empty(_TILE, np.float32)
    z, one = np.float32(0.0), np.float32(1.0)
    a0, a1, a2, a3 = z, z, z, z
    p0, p1, p2, p3 = one, one, one, one
    s0, s1, s2, s3 = k0 * chunk, (k0 + 1) * chunk, (k0 + 2) * chunk, (k0 + 3) * chunk
    j1 = chunk
    while j1 > 0:
        j0 = max(0, j1 - _TILE)
        _tile_terms(r, v, d, to, lv, steps, gamma, lam, has_to, s0 + j0, s0 + j1, b0, c0)
        _tile_terms(r, v, d, to, lv, steps, gamma, lam, has_to, s1 + j0, s1 + j1, b1, c1)
        _tile_terms(r, v, d, to, lv, steps, gamma, lam, has_to, s2 + j0, s2 + j1, b2, c2)
        _tile_terms(r, v, d, to, lv, steps, gamma, lam, has_to, s3 + j0, s3 + j1, b3, c3)
        for q in range(j1 - j0 - 1, -1, -1):
            a0 = b0[q] + c0[q] * a0
            b0[q] = a0
            p0 = p0 * c0[q]
            a1 = b1[q] + c1[q] * a1
            b1[q] = a1
            p1 = p1 * c1[q]
            a2 = b2[q] + c2[q] * a2
            b2[q] = a2
            p2 = p2 * c2[q]
            a3 = b3[q] + c3[q] * a3
            b3[q] = a3
            p3 = p3 * c3[q]
        _tile_store(v, steps, s0 + j0, s0 + j1, b0, adv, ret)
        _tile_store(v, steps, s1 + j0, s1 + j1, b1, adv, ret)
        _tile_store(v, steps, s2 + j0, s2 + j1, b2, adv, ret)
        _tile_store(v, steps, s3 + j0, s3 + j1, b3, adv, ret)
        j1 = j0
    n_chunks = prods.shape[0]
    if k0 < n_chunks:
        prods[k0, 0] = p0
    if k0 + 1 < n_chunks:
        prods[k0 + 1, 0] = p1
    if k0 + 2 < n_chunks:
        prods[k0 + 2, 0] = p2
    if k0 + 3 < n_chunks:
        prods[k0 + 3, 0] = p3


@njit(cache=True, nogil=True)
def _chains_tasks(r, v, d, to, lv, steps, gamma, lam, has_to, adv, ret, prods, chunk, lo, hi):  # noqa: ANN001, ANN202
    """Tasks ``lo .. hi-1`` for N = 1, each four consecutive chunks (see :func:`_chains`)."""
    for task in range(lo, hi):
        _chains(r, v, d, to, lv, steps, gamma, lam, has_to, adv, ret, prods, chunk, 4 * task)


@njit(cache=True, nogil=True)
def _propagate_carries(adv, prods, envs, chunk):  # noqa: ANN001, ANN202
    """``carries[k]`` = true ``A`` at the first step of chunk ``k + 1``, from the local results (serial, O(K N))."""
    n_chunks = prods.shape[0]
    carries = np.zeros((n_chunks, envs), np.float32)
    for k in range(n_chunks - 2, -1, -1):
        start = (k + 1) * chunk * envs
        for n in range(envs):
            carries[k, n] = adv[start + n] + prods[k + 1, n] * carries[k + 1, n]
    return carries


_POOL: tuple[ThreadPoolExecutor, int] | None = None  # (pool, its number of workers)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``workers`` threads, created on first use and kept (threads idle cheaply)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < workers:
            # The old pool's threads finish what they run and exit; calls already holding it are unaffected.
            _POOL = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rolloutcli-gae"), workers)
        return _POOL[0]


def _run_parallel(fn: Callable[[int, int], object], n_tasks: int, n_threads: int) -> None:
    """Run ``fn(i, i + 1)`` for every task ``i < n_tasks`` on up to ``n_threads`` threads (this one included).

    Threads take the next task as they finish one, so a thread the OS delays (the host is shared, and torch's
    OpenMP workers may still be spinning after a torch op) does not hold the others back.
    """
    n_threads = max(1, min(n_threads, n_tasks))
    if n_threads == 1:
        fn(0, n_tasks)
        return
    counter = itertools.count()  # next() on it is atomic under the GIL

    def worker() -> None:
        while (task := next(counter)) < n_tasks:
            fn(task, task + 1)

    futures = [_pool(n_threads - 1).submit(worker) for _ in range(n_threads - 1)]
    worker()
    for future in futures:
        future.result()


def _plan(steps: int, envs: int, n_threads: int) -> tuple[int, int, int, int]:
    """Work split: ``(chunk, n_chunks, block, n_threads)``: time chunk length and count, env block width, threads.

    Env blocks are the cheap way to use threads (no fix-up pass): one per thread, or more when capped at
    ``_MAX_BLOCK``. Time chunks are added only when there are fewer blocks than threads, at least ``_MIN_CHUNK``
    long so the fix-up stays small. N = 1 always uses chunks, in groups of four, for latency even on one thread.
    Finer splits (more tasks than threads) measured slower on this 2-core host at every benchmark shape.
    """
    if steps * envs < _PARALLEL_MIN_ELEMENTS:
        n_threads = 1
    max_chunks = max(1, steps // _MIN_CHUNK)
    if envs == 1:
        n_chunks = min(4 * n_threads, max_chunks)
        block = 1
    else:
        block = min(_MAX_BLOCK, -(-envs // (n_threads * _LANE)) * _LANE)
        nb = -(-envs // block)
        n_chunks = min(-(-n_threads // nb), max_chunks) if nb < n_threads else 1
    chunk = -(-steps // n_chunks)
    return chunk, -(-steps // chunk), block, n_threads


@functools.lru_cache(maxsize=8)
def _row_offsets(steps: int, envs: int) -> np.ndarray:
    """``[t * N for t < T]`` as uint64, read from memory by the vectorised kernels (see _rows_tasks).

    Cached per shape (the kernels only read it): a fresh array of 8 bytes per step would cost page faults on
    every call (0.8 MB at T = 100000).
    """
    return np.arange(steps, dtype=np.uint64) * np.uint64(envs)


def gae_into(
    r: np.ndarray,
    v: np.ndarray,
    d: np.ndarray,
    lv: np.ndarray,
    to: np.ndarray | None,
    gamma: float,
    lam: float,
    n_threads: int,
    adv: np.ndarray,
    ret: np.ndarray,
) -> None:
    """GAE into ``adv`` and ``ret`` (float32 ``[T, N]``, C-contiguous, not overlapping the inputs).

    Args:
        r, v: float32 ``[T, N]`` C-contiguous rewards and values.
        d, to: uint8 ``[T, N]`` C-contiguous flags (nonzero = set); ``to`` None when there is no bootstrap.
        lv: float32 ``[N]`` values after the last step.
        gamma, lam: in ``[0, 1]`` (the carry fix-up's early stop relies on ``|c| <= 1``).
        n_threads: threads to use (this one included).
    """
    steps, envs = r.shape
    if steps == 0 or envs == 0:
        return
    rf, vf, df, lvf = r.reshape(-1), v.reshape(-1), d.reshape(-1), lv.reshape(-1)
    af, retf = adv.reshape(-1), ret.reshape(-1)
    has_to = to is not None
    tof = to.reshape(-1) if to is not None else np.zeros(1, np.uint8)
    g32, l32 = np.float32(gamma), np.float32(lam)
    chunk, n_chunks, block, n_threads = _plan(steps, envs, n_threads)
    prods = np.empty((n_chunks, envs), np.float32)
    offs = _row_offsets(steps, envs) if envs > 1 else np.zeros(0, np.uint64)  # N = 1 needs none
    if envs == 1:
        _run_parallel(
            lambda lo, hi: _chains_tasks(rf, vf, df, tof, lvf, steps, g32, l32, has_to, af, retf, prods, chunk, lo, hi),
            -(-n_chunks // 4),
            n_threads,
        )
    else:
        _run_parallel(
            lambda lo, hi: _rows_tasks(
                rf, vf, df, tof, lvf, offs, envs, g32, l32, has_to, af, retf, prods, chunk, block, lo, hi
            ),
            n_chunks * -(-envs // block),
            n_threads,
        )
    if n_chunks > 1:
        carries = _propagate_carries(af, prods, envs, chunk)
        _run_parallel(
            lambda lo, hi: _fix_tasks(vf, df, offs, envs, g32, l32, af, retf, carries, chunk, block, lo, hi),
            (n_chunks - 1) * -(-envs // block),
            n_threads,
        )
