"""RSL-RL's GAE on ``[T, N]`` numpy arrays: the one CPU kernel behind ``compute_gae`` and ``rolloutcli gae``
(no torch import, so ``rolloutcli gae`` on the CPU never loads torch).

The recurrence (RSL-RL ``PPO.compute_returns``), reversed over ``t``, in float32, with RSL-RL's operation order::

    g_t       = (1 - done_t) * gamma
    A_t       = ((r_t + g_t * next_value_t) - v_t) + (g_t * lam) * A_{t+1}      (A_T = 0)
    returns_t = A_t + v_t
    adv_t     = returns_t - v_t                                                    (what RSL-RL stores)

Serial in time, threads over blocks of env columns only (each column depends on itself alone), so the bits
are RSL-RL's at every shape and thread count. Where ``_native.c`` was not built, :func:`_gae_loop` performs the
same float32 operations in the same order with numpy: the same bits, only slower.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rolloutcli.core import native

# Fewer elements per thread than this and waking a thread costs more than the work it takes.
MIN_ELEMENTS_PER_THREAD = 1 << 17
# Column blocks are multiples of this many envs (64 bytes of float32: threads never share a cache line).
LANE = 16


def cpu_threads() -> int:
    """CPUs this process may run on (its affinity mask), the default thread count of the kernel."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def bootstrap_rewards(rewards: Any, values: Any, time_outs: Any, gamma: float) -> Any:
    """RSL-RL's time-out bootstrap ``rewards + gamma * (values * time_outs)``: the one place of the formula.

    Works on numpy arrays and torch tensors alike, with torch's dtype rules: the product in the values' dtype,
    added in the promoted dtype, so float64 rewards are bootstrapped in float64 (as RSL-RL does when the env
    hands it float64 rewards) and rounded by the caller afterwards.
    """
    if isinstance(values, np.ndarray):
        gamma = values.dtype.type(gamma)  # torch rounds a Python float to the tensor's dtype the same way
    with np.errstate(all="ignore"):  # overflow gives inf, as in torch, which says nothing either
        return rewards + gamma * (values * (time_outs != 0))


def normalize_array(advantages: np.ndarray, mean: float, std: float) -> np.ndarray:
    """``(A - mean) / (std + 1e-8)`` in float32 with ``mean`` and ``std`` rounded to float32 first (RSL-RL's
    expression, with statistics computed elsewhere)."""
    m, s = np.float32(mean), np.float32(std)
    with np.errstate(all="ignore"):  # overflow gives inf, as in torch, which says nothing either
        return (advantages - m) / (s + np.float32(1e-8))


def _check(name: str, array: np.ndarray, dtype: type, shape: tuple[int, ...]) -> None:
    if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
        raise ValueError(
            f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {list(shape)}, found "
            f"{array.dtype} {list(array.shape)} (contiguous: {array.flags.c_contiguous})"
        )


def gae_arrays(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    last_values: np.ndarray,
    gamma: float,
    lam: float,
    *,
    threads: int | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` float32 ``[T, N]``: RSL-RL's GAE, bit for bit.

    ``rewards`` (already bootstrapped), ``values``: float32 ``[T, N]``; ``dones``: uint8 ``[T, N]``;
    ``last_values``: float32 ``[N]``; all C-contiguous. ``threads`` never changes the result; ``out``: optional
    writeable arrays to fill, overlapping no input.
    """
    steps, envs = rewards.shape
    for name, array, dtype, shape in (
        ("rewards", rewards, np.float32, (steps, envs)),
        ("values", values, np.float32, (steps, envs)),
        ("dones", dones, np.uint8, (steps, envs)),
        ("last_values", last_values, np.float32, (envs,)),
    ):
        _check(name, array, dtype, shape)
    adv, ret = out if out is not None else (np.empty_like(rewards), np.empty_like(rewards))
    for name, array in (("advantages", adv), ("returns", ret)):
        _check(name, array, np.float32, (steps, envs))
        if not array.flags.writeable:
            raise ValueError(f"{name}: expected a writeable array")
    if steps and envs:
        if native.library() is None:
            _gae_loop((rewards, values, dones, last_values, adv, ret), gamma, lam)
        else:
            _gae_compiled((rewards, values, dones, last_values, adv, ret), gamma, lam, threads or cpu_threads())
    return adv, ret


def _gae_loop(arrays: tuple[np.ndarray, ...], gamma: float, lam: float) -> None:
    """The kernel's float32 operations in the kernel's order on ``(r, v, d, lv, adv, ret)``, vectorised over envs
    (the build without C)."""
    r, v, d, lv, adv, ret = arrays
    g32, l32 = np.float32(gamma), np.float32(lam)
    carry = np.zeros(r.shape[1], np.float32)
    x, y = np.empty_like(carry), np.empty_like(carry)
    with np.errstate(all="ignore"):  # inf and NaN propagate as in C and torch
        for t in range(r.shape[0] - 1, -1, -1):
            g = (d[t] == 0).astype(np.float32) * g32
            np.multiply(g, lv if t == r.shape[0] - 1 else v[t + 1], out=x)
            np.add(r[t], x, out=x)
            np.subtract(x, v[t], out=x)
            np.multiply(np.multiply(g, l32, out=g), carry, out=y)
            np.add(x, y, out=carry)
            np.add(carry, v[t], out=ret[t])
        np.subtract(ret, v, out=adv)


def cpu_pool() -> ThreadPoolExecutor:
    """This process's pool of :func:`cpu_threads` threads for the compiled kernels, kept between calls (starting
    threads cost a quarter of an n-step call at (1000, 1024)); a forked child gets its own: the parent's threads
    do not exist there."""
    return _pool(os.getpid())


@functools.cache
def _pool(pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix=f"rolloutcli-kernels-{pid}")


def _gae_compiled(arrays: tuple[np.ndarray, ...], gamma: float, lam: float, threads: int) -> None:
    """The C kernel over column blocks, one per thread (see :func:`rolloutcli.core.native.gae_columns`)."""
    steps, envs = arrays[0].shape
    threads = max(1, min(threads, steps * envs // MIN_ELEMENTS_PER_THREAD, -(-envs // LANE)))
    width = -(-envs // (threads * LANE)) * LANE
    blocks = [(start, min(start + width, envs)) for start in range(0, envs, width)]
    kernel_arrays = (*arrays, np.empty(envs, np.float32))  # + the carry, a disjoint slice per block
    if len(blocks) == 1:
        native.gae_columns(kernel_arrays, gamma, lam, 0, envs)
        return
    jobs = [cpu_pool().submit(native.gae_columns, kernel_arrays, gamma, lam, a, b) for a, b in blocks]
    for job in jobs:
        job.result()
