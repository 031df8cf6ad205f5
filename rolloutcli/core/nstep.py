"""n-step returns: the discounted sum of up to K rewards, stopping at the episode end, and where to bootstrap.

For step ``t`` the window holds ``m`` rewards ``r_t .. r_{t+m-1}``: ``m = K`` unless an episode ends first (at
step ``e`` with ``dones[e]`` or ``time_outs[e]``: ``m = e - t + 1``) or the rollout ends first (``m = T - t``)::

    nstep_returns[t]   = sum_{k < m} gamma^k r_{t+k}      (float32 sums in k order)
    nstep_discount[t]  = gamma^m, or 0 when the window ends on a termination
    nstep_next_step[t] = t + m       the observation of that step bootstraps (T: ``last_observations``)
                         -1          the window ends on an episode end: ``final_observations[t + m - 1]``

A time-out ends an episode like a termination but bootstraps (``timeouts="final-value"``); with
``timeouts="ignore"`` it is a termination. ``gamma^m`` is ``gamma`` multiplied ``m`` times in float64, rounded to
float32. The sums are float32, as RSL-RL's storage: ``total = total + r_{t+k} * float32(gamma^k)``, each
operation rounded.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np
import torch

from rolloutcli.core.gae_numpy import LANE, MIN_ELEMENTS_PER_THREAD, cpu_pool, cpu_threads

TIMEOUT_RULES = ("final-value", "ignore")


class NStep(NamedTuple):
    """The outputs of :func:`nstep_returns`, all ``[T, N]``; ``steps`` is ``m`` (the number of rewards)."""

    returns: torch.Tensor  # float32
    discount: torch.Tensor  # float32
    next_step: torch.Tensor  # int64
    steps: torch.Tensor  # int32


_DTYPES = (torch.float32, torch.float32, torch.int64, torch.int32)  # of NStep's fields


def nstep_returns(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    n: int,
    gamma: float,
    time_outs: torch.Tensor | None = None,
    *,
    timeouts: str = "final-value",
    out: NStep | None = None,
) -> NStep:
    """n-step returns of ``rewards [T, N]`` with episode ends ``dones`` / ``time_outs`` (``[T, N]``, 0/1).

    The window of every step is advanced one offset at a time (K passes over the rollout), so the sums run in
    the same order as a loop over k and the bytes do not depend on how the envs are blocked. ``out``: optional
    contiguous ``[T, N]`` buffers (float32, float32, int64, int32) on the inputs' device, not overlapping them,
    filled and returned.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if timeouts not in TIMEOUT_RULES:
        raise ValueError(f"timeouts must be one of {TIMEOUT_RULES}, got {timeouts!r}")
    if out is not None:
        _check_out(out, rewards)
    if rewards.device.type == "cpu" and kernel() is not None and rewards.numel():
        return _compiled(rewards, dones, n, gamma, time_outs, timeouts == "final-value", out)
    result = nstep_torch(rewards, dones, n, gamma, time_outs, timeouts=timeouts)
    if out is None:
        return result
    for buffer, value in zip(out, result, strict=True):
        buffer.copy_(value)
    return out


def _check_out(out: NStep, rewards: torch.Tensor) -> None:
    for name, buffer, dtype in zip(NStep._fields, out, _DTYPES, strict=True):
        if buffer.shape != rewards.shape or buffer.dtype != dtype or buffer.device != rewards.device:
            raise ValueError(
                f"out.{name}: expected {dtype} {tuple(rewards.shape)} on {rewards.device}, found {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device}"
            )
        if not buffer.is_contiguous():
            raise ValueError(f"out.{name}: expected a contiguous tensor")


def nstep_torch(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    n: int,
    gamma: float,
    time_outs: torch.Tensor | None = None,
    *,
    timeouts: str = "final-value",
) -> NStep:
    """:func:`nstep_returns` in torch (any device; the CPU's compiled kernel gives the same bits)."""
    steps_total, device = rewards.shape[0], rewards.device
    ends = dones.to(torch.bool)
    if time_outs is not None:
        ends = ends | time_outs.to(torch.bool)
    # kind of every step: 0 none, 1 termination, 3 time-out that bootstraps (bit 1: the window bootstraps)
    kind = ends.to(torch.uint8)
    if time_outs is not None and timeouts == "final-value":
        kind = kind | (time_outs.to(torch.uint8) << 1)
    r = rewards.to(torch.float32)
    total = r + 0.0  # 0.0 + r_t as in a loop starting from 0 (turns -0.0 into 0.0; never -0.0 afterwards)
    alive = torch.ones_like(ends)  # the window of step t still takes rewards at offset k
    stop = torch.zeros_like(kind)  # the kind of the window's last step
    count = torch.ones(rewards.shape, dtype=torch.int32, device=device)
    weights = _powers(gamma, min(n, steps_total))
    for k in range(1, min(n, steps_total)):
        span = steps_total - k
        stop[span] |= kind[-1] * alive[span]  # the window of T - k reaches the rollout's end at offset k - 1
        stop[:span] |= kind[k - 1 : k - 1 + span] * alive[:span]
        alive = alive[:span] & ~ends[k - 1 : k - 1 + span]  # rows t < T - k: t + k is still inside
        # adding r * 0 leaves the sum as it is (rewards are finite, the sum is never -0.0)
        total[:span] += (r[k:] * alive).mul_(float(torch.tensor(weights[k], dtype=torch.float32)))
        count[:span] += alive
    stop[: alive.shape[0]] |= kind[count.shape[0] - alive.shape[0] :] * alive
    discount = torch.tensor(weights, dtype=torch.float32, device=device)[count]
    discount.masked_fill_(stop == 1, 0.0)
    next_step = torch.arange(steps_total, device=device).unsqueeze(1).add(count)
    next_step.masked_fill_(stop.bool(), -1)
    return NStep(total, discount, next_step, count)


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (``_nstep.c``), or None where it was not built."""
    try:
        from rolloutcli.core import _nstep_native  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = ctypes.CDLL(_nstep_native.__file__)  # a CDLL call releases the GIL: threads run column blocks
    if lib.rolloutcli_nstep_abi_version() != 2:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.rolloutcli_nstep.argtypes = [pointer] * 3 + [size] * 6 + [pointer] * 5
    lib.rolloutcli_nstep.restype = None
    return lib


def _compiled(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    n: int,
    gamma: float,
    time_outs: torch.Tensor | None,
    boot: bool,
    result: NStep | None,
) -> NStep:
    """The C kernel over column blocks on threads (each column depends on itself alone: the same bits)."""
    steps, envs = rewards.shape
    r = np.ascontiguousarray(rewards.detach().numpy(), dtype=np.float32)
    d = _flags(dones)
    o = d if time_outs is None else _flags(time_outs)
    table = np.array(_powers(gamma, min(n, steps)), dtype=np.float32)
    if result is None:
        result = NStep(*(torch.empty(steps, envs, dtype=dtype) for dtype in _DTYPES))
    out = [buffer.numpy() for buffer in result]
    lib = kernel()
    assert lib is not None

    def run(start: int, stop: int) -> None:
        f, b, q = 4 * start, start, 8 * start  # byte offsets of the first column: float32, uint8, int64
        lib.rolloutcli_nstep(
            r.ctypes.data + f, d.ctypes.data + b, o.ctypes.data + b, int(time_outs is not None), int(boot),
            steps, stop - start, envs, n, table.ctypes.data,
            out[0].ctypes.data + f, out[1].ctypes.data + f, out[2].ctypes.data + q, out[3].ctypes.data + f,
        )  # fmt: skip

    threads = max(1, min(cpu_threads(), r.size // MIN_ELEMENTS_PER_THREAD, -(-envs // LANE)))
    width = -(-envs // (threads * LANE)) * LANE
    spans = [(a, min(envs, a + width)) for a in range(0, envs, width)]
    if len(spans) == 1:
        run(0, envs)
    else:
        list(cpu_pool().map(lambda span: run(*span), spans))
    return result


def _flags(flags: torch.Tensor) -> np.ndarray:
    """One byte per flag, nonzero = set (the kernel reads any nonzero byte as 1): bytes pass as they are."""
    array = flags.detach().numpy()
    if array.dtype in (np.uint8, np.int8, np.bool_):
        return np.ascontiguousarray(array).view(np.uint8)
    return np.ascontiguousarray(array != 0, dtype=np.uint8)


def _powers(gamma: float, n: int) -> list[float]:
    """``[gamma^0 .. gamma^n]``, each the previous one times gamma."""
    out = [1.0]
    for _ in range(n):
        out.append(out[-1] * gamma)
    return out
