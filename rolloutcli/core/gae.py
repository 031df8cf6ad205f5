"""Generalised advantage estimation (GAE) exactly as RSL-RL computes it, fast on CPU and GPU.

Pure functions on tensors: no file I/O, no printing. Shapes: ``T`` steps (time) by ``N`` envs, time first,
as in RSL-RL's ``RolloutStorage``.

The recurrence (RSL-RL ``PPO.compute_returns``), reversed over ``t``::

    next_value_t = last_values            if t == T - 1 else values[t + 1]
    not_done_t   = 1 - dones_t
    delta_t      = r_t + not_done_t * gamma * next_value_t - values_t
    A_t          = delta_t + not_done_t * gamma * lam * A_{t+1}          (A_T = 0)
    returns_t    = A_t + values_t

With ``time_outs``, RSL-RL's bootstrap ``r_t += gamma * values_t * time_out_t`` is applied first (never to the
caller's tensor). ``A_t = b_t + c_t * A_{t+1}`` with ``b_t = delta_t`` and ``c_t = gamma * lam * not_done_t`` is a
*linear* recurrence, which is what makes both fast paths possible:

* CPU (``backend="numba"``): compiled loops over time, vectorised over contiguous env slices, one env block per
  thread. When there are fewer env blocks than threads (few envs, long rollouts), time is cut into chunks that are
  scanned in parallel assuming a zero carry; the true carries are then propagated backwards across chunks and
  added back, ``A_t += (c_t * ... * c_{chunk end}) * carry``, stopping as soon as that term is exactly 0. A
  single env (N = 1) always uses four chunks per thread, interleaved, to hide the latency of the serial chain.
  The returns are bit-identical to RSL-RL's (same float32 operations in the same order, no fused multiply-add)
  except where chunk carries are added, which changes the rounding only.
* Any device (``backend="torch"``): a log-depth associative scan (Hillis-Steele doubling on the pairs
  ``(c, b)``), ``ceil(log2 T)`` rounds of whole-tensor ops, no Python loop over ``T`` and no host-device sync.
  It reorders the float32 sums, so it agrees with RSL-RL to float32 rounding at the scale of the largest terms.

Everything is computed in float32, the dtype of RSL-RL's storage: float16/bfloat16 inputs are upcast and float64
inputs are rounded to float32 first, so a float64 file gives the same numbers RSL-RL would. Outputs are always
float32 ``[T, N]`` on the inputs' device.

Advantages are returned as ``A`` itself. RSL-RL stores ``returns - values`` as its advantages; that equals ``A``
up to one float32 rounding at the scale of ``|returns|``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
from numba import njit

__all__ = [
    "bootstrap_time_outs",
    "compute_gae",
    "normalize_advantages",
    "normalize_with",
]

Backend = Literal["auto", "numba", "torch"]

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
# Input checking and conversion
# ----------------------------------------------------------------------------------------------------------------


def _as_tn(x: torch.Tensor, name: str) -> torch.Tensor:
    """View ``[T, N]`` or ``[T, N, 1]`` as ``[T, N]`` (no copy)."""
    if x.dim() == 3 and x.shape[2] == 1:
        return x[:, :, 0]
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape [T, N] or [T, N, 1], found {list(x.shape)}")
    return x


def _as_f32(x: torch.Tensor, name: str) -> torch.Tensor:
    """Contiguous float32 (a no-op for a contiguous float32 tensor)."""
    if not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        raise ValueError(f"{name}: expected a float (or integer) tensor, found dtype {x.dtype}")
    return x.to(torch.float32).contiguous()


def _as_flag(x: torch.Tensor) -> torch.Tensor:
    """Contiguous one-byte flags, nonzero = set. bool and (u)int8 are reinterpreted without a copy."""
    if x.dtype == torch.bool or x.dtype == torch.int8:
        return x.contiguous().view(torch.uint8)
    if x.dtype == torch.uint8:
        return x.contiguous()
    return (x != 0).view(torch.uint8).contiguous()


def _check_coefficients(gamma: float, lam: float) -> None:
    # The carry fix-up stops once (product of c) * carry underflows to 0, which is final only if |c| <= 1.
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not (0.0 <= float(value) <= 1.0):
            raise ValueError(f"{name}: expected a number in [0, 1], found {value}")


def _prepare(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    time_outs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check shapes and devices; return contiguous ``r, v`` float32 ``[T, N]``, ``d, to`` uint8, ``lv`` ``[N]``."""
    r = _as_tn(rewards.detach(), "rewards")
    v = _as_tn(values.detach(), "values")
    d = _as_tn(dones.detach(), "dones")
    shape = tuple(r.shape)
    for name, x in (("values", v), ("dones", d)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} like rewards, found {list(x.shape)}")
    n = shape[1]
    last_values = last_values.detach()
    if last_values.dim() == 2 and last_values.shape[1] == 1:
        last_values = last_values[:, 0]
    if tuple(last_values.shape) != (n,):
        raise ValueError(f"last_values: expected shape [{n}] or [{n}, 1], found {list(last_values.shape)}")
    tensors = [rewards, values, dones, last_values]
    to = None
    if time_outs is not None:
        to = _as_tn(time_outs.detach(), "time_outs")
        if tuple(to.shape) != shape:
            raise ValueError(f"time_outs: expected shape {list(shape)} like rewards, found {list(to.shape)}")
        tensors.append(time_outs)
    device = rewards.device
    for x in tensors:
        if x.device != device:
            raise ValueError(f"all inputs must be on one device, found {device} and {x.device}")
    return (
        _as_f32(r, "rewards"),
        _as_f32(v, "values"),
        _as_flag(d),
        _as_f32(last_values, "last_values"),
        None if to is None else _as_flag(to),
    )


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    time_outs: torch.Tensor | None = None,
    backend: Backend = "auto",
    num_threads: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by RSL-RL's GAE; inputs are never modified.

    Args:
        rewards: ``[T, N]`` or ``[T, N, 1]``, any float dtype.
        values: ``[T, N]`` or ``[T, N, 1]``, the critic's ``V(s_t)``.
        dones: ``[T, N]`` or ``[T, N, 1]``, bool or numbers; nonzero = the episode ended after step ``t``.
        last_values: ``[N]`` or ``[N, 1]``, ``V(s_T)`` for bootstrapping after the last step.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.
        time_outs: optional ``[T, N]`` / ``[T, N, 1]`` flags (nonzero = truncated); applies RSL-RL's bootstrap
            ``r_t + gamma * (V(s_t) * time_out_t)`` to a copy of the rewards before the recurrence.
        backend: ``"numba"`` (CPU tensors only), ``"torch"`` (any device), or ``"auto"``: numba on CPU, torch
            elsewhere.
        num_threads: CPU threads for the numba backend; default ``torch.get_num_threads()``.
        out: optional ``(advantages, returns)`` buffers to write into and return: contiguous float32 ``[T, N]`` on
            the inputs' device, not overlapping the inputs. Reusing buffers (as RSL-RL's storage does) saves the
            page faults of fresh memory, which can cost more than the computation itself.

    Returns:
        ``(advantages, returns)``, both float32 ``[T, N]`` on the inputs' device, not normalised (see
        :func:`normalize_advantages`). ``returns = advantages + values``.
    """
    _check_coefficients(gamma, lam)
    r, v, d, lv, to = _prepare(rewards, values, dones, last_values, time_outs)
    if out is None:
        adv = torch.empty(r.shape, dtype=torch.float32, device=r.device)
        ret = torch.empty(r.shape, dtype=torch.float32, device=r.device)
    else:
        adv, ret = out
        for name, x in (("out[0]", adv), ("out[1]", ret)):
            if x.shape != r.shape or x.dtype != torch.float32 or x.device != r.device or not x.is_contiguous():
                raise ValueError(
                    f"{name}: expected a contiguous float32 tensor of shape {list(r.shape)} on {r.device}, found "
                    f"{x.dtype} {list(x.shape)} on {x.device}"
                )
    if backend == "auto":
        backend = "numba" if r.device.type == "cpu" else "torch"
    if backend == "torch":
        _gae_torch(r, v, d, lv, to, gamma, lam, adv, ret)
    elif backend != "numba":
        raise ValueError(f"backend: expected 'auto', 'numba' or 'torch', found {backend!r}")
    elif r.device.type != "cpu":
        raise ValueError(f"backend 'numba' needs CPU tensors, found {r.device}; use backend='torch' or 'auto'")
    else:
        _gae_numba(r, v, d, lv, to, gamma, lam, num_threads or torch.get_num_threads(), adv, ret)
    return adv, ret


def bootstrap_time_outs(
    rewards: torch.Tensor, values: torch.Tensor, time_outs: torch.Tensor, gamma: float
) -> torch.Tensor:
    """RSL-RL's time-out bootstrap: ``rewards + gamma * (values * time_outs)``, as a new float32 ``[T, N]`` tensor.

    A truncated episode did not end in a terminal state, so the value of the state at the step stands in for the
    lost next state. Inputs ``[T, N]`` or ``[T, N, 1]``; ``time_outs`` bool or numbers (nonzero = truncated).
    """
    r = _as_f32(_as_tn(rewards, "rewards"), "rewards")
    v = _as_f32(_as_tn(values, "values"), "values")
    to = _as_tn(time_outs, "time_outs")
    if tuple(v.shape) != tuple(r.shape) or tuple(to.shape) != tuple(r.shape):
        raise ValueError(
            f"rewards, values and time_outs must have one shape, found {list(r.shape)}, {list(v.shape)}, "
            f"{list(to.shape)}"
        )
    # Same operation order as RSL-RL (values * time_outs first, then gamma), so results agree bit for bit.
    return r + gamma * (v * (to != 0).to(torch.float32))


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """RSL-RL's whole-rollout normalisation: ``(A - A.mean()) / (A.std() + 1e-8)``, unbiased std.

    Same expression and dtype as RSL-RL, so the result agrees bit for bit. Any shape; returns a new tensor.
    """
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def normalize_with(advantages: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """``(A - mean) / (std + 1e-8)`` with global statistics (e.g. from :class:`rolloutcli.core.stats.EnvMoments`).

    ``mean`` and ``std`` are rounded to float32 first and the expression is RSL-RL's, so with float32
    statistics equal to RSL-RL's the result is identical to :func:`normalize_advantages`.
    """
    m = torch.tensor(mean, dtype=torch.float32, device=advantages.device)
    s = torch.tensor(std, dtype=torch.float32, device=advantages.device)
    return (advantages - m) / (s + 1e-8)


# ----------------------------------------------------------------------------------------------------------------
# Torch backend: log-depth scan, device-agnostic
# ----------------------------------------------------------------------------------------------------------------


def _gae_torch(
    r: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    lv: torch.Tensor,
    to: torch.Tensor | None,
    gamma: float,
    lam: float,
    adv: torch.Tensor,
    ret: torch.Tensor,
) -> None:
    """GAE on any device with ``ceil(log2 T)`` rounds of whole-tensor ops; writes float32 ``[T, N]`` adv and ret."""
    nd_gamma = (d == 0).to(torch.float32) * gamma  # not_done * gamma, RSL-RL's operation order
    if to is not None:
        r = r + gamma * (v * (to != 0).to(torch.float32))
    next_v = torch.cat([v[1:], lv.unsqueeze(0)], dim=0)
    b = r + nd_gamma * next_v - v  # delta_t
    c = nd_gamma * lam
    adv.copy_(_reverse_linear_scan(c, b))
    torch.add(adv, v, out=ret)


def _reverse_linear_scan(c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``A_t = b_t + c_t * A_{t+1}`` (``A_T = 0``) along dim 0 by Hillis-Steele doubling.

    Invariant after the round with offset ``s``: ``A_t = sum_{u=t}^{t+2s-1} (c_t...c_{u-1}) b_u`` and ``C_t`` is the
    product of ``c`` over the same window, so ``A_t + C_t * A_{t+2s}`` doubles the window. Rows ``t >= T - s`` are
    already final and are copied. Buffers ping-pong because torch may not read and write overlapping slices in
    one op. Shapes ``[T, ...]``; ``b`` and ``c`` are used as scratch space (the caller's own temporaries).
    """
    steps = b.shape[0]
    a_cur, a_nxt = b, torch.empty_like(b)
    c_cur, c_nxt = c, torch.empty_like(c)
    s = 1
    while s < steps:
        head = steps - s
        torch.addcmul(a_cur[:head], c_cur[:head], a_cur[s:], out=a_nxt[:head])
        a_nxt[head:].copy_(a_cur[head:])
        if 2 * s < steps:  # the products are needed only by a further round
            torch.mul(c_cur[:head], c_cur[s:], out=c_nxt[:head])
            c_nxt[head:].copy_(c_cur[head:])
            c_cur, c_nxt = c_nxt, c_cur
        a_cur, a_nxt = a_nxt, a_cur
        s *= 2
    return a_cur


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


def _gae_numba(
    r: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    lv: torch.Tensor,
    to: torch.Tensor | None,
    gamma: float,
    lam: float,
    n_threads: int,
    adv: torch.Tensor,
    ret: torch.Tensor,
) -> None:
    """Numba GAE on the contiguous CPU tensors of :func:`_prepare`; writes float32 ``[T, N]`` ``adv`` and ``ret``."""
    steps, envs = r.shape
    if steps == 0 or envs == 0:
        return
    # Zero-copy flat numpy views; the kernels write the outputs through them.
    rf, vf, df, lvf = r.view(-1).numpy(), v.view(-1).numpy(), d.view(-1).numpy(), lv.numpy()
    af, retf = adv.view(-1).numpy(), ret.view(-1).numpy()
    has_to = to is not None
    tof = to.view(-1).numpy() if to is not None else np.zeros(1, np.uint8)
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
